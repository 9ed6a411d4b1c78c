"""aligned::linear_partial and the 8-lane tree of the `fma` linear profile (csrc/common/contract.h).

linear cuts K into 8 lanes (floor rule), one fp32 fma chain per lane, tree ((0+1)+(2+3))+((4+5)+(6+7)), + bias
once. linear_partial(x, w, lanes) is the sub-tree over `lanes` lanes of its local K. A t-way row-parallel layer
(t = 1, 2, 4, 8) whose ranks hold aligned_ops.linear_tp_slices(K, t) and whose partials are combined by
aligned_ops.tree_combine reproduces linear bit for bit. Every bitwise claim goes through integer views
(aligned_ops.testing); every invariance has a negative control.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import aligned_ops
from aligned_ops import linear_lane_bounds, linear_partial, linear_tp_slices, tree_combine
from aligned_ops.ops.linear import finish_linear
from aligned_ops.testing import assert_bitwise_equal, bitwise_equal

sys.path.insert(0, os.path.dirname(__file__))
from test_linear import lane_tree_f32  # noqa: E402  (the plain scalar reference of the contract)

linear = torch.ops.aligned.linear
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def tp_linear(x, w, b, t, dtype):
    """A t-way row-parallel linear made of linear_partial + tree_combine + the epilogue."""
    parts = [linear_partial(x[..., k0:k1], w[:, k0:k1], 8 // t) for k0, k1 in linear_tp_slices(x.shape[-1], t)]
    return finish_linear(tree_combine(parts), b, dtype)


# ---- the lane rule ---------------------------------------------------------------------------------------


def test_lane_bounds_floor_rule():
    assert linear_lane_bounds(16) == [(2 * l, 2 * l + 2) for l in range(8)]
    assert linear_lane_bounds(9) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 9)]
    assert linear_lane_bounds(3) == [(0, 0), (0, 0), (0, 1), (1, 1), (1, 1), (1, 2), (2, 2), (2, 3)]
    assert linear_lane_bounds(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    with pytest.raises(ValueError, match="lanes must be 1, 2, 4 or 8"):
        linear_lane_bounds(16, 3)


def test_tp_slices():
    for K in (8, 64, 1536, 8960):
        for t in (1, 2, 4, 8):
            assert linear_tp_slices(K, t) == [(r * K // t, (r + 1) * K // t) for r in range(t)]
    assert linear_tp_slices(9, 2) == [(0, 4), (4, 9)]  # K % 8 != 0 that still holds whole lanes
    with pytest.raises(ValueError, match=r"K=11 cannot be split 2 ways into whole lanes: rank 0 holds K\[0:5\]"):
        linear_tp_slices(11, 2)
    with pytest.raises(ValueError, match="TP degree"):
        linear_tp_slices(16, 3)


# ---- conformance: linear_partial against the plain scalar reference ---------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lanes", [1, 2, 4, 8])
@pytest.mark.parametrize("M,K,N", [(1, 45, 37), (3, 423, 213), (20, 16, 65), (9, 3, 40)])
def test_partial_bitwise_equal_to_scalar_reference(dtype, lanes, M, K, N):
    x, w = rand(M, K, dtype=dtype, seed=1), rand(N, K, dtype=dtype, seed=2)
    got = linear_partial(x, w, lanes)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    want = torch.from_numpy(lane_tree_f32(x.float().numpy(), w.float().numpy(), lanes))
    assert_bitwise_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,N", [(1, 45, 37), (3, 423, 213), (17, 130, 33), (9, 3, 40)])
def test_kernel_equals_the_contract_helper_equals_the_python_reference(dtype, M, K, N):
    """Three-way conformance: the GEMM kernel, contract.h's scalar linear_partial_dot (the helper every backend
    is held to, exposed as _linear_partial_reference) and the independent Python scalar reference."""
    x, w = rand(M, K, dtype=dtype, seed=30), rand(N, K, dtype=dtype, seed=31)
    for lanes in (1, 2, 4, 8):
        helper = torch.ops.aligned._linear_partial_reference(x, w, lanes)
        assert_bitwise_equal(helper, torch.from_numpy(lane_tree_f32(x.float().numpy(), w.float().numpy(), lanes)))
        assert_bitwise_equal(linear_partial(x, w, lanes), helper)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_is_the_rounded_8_lane_partial(dtype):
    x, w, b = rand(5, 423, dtype=dtype, seed=3), rand(213, 423, dtype=dtype, seed=4), rand(213, dtype=dtype, seed=5)
    assert_bitwise_equal(linear(x, w, b), finish_linear(linear_partial(x, w, 8), b, dtype))
    assert_bitwise_equal(linear(x, w), finish_linear(linear_partial(x, w, 8), None, dtype))


# ---- TP: linear equals the tree of its partials --------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("M,K,N", [(1, 1536, 96), (7, 64, 33), (33, 8, 17), (4, 2048, 40), (3, 9, 21)])
def test_linear_equals_tree_of_rank_partials(dtype, t, M, K, N):
    try:
        linear_tp_slices(K, t)
    except ValueError:
        pytest.skip(f"K={K} has no whole-lane {t}-way split")
    x, w, b = rand(M, K, dtype=dtype, seed=M + K), rand(N, K, dtype=dtype, seed=6), rand(N, dtype=dtype, seed=7)
    assert_bitwise_equal(tp_linear(x, w, b, t, dtype), linear(x, w, b))
    assert_bitwise_equal(tp_linear(x, w, None, t, dtype), linear(x, w))


def _sequential_combine(parts):
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


@pytest.mark.parametrize("t", [4, 8])
def test_negative_control_sequential_combine_differs(t):
    """The same rank partials summed in rank order ((p0+p1)+p2)+p3 instead of the tree: provably other bits.
    K = 8, w = 1: lane l sums exactly x[l]. t = 4: partials (2^24, 1, 1, 1) -> tree (2^24+1)+(1+1) = 2^24+2,
    sequential ((2^24+1)+1)+1 = 2^24 (every +1 is a tie to even). t = 8: (2^24, 1, ..., 1) -> tree 2^24+6 vs
    sequential 2^24. Random inputs differ too (count > 0)."""
    x = torch.tensor([[2.0**24, 0, 1, 0, 1, 0, 1, 0]] if t == 4 else [[2.0**24, 1, 1, 1, 1, 1, 1, 1]])
    w = torch.ones(1, 8)
    parts = [linear_partial(x[:, k0:k1], w[:, k0:k1], 8 // t) for k0, k1 in linear_tp_slices(8, t)]
    assert_bitwise_equal(tree_combine(parts), linear(x, w))
    assert linear(x, w).item() == 2.0**24 + (2 if t == 4 else 6)
    assert _sequential_combine(parts).item() == 2.0**24
    assert not bitwise_equal(_sequential_combine(parts), linear(x, w))
    xr, wr = rand(64, 1536, seed=8) * 100, rand(128, 1536, seed=9)
    parts = [linear_partial(xr[:, k0:k1], wr[:, k0:k1], 8 // t) for k0, k1 in linear_tp_slices(1536, t)]
    assert_bitwise_equal(tree_combine(parts), linear(xr, wr))
    assert not bitwise_equal(_sequential_combine(parts), linear(xr, wr))


def test_negative_control_t2_one_chain_per_rank_differs():
    """For t = 2 a sequential combine of two partials IS the tree; the negative control is a rank that runs one
    chain over its slice (lanes=1) instead of its 4 lanes: other bits."""
    x, w = rand(16, 1536, seed=10), rand(64, 1536, seed=11)
    parts = [linear_partial(x[:, a:b], w[:, a:b], 1) for a, b in linear_tp_slices(1536, 2)]
    assert not bitwise_equal(tree_combine(parts), linear(x, w))


def test_tree_combine_rejects_bad_input():
    with pytest.raises(ValueError, match="needs 1, 2, 4 or 8 partials, got 3"):
        tree_combine([torch.zeros(2)] * 3)
    with pytest.raises(ValueError, match="must be float32"):
        tree_combine([torch.zeros(2, dtype=torch.bfloat16)] * 2)


def test_tree_combine_refuses_partials_of_other_shapes():
    """A partial of another shape broadcast into the sum ([1, N] beside [M, N]: rank 1's row added to every row);
    one of another size died in torch's add, and a None in an AttributeError, neither naming tree_combine. The
    negative control: equal shapes still combine, to the plain sum's bits."""
    a, b = rand(4, 8, seed=20), rand(4, 8, seed=21)
    with pytest.raises(ValueError, match=r"tree_combine: every partial must have partials\[0\]'s shape .*partials\[1\] \(1, 8\)"):
        tree_combine([a, b[:1]])
    with pytest.raises(ValueError, match=r"tree_combine: .*partials\[1\] \(3, 8\)"):
        tree_combine([a, b[:3]])
    with pytest.raises(TypeError, match=r"tree_combine: partials\[1\] must be a tensor, got NoneType"):
        tree_combine([a, None])
    assert_bitwise_equal(tree_combine([a, b]), a + b)


# ---- invariance ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lanes", [2, 8])
def test_batch_invariance_m_1_to_40(dtype, lanes):
    """Every row of M = 1..40 (all kernel paths: direct, streamed, packed; every tail of the row tiles) equals
    the same row computed alone."""
    K, N = 203, 70
    w = rand(N, K, dtype=dtype, seed=12)
    xs = rand(40, K, dtype=dtype, seed=13)
    alone = torch.cat([linear_partial(xs[i : i + 1], w, lanes) for i in range(40)])
    for M in range(1, 41):
        assert_bitwise_equal(linear_partial(xs[:M], w, lanes), alone[:M])
    lin_alone = torch.cat([linear(xs[i : i + 1], w) for i in range(40)])
    for M in (2, 9, 17, 40):
        assert_bitwise_equal(linear(xs[:M], w), lin_alone[:M])


def test_negative_control_lane_count_changes_bits():
    """The lane count is part of the result (why every backend must use 8 lanes for linear)."""
    x, w = rand(8, 1536, seed=14), rand(64, 1536, seed=15)
    p = {L: linear_partial(x, w, L) for L in (1, 2, 4, 8)}
    for a in (1, 2, 4):
        assert not bitwise_equal(p[a], p[8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_and_batch_dims(dtype):
    x3 = rand(2, 5, 134, dtype=dtype, seed=16)[..., ::2]
    w = rand(45, 134, dtype=dtype, seed=17)[:, ::2]
    assert not x3.is_contiguous() and not w.is_contiguous()
    got = linear_partial(x3, w, 4)
    assert got.shape == (2, 5, 45)
    assert_bitwise_equal(got, linear_partial(x3.contiguous(), w.contiguous(), 4))
    assert_bitwise_equal(linear_partial(x3, w.T.contiguous().T, 4), got)  # column-major weight


def test_threads_do_not_change_bits():
    x, w = rand(300, 203, seed=18), rand(100, 203, seed=19)
    torch.set_num_threads(1)
    one = linear_partial(x, w, 4)
    torch.set_num_threads(2)
    assert_bitwise_equal(linear_partial(x, w, 4), one)


def test_zero_size_and_short_k():
    assert linear_partial(torch.empty(0, 5), rand(7, 5), 8).shape == (0, 7)
    assert_bitwise_equal(linear_partial(torch.empty(4, 0), torch.empty(7, 0), 8), torch.zeros(4, 7))
    x, w = rand(3, 3, seed=20), rand(5, 3, seed=21)  # K < lanes: empty lanes are +0
    assert_bitwise_equal(linear_partial(x, w, 8), torch.from_numpy(lane_tree_f32(x.numpy(), w.numpy(), 8)))


def test_accuracy_vs_float64():
    x, w = rand(3, 423, seed=22), rand(213, 423, seed=23)
    torch.testing.assert_close(linear_partial(x, w, 8).double(), x.double() @ w.double().T, rtol=2e-5, atol=2e-4)


# ---- ISA levels ------------------------------------------------------------------------------------------

_ISA_SCRIPT = r"""
import hashlib, torch, aligned_ops
from aligned_ops import linear_partial, linear_tp_slices, tree_combine
torch.set_num_threads(2)
h = hashlib.sha256()
for dt in (torch.float32, torch.bfloat16, torch.float16):
    for M, K, N in ((1, 67, 45), (3, 423, 213), (12, 1536, 40), (37, 64, 100), (5, 3, 17)):
        g = torch.Generator().manual_seed(M * 1000 + K)
        x = torch.randn(M, K, generator=g).to(dt)
        w = torch.randn(N, K, generator=g).to(dt)
        for lanes in (1, 2, 4, 8):
            got = linear_partial(x, w, lanes)
            ref = torch.ops.aligned._linear_partial_reference(x, w, lanes)  # contract.h helper, scalar
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (dt, M, K, N, lanes)
            h.update(got.view(torch.int32).numpy().tobytes())
            h.update(linear_partial(x, w.T.contiguous().T, lanes).view(torch.int32).numpy().tobytes())
        if K % 8 == 0:
            for t in (2, 4, 8):
                parts = [linear_partial(x[:, a:b], w[:, a:b], 8 // t) for a, b in linear_tp_slices(K, t)]
                h.update(tree_combine(parts).view(torch.int32).numpy().tobytes())
print(h.hexdigest())
"""


ISA_FAMILIES = {"linear_partial": _ISA_SCRIPT}  # run once per level for the whole run by tests/_isa_matrix.py


@pytest.mark.slow
def test_isa_levels_compute_identical_bits(isa_matrix):
    """Each level (its own process) equals contract.h's scalar helper on every case, and all digests agree."""
    digests = {}
    for isa in isa_matrix.levels_to_compare():
        digests[isa] = isa_matrix.run(isa, "linear_partial").stdout.strip()  # the script's asserts ran there
    assert all(digests.values()), digests  # every level printed its digest
    assert len(set(digests.values())) == 1, digests


# ---- torch integration and bad input ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    x, w = rand(5, 19, dtype=dtype), rand(11, 19, dtype=dtype)
    torch.library.opcheck(torch.ops.aligned.linear_partial, (x, w, 4))
    torch.library.opcheck(torch.ops.aligned.linear_partial, (rand(2, 3, 19, dtype=dtype), w, 8))


def test_compile_fullgraph_bitwise_equals_eager():
    x, w = rand(6, 64, seed=24), rand(30, 64, seed=25)

    def f(x, w):
        parts = [aligned_ops.linear_partial(x[:, a:b], w[:, a:b], 2) for a, b in ((0, 16), (16, 32), (32, 48), (48, 64))]
        return tree_combine(parts) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    assert_bitwise_equal(compiled(x, w), f(x, w))
    x2 = rand(9, 64, seed=26)
    assert_bitwise_equal(compiled(x2, w), f(x2, w))


def test_backward_raises():
    x = rand(3, 16, seed=27).requires_grad_()
    w = rand(5, 16, seed=28)
    out = linear_partial(x, w, 8)
    with pytest.raises(RuntimeError, match="linear_partial has no backward"):
        out.sum().backward()


@pytest.mark.parametrize(
    "args, match",
    [
        ((rand(2, 16), rand(4, 16), 3), "aligned::linear_partial: lanes must be 1, 2, 4 or 8 .*got 3"),
        ((rand(2, 16), rand(4, 16), 16), "lanes must be 1, 2, 4 or 8"),
        ((rand(2, 16), rand(4, 16, dtype=torch.bfloat16), 8), "aligned::linear_partial: weight dtype"),
        ((rand(2, 16), rand(4, 15), 8), "aligned::linear_partial: x has 16 input features"),
        ((rand(2, 16).double(), rand(4, 16).double(), 8), "aligned::linear_partial: x must be float32"),
        ((torch.tensor(1.0), rand(4, 16), 8), "aligned::linear_partial: x must have at least one dimension"),
    ],
)
def test_bad_input(args, match):
    with pytest.raises(RuntimeError, match=match):
        linear_partial(*args)


def test_meta_and_mixed_devices():
    out = linear_partial(torch.empty(2, 5, 16, device="meta"), torch.empty(4, 16, device="meta"), 8)
    assert out.device.type == "meta" and out.shape == (2, 5, 4) and out.dtype == torch.float32
    with pytest.raises(RuntimeError, match="same device"):
        linear_partial(rand(2, 16), torch.empty(4, 16, device="meta"), 8)
