"""Microbenchmark: the `mma` profile's linear (torch.ops.aligned.linear_mma, AVX512-BF16 vdpbf16ps) vs torch's bf16
F.linear (oneDNN), and the `fma` profile's aligned.linear vs the same torch call, same inputs, same run.

    PYTHONPATH=python python bench/bench_linear_mma.py --threads 2 [--ms 1,16,256] [--ks 1536,4096] [--repeat 3]
        [--backward] [--cpu-time]

Ratio = torch time / aligned time (> 1: aligned is faster). Rows are interleaved (aligned, torch) `repeat` times
and the medians reported, so a shared machine's noise hits both sides alike; say which CPU (AMX or not: torch's
bf16 path uses AMX tiles where the CPU has them) and the load average next to the numbers.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import Table, emit  # noqa: E402

import aligned_ops  # noqa: E402


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ms", default="1,16,256")
    p.add_argument("--ks", default="1536,4096", help="K = N of each square projection")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--backward", action="store_true", help="also dx, dw (linear_mma_backward vs g @ w, g.T @ x)")
    p.add_argument("--no-fma", action="store_true", help="skip the fma profile's rows")
    p.add_argument("--cpu-time", action="store_true", help="calling thread's CPU time (forces --threads 1)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if aligned_ops.mma_unit() is None:
        raise SystemExit("bench_linear_mma: this CPU has no avx512_bf16 (the mma profile refuses)")
    if args.cpu_time:
        args.threads = 1
    torch.set_num_threads(args.threads)
    clock = "thread CPU time" if args.cpu_time else "wall time"
    table = Table(f"linear_mma vs torch bf16 (CPU, {args.threads} threads, {clock}, median of {args.repeat})",
                  cpu_time=args.cpu_time)
    torch.manual_seed(0)
    bf = torch.bfloat16
    for K in (int(k) for k in args.ks.split(",")):
        N = K
        w = (torch.randn(N, K) / K**0.5).to(bf)
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K).to(bf)
            shape = f"M={M} K={K} N={N}"
            table.add("linear_mma", shape, bf, lambda: aligned_ops.linear_mma(x, w), lambda: F.linear(x, w), 0.3,
                      repeat=args.repeat)
            if not args.no_fma:
                table.add("linear (fma)", shape, bf, lambda: aligned_ops.linear(x, w), lambda: F.linear(x, w), 0.3,
                          repeat=args.repeat)
            if args.backward and M > 1:
                g = torch.randn(M, N).to(bf)
                table.add("linear_mma_backward dx,dw", shape, bf,
                          lambda: torch.ops.aligned.linear_mma_backward(g, x, w, True, True, False),
                          lambda: (g @ w, g.T @ x), 0.3, repeat=args.repeat)
    emit(table, args)


if __name__ == "__main__":
    main()
