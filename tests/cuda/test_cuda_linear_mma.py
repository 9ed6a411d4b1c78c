"""The GPU `mma` linear (csrc/gpu/mma_linear_kernels.cuh: bf16 mma.sync m16n8k16 on CUDA, v_mfma_f32_16x16x16_bf16 on
ROCm) on a real GPU — the checks no emulator can make (.ci/gpu_check.sh step "mma:test_cuda_linear_mma.py"):

* the hardware instruction against the emulator's MMA-Sim model of this arch (csrc/emu/bf16_mma_models.h), on
  random and adversarial dot products of one and two k-blocks (C = +0 and C carried): the agreement is printed
  (shown when it fails; the record the emulated suite's "mmasim" model rests on) and asserted complete;
* the whole kernel against the emulated kernel under that model (same bits), and batch invariance on the
  hardware: a row alone == inside batches up to 4096 rows (the lanes, rows and block-tiled kernels), run to run.

Skipped without a GPU (CI has none; tests/emulated/test_emulated_linear_mma.py runs the same source).
"""

from __future__ import annotations

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, count_bitwise_equal

ops = torch.ops.aligned
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) GPU")


def emulated_arch() -> str:
    """The emulated arch whose model describes this GPU (aligned_ops.emulation.ARCHS)."""
    if torch.version.hip:
        name = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
        return name if name in ("gfx942", "gfx950") else pytest.skip(f"no emulated model for {name}")
    major, minor = torch.cuda.get_device_capability()
    arch = {8: "sm_80", 9: "sm_90", 10: "sm_100", 12: "sm_120"}.get(major)
    return arch or pytest.skip(f"no emulated model for sm_{major}{minor}")


def adversarial(shape, seed, spread):
    g = torch.Generator().manual_seed(seed)
    mant = torch.randn(*shape, generator=g)
    exp = torch.randint(-spread, spread + 1, shape, generator=g).float()
    return (mant * torch.exp2(exp)).to(torch.bfloat16)


@pytest.mark.parametrize("K", [16, 32])  # one instruction onto C = +0; two, the second onto the carried C
@pytest.mark.parametrize("spread", [0, 6, 24])
def test_instruction_agrees_with_the_mmasim_model(K, spread):
    arch = emulated_arch()
    x = adversarial((256, K), 1 + K + spread, spread)
    w = adversarial((256, K), 2 + K + spread, spread)
    hw = ops.linear_mma_partial(x.cuda(), w.cuda(), 1).cpu()  # one lane: the chain of K / 16 instructions
    with aligned_ops.emulate(arch, mma_model="mmasim"):
        model = ops._linear_mma_reference(x, w, 1)
    n = hw.numel()
    agree = count_bitwise_equal(hw[~hw.isnan()], model[~hw.isnan()]) + int(hw.isnan().sum())
    print(f"mma model agreement {arch} K={K} spread=2^{spread}: {agree}/{n}")
    assert agree == n


# (M, K, N): the tiled kernel's element path (odd K) and vector path (K % 64 == 0, cp.async), the rows kernel
@pytest.mark.parametrize("M,K,N", [(300, 203, 37), (130, 1024, 70), (64, 4096, 96)])
def test_kernel_equals_emulated_kernel(M, K, N):
    arch = emulated_arch()
    x = adversarial((M, K), 3, 8)
    w = adversarial((N, K), 4, 8)
    b = adversarial((N,), 5, 8)
    hw = ops.linear_mma(x.cuda(), w.cuda(), b.cuda()).cpu()
    with aligned_ops.emulate(arch, mma_model="mmasim"):
        emu = ops.linear_mma(x, w, b)
    assert_bitwise_equal(hw, emu)


def test_row_bits_alone_and_in_batches_on_the_gpu():
    x = adversarial((4096, 1024), 6, 6).cuda()
    w = adversarial((512, 1024), 7, 6).cuda()
    full = ops.linear_mma(x, w)
    assert_bitwise_equal(ops.linear_mma(x, w), full)  # run to run
    for M in (1, 5, 16, 17, 64, 200, 300, 4095):
        assert_bitwise_equal(ops.linear_mma(x[:M], w), full[:M])
    for r in (0, 17, 4095):
        assert_bitwise_equal(ops.linear_mma(x[r:r + 1], w)[0], full[r])
