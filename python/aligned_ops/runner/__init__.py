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

from .config import ConfigError, RunConfig
from .launch import run
from .metrics import read_records, scalars, summarize

__all__ = ["ConfigError", "RunConfig", "run", "read_records", "scalars", "summarize"]
