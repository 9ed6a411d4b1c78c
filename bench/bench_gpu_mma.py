"""GPU speed of the `mma` linear (aligned::linear_mma: bf16 mma.sync / MFMA in the 8 fixed lanes) against the peer
in the same run: torch.matmul on bf16 (cuBLAS / hipBLASLt) and the `fma` linear (aligned::linear, CUDA cores).

    PYTHONPATH=python python3 bench/bench_gpu_mma.py [--out FILE] [--quick]

Ratios are torch-time / aligned-time (> 1: aligned faster). Also checks on the hardware that row 0 of every batch
is bitwise the row computed alone (the profile's promise), so a timing row never stands for wrong bits.
"""

from __future__ import annotations

import argparse
import sys

import torch

import aligned_ops  # noqa: F401  (registers torch.ops.aligned)
from common import device_median_ms

ops = torch.ops.aligned


def tiling(m: int) -> str:
    """The kernel csrc/gpu/mma_launch.cuh picks for M rows (lanes: M <= 16, rows: M <= 64, tiled above)."""
    return "lanes" if m <= 16 else "rows" if m <= 64 else "tiled"


def timed(fn, reps: int) -> float:
    """Median milliseconds of ``reps`` calls (CUDA events, after 3 warm-up calls): bench/common.py's timer."""
    return device_median_ms(fn, reps, warmup=3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="append the Markdown table to this file")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_mma: no GPU", file=sys.stderr)
        return 3
    shapes = [(1, 4096, 4096), (16, 4096, 4096), (64, 4096, 4096), (256, 4096, 4096), (2048, 4096, 4096)]
    if not a.quick:
        shapes += [(4096, 4096, 14336), (16, 4096, 14336)]
    reps = 10 if a.quick else 30
    name = torch.cuda.get_device_name(0)
    lines = [f"### `mma` linear vs cuBLAS and the `fma` linear — {name}, torch {torch.__version__}, bf16, median of "
             f"{reps}", "",
             "| M | K | N | mma kernel | torch.matmul (ms) | linear_mma (ms) | linear fma (ms) | torch ÷ mma | "
             "torch ÷ fma | mma TFLOP/s | row alone ≡ in batch |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k, n in shapes:
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(torch.bfloat16)
        t_torch = timed(lambda: torch.matmul(x, w.T), reps)
        t_mma = timed(lambda: ops.linear_mma(x, w, None), reps)
        t_fma = timed(lambda: ops.linear(x, w, None), max(3, reps // 3))
        full = ops.linear_mma(x, w, None)
        alone = ops.linear_mma(x[:1].contiguous(), w, None)
        same = bool(torch.equal(full[:1].view(torch.int16), alone.view(torch.int16)))
        tflops = 2 * m * k * n / (t_mma * 1e-3) / 1e12
        lines.append(f"| {m} | {k} | {n} | {tiling(m)} | {t_torch:.4f} | {t_mma:.4f} | {t_fma:.4f} | {t_torch / t_mma:.3f} | "
                     f"{t_torch / t_fma:.3f} | {tflops:.1f} | {'yes' if same else 'NO'} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
