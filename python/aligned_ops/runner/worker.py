"""A rollout worker: one vLLM engine in its own process, generating batches continuously.

Worker w of W generates the batches b = w, w + W, w + 2W, ... from ``start`` on. Batch b is generated with the
weights version max(0, b - k) (k = ``max_lag``): the most the staleness bound allows, so the worker overlaps with
the learner as far as k permits and every run is reproducible. Versions arrive in the background
(``sync.WeightReceiver``); the worker loads one into vLLM (``rollout.refit``: vLLM's in-place reload) only between
two batches. Each request samples with its own seed (a function of the run seed, b and its index), so a batch
does not depend on what the engine ran before it — a resumed run regenerates the same rollouts.

Messages to the learner (``outbox.put``): ("ready", w, info), ("batch", b, payload), ("error", w, text).
"""

from __future__ import annotations

import os
import time
import traceback

def request_seed(run_seed: int, batch: int, index: int) -> int:
    """The sampling seed of rollout ``index`` of batch ``batch``: a 32-bit hash of the three (torch's CPU generator
    keeps 32 bits of a seed), from numpy's SeedSequence."""
    import numpy as np

    return int(np.random.SeedSequence([run_seed, batch, index]).generate_state(1)[0])


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a killed learner must not leave engines behind)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except OSError:
        pass


def pin_process(cores, threads: int) -> None:
    import torch

    if cores:
        try:
            os.sched_setaffinity(0, set(cores))
        except (AttributeError, OSError):
            pass
    torch.set_num_threads(threads)


def worker_env(kernels: str, linear: str | None = None) -> dict:
    """Environment of a rollout worker: the plugin switch, the linear profile the learner runs (by name: the
    engine's plugin reads it at start-up), a single-process engine, quiet logs."""
    from .. import profiles

    env = {"ALIGNED_OPS_VLLM": "1" if kernels == "aligned" else "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")}
    if linear is not None:
        env[profiles.ENV_VAR] = profiles.get(linear).name
    return env


def rollout_worker_main(spec: dict, outbox) -> None:
    """Process entry point (plain process or Ray actor). ``spec``: cfg, model_dir, worker, workers, start,
    steps, sync (host, port, world_size, layout), cores, parent_death."""
    if spec.get("parent_death", True):
        die_with_parent()
    if spec.get("log"):  # the engine's output goes to a log file, not the learner's progress bar
        fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.update(worker_env(spec["cfg"]["kernels"], spec["cfg"].get("linear")))
    w = spec["worker"]
    try:
        _run(spec, outbox)
    except BaseException:
        outbox.put(("error", w, traceback.format_exc()))
        raise


def _run(spec: dict, outbox) -> None:
    t_start = time.time()
    from .config import RunConfig

    cfg = RunConfig.from_dict(spec["cfg"])
    pin_process(spec.get("cores"), cfg.threads)

    from .sync import SyncGroup, WeightLayout, WeightReceiver

    sync = spec["sync"]
    layout = WeightLayout(sync["layout"])
    group = SyncGroup(sync["host"], sync["port"], spec["worker"] + 1, sync["world_size"])
    receiver = WeightReceiver(group, layout)
    receiver.start()  # versions arrive while the engine starts

    import torch

    from ..integrations import rollout
    from .task import AdditionTask

    aligned = cfg.kernels == "aligned"
    model_dir = spec["model_dir"]
    batch = cfg.batch_size
    # Stock vLLM 0.32 returns "raw" log-probs at temperature 1 whatever the request's temperature; its processed ones
    # are log_softmax(logits / T), what the trainer scores (the same at T = 1). The plugin's raw log-probs are at T.
    extra = {} if aligned else {"logprobs_mode": "processed_logprobs"}
    llm = rollout.make_llm(model_dir, dtype=cfg.dtype, aligned=aligned, seed=cfg.seed,
                           max_num_seqs=min(batch, 256), max_num_batched_tokens=max(2048, 16 * min(batch, 256)),
                           max_model_len=1024, **extra)
    tok = llm.get_tokenizer()
    task = AdditionTask(tok, a_range=cfg.a_range)
    recorder = None
    if spec.get("moe_layers"):
        from .routes import EngineRouteRecorder

        recorder = EngineRouteRecorder(llm, spec["moe_layers"])
    # Warm-up (not timed by the learner): the first generate compiles vLLM's CPU sampling helpers.
    warm_prompt = task.sample(torch.Generator().manual_seed(0), 1)[0][0]
    _generate(llm, [warm_prompt], task.max_answer_tokens, cfg.temperature, [1])
    engine_profile = unit = None
    if aligned:  # the profile the plugin configured the engine with, and its CPU unit (the learner checks both)
        from ..integrations.vllm import installed_profile

        engine_profile = getattr(installed_profile(), "name", None)
        unit = installed_profile().cpu_unit() if installed_profile() is not None else None
    outbox.put(("ready", spec["worker"], {"startup_s": time.time() - t_start, "pid": os.getpid(),
                                          "linear_profile": engine_profile, "cpu_unit": unit}))

    loaded = None
    k, W = cfg.lag, spec["workers"]
    first = spec["start"] + ((spec["worker"] - spec["start"]) % W)
    for b in range(first, spec["steps"], W):
        version = max(0, b - k)
        t0 = time.time()
        flats = receiver.wait_for(version)
        if flats is None:
            break  # the learner stopped early
        t1 = time.time()
        c1 = time.process_time()
        if loaded != version:
            rollout.refit(llm, layout.unpack(flats))
            loaded = version
        t2 = time.time()
        receiver.drop_below(max(0, b + W - k))
        prompts, answers = task.batch(cfg.seed, b, cfg.prompts, cfg.samples)
        seeds = [request_seed(cfg.seed, b, i) for i in range(len(prompts))]
        if recorder is not None:
            recorder.armed = True
        outs = _generate(llm, prompts, task.max_answer_tokens, cfg.temperature, seeds)
        routes = None
        if recorder is not None:
            recorder.armed = False
            by_id = recorder.take()
            routes = [by_id[o.request_id] for o in outs]
        t3 = time.time()
        cpu = time.process_time() - c1  # this process's CPU time for the weights load and the generation
        completions = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                    for o in outs]
        rewards = [task.reward(c, a, cfg.reward) for c, a in zip(completions, answers)]
        outbox.put(("batch", b, dict(
            step=b, version=version, worker=spec["worker"], prompts=prompts, completions=completions,
            logprobs=logprobs, rewards=rewards, routes=routes, wait_s=t1 - t0, load_s=t2 - t1, gen_s=t3 - t2,
            gen_tokens=sum(len(c) for c in completions), gen_cpu_s=cpu, t_gen_start=t2, t_gen_end=t3)))
    receiver.join(timeout=60)
    if recorder is not None:
        recorder.close()
    rollout.shutdown(llm)


def _generate(llm, prompts, max_tokens: int, temperature: float, seeds):
    from vllm import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=0, seed=s, ignore_eos=False)
              for s in seeds]
    return llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
