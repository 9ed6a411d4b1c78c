"""Cross-check of the emulator's bf16 MMA models (csrc/emu/bf16_mma_models.h, written from MMA-Sim's description)
against MMA-Sim's own Python simulator (microsoft/MMA-Sim, mmasim/simulator), instruction by instruction.

    python3 bench/experiments/mmasim_crosscheck.py /path/to/MMA-Sim [instructions per case]

For each arch (sm_80 = MMA-Sim "Ampere" mma m16n8k16, sm_90 = "Hopper" mma m16n8k16, gfx942 = "CDNA3" mfma
f32_16x16x16_bf16) and each input family (random; exponents spread over 2^-24..2^24; cancellation), it draws A, B,
runs one instruction onto C = +0 and a second onto the carried C in MMA-Sim (D = sim(A1, B1, sim(A0, B0, 0))),
and the emulator's chain of the same two k-blocks (aligned::linear_mma_partial with one lane, K = 32, under
aligned_ops.emulate(arch, mma_model="mmasim")), and counts bit-equal outputs. Needs torch and the built
extension (PYTHONPATH=python). Slow: MMA-Sim loops in Python per element. NaN/inf inputs are not drawn.
"""

from __future__ import annotations

import sys

import torch

import aligned_ops

ops = torch.ops.aligned


def draw(kind, shape, g):
    m = torch.randn(*shape, generator=g)
    if kind == "spread":
        m = m * torch.exp2(torch.randint(-24, 25, shape, generator=g).float())
    if kind == "cancel":  # pairs of near-equal magnitude and opposite sign in each row
        m = m.round(decimals=1)
        m[..., 1::2] = -m[..., 0::2] * (1 + torch.randint(-2, 3, m[..., 1::2].shape, generator=g) * 2.0 ** -7)
    return m.to(torch.bfloat16)


def main() -> int:
    sys.path.insert(0, sys.argv[1])
    from mmasim.simulator.amd import mfma
    from mmasim.simulator.nv_ptx import mma

    count = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    units = {"sm_80": (mma("Ampere", "m16n8k16.f32.bf16.bf16.f32"), 8),
             "sm_90": (mma("Hopper", "m16n8k16.f32.bf16.bf16.f32"), 8),
             "gfx942": (mfma("CDNA3", "f32_16x16x16_bf16"), 16)}
    total_bad = 0
    for arch, (sim, n) in units.items():
        for kind in ("random", "spread", "cancel"):
            g = torch.Generator().manual_seed(hash((arch, kind)) % 2**31)
            same = tot = 0
            for _ in range(count):
                x = draw(kind, (16, 32), g)
                w = draw(kind, (n, 32), g)
                d0 = sim(x[:, :16], w[:, :16].T.contiguous(), torch.zeros(16, n))
                d = sim(x[:, 16:], w[:, 16:].T.contiguous(), d0)
                with aligned_ops.emulate(arch, mma_model="mmasim"):
                    ours = ops.linear_mma_partial(x, w, 1)
                same += int((ours.view(torch.int32) == d.view(torch.int32)).sum())
                tot += d.numel()
            total_bad += tot - same
            print(f"{arch:7s} {kind:7s} {same}/{tot} outputs bit-equal to MMA-Sim")
    return 1 if total_bad else 0


if __name__ == "__main__":
    sys.exit(main())
