"""Long-run stability of untruncated token IS (REINFORCE Zero) in the async runner: aligned vs stock kernels.

Runs `aligned-ops train --mode async` for --steps updates (default 2000) on the demo's warmed-up tiny MoE at 10x
the demo's learning rate with partial-credit rewards (so the policy visibly learns), with the aligned kernels and
with stock ones, both untruncated; then, if the stock run broke (a NaN step) or spiked, the
same stock run with truncated IS (`--loss tis`, C = 2) to show what it takes to survive. Reports per run: NaN
steps, the IS ratio range, the spikes (steps whose max IS ratio exceeds 2 and 10; steps whose D3 exceeds 10x the
run's median D3), D3 peak-to-median, the kernel-only mismatch, the reward of the first and last fifth.

With aligned kernels the IS ratio carries the lag alone: the kernel-only mismatch is 0 at every step, so each
ratio is exactly the trainer's own ratio between two consecutive weight versions.

    PYTHONPATH=$PWD/python nice -n 10 python3 bench/bench_runner_stability.py                # 2 x 2000 updates
    PYTHONPATH=$PWD/python python3 bench/bench_runner_stability.py --steps 300 --runs aligned standard

Extra `aligned-ops train` flags go after `--` (e.g. `-- --lr 1e-4 --train-scope all`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

# (kernels, loss) per run name
RUNS = {"aligned": ("aligned", "reinforce_zero"), "standard": ("standard", "reinforce_zero"),
        "standard_tis": ("standard", "tis")}


def loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def spikes(records: list[dict]) -> dict:
    d3 = [r["d3"] for r in records if not math.isnan(r["d3"])]
    med = statistics.median(d3) if d3 else float("nan")
    return dict(ratio_over_2=sum(r["is_ratio_max"] > 2 or r["is_ratio_min"] < 0.5 for r in records),
                ratio_over_10=sum(r["is_ratio_max"] > 10 or r["is_ratio_min"] < 0.1 for r in records),
                d3_over_10x_median=sum(v > 10 * med for v in d3))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--runs", nargs="+", default=["aligned", "standard"], choices=list(RUNS),
                   help="standard_tis is added by itself when the untruncated stock run breaks or spikes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4, help="10x the demo's: the policy learns within the run")
    p.add_argument("--reward", default="digits", choices=["exact", "digits"])
    p.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    p.add_argument("train_args", nargs="*", help="more `aligned-ops train` flags after --")
    args = p.parse_args()

    from aligned_ops.apps.demo import DEMO_DEFAULTS
    from aligned_ops.runner import RunConfig
    from aligned_ops.runner.models import prepare_tiny_model

    out = args.out or tempfile.mkdtemp(prefix="bench_stability_")
    cfg = RunConfig(**dict(DEMO_DEFAULTS, steps=args.steps, seed=args.seed, prompts=args.prompts, lr=args.lr,
                           reward=args.reward)).validate(check_out=False)
    model = prepare_tiny_model(cfg, os.path.join(out, "model"))
    results = {}
    queue = list(args.runs)
    while queue:
        name = queue.pop(0)
        kernels, loss = RUNS[name]
        run = os.path.join(out, name)
        subprocess.run(["rm", "-rf", run])
        cmd = [sys.executable, "-m", "aligned_ops.apps.cli", "train", "--no-progress", "--model", model, "--mode",
               "async", "--kernels", kernels, "--loss", loss, "--steps", str(args.steps), "--seed", str(args.seed),
               "--prompts", str(cfg.prompts), "--samples", str(cfg.samples), "--lr", str(cfg.lr), "--a-range",
               str(cfg.a_range), "--reward", cfg.reward, "--checkpoint-every", "100", "--out", run,
               *args.train_args]
        t0 = time.time()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(run, "summary.json")) as f:
            s = json.load(f)
        with open(os.path.join(run, "metrics.jsonl")) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        results[name] = dict(s, **spikes(recs), wall=time.time() - t0, load=loadavg())
        print(f"{name}: {json.dumps({k: results[name][k] for k in ('nan_steps', 'is_ratio_max', 'ratio_over_2', 'd3_peak_to_median', 'reward_first', 'reward_last')})}",
              flush=True)
        broke = s["nan_steps"] > 0 or results[name]["ratio_over_10"] > 0
        if name == "standard" and broke and "standard_tis" not in results and "standard_tis" not in queue:
            queue.append("standard_tis")
    print(f"\n### {args.steps} async updates (lag 1), tiny Qwen3-MoE (the demo's), {cfg.prompts}x{cfg.samples} "
          f"rollouts/step, lr {cfg.lr:g}, reward {cfg.reward}, seed {args.seed}; extra flags: "
          f"{' '.join(args.train_args) or 'none'}\n")
    cols = list(results)
    rows = [
        ("loss", lambda s: s["loss"]),
        ("updates", lambda s: s["updates"]),
        ("NaN steps", lambda s: s["nan_steps"]),
        ("IS ratio min / max (any token, any step)", lambda s: f"{s['is_ratio_min']:.3g} / {s['is_ratio_max']:.3g}"),
        ("steps with a ratio outside [0.5, 2]", lambda s: s["ratio_over_2"]),
        ("steps with a ratio outside [0.1, 10]", lambda s: s["ratio_over_10"]),
        ("steps with D3 > 10x its median", lambda s: s["d3_over_10x_median"]),
        ("D3 median / peak-to-median", lambda s: f"{s['d3_median']:.3g} / {s['d3_peak_to_median']:.3g}"),
        ("kernel-only bitwise equal (min %)", lambda s: f"{100 * s['kernel_bitwise_min']:.0f}"),
        ("kernel-only max abs Δlogp", lambda s: f"{s['kernel_abs_diff_max']:.3g}"),
        ("reward first -> last fifth", lambda s: f"{s['reward_first']:.3f} -> {s['reward_last']:.3f}"),
        ("wall (s) / load average after", lambda s: f"{s['wall']:.0f} / {s['load']}"),
    ]
    print("| metric | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name, fn in rows:
        print(f"| {name} | " + " | ".join(str(fn(results[c])) for c in cols) + " |")
    print(f"\nruns: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
