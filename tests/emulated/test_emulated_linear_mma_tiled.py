"""The block-tiled GPU `mma` linear (csrc/gpu/mma_tiled_kernels.cuh: M > 64, 128 x 64 CTA tiles, operands staged
through shared memory, register-blocked warps, a progressive lane fold) under emulation.

What is proven here, on integer views only, at both warp widths (sm_90: 32-lane warps, mma.sync m16n8k16;
gfx942: wave64, v_mfma_f32_16x16x16_bf16), under both arithmetic models of the instruction (MMA_MODELS):
* the tiled kernel == the rows kernel (16 < M <= 64) == the lanes kernel (M <= 16) == the host model of mma.h's
  chain (_linear_mma_reference), bitwise: a row alone (M = 1) and inside batches of M = 5, 64, 65, 128, 129, 200,
  300 — for both staging paths (vector: 16-byte copies / cp.async; element: odd K, lanes not 8-aligned), lane tails, K < 8
  (empty lanes), K = 4864 (608 k per lane), N not a multiple of the 64-column tile, bias and no bias;
* a contiguous x or w whose base is one element past 16-byte alignment takes the element path, same bits;
* weights read in place with a row stride != K (element and vector staging) and non-contiguous / transposed
  activations give the contiguous operands' bits;
* linear_mma_partial with 1, 2, 4, 8 lanes (the progressive fold's sub-trees) == the reference and the TP tree;
* backward: dx and dw (whose GEMMs read w and x as transposed B operands) on the tiled kernel == the reference;
* every emulator schedule gives the same bits. What the emulator can and cannot prove about the pipeline: its warps
  run in lockstep up to each instruction and a cp.async lands when the wait retires it, so a missing / too-short
  cp.async wait (a stage read before its copies landed) is caught here, and a missing barrier is caught by the
  barrier_noop control below (every __syncthreads a no-op: the bits move). A stage buffer overwritten while another
  warp still reads it (write-after-read across warps, e.g. issue() moved above the __syncthreads) is NOT caught by
  any emulated test: only hardware checks that (tests/cuda, compute-sanitizer racecheck);
* NEGATIVE CONTROLS: a split-K by M, k-blocks reversed by M, and a left-to-right fold of the lane sums in the
  tiled kernel (instead of linear_lane_fold's tree) are each caught by the same row-vs-batch comparison; with the
  barriers removed (barrier_noop) the tiled kernel's bits differ from the reference.
"""

from __future__ import annotations

import pytest
import torch

import aligned_ops
from aligned_ops.emulation import MMA_MODELS
from aligned_ops.testing import assert_bitwise_equal, count_bitwise_equal

ops = torch.ops.aligned
pytestmark = pytest.mark.emulated

WIDTHS = ["sm_90", "gfx942"]
# lanes kernel, lanes, rows, tiled (1 CTA row + 1 row), tiled (exactly 1 CTA row, 1 CTA row + 1 row), 2 / 3 CTA rows
BATCHES = (1, 5, 64, 65, 128, 129, 200, 300)
ROWS = (0, 4, 63, 64, 127, 128, 199, 299)  # rows on both sides of the 128-row CTA boundary
TILED = "mma_linear_tiled_kernel"
VECTOR, ELEMENT = 1, 0  # MmaTiledStaging
CONTROLS = {"mma_split_k_by_m": 1, "mma_block_order_by_m": 2, "mma_fold_order_by_m": 3}  # enum MmaControl


def adversarial(shape, seed, spread=12):
    """bf16 values whose exponents spread over 2^-spread .. 2^spread (alignment / rounding order show in the bits)."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.randn(*shape, generator=g)
    exp = torch.randint(-spread, spread + 1, shape, generator=g).float()
    return (mant * torch.exp2(exp)).to(torch.bfloat16)


def tiled_template_args(emu, index):
    """Template argument `index` (0-based) of the tiled launches in an emulate scope."""
    out = set()
    for launch in emu.launches:
        if launch.kernel_base == TILED:
            args = launch.kernel.split("<", 1)[1].rstrip(">").split(",")
            out.add(int(args[index].strip()))
    return out


def tiled_stagings(emu):
    """The staging paths (template argument 2 of the tiled kernel) of the tiled launches in an emulate scope."""
    return tiled_template_args(emu, 1)


def tiled_controls(emu):
    """The negative-control variants (template argument 3, enum MmaControl) of the tiled launches."""
    return tiled_template_args(emu, 2)


def assert_rows_invariant(x, w, b, batches=BATCHES, rows=ROWS):
    """linear_mma (bf16) and its unrounded 8-lane sum (fp32) of every batch prefix and of single rows are the full
    batch's rows, bitwise. Returns the full batch's (out, partial)."""
    n = max(batches)
    full, full_p = ops.linear_mma(x[:n], w, b), ops.linear_mma_partial(x[:n], w, 8)
    for M in batches[:-1]:
        assert_bitwise_equal(ops.linear_mma(x[:M], w, b), full[:M])
        assert_bitwise_equal(ops.linear_mma_partial(x[:M], w, 8), full_p[:M])
    for r in rows:
        if r < n:
            assert_bitwise_equal(ops.linear_mma(x[r:r + 1], w, b)[0], full[r])
            assert_bitwise_equal(ops.linear_mma_partial(x[r:r + 1], w, 8)[0], full_p[r])
    return full, full_p


# (K, N, staging): odd K (lanes of 25 / 26 k: a full block and a padded one), K = 320 (lanes of 40 = 2 blocks + an
# 8-k tail: a zero-filled 16-byte chunk), K = 5 (< 8: lanes 0..2 empty), N = 37 (< one 64-column tile) / 70 (a
# full tile + 6 columns).
SHAPES = [(203, 70, ELEMENT), (320, 37, VECTOR), (5, 37, ELEMENT)]


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("model", MMA_MODELS)
@pytest.mark.parametrize("K,N,staging", SHAPES)
def test_tiled_equals_rows_lanes_and_reference(arch, model, K, N, staging):
    x = adversarial((300, K), 1)
    w = adversarial((N, K), 2)
    for b in (adversarial((N,), 3), None):
        with aligned_ops.emulate(arch, mma_model=model) as emu:
            full, full_p = assert_rows_invariant(x, w, b)
            ref_p = ops._linear_mma_reference(x, w, 8)
        assert {"mma_linear_lanes_kernel", "mma_linear_rows_kernel", TILED} <= emu.kernels()
        assert tiled_stagings(emu) == {staging}
        assert_bitwise_equal(full_p, ref_p)
        assert_bitwise_equal(full, (ref_p + b.float() if b is not None else ref_p).to(torch.bfloat16))


@pytest.mark.parametrize("arch", WIDTHS)
def test_tiled_k4864(arch):
    """A model-sized K: 608 k per lane (38 k-blocks, 304 instructions per output), the vector path."""
    x = adversarial((130, 4864), 4, spread=6)
    w = adversarial((20, 4864), 5, spread=6)
    with aligned_ops.emulate(arch, mma_model="fma_chain") as emu:
        full = ops.linear_mma_partial(x, w, 8)
        for r in (0, 129):
            assert_bitwise_equal(ops.linear_mma_partial(x[r:r + 1], w, 8)[0], full[r])
        ref = ops._linear_mma_reference(x, w, 8)
    assert tiled_stagings(emu) == {VECTOR}
    assert_bitwise_equal(full, ref)


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("row_stride,staging", [(323, ELEMENT), (328, VECTOR)])
def test_tiled_weight_row_stride(arch, row_stride, staging):
    """A weight view with row stride != K is read in place (b_sn = row_stride): 323 (rows not 16-byte aligned) takes
    the element path, 328 the vector path; both give the contiguous weight's bits."""
    K, N = 320, 70
    x = adversarial((130, K), 18)
    w = adversarial((N, K), 19)
    wide = torch.zeros(N, row_stride, dtype=torch.bfloat16)
    wide[:, :K] = w
    with aligned_ops.emulate(arch, mma_model="fma_chain") as emu:
        got = ops.linear_mma_partial(x, wide[:, :K], 8)
    assert tiled_stagings(emu) == {staging}
    with aligned_ops.emulate(arch, mma_model="fma_chain") as emu:
        want = ops.linear_mma_partial(x, w, 8)
    assert tiled_stagings(emu) == {VECTOR}
    assert_bitwise_equal(got, want)


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("operand", ["x", "w"])
def test_tiled_base_misaligned_by_one_element(arch, operand):
    """A contiguous operand whose storage starts one element (2 bytes) past its allocation (storage offset 1): the
    base is not 16-byte aligned, so the launcher takes the element path although K = 320 alone would allow the vector
    path; the bits are the reference's (and the aligned operands' on the vector path)."""
    K, N = 320, 70
    x = adversarial((130, K), 22)
    w = adversarial((N, K), 23)
    src = x if operand == "x" else w
    buf = torch.zeros(src.numel() + 1, dtype=torch.bfloat16)
    shifted = buf[1:].view(src.shape)
    shifted.copy_(src)
    assert shifted.is_contiguous() and shifted.storage_offset() == 1 and shifted.data_ptr() % 16 != 0
    xs, ws = (shifted, w) if operand == "x" else (x, shifted)
    with aligned_ops.emulate(arch, mma_model="fma_chain") as emu:
        got = ops.linear_mma_partial(xs, ws, 8)
    assert tiled_stagings(emu) == {ELEMENT}
    with aligned_ops.emulate(arch, mma_model="fma_chain") as emu:
        aligned = ops.linear_mma_partial(x, w, 8)
        ref = ops._linear_mma_reference(x, w, 8)  # the host model of the emulated arch's instruction
    assert tiled_stagings(emu) == {VECTOR}
    assert_bitwise_equal(got, ref)
    assert_bitwise_equal(got, aligned)


@pytest.mark.parametrize("arch", WIDTHS)
def test_tiled_strided_and_transposed_activations(arch):
    K, N = 72, 37  # lanes of 9: one full and one padded block; K % 64 != 0 so every layout is the element path
    x = adversarial((200, K), 6)
    w = adversarial((N, K), 7)
    b = adversarial((N,), 8)
    wide = torch.zeros(200, 2 * K, dtype=torch.bfloat16)
    wide[:, ::2] = x
    xt = x.t().contiguous().t()  # [200, K] with strides (1, 200)
    assert xt.stride() == (1, 200) and wide[:, ::2].stride() == (2 * K, 2)
    with aligned_ops.emulate(arch, mma_model="fma_chain") as emu:
        want = ops.linear_mma(x, w, b)
        for view in (wide[:, ::2], xt):
            assert_bitwise_equal(ops.linear_mma(view, w, b), want)
            assert_bitwise_equal(ops.linear_mma(view[5:6], w, b)[0], want[5])
        ref = ops._linear_mma_reference(x, w, 8)
    assert TILED in emu.kernels()
    assert_bitwise_equal(want, (ref + b.float()).to(torch.bfloat16))


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("model", MMA_MODELS)
@pytest.mark.parametrize("K", [8 * 37, 8 * 64])  # lanes of 37 (element path) / 64 (vector path) for t = 8
def test_tiled_partial_lanes_and_tp_tree(arch, model, K):
    x = adversarial((130, K), 9)
    w = adversarial((70, K), 10)
    with aligned_ops.emulate(arch, mma_model=model) as emu:
        full8 = ops.linear_mma_partial(x, w, 8)
        for t in (1, 2, 4, 8):
            part = ops.linear_mma_partial(x, w, t)
            assert_bitwise_equal(part, ops._linear_mma_reference(x, w, t))
            assert_bitwise_equal(ops.linear_mma_partial(x[3:4], w, t)[0], part[3])  # lanes kernel, t lanes
            parts = [ops.linear_mma_partial(x[:, r * K // t:(r + 1) * K // t], w[:, r * K // t:(r + 1) * K // t],
                                            8 // t) for r in range(t)]
            while len(parts) > 1:
                parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
            assert_bitwise_equal(parts[0], full8)
    assert TILED in emu.kernels()


@pytest.mark.parametrize("arch", WIDTHS)
def test_tiled_backward(arch):
    """dx (A = g, B = w read in place as a transposed operand) and dw (A = g^T, B = x transposed) on the tiled
    kernel (both GEMMs have > 64 rows) == the host model; dx's rows are the rows of a single-token backward."""
    x = adversarial((150, 72), 11, spread=4)
    w = adversarial((90, 72), 12, spread=4)
    g = adversarial((150, 90), 13, spread=4)
    with aligned_ops.emulate(arch, mma_model="fma_chain") as emu:
        dx, dw, db = ops.linear_mma_backward(g, x, w, True, True, True)
        dx2, dw2, db2 = ops.linear_mma_backward(g, x, w, True, True, True)
        dx_row = ops.linear_mma_backward(g[77:78], x[77:78], w, True, False, False)[0]
        ref_dx = ops._linear_mma_reference(g, w.t().contiguous(), 8).to(torch.bfloat16)
        ref_dw = ops._linear_mma_reference(g.t().contiguous(), x.t().contiguous(), 8).to(torch.bfloat16)
    assert TILED in emu.kernels()
    assert tiled_stagings(emu) == {ELEMENT}
    assert_bitwise_equal(dx, ref_dx)
    assert_bitwise_equal(dw, ref_dw)
    assert_bitwise_equal(dx_row[0], dx[77])
    for a, b in ((dx, dx2), (dw, dw2), (db, db2)):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("schedule", ["reverse", "random:11"])
def test_tiled_every_schedule(arch, schedule):
    """Every schedule == the reference: proves the cp.async waits (a stage read before its wait retired it would
    read stale / zero bytes) and, with test_tiled_barrier_noop_caught, that the barriers exist. It cannot prove that
    no warp overwrites a stage buffer another warp still reads (write-after-read: the emulator's warps are in
    lockstep up to each instruction), see the module docstring."""
    for K in (203, 320):  # element and vector staging
        x = adversarial((200, K), 14)
        w = adversarial((70, K), 15)
        with aligned_ops.emulate(arch, mma_model="fma_chain", schedule=schedule) as emu:
            out = ops.linear_mma_partial(x, w, 8)
        with aligned_ops.emulate(arch, mma_model="fma_chain", schedule="forward"):
            ref = ops._linear_mma_reference(x, w, 8)
        assert TILED in emu.kernels()
        assert_bitwise_equal(out, ref)


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("K", [203, 320])
def test_tiled_barrier_noop_caught(arch, K):
    """NEGATIVE CONTROL of the schedule test: with every __syncthreads a no-op the tiled kernel (element and vector
    staging) no longer gives the reference's bits, and the comparison that test_tiled_every_schedule makes fails."""
    x = adversarial((200, K), 14)
    w = adversarial((70, K), 15)
    with aligned_ops.emulate(arch, mma_model="fma_chain", _fault="barrier_noop") as emu:
        out = ops.linear_mma_partial(x, w, 8)
    ref = ops._linear_mma_reference(x, w, 8)
    assert TILED in emu.kernels()
    assert tiled_stagings(emu) == {ELEMENT if K == 203 else VECTOR}
    with pytest.raises(AssertionError):
        assert_bitwise_equal(out, ref)
    assert count_bitwise_equal(out, ref) < out.numel() // 2


@pytest.mark.parametrize("fault", ["mma_split_k_by_m", "mma_block_order_by_m", "mma_fold_order_by_m"])
@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("K", [203, 320])
def test_tiled_negative_controls_caught(fault, arch, K):
    """Each fault changes the tiled kernel's order for M > 64 only (the fold fault: a left-to-right fold of the lane
    sums); the row-vs-batch comparison catches it, and passes without the fault."""
    x = adversarial((200, K), 16)
    w = adversarial((37, K), 17)
    with aligned_ops.emulate(arch, mma_model="fma_chain", _fault=fault) as emu:
        alone, batch = ops.linear_mma_partial(x[:1], w, 8), ops.linear_mma_partial(x[:200], w, 8)
        with pytest.raises(AssertionError):
            assert_rows_invariant(x, w, None, batches=(1, 200), rows=(0, 199))
    assert tiled_controls(emu) == {CONTROLS[fault]}  # the control variant ran, not the contract's kernel
    assert count_bitwise_equal(alone[0], batch[0]) < 37  # the first row's lane sums moved with M
    with aligned_ops.emulate(arch, mma_model="fma_chain"):
        assert_rows_invariant(x, w, None, batches=(1, 200), rows=(0, 199))


@pytest.mark.parametrize("arch", aligned_ops.emulation.ARCHS)
def test_tiled_every_arch(arch):
    """Every emulated arch (sm_80 .. sm_120: 86 KiB of shared memory after the opt-in; gfx942 / gfx950: 54 KiB of
    LDS) launches the tiled kernel and gives the host model's bits; a row alone equals it in the batch."""
    for K in (45, 128):  # element and vector staging
        x = adversarial((70, K), 20)
        w = adversarial((20, K), 21)
        with aligned_ops.emulate(arch) as emu:
            full = ops.linear_mma_partial(x, w, 8)
            one = ops.linear_mma_partial(x[69:70], w, 8)
            ref = ops._linear_mma_reference(x, w, 8)
        assert tiled_stagings(emu) == {VECTOR if K == 128 else ELEMENT}
        assert {launch.shared_bytes for launch in emu.launches if launch.kernel_base == TILED} == {
            54 * 1024 if arch.startswith("gfx") else 86 * 1024}
        assert_bitwise_equal(full, ref)
        assert_bitwise_equal(one[0], full[69])
