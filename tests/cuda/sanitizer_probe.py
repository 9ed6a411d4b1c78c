"""A short run of every GPU kernel for compute-sanitizer (.ci/gpu_check.sh: memcheck and racecheck).

    compute-sanitizer --tool memcheck  python tests/cuda/sanitizer_probe.py
    python tests/cuda/sanitizer_probe.py --emulate sm_90     # the same logic under the emulator, no GPU

Runs the realistic cases at their small sizes (realistic_cases.py) plus the ops they do not reach (backward
passes, rotary, silu, the KV-cache write, the exact linear), every result compared with the CPU backend bit for
bit. Small shapes: the sanitizers slow kernels down 10-100x. Exit 0 when every comparison held; the sanitizer's
own --error-exitcode reports what it found.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import aligned_ops  # noqa: E402
from aligned_ops.testing import assert_bitwise_equal  # noqa: E402
from realistic_cases import CASES  # noqa: E402

ops = torch.ops.aligned


def extra_ops(run, launch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 97, generator=g).bfloat16()
    w = torch.randn(97, generator=g).bfloat16()
    run(ops.rms_norm_backward, x.flip(1), x, w, 1e-6)
    run(ops.silu_and_mul_backward, x[:, :48], x[:, :96])
    cache = aligned_ops.rotary_cos_sin_cache(32, 64)
    xr = torch.randn(3, 2, 48, generator=g)
    run(ops.rotary_embedding, torch.tensor([0, 5, 63]), xr, cache, 32, True)
    wl = torch.randn(11, 97, generator=g).bfloat16()
    run(ops.linear_backward, torch.randn(5, 11, generator=g).bfloat16(), x, wl, True, True, True)
    run(ops.linear, torch.randn(300, 97, generator=g).bfloat16(), wl, None)  # the large-M GEMM path
    run(ops.linear_exact, x, wl, None)
    qa, ka = torch.randn(40, 4, 64, generator=g), torch.randn(40, 2, 64, generator=g)
    cu = torch.tensor([0, 7, 40], dtype=torch.int32)
    oa, la = run(ops.attention_varlen, qa, ka, ka.flip(0), cu, cu, 0.125, True)
    run(ops.attention_varlen_backward, qa.flip(0), qa, ka, ka.flip(0), oa, la, cu, cu, 0.125, True)
    # the mma linear's block-tiled kernel (M > 64): its pipelined shared-memory stages are what racecheck is for (the
    # emulator cannot see a stage buffer overwritten while another warp still reads it). Launched, not compared:
    # the GPU unit's bits are not the CPU unit's (tests/cuda/test_cuda_linear_mma.py compares them with the emulator)
    for k in (320, 203):  # K = 320: the vector (cp.async) staging path; K = 203: the element path
        launch(ops.linear_mma, torch.randn(130, k, generator=g).bfloat16(), torch.randn(70, k, generator=g).bfloat16(),
               None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--emulate", default=None, help="run under aligned_ops.emulate(ARCH) instead of on the GPU")
    a = ap.parse_args()
    if a.emulate:
        def run(op, *args):
            ref = op(*args)
            with aligned_ops.emulate(a.emulate):
                got = op(*args)
            for r, gt in zip(ref if isinstance(ref, (tuple, list)) else [ref], got if isinstance(got, (tuple, list)) else [got]):
                assert_bitwise_equal(gt, r, str(op))
            return ref

        def launch(op, *args):
            with aligned_ops.emulate(a.emulate):
                return op(*args)
    else:
        if not torch.cuda.is_available():
            print("sanitizer_probe: no GPU", file=sys.stderr)
            return 2

        def run(op, *args):
            ref = op(*args)
            dev = [t.cuda() if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.dtype == torch.int64) else t
                   for t in args]
            got = op(*dev)
            torch.cuda.synchronize()
            for r, gt in zip(ref if isinstance(ref, (tuple, list)) else [ref], got if isinstance(got, (tuple, list)) else [got]):
                assert_bitwise_equal(gt.cpu(), r, str(op))
            return ref

        def launch(op, *args):
            out = op(*[t.cuda() if isinstance(t, torch.Tensor) else t for t in args])
            torch.cuda.synchronize()
            return out
    t0 = time.time()
    for name, case in sorted(CASES.items()):
        case(run, "small")
        print(f"sanitizer_probe: {name} ok ({time.time() - t0:.1f}s)", flush=True)
    extra_ops(run, launch)
    print(f"sanitizer_probe: extra ops ok ({time.time() - t0:.1f}s)", flush=True)
    if not a.emulate:
        aligned_ops.check_device_errors("cuda")
    return 0


if __name__ == "__main__":
    sys.exit(main())
