"""An aligned vLLM engine run in a fresh process (a background job, tests/_background.py; the test compares its
rollouts with the trainer in the test process): ``make_llm(MODEL_DIR, aligned=True, **spec["llm"])`` samples
``spec["prompts"]`` at ``spec["temperature"]`` for ``spec["max_tokens"]``; prints one JSON line: the engine's TP
size and eager flag, and each rollout's prompt, sampled ids and log-probs (float.hex, exact). The linear profile is
the environment's (``ALIGNED_OPS_LINEAR``, inherited by mp workers). Jobs and results: engine_job / engine_result.
Usage: python _aligned_engine.py MODEL_DIR SPEC_JSON
"""

import json
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"


def engine_job(path: str, llm: dict, prompts, temperature: float, max_tokens: int, env: dict | None = None,
               timeout: float = 1200) -> dict:
    """The background job (tests/_background.py) running this script; ``env``: variables added to the test
    process's environment (e.g. ``ALIGNED_OPS_LINEAR``). TP > 1 engines get one core per rank bound unless the
    environment binds them."""
    src = os.path.dirname(os.path.dirname(os.path.abspath(__import__("aligned_ops").__file__)))
    e = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    tp = llm.get("tensor_parallel_size", 1)
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in e:  # auto binding wants one NUMA node per rank
        e["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp))
    spec = dict(llm=llm, prompts=[list(p) for p in prompts], temperature=temperature, max_tokens=max_tokens)
    return dict(argv=[sys.executable, os.path.abspath(__file__), path, json.dumps(spec)], env=e, timeout=timeout)


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
    """``(info, rollouts)`` of a finished job: info has ``tp_size`` and ``enforce_eager``; rollouts are
    ``aligned_ops.integrations.rollout.Rollout`` with the engine's exact log-probs."""
    from aligned_ops.integrations.rollout import Rollout

    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    rollouts = [Rollout(r["prompt"], r["tokens"], [float.fromhex(h) for h in r["logprobs"]])
                for r in out.pop("rollouts")]
    return out, rollouts


def main():
    from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, shutdown

    model_dir, spec = sys.argv[1], json.loads(sys.argv[2])
    llm = make_llm(model_dir, aligned=True, **spec["llm"])
    try:
        cfg = llm.llm_engine.vllm_config
        rollouts = generate_with_logprobs(llm, spec["prompts"], temperature=spec["temperature"],
                                          max_tokens=spec["max_tokens"])
        out = {"tp_size": cfg.parallel_config.tensor_parallel_size, "enforce_eager": cfg.model_config.enforce_eager,
               "rollouts": [{"prompt": r.prompt_token_ids, "tokens": r.token_ids,
                             "logprobs": [float(x).hex() for x in r.logprobs_tensor().tolist()]} for r in rollouts]}
    finally:
        shutdown(llm)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
