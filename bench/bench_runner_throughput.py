"""Async vs sync throughput of the RL runner, robust to a shared machine: interleaved runs, same-run ratios.

Runs `aligned-ops train --mode sync` and `--mode async` alternately (S A S A ..., each a fresh pair of processes:
one rollout worker and one learner, one core each), on one warmed-up model built once, and reports for each pair
the ratio of async to sync generated tokens/s, plus the median over pairs. Also the per-step medians that explain
the ratio: generation time (rollout worker), learner update time, and the step time. With k = 1 the ideal ratio is
(gen + learner) / max(gen, learner) when neither waits on anything else.

    PYTHONPATH=$PWD/python python3 bench/bench_runner_throughput.py --pairs 3          # the demo's settings
    PYTHONPATH=$PWD/python python3 bench/bench_runner_throughput.py --kernels standard --pairs 3

Prints a Markdown table with the load average before and after (the numbers move with other processes on the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default="aligned", choices=["aligned", "standard"])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    p.add_argument("train_args", nargs="*", help="more `aligned-ops train` flags after --")
    args = p.parse_args()

    from aligned_ops.apps.demo import DEMO_DEFAULTS
    from aligned_ops.runner import RunConfig
    from aligned_ops.runner.models import prepare_tiny_model

    out = args.out or tempfile.mkdtemp(prefix="bench_runner_")
    cfg = RunConfig(**dict(DEMO_DEFAULTS, steps=args.steps, prompts=args.prompts, samples=args.samples,
                           seed=args.seed)).validate(check_out=False)
    model = prepare_tiny_model(cfg, os.path.join(out, "model"))
    load_before = loadavg()
    rows = []
    for i in range(args.pairs):
        pair = {}
        for mode in ("sync", "async"):
            run = os.path.join(out, f"{mode}_{i}")
            subprocess.run(["rm", "-rf", run])
            cmd = [sys.executable, "-m", "aligned_ops.apps.cli", "train", "--no-progress", "--model", model,
                   "--mode", mode, "--kernels", args.kernels, "--steps", str(args.steps), "--prompts",
                   str(args.prompts), "--samples", str(args.samples), "--seed", str(args.seed),
                   "--lr", str(cfg.lr), "--a-range", str(cfg.a_range), "--out", run, *args.train_args]
            t0 = time.time()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            with open(os.path.join(run, "summary.json")) as f:
                pair[mode] = dict(json.load(f), wall=time.time() - t0, load=loadavg())
        rows.append(pair)
        print(f"pair {i}: sync {pair['sync']['tokens_per_s']:.0f} tok/s, async {pair['async']['tokens_per_s']:.0f} "
              f"tok/s, ratio {pair['async']['tokens_per_s'] / pair['sync']['tokens_per_s']:.2f} (load "
              f"{pair['async']['load']})", flush=True)
    ratios = [r["async"]["tokens_per_s"] / r["sync"]["tokens_per_s"] for r in rows]
    from aligned_ops.apps.demo import cpu_speedup

    print(f"\n### {args.kernels} kernels, {args.steps} steps of {args.prompts}x{args.samples} rollouts; load average "
          f"{load_before} before, {loadavg()} after\n")
    print("| pair | mode | tokens/s | step median (s) | generation median (s) | learner update median (s) | "
          "learner waits, median (s) | CPU s per step: generation / learner | weight sync (ms) | async / sync | "
          "async / sync from CPU time |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, (r, ratio) in enumerate(zip(rows, ratios)):
        for mode in ("sync", "async"):
            s = r[mode]
            print(f"| {i} | {mode} | {s['tokens_per_s']:.0f} | {s['step_s_median']:.3f} | {s['gen_s_median']:.3f} | "
                  f"{s['train_s_median']:.3f} | {s['learner_wait_s_median']:.3f} | {s['gen_cpu_s_median']:.3f} / "
                  f"{s['learner_cpu_s_median']:.3f} | {1e3 * s['sync_s_mean']:.1f} | "
                  + (f"**{ratio:.2f}×** | {cpu_speedup(r['sync'], s):.2f}× |" if mode == "async" else " | |"))
    print(f"\nmedian async / sync over {len(ratios)} pairs: **{statistics.median(ratios):.2f}×** "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}) in wall time; from CPU time per step (two free cores): "
          f"{statistics.median(cpu_speedup(r['sync'], r['async']) for r in rows):.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
