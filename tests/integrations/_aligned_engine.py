"""An aligned vLLM engine run as a background job (tests/_background.py; the test compares its rollouts with the trainer
in the test process): ``make_llm(MODEL_DIR, aligned=True, **spec["llm"])`` samples ``spec["prompts"]`` at
``spec["temperature"]`` for ``spec["max_tokens"]``; prints one result line (RESULT_PREFIX + JSON; vLLM may print
after it): the engine's TP size, eager flag, linear profile (``additional_config``'s ``aligned_ops_linear``, what the
workers bind) and MLA form (``aligned_ops_mla_form``, None for a model without MLA) with ``use_mla``, and each
rollout's prompt, sampled ids and log-probs (int32 bit patterns: exact, NaN payloads too). The linear profile is the
environment's (``ALIGNED_OPS_LINEAR`` when the engine is built; its mp workers bind it from the engine's config)
unless ``spec["llm"]["additional_config"]`` names one. Jobs and results: engine_job / engine_result.

The jobs run one after the other in one interpreter (``shared=SHARED``: tests/_shared_process.py), as the stock
probes do: each fresh interpreter paid ~9-12 CPU s importing vLLM before its engine started (9.0 s alone on an idle
core, bench/RESULTS.md session 39; more on busy ones). A shared process has one environment, so what a job adds to it
(its linear profile, MLA form, TP thread binding) travels in its spec (``spec["env"]``) and is set before its engine
is built — the engine resolves its profile and form then, and its mp workers inherit the environment of that moment;
the shared process restores the environment after the job.
Usage: python _aligned_engine.py MODEL_DIR SPEC_JSON
"""

import json
import os
import sys

RESULT_PREFIX = "ALIGNED_RESULT "  # the line a job's result is on (other output may come before or after it)
SHARED = "aligned_vllm"  # the shared process's name (tests/_background.py)


def emit_result(obj) -> None:
    """Prints ``obj`` as the job's result line."""
    print(RESULT_PREFIX + json.dumps(obj), flush=True)


def parse_result(stdout: str):
    """The object of the last result line of a job's stdout (AssertionError, with the tail, when none)."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    assert lines, f"no {RESULT_PREFIX.strip()} line in the job's stdout: {stdout[-2000:]!r}"
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def logprob_bits(t) -> list:
    """fp32 log-probs as their int32 bit patterns (JSON-exact, NaN sign and payload kept)."""
    import torch

    return t.to(torch.float32).contiguous().view(torch.int32).tolist()


def logprobs_from_bits(bits: list) -> list:
    """The inverse of :func:`logprob_bits`: a list of Python floats (exact: fp32 widens to float64 losslessly)."""
    import torch

    return torch.tensor(bits, dtype=torch.int32).view(torch.float32).tolist()


def engine_job(path: str, llm: dict, prompts, temperature: float, max_tokens: int, env: dict | None = None,
               timeout: float = 1200) -> dict:
    """The background job (tests/_background.py) running this script in the shared process (``SHARED``);
    ``env``: variables added to the test process's environment for this job (e.g. ``ALIGNED_OPS_LINEAR``), set by
    the job itself (``spec["env"]``). TP > 1 engines get one core per rank bound unless the environment binds them."""
    src = os.path.dirname(os.path.dirname(os.path.abspath(__import__("aligned_ops").__file__)))
    base = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1")
    own = dict(env or {})
    tp = llm.get("tensor_parallel_size", 1)
    # (vLLM's auto binding wants one NUMA node per rank)
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in base and "VLLM_CPU_OMP_THREADS_BIND" not in own:
        own["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp))
    spec = dict(llm=llm, prompts=[list(p) for p in prompts], temperature=temperature, max_tokens=max_tokens, env=own)
    return dict(argv=[sys.executable, os.path.abspath(__file__), path, json.dumps(spec)], env=base, timeout=timeout,
                shared=SHARED)


def profile_engine_jobs(prefix: str, profiles: dict, path: str, llm: dict, prompts, temperature: float,
                        max_tokens: int) -> dict:
    """One :func:`engine_job` per linear profile: ``{f"{prefix}_{key}": job}`` for ``profiles`` ``{key: profile}``
    (None: the process's; otherwise ``ALIGNED_OPS_LINEAR`` set for the job). A profile this machine cannot run is
    left out (its test skips: ``linear_profile_env``)."""
    from aligned_ops import profiles as registry

    jobs = {}
    for key, profile in profiles.items():
        if profile is not None and registry.get(profile).model_refusals("bfloat16"):
            continue
        env = {} if profile is None else {"ALIGNED_OPS_LINEAR": profile}
        jobs[f"{prefix}_{key}"] = engine_job(path, llm, prompts, temperature, max_tokens, env)
    return jobs


def engine_result(res):
    """``(info, rollouts)`` of a finished job: info has ``tp_size``, ``enforce_eager``, ``linear_profile``,
    ``mla_form`` and ``use_mla``; rollouts are ``aligned_ops.integrations.rollout.Rollout`` with the engine's exact
    log-probs."""
    from aligned_ops.integrations.rollout import Rollout

    assert res.returncode == 0, res.stderr[-3000:]
    out = parse_result(res.stdout)
    rollouts = [Rollout(r["prompt"], r["tokens"], logprobs_from_bits(r["logprobs"])) for r in out.pop("rollouts")]
    return out, rollouts


def main():
    os.environ["HF_HUB_OFFLINE"] = "1"  # (engine_job sets it too; here for a direct run)
    from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, shutdown
    from aligned_ops.integrations.vllm.bind import PROFILE_KEY
    from aligned_ops.integrations.vllm.config import MLA_FORM_KEY

    model_dir, spec = sys.argv[1], json.loads(sys.argv[2])
    os.environ.update(spec.get("env", {}))  # this job's own variables, before its engine resolves profile and form
    llm = make_llm(model_dir, aligned=True, **spec["llm"])
    try:
        cfg = llm.llm_engine.vllm_config
        rollouts = generate_with_logprobs(llm, spec["prompts"], temperature=spec["temperature"],
                                          max_tokens=spec["max_tokens"])
        extra = cfg.additional_config if isinstance(cfg.additional_config, dict) else {}
        out = {"tp_size": cfg.parallel_config.tensor_parallel_size, "enforce_eager": cfg.model_config.enforce_eager,
               "linear_profile": extra.get(PROFILE_KEY), "mla_form": extra.get(MLA_FORM_KEY),
               "use_mla": bool(cfg.model_config.use_mla),
               "rollouts": [{"prompt": r.prompt_token_ids, "tokens": r.token_ids,
                             "logprobs": logprob_bits(r.logprobs_tensor())} for r in rollouts]}
    finally:
        shutdown(llm)
    emit_result(out)


if __name__ == "__main__":
    main()
