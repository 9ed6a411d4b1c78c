"""aligned::linear_mma (the `mma` linear profile, csrc/common/mma.h) on the CPU's unit: AVX512-BF16 vdpbf16ps (the
`avx512` level), or AMX-BF16 tdpbf16ps (the `amx` level; its own tests: test_linear_mma_amx.py). Every test here
runs on either unit except the two that check vdpbf16ps's own numpy model (marked `vdpbf16ps_model`; on an AMX CPU
test_linear_mma_amx.py runs them under ALIGNED_CPU_ISA=avx512, whose unit is vdpbf16ps).

Contract: bf16 x, weight, bias; K cut into the fma profile's 8 lanes; each lane one chain of the unit (pairs
(k, k+1) ascending from the lane start, odd element first, bf16 inputs and the accumulator DAZ'd, every fma
result flushed; an odd lane's last pair padded with +0); the 8 lane sums folded by the tree, + bias once, one
rounding. Backward on the unit: dx over 8 lanes of N, dw over 8 fixed token blocks, db fp32 column chains.

Families (DEVELOPERS.md "Tests — what counts"):
- the model: an independent numpy emulation of mma.h's step equals the C++ reference, which equals the kernel
  on every tile path (direct / packed, every row remainder, column tails, odd lanes, K < 8), on random and
  adversarial inputs (subnormals, products at the subnormal boundary, overflow, cancellation, zeros, inf, NaN);
  negative controls: the natural (even-first) order and the unflushed chain differ from the kernel;
- invariance (int16 / int32 views): a row alone vs inside batches of M = 1, 5, 13, 17, 64, 200, 300 at several
  positions with other rows around it, threads 1 vs 2, repeated runs, forward and backward; negative controls
  through the same checker: a split-K that depends on M, a k-block order that changes with M;
- TP: the tree of rank partials (t = 1, 2, 4, 8) + bias, rounded, equals linear_mma; a sequential combine does not;
- accuracy vs float64 (forward and autograd), opcheck, torch.compile(fullgraph=True), bad input, the refusal of
  a CPU without the unit (ALIGNED_CPU_ISA=avx2 in a subprocess).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import aligned_ops
from aligned_ops import linear_tp_slices, tree_combine
from aligned_ops.ops.linear import finish_linear
from aligned_ops.testing import assert_bitwise_equal, bits, bitwise_equal

sys.path.insert(0, os.path.dirname(__file__))
from dense_invariance import rows_varying  # noqa: E402
from test_linear import fma_f32  # noqa: E402  (exact IEEE fma on float32 arrays)

ops = torch.ops.aligned
pytestmark = pytest.mark.skipif(aligned_ops.mma_unit() is None, reason="this CPU has no avx512_bf16 (mma refuses)")

BF = torch.bfloat16
UNIT = aligned_ops.mma_unit()
# mma.h's scalar model is vdpbf16ps's: the AMX unit (tdpbf16ps) has no model, its reference is the instruction itself
vdpbf16ps_model = pytest.mark.skipif(UNIT != "avx512_bf16", reason=f"the vdpbf16ps model; this process's unit is "
                                     f"{UNIT} (test_linear_mma_amx.py runs these under ALIGNED_CPU_ISA=avx512)")


def rand(*shape, seed=0, scale=1.0, dtype=BF):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def adversarial(M, K, N, seed=0):
    """bf16 x [M, K], w [N, K] mixing: N(0,1) values, bf16 subnormals, values whose products land around the fp32
    subnormal boundary (2^-126), huge values (products overflow to inf), exact cancellations, signed zeros, and
    a sprinkle of inf / NaN."""
    g = torch.Generator().manual_seed(seed)

    def pool(rows):
        sign = torch.randint(0, 2, (rows, K), generator=g, dtype=torch.int32) << 15
        man = torch.randint(0, 128, (rows, K), generator=g, dtype=torch.int32)
        kind = torch.randint(0, 10, (rows, K), generator=g)
        exp = torch.where(kind < 3, torch.randint(117, 138, (rows, K), generator=g, dtype=torch.int32),  # ~1
              torch.where(kind < 5, torch.zeros_like(man),                                               # subnormal / 0
              torch.where(kind < 8, torch.randint(60, 70, (rows, K), generator=g, dtype=torch.int32),    # ~2^-63
                          torch.randint(185, 200, (rows, K), generator=g, dtype=torch.int32))))          # ~2^62
        b = (sign | (exp << 7) | man).to(torch.int16)
        return b.view(BF).clone()

    x, w = pool(M), pool(N)
    if K >= 4:  # cancellations: x[:, 1] = -x[:, 0] against equal weights
        x[: M // 2, 1] = -x[: M // 2, 0]
        w[:, 1] = w[:, 0]
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 97),), generator=g)
    flat[idx[::3]] = float("inf")
    flat[idx[1::3]] = -0.0
    flat[idx[2::7]] = float("nan")
    return x, w


def same_bits_nan_aware(a, b):
    """Bits equal everywhere, NaN positions equal (a NaN's payload is the unit's; mma.h does not define it)."""
    na, nb = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(na, nb)) and bool(torch.equal(bits(a)[~na], bits(b)[~nb]))


# ---- the model: numpy emulation == C++ reference == kernel --------------------------------------------------


_OVERFLOW = 2.0**128 - 2.0**103  # |exact| at or above this rounds to inf in fp32 (FLT_MAX + half an ulp, a tie to inf)


def _fma(a, b, c):
    """Exact IEEE fp32 fma (test_linear.fma_f32) including overflow to inf, which its midpoint fix-up does not
    cover (and the adversarial inputs reach)."""
    r = fma_f32(a, b, c)
    s = a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)
    return np.where(np.abs(s) >= _OVERFLOW, np.copysign(np.float32(np.inf), s), r).astype(np.float32)


def _flush(v):
    return np.where((v.view(np.uint32) & 0x7F800000) == 0, np.copysign(np.float32(0), v), v).astype(np.float32)


def numpy_model(x, w, lanes, *, order="odd_first", flush=True):
    """mma.h's chain of the CPU unit, vectorised over (m, n) with an exact fma. `order`, `flush`: the wrong
    variants the negative controls use."""
    X = x.float().numpy()
    W = w.float().numpy()
    M, K = X.shape
    N = W.shape[0]
    fl = _flush if flush else (lambda v: v.astype(np.float32))
    X, W = fl(X), fl(W)
    sums = []
    with np.errstate(all="ignore"):
        for l in range(lanes):
            k0, k1 = l * K // lanes, (l + 1) * K // lanes
            acc = np.zeros((M, N), np.float32)
            for k in range(k0, k1, 2):
                x0, w0 = X[:, k][:, None], W[:, k][None, :]
                full = k + 1 < k1
                x1 = X[:, k + 1][:, None] if full else np.zeros((M, 1), np.float32)
                w1 = W[:, k + 1][None, :] if full else np.zeros((1, N), np.float32)
                first, second = ((x1, w1), (x0, w0)) if order == "odd_first" else ((x0, w0), (x1, w1))
                acc = fl(_fma(np.broadcast_to(first[0], (M, N)), np.broadcast_to(first[1], (M, N)), fl(acc)))
                acc = fl(_fma(np.broadcast_to(second[0], (M, N)), np.broadcast_to(second[1], (M, N)), acc))
            sums.append(torch.from_numpy(acc))
    return tree_combine(sums) if lanes > 1 else sums[0]


MODEL_SHAPES = [(3, 2, 5), (4, 7, 9), (5, 16, 17), (6, 33, 8), (3, 64, 16), (2, 101, 7)]


@vdpbf16ps_model
@pytest.mark.parametrize("M,K,N", MODEL_SHAPES)
@pytest.mark.parametrize("lanes", [1, 8])
def test_numpy_model_equals_reference_equals_kernel(M, K, N, lanes):
    for seed, (x, w) in enumerate([(rand(M, K, seed=1), rand(N, K, seed=2)), adversarial(M, K, N, seed=3),
                                   adversarial(M, K, N, seed=4)]):
        ref = ops._linear_mma_reference(x, w, lanes)
        assert same_bits_nan_aware(numpy_model(x, w, lanes), ref), (seed, "numpy model vs reference")
        assert same_bits_nan_aware(ops.linear_mma_partial(x, w, lanes), ref), (seed, "kernel vs reference")


@vdpbf16ps_model
def test_negative_controls_other_order_and_no_flush_differ_from_the_kernel():
    """The model checks can fail: the natural (even-first) pair order and the chain without DAZ/FTZ each differ
    from the kernel on inputs built for it (but equal the kernel's on most ordinary values)."""
    x, w = adversarial(32, 64, 24, seed=5)
    kern = ops.linear_mma_partial(x, w, 8)
    assert same_bits_nan_aware(numpy_model(x, w, 8), kern)
    assert not same_bits_nan_aware(numpy_model(x, w, 8, order="even_first"), kern)
    assert not same_bits_nan_aware(numpy_model(x, w, 8, flush=False), kern)
    # and the fma profile's chains are another profile (not the unit's)
    assert not same_bits_nan_aware(ops.linear_partial(x, w, 8), kern)


# Every tile path of gemm_mma_kernels.cpp: direct (rows <= 8: weight transposed in registers, 1..8-row variants),
# row-lane (rows 9..16 with one zmm per column, 24..32 with two: rows in the zmm lanes), packed (17..23 and > 32
# rows: remainders 1..7 of the 8-row microkernel, > 256 rows = two row blocks); column tails (N % 16, N % 32);
# odd lanes (K % 16 != 0), K < 8 (empty lanes), K = 1; lanes 1, 2, 4, 8; K = 2048 (rows 4 KiB apart).
KERNEL_SHAPES = [(1, 64, 16), (1, 7, 3), (2, 1, 5), (3, 77, 33), (7, 130, 31), (8, 40, 48), (9, 5, 17), (13, 61, 40),
                 (16, 96, 65), (17, 50, 32), (23, 131, 47), (24, 33, 18), (29, 2048, 20), (32, 70, 9), (33, 40, 40),
                 (64, 96, 33), (100, 66, 70), (259, 40, 20)]


# The AMX unit's paths (gemm_amx_mma_kernels.cpp; test_linear_mma_amx.py): row tails and row groups, column tails,
# lanes of whole 32-k blocks and lanes ending in a partial one, K < 8, K = 1.
AMX_SHAPES = [(1, 896, 40), (15, 203, 17), (16, 256, 32), (17, 77, 33), (31, 4864, 20), (32, 5, 48), (33, 1, 16),
              (47, 130, 31), (100, 320, 70), (259, 64, 9)]


@pytest.mark.parametrize("M,K,N", KERNEL_SHAPES + AMX_SHAPES)
def test_kernel_bitwise_equal_to_reference_on_every_path(M, K, N):
    x, w = rand(M, K, seed=M + K), rand(N, K, seed=N, scale=0.05)
    xa, wa = adversarial(M, K, N, seed=M * 7 + N)
    for xx, ww in ((x, w), (xa, wa)):
        for lanes in (1, 2, 4, 8):
            assert same_bits_nan_aware(ops.linear_mma_partial(xx, ww, lanes), ops._linear_mma_reference(xx, ww, lanes))
    b = rand(N, seed=9)
    assert_bitwise_equal(ops.linear_mma(x, w, b), finish_linear(ops._linear_mma_reference(x, w, 8), b, BF))
    assert_bitwise_equal(ops.linear_mma(x, w), ops._linear_mma_reference(x, w, 8).to(BF))


def test_zero_size_and_empty_k():
    w = rand(5, 0)
    assert_bitwise_equal(ops.linear_mma(rand(3, 0), w), torch.zeros(3, 5, dtype=BF))
    b = rand(5, seed=1)
    assert_bitwise_equal(ops.linear_mma(rand(3, 0), w, b), b.expand(3, 5).contiguous())
    assert ops.linear_mma(rand(0, 4), rand(5, 4)).shape == (0, 5)
    assert ops.linear_mma(rand(2, 4), rand(0, 4)).shape == (2, 0)


def test_non_contiguous_and_batch_dims():
    x, w, b = rand(3, 4, 40, seed=1), rand(40, 24, seed=2).T, rand(24, seed=3)  # w: [24, 40] transposed view
    want = ops.linear_mma(x.contiguous(), w.contiguous(), b)
    assert want.shape == (3, 4, 24)
    assert_bitwise_equal(ops.linear_mma(x, w, b), want)
    assert_bitwise_equal(ops.linear_mma(x.transpose(0, 1).contiguous().transpose(0, 1), w, b), want)


def test_special_values_propagate():
    x, w = rand(2, 32), rand(3, 32)
    x[0, 5] = float("nan")
    x[1, 6] = float("inf")
    out = ops.linear_mma(x, w)
    assert torch.isnan(out[0]).all()
    assert torch.isinf(out[1]).any() or torch.isnan(out[1]).any()
    # a subnormal bf16 input is a zero to the unit (DAZ): the output equals that of an explicit zero
    xs = rand(4, 48, seed=3)
    xs[:, 10] = torch.tensor(2.0**-130).to(BF)  # bf16 subnormal
    xz = xs.clone()
    xz[:, 10] = 0.0
    assert_bitwise_equal(ops.linear_mma(xs, rand(6, 48, seed=4)), ops.linear_mma(xz, rand(6, 48, seed=4)))


def test_linear_is_the_rounded_8_lane_partial_plus_bias():
    x, w, b = rand(37, 200, seed=5), rand(50, 200, seed=6), rand(50, seed=7)
    assert_bitwise_equal(ops.linear_mma(x, w, b), finish_linear(ops.linear_mma_partial(x, w, 8), b, BF))


def test_accuracy_vs_float64():
    for M, K, N in ((1, 1536, 64), (33, 700, 45), (300, 96, 50)):
        x, w, b = rand(M, K, seed=M), rand(N, K, seed=N, scale=K**-0.5), rand(N, seed=1)
        want = F.linear(x.double(), w.double(), b.double())
        got = ops.linear_mma(x, w, b).double()
        # one bf16 rounding of the output (2^-8 relative) plus the fp32 chains
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-5 * K**0.5)


# ---- invariance -------------------------------------------------------------------------------------------------

K_INV = 1536
BATCHES = (1, 5, 13, 17, 29, 64, 200, 300)  # every path: direct, row-lane 1 / 2 zmm, packed, two row blocks


@pytest.mark.parametrize("M", BATCHES)
def test_row_alone_equals_row_in_batch(M):
    x, w, b = rand(M, K_INV, seed=M), rand(96, K_INV, seed=20, scale=0.03), rand(96, seed=21)
    rows = sorted({0, M // 2, M - 1})
    assert rows_varying(lambda t: ops.linear_mma(t, w, b), x, rows) == []
    assert rows_varying(lambda t: ops.linear_mma_partial(t, w, 8), x, rows) == []  # fp32: the tree unrounded


def test_negative_control_split_k_by_m_is_caught():
    """A kernel whose K split depends on M (8 lanes for small batches, 4 for large, as split-K heuristics do)
    fails the same check."""
    x, w = rand(64, K_INV, seed=22), rand(40, K_INV, seed=23, scale=0.03)

    def split_k_by_m(t):
        return ops.linear_mma_partial(t, w, 8 if t.shape[0] < 16 else 4)  # fp32: no final rounding to hide it

    assert rows_varying(split_k_by_m, x, [0, 63]) != []


def test_negative_control_k_block_order_changing_with_m_is_caught():
    """A kernel that walks the k-blocks in another order for large M (here: the pairs of each lane from the lane's
    end, i.e. the same lanes on K reversed) fails the same check."""
    x, w = rand(64, K_INV, seed=24), rand(40, K_INV, seed=25, scale=0.03)

    def order_by_m(t):
        if t.shape[0] < 16:
            return ops.linear_mma_partial(t, w, 8)
        return ops.linear_mma_partial(t.flip(-1).contiguous(), w.flip(-1).contiguous(), 8)

    assert rows_varying(order_by_m, x, [0, 63]) != []


@pytest.mark.parametrize("M,N", [(1, 300), (5, 40), (64, 40), (300, 100)])
def test_threads_and_runs(M, N):
    x, w, b = rand(M, K_INV, seed=26), rand(N, K_INV, seed=27, scale=0.03), rand(N, seed=28)
    g = rand(M, N, seed=29)

    def all_outputs():
        return (ops.linear_mma(x, w, b), ops.linear_mma_partial(x, w, 4),
                *ops.linear_mma_backward(g, x, w, True, True, True))

    torch.set_num_threads(1)
    one = all_outputs()
    torch.set_num_threads(2)
    two, again = all_outputs(), all_outputs()
    for a, b2, c in zip(one, two, again):
        assert bitwise_equal(a, b2) and bitwise_equal(b2, c)


# ---- tensor parallelism (row-parallel): the rank partials and the tree ----------------------------------------


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("K", [1536, 96])
def test_tree_of_rank_partials_equals_linear_mma(t, K):
    x, w, b = rand(9, K, seed=30 + t), rand(33, K, seed=31, scale=0.05), rand(33, seed=32)
    parts = [ops.linear_mma_partial(x[:, k0:k1].contiguous(), w[:, k0:k1].contiguous(), 8 // t)
             for k0, k1 in linear_tp_slices(K, t)]
    assert_bitwise_equal(finish_linear(tree_combine(parts), b, BF), ops.linear_mma(x, w, b))


def test_negative_control_sequential_rank_combine_differs():
    x, w = rand(64, 1536, seed=33), rand(64, 1536, seed=34, scale=0.05)
    lanes = [ops.linear_mma_partial(x[:, k0:k1].contiguous(), w[:, k0:k1].contiguous(), 1)
             for k0, k1 in linear_tp_slices(1536, 8)]
    seq = lanes[0]
    for s in lanes[1:]:
        seq = seq + s
    assert_bitwise_equal(tree_combine(lanes), ops.linear_mma_partial(x, w, 8))
    assert not bitwise_equal(seq, tree_combine(lanes))


# ---- backward --------------------------------------------------------------------------------------------------


def test_backward_is_the_profile_linear_of_its_operands():
    """dx = linear_mma over N of (g, w^T), dw = over the M tokens of (g^T, x^T), db = fp32 column chains (the same
    chains as the fma profile's db) — bitwise, on both kernel paths (M small / large)."""
    for M, K, N in ((3, 70, 90), (300, 40, 24), (20, 130, 17)):
        x, w, g = rand(M, K, seed=M), rand(N, K, seed=N), rand(M, N, seed=K)
        dx, dw, db = ops.linear_mma_backward(g, x, w, True, True, True)
        assert_bitwise_equal(dx, ops._linear_mma_reference(g, w.T.contiguous(), 8).to(BF))
        assert_bitwise_equal(dw, ops._linear_mma_reference(g.T.contiguous(), x.T.contiguous(), 8).to(BF))
        assert_bitwise_equal(db, ops.linear_backward(g, x, w, False, False, True)[2])
        none = ops.linear_mma_backward(g, x, w, False, False, False)
        assert all(t is None for t in none)


@pytest.mark.parametrize("M", (1, 5, 64, 300))
def test_backward_dx_row_invariance(M):
    w = rand(100, K_INV, seed=35, scale=0.03)
    g = rand(M, 100, seed=36 + M)

    def dx_of(gr):  # dx does not read x's values, only its shape
        return ops.linear_mma_backward(gr, torch.zeros(gr.shape[0], K_INV, dtype=BF), w, True, False, False)[0]

    assert rows_varying(dx_of, g, sorted({0, M // 2, M - 1})) == []


def test_dw_follows_its_token_blocks():
    """dw is deterministic (threads, runs) for the same tokens; reversing the tokens (other blocks and chains)
    changes bits but not the value beyond bf16 rounding (the check can fail)."""
    M, K, N = 300, 70, 90
    x, g, w = rand(M, K, seed=37), rand(M, N, seed=38), rand(N, K, seed=39)
    torch.set_num_threads(1)
    dw1 = ops.linear_mma_backward(g, x, w, False, True, False)[1]
    torch.set_num_threads(2)
    dw2 = ops.linear_mma_backward(g, x, w, False, True, False)[1]
    assert bitwise_equal(dw1, dw2)
    dw_rev = ops.linear_mma_backward(g.flip(0), x.flip(0), w, False, True, False)[1]
    assert not bitwise_equal(dw_rev, dw1)
    torch.testing.assert_close(dw_rev.float(), dw1.float(), rtol=2**-6, atol=1e-2)


def test_autograd_vs_float64():
    x = rand(2, 7, 96, seed=44).requires_grad_()
    w = rand(21, 96, seed=45, scale=0.1).requires_grad_()
    b = rand(21, seed=46).requires_grad_()
    g = rand(2, 7, 21, seed=47)
    aligned_ops.linear_mma(x, w, b).backward(g)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    F.linear(x64, w64, b64).backward(g.double())
    for got, want in ((x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert got.dtype == BF
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=2e-2)
    # grads for x only, no bias
    x.grad = None
    aligned_ops.linear_mma(x, w.detach()).sum().backward()
    torch.testing.assert_close(x.grad.double(), w.detach().double().sum(0).expand(2, 7, 96), rtol=2**-7, atol=2e-2)


def test_partial_and_backward_op_have_no_backward():
    x, w = rand(2, 16).requires_grad_(), rand(3, 16)
    with pytest.raises(RuntimeError, match="linear_mma_partial has no backward"):
        ops.linear_mma_partial(x, w, 8).sum().backward()
    g = rand(2, 3).requires_grad_()
    dx = ops.linear_mma_backward(g, x.detach(), w, True, False, False)[0]
    with pytest.raises(RuntimeError, match="linear_mma_backward has no backward"):
        dx.sum().backward()


# ---- torch integration ------------------------------------------------------------------------------------------


def test_opcheck():
    x, w, b = rand(5, 19), rand(11, 19), rand(11)
    torch.library.opcheck(ops.linear_mma, (x, w, b))
    torch.library.opcheck(ops.linear_mma, (rand(2, 3, 19), w, None))
    torch.library.opcheck(ops.linear_mma_partial, (x, w, 4))
    torch.library.opcheck(ops.linear_mma_backward, (rand(5, 11), x, w, True, True, True))


def test_compile_fullgraph_bitwise_equals_eager():
    x, w, b = rand(6, 45, seed=40), rand(30, 45, seed=41), rand(30, seed=42)

    # (no bf16 arithmetic around the ops: inductor would fuse it in fp32 without eager's intermediate roundings)
    def f(x, w, b):
        return aligned_ops.linear_mma(torch.relu(x), w, b), aligned_ops.linear_mma_partial(x, w, 2) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    for xx in (x, rand(9, 45, seed=43)):  # another batch size
        for got, want in zip(compiled(xx, w, b), f(xx, w, b)):
            assert bitwise_equal(got, want)


def test_profile_switch(monkeypatch):
    """ALIGNED_OPS_LINEAR=mma resolves to the registered MMA object (the one resolution path), whose linear is
    aligned::linear_mma; the fma profile is another arithmetic (negative control)."""
    from aligned_ops import profiles
    from aligned_ops.models.spec import LayerRules

    x, w, b = rand(4, 64), rand(8, 64), rand(8)
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "mma")
    assert profiles.resolve() is profiles.MMA and profiles.REGISTRY["mma"] is profiles.MMA
    assert aligned_ops.linear_profile() == "mma" and profiles.MMA.op == "linear_mma"
    assert_bitwise_equal(aligned_ops.profile_linear(x, w, b), ops.linear_mma(x, w, b))
    assert LayerRules().resolve_profile() is profiles.MMA
    assert_bitwise_equal(profiles.MMA.linear(x, w, b), ops.linear_mma(x, w, b))
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "fma")
    assert LayerRules().resolve_profile() is profiles.FMA
    assert LayerRules(linear_profile="mma").resolve_profile() is profiles.MMA  # an architecture's pin
    xl, wl = rand(16, 1536, seed=1), rand(16, 1536, seed=2)  # another profile, other bits (fp32: unrounded)
    assert not bitwise_equal(ops.linear_partial(xl, wl, 8), ops.linear_mma_partial(xl, wl, 8))


@pytest.mark.parametrize(
    "fn, args, match",
    [
        (ops.linear_mma, (rand(2, 3, dtype=torch.float32), rand(4, 3)), "aligned::linear_mma: x must be bfloat16 .* ALIGNED_OPS_LINEAR=fma"),
        (ops.linear_mma, (rand(2, 3), rand(4, 3, dtype=torch.float16)), "aligned::linear_mma: weight must be bfloat16"),
        (ops.linear_mma, (rand(2, 3), rand(4, 3), rand(4, dtype=torch.float32)), "aligned::linear_mma: bias must be bfloat16"),
        (ops.linear_mma, (rand(2, 3), rand(4, 5)), "aligned::linear_mma: x has 3 input features"),
        (ops.linear_mma, (rand(2, 3), rand(4, 3), rand(5)), r"aligned::linear_mma: bias must be \[4\]"),
        (ops.linear_mma, (torch.tensor(1.0, dtype=BF), rand(4, 3)), "at least one dimension"),
        (ops.linear_mma_partial, (rand(2, 3), rand(4, 3), 3), "aligned::linear_mma_partial: lanes must be 1, 2, 4 or 8"),
        (ops.linear_mma_partial, (rand(2, 3, dtype=torch.float32), rand(4, 3), 8), "aligned::linear_mma_partial: x must be bfloat16"),
        (ops.linear_mma_backward, (rand(2, 4, dtype=torch.float32), rand(2, 3), rand(4, 3), True, True, True),
         "aligned::linear_mma_backward: grad_out must be bfloat16"),
        (ops.linear_mma_backward, (rand(2, 5), rand(2, 3), rand(4, 3), True, True, True),
         r"aligned::linear_mma_backward: grad_out must have shape \[2, 4\]"),
    ],
)
def test_bad_input(fn, args, match):
    with pytest.raises(RuntimeError, match=match):
        fn(*args)


def test_meta_and_mixed_devices():
    out = ops.linear_mma(torch.empty(2, 5, 3, device="meta", dtype=BF), torch.empty(4, 3, device="meta", dtype=BF))
    assert out.device.type == "meta" and out.shape == (2, 5, 4)
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        ops.linear_mma(torch.empty(2, 3, device="meta"), torch.empty(4, 3, device="meta"))
    with pytest.raises(RuntimeError, match="same device"):
        ops.linear_mma(rand(2, 3), torch.empty(4, 3, device="meta", dtype=BF))


_NO_UNIT = r"""
import torch, aligned_ops
assert aligned_ops.mma_unit() is None, aligned_ops.mma_unit()
x, w = torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(3, 8, dtype=torch.bfloat16)
ref = torch.ops.aligned._linear_mma_reference(x, w, 8)   # the model needs no unit
assert float(ref[0, 0]) == 8.0
for call in (lambda: aligned_ops.linear_mma(x, w), lambda: aligned_ops.linear_mma_partial(x, w, 8)):
    try:
        call()
    except RuntimeError as e:
        print(str(e).splitlines()[0])
    else:
        raise SystemExit("no refusal")
try:
    from aligned_ops.ops.linear_mma import check_mma_available
    check_mma_available("trainer")
except RuntimeError as e:
    print(e)
"""


@pytest.mark.parametrize("isa, refused", [("avx2", True), ("generic", True), ("avx512", False)])
def test_a_cpu_without_the_unit_refuses_by_name(isa, refused):
    """ALIGNED_CPU_ISA=avx2 / generic make the process a CPU without AVX-512 (cpu_backend.h): every mma op and the
    start-up check refuse in one line that names the requirement and the way out; avx512 keeps the unit."""
    res = subprocess.run([sys.executable, "-c", _NO_UNIT], env=dict(os.environ, ALIGNED_CPU_ISA=isa),
                         capture_output=True, text=True, timeout=120)
    if not refused:
        assert res.returncode != 0 and "avx512_bf16" in res.stderr  # the script's first assert: the unit is there
        return
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    assert lines[0].startswith("aligned::linear_mma: mma needs avx512_bf16; use ALIGNED_OPS_LINEAR=fma"), lines
    assert lines[1].startswith("aligned::linear_mma_partial: mma needs avx512_bf16; use ALIGNED_OPS_LINEAR=fma"), lines
    assert lines[2].startswith("aligned_ops (trainer): mma needs avx512_bf16; use ALIGNED_OPS_LINEAR=fma"), lines


# ---- MoE experts under the mma profile (moe.h: every projection is the profile's linear) -------------------------


def _experts_reference_mma(x, tw, ids, w13, w2, sw13=None, sw2=None, sgate=None):
    """moe.h's per-token experts, composed of the mma ops token by token: h = linear_mma, y = the unrounded
    8-lane linear_mma_partial, the rank-order fp32 combine (products rounded, then added), one rounding."""
    T, H = x.shape
    out = torch.empty_like(x)
    for t in range(T):
        xt = x[t : t + 1]
        acc = torch.zeros(1, H)
        for r in range(ids.shape[1]):
            e = int(ids[t, r])
            y = ops.linear_mma_partial(ops.silu_and_mul(ops.linear_mma(xt, w13[e])), w2[e], 8)
            acc = acc + tw[t, r] * y
        if sw13 is not None:
            ys = ops.linear_mma_partial(ops.silu_and_mul(ops.linear_mma(xt, sw13)), sw2, 8)
            g = 1.0 / (1.0 + ops._exp_f32(-ops.linear_mma_partial(xt, sgate, 8))) if sgate is not None else 1.0
            acc = acc + g * ys
        out[t] = acc[0].to(x.dtype)
    return out


def _moe_inputs(T, E=6, H=64, I=40, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(BF)
    w13 = (0.1 * torch.randn(E, 2 * I, H, generator=g)).to(BF)
    w2 = (0.1 * torch.randn(E, H, I, generator=g)).to(BF)
    tw, ids, _ = aligned_ops.moe_routing(torch.randn(T, E, generator=g), k)
    shared = ((0.1 * torch.randn(2 * 24, H, generator=g)).to(BF), (0.1 * torch.randn(H, 24, generator=g)).to(BF),
              (0.1 * torch.randn(1, H, generator=g)).to(BF))
    return x, tw, ids, w13, w2, shared


@pytest.mark.parametrize("with_shared", [False, True])
def test_moe_experts_mma_equals_the_composition_of_mma_ops(with_shared):
    x, tw, ids, w13, w2, shared = _moe_inputs(37)
    sh = shared if with_shared else (None, None, None)
    got = aligned_ops.moe_experts(x, tw, ids, w13, w2, *sh, linear_profile="mma")
    assert_bitwise_equal(got, _experts_reference_mma(x, tw, ids, w13, w2, *sh))
    assert_bitwise_equal(aligned_ops.moe_experts(x, tw, ids, w13, w2, *sh),  # the op's default is fma
                         aligned_ops.moe_experts(x, tw, ids, w13, w2, *sh, linear_profile="fma"))
    # The two profiles' fp32 sums differ by an ulp in a few % of the outputs, which the bf16 rounding mostly hides;
    # products in the subnormal range show them apart (the unit flushes them, the fma chain keeps them).
    def tiny(t):  # down projections around the subnormal boundary
        return None if t is None else (t.float() * 2.0**-124).to(BF)

    w2t, sht = tiny(w2), (sh[0], tiny(sh[1]), sh[2])
    got = aligned_ops.moe_experts(x, tw, ids, w13, w2t, *sht, linear_profile="mma")
    assert_bitwise_equal(got, _experts_reference_mma(x, tw, ids, w13, w2t, *sht))
    assert not bitwise_equal(got, aligned_ops.moe_experts(x, tw, ids, w13, w2t, *sht))


def test_moe_experts_mma_token_alone_equals_token_in_batch():
    x, tw, ids, w13, w2, shared = _moe_inputs(300, seed=1)
    full = aligned_ops.moe_experts(x, tw, ids, w13, w2, *shared, linear_profile="mma")
    for t in (0, 1, 150, 299):
        alone = aligned_ops.moe_experts(x[t : t + 1], tw[t : t + 1], ids[t : t + 1], w13, w2, *shared,
                                        linear_profile="mma")
        assert_bitwise_equal(alone[0], full[t])
    for M in (5, 64):
        part = aligned_ops.moe_experts(x[:M], tw[:M], ids[:M], w13, w2, *shared, linear_profile="mma")
        assert_bitwise_equal(part, full[:M])


def test_moe_experts_mma_backward_recomputes_the_mma_forward():
    """The experts' backward runs the fma profile's fp32 gradient chains on the mma forward's activations; close to
    float64 autograd of the same math."""
    x, tw, ids, w13, w2, shared = _moe_inputs(9, seed=2)
    xs, w13s, w2s = (t.clone().requires_grad_() for t in (x, w13, w2))
    twr = tw.clone().requires_grad_()
    out = aligned_ops.moe_experts(xs, twr, ids, w13s, w2s, linear_profile="mma")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(BF)
    out.backward(g)
    x64, w1364, w264, tw64 = (t.detach().double().requires_grad_() for t in (x, w13, w2, tw))
    ref = torch.zeros(9, 64, dtype=torch.float64)
    for t in range(9):
        for r in range(2):
            e = int(ids[t, r])
            h = x64[t] @ w1364[e].T
            a = F.silu(h[:40]) * h[40:]
            ref[t] = ref[t] + tw64[t, r] * (a @ w264[e].T)
    ref.backward(g.double())
    for got, want in ((xs.grad, x64.grad), (w13s.grad, w1364.grad), (w2s.grad, w264.grad), (twr.grad, tw64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)


def test_moe_experts_mma_refusals():
    x, tw, ids, w13, w2, _ = _moe_inputs(3)
    with pytest.raises(RuntimeError, match="aligned::moe_experts: the mma profile's experts take bfloat16"):
        aligned_ops.moe_experts(x.float(), tw, ids, w13.float(), w2.float(), linear_profile="mma")
    with pytest.raises(RuntimeError, match="aligned::moe_experts: linear_profile must be 'fma' or 'mma', got 'exact'"):
        aligned_ops.moe_experts(x, tw, ids, w13, w2, linear_profile="exact")
    torch.library.opcheck(ops.moe_experts, (x, tw, ids, w13, w2, None, None, None, "mma"))


def test_the_profile_runs_every_matrix_op():
    """The profile object (what both sides carry): linear, the LM head (LayerRules.head_logits) and the MoE
    experts run the unit; the router keeps router_profile (fma); the exact profile's experts run the fma chains,
    as before it had a profile object."""
    from aligned_ops import profiles
    from aligned_ops.models.spec import LayerRules

    x, tw, ids, w13, w2, shared = _moe_inputs(5)
    rules = LayerRules()
    assert_bitwise_equal(profiles.MMA.moe_experts(x, tw, ids, w13, w2, *shared),
                         aligned_ops.moe_experts(x, tw, ids, w13, w2, *shared, linear_profile="mma"))
    assert_bitwise_equal(rules.head_logits(profiles.MMA, x, w13[0]), ops.linear_mma(x, w13[0]))
    assert_bitwise_equal(rules.router_linear(x, w13[0]), ops.linear(x, w13[0]))
    assert_bitwise_equal(profiles.EXACT.moe_experts(x, tw, ids, w13, w2), aligned_ops.moe_experts(x, tw, ids, w13, w2))
    # models.moe.sparse_moe (both sides' block) hands the experts to the profile it is given
    from aligned_ops.models.moe import MoEWeights, sparse_moe

    mw = MoEWeights(router=w13[:, 0, :].contiguous(), top_k=ids.shape[1], scoring="softmax", renormalize=True,
                    w13=w13, w2=w2)
    logits = rules.router_linear(x, mw.router)
    wts, ids2, _ = aligned_ops.moe_routing(logits.contiguous(), mw.top_k, "softmax", True)
    assert_bitwise_equal(sparse_moe(rules, x, mw, profile=profiles.MMA),
                         aligned_ops.moe_experts(x, wts, ids2, w13, w2, linear_profile="mma"))
    assert_bitwise_equal(sparse_moe(rules, x, mw, profile=profiles.FMA),
                         aligned_ops.moe_experts(x, wts, ids2, w13, w2))


def test_mma_model_refusals():
    from aligned_ops import profiles
    from aligned_ops.ops.linear_mma import mma_model_reasons

    assert mma_model_reasons(torch.bfloat16) == [] and profiles.MMA.model_refusals(torch.bfloat16) == []
    assert mma_model_reasons("float32") == [
        "the mma profile takes bfloat16 models (its matrix units multiply bf16), got float32; use ALIGNED_OPS_LINEAR=fma"]
    # a GPU: refused only where this build has no GPU kernels (this CPU build), in the profile's own words
    cuda = profiles.MMA.refusals(device="cuda", dtype=torch.bfloat16)
    if torch._C._dispatch_has_kernel_for_dispatch_key("aligned::linear_mma", "CUDA"):
        assert cuda == []
    else:
        assert cuda == ["the mma profile has no cuda kernels in this build (aligned_ops was built without CUDA / "
                        "ROCm); use ALIGNED_OPS_LINEAR=fma"]
        # the GPU refusal does not depend on the CPU's unit, and the dtype refusal is still given
        assert profiles.MMA.model_refusals("float32", "cuda")[-1].startswith("the mma profile takes bfloat16")

@pytest.mark.skipif(UNIT != "avx512_bf16", reason="the vdpbf16ps unit's refusal (the AMX unit packs)")
def test_the_vdpbf16ps_unit_refuses_packed_weights_by_name():
    """linear_mma_pack_weight / linear_mma_packed are the amx_bf16 unit's (test_linear_mma_amx.py); on vdpbf16ps
    both refuse in one line naming the unit, and aligned_ops.linear_mma reads a registered weight in place."""
    w, x = rand(20, 64, seed=1), rand(3, 64, seed=2)
    with pytest.raises(RuntimeError, match="linear_mma_pack_weight: packs weights for the amx_bf16 unit; this "
                                           "process's mma unit is avx512_bf16"):
        ops.linear_mma_pack_weight(w)
    fake = torch.zeros(aligned_ops.ops.linear_mma._packed_weight_elems(20, 64), dtype=torch.int16)
    with pytest.raises(RuntimeError, match="linear_mma_packed: packed weights are the amx_bf16 unit's"):
        ops.linear_mma_packed(x, w, fake, None)
    aligned_ops.cache_exact_weights(w)
    assert_bitwise_equal(aligned_ops.linear_mma(x, w), ops.linear_mma(x, w))


class TorchFunctionParameter(torch.nn.Parameter):
    """vLLM's parameter classes (model_executor/parameter.py BasevLLMParameter): a __torch_function__ that every
    op and property read of the weight goes through. Counts the calls that reach it."""

    calls = 0

    def __new__(cls, data):
        return super().__new__(cls, data=data, requires_grad=False)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_registered_vllm_style_parameter_runs_without_its_torch_function():
    """The rollout engine's weights are registered vLLM parameters: aligned_ops.linear_mma runs them as plain tensors
    (no call reaches their pass-through __torch_function__, ~3 us each), on either unit, with the bits of the plain
    tensor. An unregistered weight keeps its subclass's hooks: the control shows they do run there."""
    w = TorchFunctionParameter(rand(24, 96, seed=21, scale=0.05))
    x = rand(3, 96, seed=22)
    want = ops.linear_mma(x, w.detach().as_subclass(torch.Tensor))
    with torch.no_grad():
        TorchFunctionParameter.calls = 0
        assert_bitwise_equal(aligned_ops.linear_mma(x, w), want)
        assert TorchFunctionParameter.calls > 0  # control: not registered, its hooks run
        aligned_ops.cache_exact_weights(w)
        TorchFunctionParameter.calls = 0
        assert_bitwise_equal(aligned_ops.linear_mma(x, w), want)
        assert TorchFunctionParameter.calls == 0
        # an activation of a subclass keeps its hooks (only a registered weight is read plain): with a registered
        # plain weight the output is the activation's subclass, as with an unregistered one
        w_plain = w.detach().as_subclass(torch.Tensor).clone()
        aligned_ops.cache_exact_weights(w_plain)
        tagged = aligned_ops.linear_mma(x.as_subclass(TaggedTensor), w_plain)
        assert type(tagged) is TaggedTensor
        assert_bitwise_equal(tagged.as_subclass(torch.Tensor), want)
        assert type(aligned_ops.linear_mma(x, w_plain)) is torch.Tensor  # control


class TaggedTensor(torch.Tensor):
    """An activation subclass whose __torch_function__ wraps results (the default Tensor behaviour)."""
