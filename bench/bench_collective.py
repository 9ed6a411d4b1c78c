"""Microbenchmark: aligned_ops.tree_all_reduce (recursive halving, and the all-gather fallback) vs
torch.distributed.all_reduce (SUM) on the same fp32 tensors, t local gloo processes on the CPU.

    PYTHONPATH=python python bench/bench_collective.py [--ranks 2,4] [--quick] [--out FILE]

Shapes are row-parallel outputs [tokens, hidden]: decode (1, 16 tokens) and prefill chunks of a 1.5B model
(hidden 1536) plus one 4096-wide. Each rank runs one thread. Every measurement is the median over repeats of
a timed loop (same tensors, aligned and torch interleaved in the same run); ratio = torch time / aligned
time (> 1: aligned is faster). torch's all_reduce is in place and its SUM order is gloo's, not the tree.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

SHAPES = [(1, 1536), (16, 1536), (128, 1536), (512, 1536), (128, 4096)]


def worker(quick: bool):
    import torch
    import torch.distributed as dist

    import aligned_ops
    from aligned_ops.testing.distributed import init_from_env

    rank, world = init_from_env()
    torch.set_num_threads(1)
    rows = []
    shapes = SHAPES[:3] if quick else SHAPES
    for shape in shapes:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(rank))
        n_iter = max(5, int(2e6 // x.numel())) if not quick else 5
        fns = {
            "tree (halving)": lambda: aligned_ops.tree_all_reduce(x, algorithm="halving"),
            "tree (allgather)": lambda: aligned_ops.tree_all_reduce(x, algorithm="allgather"),
            "torch all_reduce": lambda: dist.all_reduce(x.clone()),
        }
        times = {k: [] for k in fns}
        for _ in range(3 if quick else 7):
            for k, fn in fns.items():
                fn()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(n_iter):
                    fn()
                dist.barrier()
                times[k].append((time.perf_counter() - t0) / n_iter * 1e6)
        rows.append(dict(shape=list(shape), **{k: statistics.median(v) for k, v in times.items()}))
    if rank == 0:
        print(json.dumps(dict(world=world, rows=rows)))
    dist.destroy_process_group()


def main():
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from aligned_ops.testing.distributed import launch

    lines = ["### tree_all_reduce vs torch.distributed.all_reduce (gloo, CPU, 1 thread per rank)", "",
             "| ranks | shape | tree halving (us) | tree allgather (us) | torch all_reduce (us) | ratio torch/halving |",
             "|---:|---|---:|---:|---:|---:|"]
    for t in map(int, args.ranks.split(",")):
        out = launch(os.path.abspath(__file__), t, ["--worker"] + (["--quick"] if args.quick else []), timeout=1800)
        res = json.loads(out[0].strip().splitlines()[-1])
        for r in res["rows"]:
            h, a, d = r["tree (halving)"], r["tree (allgather)"], r["torch all_reduce"]
            line = f"| {t} | {r['shape'][0]}x{r['shape'][1]} | {h:.1f} | {a:.1f} | {d:.1f} | {d / h:.2f} |"
            lines.append(line)
            print(line, file=sys.stderr, flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker("--quick" in sys.argv)
    else:
        main()
