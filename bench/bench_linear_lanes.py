"""The cost of the 8-lane tree, isolated: the same GEMM kernel run with 1 lane (one chain over K: the order
before the lane change) and with 8 lanes (linear's order), in ONE process, interleaved, on thread CPU time with
1 thread — so a shared machine's load and process-to-process variation cancel out. Also torch's F.linear.

    PYTHONPATH=python python bench/bench_linear_lanes.py [--rounds 7] [--ms 1,16,256] [--kn 1536]

Prints time(lanes=1) / time(lanes=8) (> 1: the lanes are faster) and torch / lanes=8, medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import cpu_time_us  # noqa: E402

import aligned_ops  # noqa: E402,F401


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--ms", default="1,16,256")
    p.add_argument("--kn", type=int, default=1536)
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args()
    torch.set_num_threads(1)
    K = N = args.kn
    print("| M | K=N | dtype | lanes1/lanes8 median [min, max] | torch/lanes8 median |")
    print("|---:|---:|---|---|---:|")
    for dt_name in args.dtypes.split(","):
        dt = getattr(torch, dt_name)
        for M in [int(m) for m in args.ms.split(",")]:
            w = (torch.randn(N, K) / K**0.5).to(dt)
            x = torch.randn(M, K).to(dt)
            r, rt = [], []
            for _ in range(args.rounds):
                t1 = cpu_time_us(lambda: torch.ops.aligned.linear_partial(x, w, 1), 0.2)
                t8 = cpu_time_us(lambda: torch.ops.aligned.linear_partial(x, w, 8), 0.2)
                tt = cpu_time_us(lambda: F.linear(x, w), 0.2)
                r.append(t1 / t8)
                rt.append(tt / t8)
            print(f"| {M} | {K} | {dt_name} | {statistics.median(r):.3f} [{min(r):.2f}, {max(r):.2f}] | "
                  f"{statistics.median(rt):.2f} |", flush=True)


if __name__ == "__main__":
    main()
