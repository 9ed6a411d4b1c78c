"""The GPU `mma` linear (csrc/gpu/mma_linear_kernels.cuh: bf16 mma.sync m16n8k16 on CUDA, v_mfma_f32_16x16x16_bf16
on HIP) under emulation, with both arithmetic models of the bf16 matrix instruction (aligned_ops.emulation.MMA_MODELS,
csrc/emu/bf16_mma_models.h): "mmasim" (MMA-Sim's characterisation of the arch's unit) and "fma_chain" (order-
sensitive on purpose: it rounds after every product, so a kernel whose k-block order or K split followed M
would give other bits).

What is proven here, on integer views only:
* a row's bits are the same alone and inside batches of M = 1, 5, 64, 200, 300 — every tiling the launcher picks
  (the lanes kernel for M <= 16, the rows kernel up to 64, the block-tiled kernel above: its own file is
  test_emulated_linear_mma_tiled.py) — at both warp widths (sm_90: 32, gfx942: 64), under both
  models and the emulator's schedules, with odd K (lane tails), N not a multiple of the tile, bias / no bias;
* the kernels equal the host model of mma.h's chain (_linear_mma_reference under emulate: the same model);
* linear_mma_partial for t = 1, 2, 4, 8 lanes combined by the tree == the full 8-lane sum (TP route);
* the two models, and the archs' MMA-Sim models, give different bits (the switch is real);
* NEGATIVE CONTROLS: a split-K that depends on M and a k-block order that depends on M (emulated kernel
  variants, emulation.h Fault) are caught by the same row-vs-batch comparison;
* accuracy against float64 within bf16 tolerance; the backward's GEMMs on the same kernels.
"""

from __future__ import annotations

import pytest
import torch

import aligned_ops
from aligned_ops.emulation import MMA_MODELS
from aligned_ops.testing import assert_bitwise_equal, count_bitwise_equal

ops = torch.ops.aligned
pytestmark = pytest.mark.emulated

WIDTHS = ["sm_90", "gfx942"]  # 32-lane warps (CUDA spelling) and wave64 (HIP spelling)
BATCHES = (1, 5, 64, 200, 300)
KERNELS = {"mma_linear_lanes_kernel", "mma_linear_rows_kernel", "mma_linear_tiled_kernel"}
K_ODD, N_ODD = 203, 37  # lanes of 25 / 26 k: two k-blocks each, the second padded; N: 2 full tiles + 5 columns


def adversarial(shape, seed, spread=12):
    """bf16 values whose exponents spread over 2^-spread .. 2^spread, so products are far apart in magnitude and
    alignment / truncation / rounding order all show in the low bits."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.randn(*shape, generator=g)
    exp = torch.randint(-spread, spread + 1, shape, generator=g).float()
    return (mant * torch.exp2(exp)).to(torch.bfloat16)


def reference_out(x, w, bias):
    """mma.h's epilogue over the host model's 8-lane sum: one fp32 add of the bias, one rounding to bf16."""
    acc = ops._linear_mma_reference(x, w, 8)
    return (acc + bias.float() if bias is not None else acc).to(torch.bfloat16)


def assert_rows_invariant(x, w, b):
    """Inside an emulate scope: every row of linear_mma (bf16) and of its unrounded 8-lane sum (linear_mma_partial,
    fp32: a difference the bf16 rounding could hide shows there) is bitwise the same alone (rows 0, 4, 63, 199,
    299) and inside the batches of M = 1, 5, 64, 200, 300. Returns the full batch's (out, partial)."""
    full, full_p = ops.linear_mma(x, w, b), ops.linear_mma_partial(x, w, 8)
    for M in BATCHES:
        assert_bitwise_equal(ops.linear_mma(x[:M], w, b), full[:M])
        assert_bitwise_equal(ops.linear_mma_partial(x[:M], w, 8), full_p[:M])
    for r in (0, 4, 63, 199, 299):
        assert_bitwise_equal(ops.linear_mma(x[r:r + 1], w, b)[0], full[r])
        assert_bitwise_equal(ops.linear_mma_partial(x[r:r + 1], w, 8)[0], full_p[r])
    return full, full_p


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("model", MMA_MODELS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_row_bits_alone_and_in_every_batch(arch, model, with_bias):
    x = adversarial((max(BATCHES), K_ODD), 1)
    w = adversarial((N_ODD, K_ODD), 2)
    b = adversarial((N_ODD,), 3) if with_bias else None
    with aligned_ops.emulate(arch, mma_model=model) as emu:
        full, full_p = assert_rows_invariant(x, w, b)
        ref = reference_out(x, w, b)
        ref_p = ops._linear_mma_reference(x, w, 8)
    assert emu.kernels() == KERNELS  # every tiling ran, nothing else
    assert_bitwise_equal(full, ref)  # the kernels are mma.h's chain under this model
    assert_bitwise_equal(full_p, ref_p)


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("schedule", ["forward", "reverse", "random:7"])
def test_bits_under_every_schedule(arch, schedule):
    x = adversarial((70, K_ODD), 4)
    w = adversarial((N_ODD, K_ODD), 5)
    ref = None
    for model in MMA_MODELS:
        with aligned_ops.emulate(arch, mma_model=model, schedule=schedule):
            outs = [ops.linear_mma_partial(x[:M], w, 8) for M in (1, 16, 70)]
            ref = ops._linear_mma_reference(x, w, 8)
        for M, out in zip((1, 16, 70), outs):
            assert_bitwise_equal(out, ref[:M])


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("model", MMA_MODELS)
def test_partial_lanes_and_tp_tree(arch, model):
    K = 8 * 37  # every rank's slice is whole lanes for t = 1, 2, 4, 8
    x = adversarial((20, K), 6)
    w = adversarial((N_ODD, K), 7)
    b = adversarial((N_ODD,), 8)
    with aligned_ops.emulate(arch, mma_model=model):
        full8 = ops.linear_mma_partial(x, w, 8)
        out = ops.linear_mma(x, w, b)
        for t in (1, 2, 4, 8):
            assert_bitwise_equal(ops.linear_mma_partial(x, w, t), ops._linear_mma_reference(x, w, t))
            # rank r holds K slice r of t and computes its 8/t lanes; the tree finishes the 8-lane fold
            parts = [ops.linear_mma_partial(x[:, r * K // t:(r + 1) * K // t], w[:, r * K // t:(r + 1) * K // t], 8 // t)
                     for r in range(t)]
            while len(parts) > 1:
                parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
            assert_bitwise_equal(parts[0], full8)
    assert_bitwise_equal(out, (full8 + b.float()).to(torch.bfloat16))


def test_models_differ():
    """The model switch is real: the two models, and MMA-Sim's models of different units, give other bits."""
    x = adversarial((16, 64), 9, spread=20)
    w = adversarial((16, 64), 10, spread=20)
    got = {}
    for arch in ("sm_80", "sm_90", "gfx942"):
        for model in MMA_MODELS:
            with aligned_ops.emulate(arch, mma_model=model):
                got[arch, model] = ops.linear_mma_partial(x, w, 1)
    n = x.shape[0] * w.shape[0]
    for arch in ("sm_90", "gfx942"):
        assert count_bitwise_equal(got[arch, "mmasim"], got[arch, "fma_chain"]) < n // 2
    assert count_bitwise_equal(got["sm_80", "mmasim"], got["sm_90", "mmasim"]) < n
    assert count_bitwise_equal(got["sm_90", "mmasim"], got["gfx942", "mmasim"]) < n
    # fma_chain is the same arithmetic on every arch (the kernels' chain is the same at both widths)
    assert_bitwise_equal(got["sm_90", "fma_chain"], got["gfx942", "fma_chain"])


@pytest.mark.parametrize("arch", aligned_ops.emulation.ARCHS)
def test_matrix_model_describes_the_scopes_model(arch):
    """emu.matrix_model says what the scope's bf16 instruction computes: under mma_model="fma_chain" the fma chain,
    not the arch's MMA-Sim model (it said "under mma_model 'mmasim': MMA-Sim's ... model" in every scope, the one
    that ran the fma chain included). Control: the mmasim scope keeps the arch's MMA-Sim description, and the
    integer instruction's description is kept in both."""
    sim = aligned_ops.emulate(arch, mma_model="mmasim").matrix_model
    chain = aligned_ops.emulate(arch, mma_model="fma_chain").matrix_model
    assert "under mma_model 'mmasim': " in sim and ("MMA-Sim" in sim or "CDNA3 model" in sim)
    assert "under mma_model 'fma_chain': 16 sequential IEEE fp32 fmas per instruction, k ascending" in chain
    assert "mmasim" not in chain and "MMA-Sim" not in chain
    integer = sim.split("; bf16 ")[0]
    assert integer.startswith("integer ") and chain.startswith(integer + "; bf16 ")


def test_mmasim_step_hand_cases():
    """Single-instruction cases whose bits follow from MMA-Sim's published rules (K = 16 in one block)."""
    def one(arch, xs, ws):
        x = torch.zeros(1, 16)
        w = torch.zeros(1, 16)
        x[0, :len(xs)] = torch.tensor(xs)
        w[0, :len(ws)] = torch.tensor(ws)
        with aligned_ops.emulate(arch):
            return ops.linear_mma_partial(x.bfloat16(), w.bfloat16(), 1)[0, 0].item()
    # 1 + 2^-30: terms aligned to 2^0 keep 25 (NV) / 24 (AMD) fractional bits, the tiny one is truncated away
    assert one("sm_90", [1.0, 2.0 ** -15], [1.0, 2.0 ** -15]) == 1.0
    assert one("gfx942", [1.0, 2.0 ** -15], [1.0, 2.0 ** -15]) == 1.0
    # 1 - 2^-30: truncation toward zero of the negative term's bits (NV: -2^-30 -> 0 at 25 bits, so exactly 1)
    assert one("sm_90", [1.0, -(2.0 ** -15)], [1.0, 2.0 ** -15]) == 1.0
    # 1 + 2^-24 (exact sum needs 25 bits): NV rounds toward zero -> 1; an fma chain rounds to nearest even -> 1
    # 1 + 3 * 2^-25: NV keeps it in the sum, rounds toward zero to 1 + 2^-23; fma rounds to nearest 1 + 2^-23 too
    # 1 + 2^-23 + 2^-24: RZ gives 1 + 2^-23, round-to-nearest-even gives 1 + 2^-22
    xs = [1.0, 2.0 ** -12, 2.0 ** -12]
    ws = [1.0, 2.0 ** -11, 2.0 ** -12]
    assert one("sm_90", xs, ws) == 1.0 + 2.0 ** -23
    with aligned_ops.emulate("sm_90", mma_model="fma_chain"):
        x = torch.tensor([xs + [0.0] * 13]).bfloat16()
        w = torch.tensor([ws + [0.0] * 13]).bfloat16()
        assert ops.linear_mma_partial(x, w, 1)[0, 0].item() == 1.0 + 2.0 ** -22


@pytest.mark.parametrize("fault", ["mma_split_k_by_m", "mma_block_order_by_m"])
@pytest.mark.parametrize("arch", WIDTHS)
def test_negative_controls_caught(fault, arch):
    """A kernel that cuts a lane's K by M, or reorders its k-blocks by M (emulated variants, M > 16 only), fails
    the invariance check of test_row_bits_alone_and_in_every_batch under the order-sensitive model — and the
    same check passes without the fault."""
    x = adversarial((max(BATCHES), K_ODD), 11)
    w = adversarial((N_ODD, K_ODD), 12)
    with aligned_ops.emulate(arch, mma_model="fma_chain", _fault=fault):
        with pytest.raises(AssertionError):
            assert_rows_invariant(x, w, None)
        alone, batch = ops.linear_mma_partial(x[:1], w, 8), ops.linear_mma_partial(x[:64], w, 8)
    assert count_bitwise_equal(alone[0], batch[0]) < N_ODD  # the first row's lane sums moved with M
    with aligned_ops.emulate(arch, mma_model="fma_chain"):
        assert_rows_invariant(x, w, None)


@pytest.mark.parametrize("arch", WIDTHS)
def test_accuracy_vs_float64(arch):
    g = torch.Generator().manual_seed(13)
    x = torch.randn(33, 517, generator=g).bfloat16()
    w = torch.randn(45, 517, generator=g).bfloat16()
    b = torch.randn(45, generator=g).bfloat16()
    with aligned_ops.emulate(arch):
        out = ops.linear_mma(x, w, b)
    exact = x.double() @ w.double().T + b.double()
    scale = x.double().abs() @ w.double().abs().T + b.double().abs()
    err = (out.double() - exact).abs()
    # one bf16 rounding (2^-8 relative) plus the unit's fp32 truncations over 517 terms
    assert (err <= 2.0 ** -8 * exact.abs() + 2.0 ** -16 * scale).all()


@pytest.mark.parametrize("arch", WIDTHS)
def test_backward_on_the_kernels(arch):
    x = adversarial((24, 70), 14, spread=4)
    w = adversarial((29, 70), 15, spread=4)
    g = adversarial((24, 29), 16, spread=4)
    with aligned_ops.emulate(arch) as emu:
        dx, dw, db = ops.linear_mma_backward(g, x, w, True, True, True)
        dx2, dw2, db2 = ops.linear_mma_backward(g, x, w, True, True, True)
        ref_dx = ops._linear_mma_reference(g, w.t().contiguous(), 8).to(torch.bfloat16)
        ref_dw = ops._linear_mma_reference(g.t().contiguous(), x.t().contiguous(), 8).to(torch.bfloat16)
    assert KERNELS & emu.kernels()
    assert_bitwise_equal(dx, ref_dx)
    assert_bitwise_equal(dw, ref_dw)
    for a, b in ((dx, dx2), (dw, dw2), (db, db2)):
        assert_bitwise_equal(a, b)


def test_unknown_model_refused():
    with pytest.raises(ValueError, match="mma_model must be one of mmasim, fma_chain, got 'rz'"):
        aligned_ops.emulate("sm_90", mma_model="rz")


@pytest.mark.parametrize("arch", aligned_ops.emulation.ARCHS)
def test_every_arch_row_vs_batch(arch):
    x = adversarial((40, 45), 17)
    w = adversarial((20, 45), 18)
    with aligned_ops.emulate(arch) as emu:
        full = ops.linear_mma_partial(x, w, 8)
        one = ops.linear_mma_partial(x[7:8], w, 8)
        ref = ops._linear_mma_reference(x, w, 8)
    assert "mma_linear_rows_kernel" in emu.kernels()
    assert_bitwise_equal(full, ref)
    assert_bitwise_equal(one[0], full[7])
