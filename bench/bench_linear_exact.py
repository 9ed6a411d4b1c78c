"""Speed of aligned_ops.linear_exact (the `exact` profile) vs torch's bf16 linear and the `fma` aligned linear,
in one process, interleaved, repeated: ratios are medians over the repeats (ratio = torch time / ours, > 1 means
faster than torch). The packed weight is built once (as at load/refit) and not timed; the activation packing is.

    PYTHONPATH=python python3 bench/bench_linear_exact.py [--threads 2] [--repeats 5] [--matrix]

--cpu-time times with time.thread_time at 1 thread (CPU time of the calling thread: robust to a shared machine's
scheduling, which wall-clock ratios at 2 threads are not); --shapes M,K,N;... limits the table.
--matrix runs the table in four subprocesses: integer unit AMX (default) or AVX512-VNNI (ALIGNED_CPU_ISA=avx512),
and torch with oneDNN's AMX (default) or without it (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SHAPES = [(1, 1536, 1536), (16, 1536, 1536), (256, 1536, 1536), (16, 896, 4864 * 2), (256, 4864, 896)]


CLOCK = time.perf_counter


def timed(fn, reps):
    fn()
    best = []
    for _ in range(reps):
        t0 = CLOCK()
        fn()
        best.append(CLOCK() - t0)
    return statistics.median(best)


def run(args):
    import torch
    import torch.nn.functional as F

    import aligned_ops

    global CLOCK
    if args.cpu_time:
        args.threads = 1
        CLOCK = time.thread_time
    torch.set_num_threads(args.threads)
    ops = torch.ops.aligned
    g = torch.Generator().manual_seed(0)
    unit = ops._exact_unit()
    rows = []
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in t.split(",")) for t in args.shapes.split(";")]
    for M, K, N in shapes:
        w = (torch.randn(N, K, generator=g) * 0.02).bfloat16()
        x = torch.randn(M, K, generator=g).bfloat16()
        packed = ops.linear_exact_pack_weight(w)
        bounds = ops.linear_exact_f64_bounds(w)  # the fp64 path's per-row bounds (once per weight, as packed)
        inner = max(1, int(2e8 / (M * K * N)))  # calls per sample, so small shapes are not timer-bound

        def many(f):
            return lambda: [f() for _ in range(inner)]

        def exact(mode):
            def f():
                os.environ["ALIGNED_EXACT_F64"] = mode  # read per call: auto = the op's own choice
                return ops.linear_exact_packed(x, *packed, N, None, 1, w, bounds)
            return f

        fe = many(exact(args.f64))
        fd = many(exact("off"))
        ft = many(lambda: F.linear(x, w))
        ff = many(lambda: ops.linear(x, w))
        re, rf, rd, td_all, te_all, tt_all, tf_all = [], [], [], [], [], [], []
        for _ in range(args.repeats):  # interleaved: the machine's load hits all alike
            te, tt, tf, td = timed(fe, 3) / inner, timed(ft, 3) / inner, timed(ff, 3) / inner, timed(fd, 3) / inner
            re.append(tt / te)
            rf.append(tt / tf)
            rd.append(tt / td)
            td_all.append(td)
            te_all.append(te)
            tt_all.append(tt)
            tf_all.append(tf)
        sw = packed[0].shape[0]
        mem = sum(t.numel() * t.element_size() for t in packed)
        rows.append((M, K, N, sw, mem, statistics.median(te_all), statistics.median(tt_all), statistics.median(tf_all),
                     statistics.median(re), statistics.median(rf), statistics.median(td_all), statistics.median(rd)))
        print(f"  M={M} K={K} N={N}: exact {rows[-1][5]*1e3:.3f} ms, torch {rows[-1][6]*1e3:.3f} ms, "
              f"ratio {rows[-1][8]:.2f} (fma {rows[-1][9]:.2f})", file=sys.stderr, flush=True)
    torch_isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "default (AMX)")
    print(f"\n### linear_exact (ALIGNED_EXACT_F64={args.f64}), unit {unit}, torch oneDNN ISA {torch_isa}, "
          f"{args.threads} threads, "
          f"{'single-thread CPU time (time.thread_time)' if args.cpu_time else 'wall clock'}, "
          f"median of {args.repeats} interleaved repeats\n")
    print("| M | K | N | weight digits | packed weight (MiB) | exact (ms) | digit path only (ms) | torch bf16 (ms) | "
          "fma (ms) | exact ratio (torch/exact) | digit-only ratio | fma ratio (torch/fma) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for M, K, N, sw, mem, te, tt, tf, r, rf, td, rd in rows:
        print(f"| {M} | {K} | {N} | {sw} | {mem / 2**20:.1f} | {te*1e3:.3f} | {td*1e3:.3f} | {tt*1e3:.3f} | "
              f"{tf*1e3:.3f} | {r:.2f} | {rd:.2f} | {rf:.2f} |")
    sys.stdout.flush()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--matrix", action="store_true")
    p.add_argument("--cpu-time", action="store_true")
    p.add_argument("--shapes", default="")
    p.add_argument("--f64", default="auto", choices=("auto", "all", "off"),
                   help="ALIGNED_EXACT_F64 for the exact op: auto (its choice), all (fp64 path wherever the bound "
                        "holds), off (digit path only)")
    args = p.parse_args()
    if not args.matrix:
        return run(args)
    for isa in (None, "avx512"):
        for onednn in (None, "AVX512_CORE_BF16"):
            env = dict(os.environ)
            env.pop("ALIGNED_CPU_ISA", None)
            env.pop("ONEDNN_MAX_CPU_ISA", None)
            if isa:
                env["ALIGNED_CPU_ISA"] = isa
            if onednn:
                env["ONEDNN_MAX_CPU_ISA"] = onednn
            cmd = [sys.executable, __file__, "--threads", str(args.threads), "--repeats", str(args.repeats)]
            if args.cpu_time:
                cmd.append("--cpu-time")
            if args.shapes:
                cmd += ["--shapes", args.shapes]
            cmd += ["--f64", args.f64]
            subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main()
