"""Microbenchmark: torch.ops.aligned.linear vs torch.nn.functional.linear on the projection shapes of a 1.5B model
(hidden 1536, kv 256, MLP 8960), decode (M = 1, 16) and prefill (M = 512, 2048; 4096 with --full), fp32 and bf16.

    PYTHONPATH=python python bench/bench_linear.py --threads 2 [--quick] [--full] [--backward] [--device cuda]
        [--ms 1,16,256] [--shapes qo] [--repeat 3]

--ms/--shapes pick a sub-grid; --repeat times each row that many times (aligned and torch interleaved in the
same run) and reports the median of each, so a shared machine's noise hits both sides alike. --cpu-time
measures the calling thread's CPU time with 1 thread (on a loaded machine wall time is mostly waiting).

Ratio = torch time / aligned time (> 1: aligned is faster). Both ops get the same inputs and thread count.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import Table, emit  # noqa: E402

import aligned_ops  # noqa: E402,F401

# (name, K, N): q/o projection, k/v projection, gate+up (fused), down
SHAPES = [("qo", 1536, 1536), ("kv", 1536, 256), ("gate_up", 1536, 17920), ("down", 8960, 1536)]


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="decode + M=512 only, short timing")
    p.add_argument("--full", action="store_true", help="also M=4096")
    p.add_argument("--backward", action="store_true", help="also time linear_backward (dx, dw) at M=512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the CUDA build of aligned_ops)")
    p.add_argument("--ms", default=None, help="comma-separated batch sizes M (overrides --quick/--full)")
    p.add_argument("--shapes", default=None, help="comma-separated shape names of SHAPES (default: all)")
    p.add_argument("--repeat", type=int, default=1, help="time each row this many times, report medians")
    p.add_argument("--cpu-time", action="store_true",
                   help="time the calling thread's CPU time instead of wall time (forces --threads 1): robust on a "
                        "shared machine")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.cpu_time:
        args.threads = 1
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    ms = [1, 16, 512] if args.quick else [1, 16, 512, 2048] + ([4096] if args.full else [])
    if args.ms:
        ms = [int(m) for m in args.ms.split(",")]
    shapes = [s for s in SHAPES if args.shapes is None or s[0] in args.shapes.split(",")]
    run_time = 0.1 if args.quick else 0.2
    where = "CPU" if dev.type == "cpu" else torch.cuda.get_device_name(dev)
    clock = "thread CPU time" if args.cpu_time else "wall time"
    table = Table(f"linear ({where}, {args.threads} threads, {clock}, median of {args.repeat})", cpu_time=args.cpu_time)
    torch.manual_seed(0)
    for dt_name in args.dtypes.split(","):
        dt = getattr(torch, dt_name)
        for name, K, N in shapes:
            w = (torch.randn(N, K) / K**0.5).to(dt).to(dev)
            for M in ms:
                if M >= 2048 and N * K > 1536 * 1536 * 2 and not args.full:
                    continue  # the big MLP shapes at M = 2048 take seconds per call: --full only
                x = torch.randn(M, K).to(dt).to(dev)
                table.add("linear", f"{name} M={M} K={K} N={N}", dt, lambda: torch.ops.aligned.linear(x, w),
                          lambda: F.linear(x, w), run_time, repeat=args.repeat)
            if args.backward:
                M = 512
                x = torch.randn(M, K).to(dt).to(dev)
                g = torch.randn(M, N).to(dt).to(dev)
                table.add("linear_backward dx,dw", f"{name} M={M} K={K} N={N}", dt,
                          lambda: torch.ops.aligned.linear_backward(g, x, w, True, True, False),
                          lambda: (g @ w, g.T @ x), run_time, repeat=args.repeat)
    emit(table, args)


if __name__ == "__main__":
    main()
