"""Per-step records (JSON lines), logger-ready scalar dicts (TensorBoard / W&B), and the run summary.

``metrics.jsonl`` holds one JSON object per learner step, in step order, each step exactly once: a resumed run
first cuts the file back to what its checkpoint covered (:meth:`MetricsLog.open`), so a step redone after a kill
is never counted twice. :func:`scalars` turns a record into ``{"group/name": float}`` for
``SummaryWriter.add_scalar`` or ``wandb.log``; :func:`summarize` computes ``summary.json``.
"""

from __future__ import annotations

import json
import math
import os
import statistics

from ..diagnostics import nan_max, nan_min, peak_to_median

# record key -> logger name (what a dashboard groups by)
SCALARS = {
    "reward": "rl/reward", "loss": "rl/loss", "grad_norm": "rl/grad_norm", "lr": "rl/lr",
    "d3": "mismatch/d3", "is_ratio_max": "mismatch/is_ratio_max", "is_ratio_min": "mismatch/is_ratio_min",
    "abs_diff_max": "mismatch/abs_diff_max", "frac_truncated": "mismatch/frac_truncated",
    "frac_masked": "mismatch/frac_masked",
    "kernel_bitwise_frac": "kernel/bitwise_frac", "kernel_abs_diff_max": "kernel/abs_diff_max",
    "kernel_d3": "kernel/d3", "routing_flips": "kernel/routing_flips", "lag_routing_flips": "mismatch/lag_routing_flips",
    "staleness": "async/staleness", "tokens_per_s": "perf/tokens_per_s", "step_s": "perf/step_s",
    "gen_s": "perf/gen_s", "train_s": "perf/train_s", "wait_s": "perf/learner_wait_s",
    "sync_send_s": "sync/send_s", "sync_load_s": "sync/load_s", "sync_s": "sync/total_s",
    "gen_tokens": "perf/gen_tokens", "gen_cpu_s": "perf/gen_cpu_s", "learner_cpu_s": "perf/learner_cpu_s",
}


def scalars(record: dict) -> dict[str, float]:
    """A step record as ``{"group/name": value}`` (numbers only), ready for TensorBoard or W&B."""
    return {name: float(record[key]) for key, name in SCALARS.items()
            if key in record and isinstance(record[key], (int, float))}


class MetricsLog:
    """Append-only JSON lines with an explicit durable offset (what a checkpoint records)."""

    def __init__(self, path: str):
        self.path = path
        self._f = None

    def open(self, truncate_to: int | None) -> None:
        """Open for appending; ``truncate_to`` (a checkpoint's offset) first drops lines written after it."""
        mode = "r+b" if os.path.exists(self.path) else "w+b"
        self._f = open(self.path, mode)
        if truncate_to is not None:
            self._f.truncate(truncate_to)
        elif mode == "r+b":
            self._f.truncate(0)
        self._f.seek(0, os.SEEK_END)

    def append(self, record: dict) -> int:
        """Write one record durably; returns the file offset after it."""
        self._f.write((json.dumps(record, allow_nan=True, sort_keys=True) + "\n").encode())
        self._f.flush()
        os.fsync(self._f.fileno())
        return self._f.tell()

    def offset(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _fifth(records: list[dict], key: str, last: bool) -> float:
    n = max(1, len(records) // 5)
    part = records[-n:] if last else records[:n]
    return statistics.fmean(r[key] for r in part)


def _cpu(records: list[dict]) -> dict:
    """CPU seconds per step of each side (medians) and what they allow: with one core each and nothing else running,
    a synchronous step costs gen + learner, an overlapped one max(gen, learner). Unlike wall time, CPU time hardly
    moves when other processes share the cores, so ``overlap_bound`` is the load-independent view of async vs sync."""
    gen = [r["gen_cpu_s"] for r in records if "gen_cpu_s" in r and not math.isnan(r["gen_cpu_s"])]
    learn = [r["learner_cpu_s"] for r in records if "learner_cpu_s" in r]
    if not gen or not learn:
        return {}
    g, le = statistics.median(gen), statistics.median(learn)
    return dict(gen_cpu_s_median=g, learner_cpu_s_median=le, overlap_bound=(g + le) / max(g, le))


def summarize(records: list[dict], cfg, extra: dict | None = None) -> dict:
    """summary.json from the step records: throughput, the D3 summary (steps >= ``cfg.summary_from``), the IS
    ratio range, the kernel-only mismatch, rewards (mean of the first and of the last fifth of the steps)."""
    if not records:
        raise ValueError("summarize: no step records")
    window = [r for r in records if r["step"] >= cfg.summary_from] or records
    d3 = [r["d3"] for r in window]
    wall = sum(r["step_s"] for r in records)
    tokens = sum(r["gen_tokens"] for r in records)
    out = dict(
        mode=cfg.mode, kernels=cfg.kernels, linear_profile=cfg.linear if cfg.kernels == "aligned" else "stock",
        max_lag=cfg.lag, loss=cfg.loss, backend=cfg.backend,
        rollout_workers=cfg.rollout_workers, seed=cfg.seed,
        updates=len(records),
        rollouts=sum(r["num_rollouts"] for r in records),
        gen_tokens=tokens,
        loop_s=wall,
        tokens_per_s=tokens / wall if wall > 0 else float("nan"),
        step_s_median=statistics.median(r["step_s"] for r in records),
        gen_s_median=statistics.median(r["gen_s"] for r in records),
        train_s_median=statistics.median(r["train_s"] for r in records),
        learner_wait_s_median=statistics.median(r["wait_s"] for r in records),
        sync_s_mean=statistics.fmean(r["sync_s"] for r in records),
        **_cpu(records),
        sync_send_s_mean=statistics.fmean(r["sync_send_s"] for r in records),
        sync_load_s_mean=statistics.fmean(r["sync_load_s"] for r in records),
        sync_bytes=records[-1].get("sync_bytes", 0),
        staleness_max=max(r["staleness"] for r in records),
        d3_from=cfg.summary_from,
        d3_steps=len(window),
        d3_median=statistics.median(d3) if not any(map(math.isnan, d3)) else float("nan"),
        d3_peak=nan_max(d3),
        d3_peak_step=window[max(range(len(d3)), key=lambda i: (math.isnan(d3[i]), d3[i]))]["step"],
        d3_peak_to_median=peak_to_median(d3),
        d3_peak_to_median_all_steps=peak_to_median([r["d3"] for r in records]),
        is_ratio_max=nan_max(r["is_ratio_max"] for r in records),
        is_ratio_min=nan_min(r["is_ratio_min"] for r in records),
        nan_steps=sum(1 for r in records if any(isinstance(v, float) and math.isnan(v)
                                                 for v in (r["loss"], r["d3"], r["grad_norm"]))),
        kernel_bitwise_min=nan_min(r["kernel_bitwise_frac"] for r in records),
        kernel_abs_diff_max=nan_max(r["kernel_abs_diff_max"] for r in records),
        kernel_d3_max=nan_max(r["kernel_d3"] for r in records),
        reward_first=_fifth(records, "reward", last=False),
        reward_last=_fifth(records, "reward", last=True),
    )
    if any("routing_flips" in r for r in records):
        out.update(routing_flips=sum(r.get("routing_flips", 0) for r in records),
                   steps_with_routing_flip=sum(1 for r in records if r.get("routing_flips", 0) > 0),
                   lag_routing_flips=sum(r.get("lag_routing_flips", 0) for r in records))
    if extra:
        out.update(extra)
    return out
