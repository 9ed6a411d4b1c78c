"""``aligned_ops.runner``: the RL loop — rollout workers (vLLM engines in their own processes, generating
continuously), a learner (the trainer, REINFORCE Zero by default or any ``aligned_ops.rl`` policy loss), a
versioned rollout queue with a maximum staleness k (k = 0 is synchronous RL), and a weight sync after every
learner step (``torch.distributed`` broadcast into vLLM's in-place reload). Both sides run the aligned kernels
or stock ones (``kernels="aligned" | "standard"``).

    from aligned_ops.runner import RunConfig, run
    summary = run(RunConfig(out="runs/a", mode="async", max_lag=1, kernels="aligned", steps=100))

Writes ``out/metrics.jsonl`` (one record per learner step; :func:`scalars` maps a record to TensorBoard / W&B
names), ``out/summary.json`` and ``out/checkpoint/`` (``RunConfig(resume=True)`` continues after a kill). The CLI
is ``aligned-ops train``; ``aligned-ops demo`` runs four configurations of it side by side.
"""

from .config import ConfigError, RunConfig  # torch-free: `aligned-ops train/demo` check their flags before torch

__all__ = ["ConfigError", "RunConfig", "run", "read_records", "scalars", "summarize"]

def __getattr__(name):  # the loop and its metrics import torch: loaded on first use, not with the config
    if name == "run":
        from .launch import run as value
    elif name in ("read_records", "scalars", "summarize"):
        from . import metrics

        value = getattr(metrics, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
