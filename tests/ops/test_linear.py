"""aligned::linear and aligned::linear_backward on the CPU.

Contract (csrc/common/contract.h, `fma` profile): K is cut into 8 lanes, lane l = [floor(l*K/8), floor((l+1)*K/8));
each lane is one fp32 chain acc = +0, acc = fma(x[m, k], w[n, k], acc) in k order; the lane sums s_l combine as
((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)); out[m, n] = round_T(tree + bias[n]). Backward: one chain per element (a
1-lane linear): dx[m, k] = chain over n of fma(g[m, n], w[n, k], .), dw[n, k] = chain over m of
fma(g[m, n], x[m, k], .), db[n] = chain over m of (. + g[m, n]). (linear_partial and the TP tree:
tests/ops/test_linear_partial.py.)

Families: exactness against an exact scalar model of that order (bitwise), accuracy against float64,
invariance (integer views, aligned_ops.testing) across batch size, row position, other rows, threads, runs and ISA levels, each with a
negative control that proves the check can fail; opcheck, torch.compile, autograd and bad input.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import aligned_ops  # noqa: F401
from aligned_ops.testing import assert_bitwise_equal, bitwise_equal
from dense_invariance import rows_varying

linear = torch.ops.aligned.linear
linear_backward = torch.ops.aligned.linear_backward

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


# ---- exact model of the contract's fma chain ------------------------------------------------------------


def _round_f32(s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Correctly rounds the exact value s + e (s = float64 sum, e = its exact TwoSum error) to float32.

    s is the float64 nearest to the exact value, and every float32 rounding midpoint is a float64 number, so
    rounding s gives the right float32 unless s sits exactly on a midpoint; then e decides the direction."""
    r = s.astype(np.float32)
    d = s - r.astype(np.float64)  # exact
    toward = np.nextafter(r, np.where(d >= 0, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32))
    half = (toward.astype(np.float64) - r.astype(np.float64)) / 2
    on_mid = (d != 0) & (d == half)
    # On a midpoint numpy picked the even neighbour r; the exact value lies past the midpoint when e pushes
    # the same way as d.
    go = on_mid & (np.sign(e) == np.sign(d))
    return np.where(go, toward, r)


def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Exact IEEE fma on float32 arrays: a*b is exact in float64, the sum is made exact by TwoSum."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    bv = s - p
    e = (p - (s - bv)) + (c64 - bv)
    return _round_f32(s, e)


def fma_fraction(a: float, b: float, c: float) -> np.float32:
    """The same fma by rational arithmetic, used to validate the vectorised model."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    r = np.float32(float(exact))
    best = None
    for cand in (np.nextafter(r, np.float32(-np.inf)), r, np.nextafter(r, np.float32(np.inf))):
        dist = abs(Fraction(float(cand)) - exact)
        key = (dist, int(np.float32(cand).view(np.uint32)) & 1)  # ties -> even mantissa
        if best is None or key < best[0]:
            best = (key, cand)
    return np.float32(best[1])


def chain_f32(xf: np.ndarray, wf: np.ndarray) -> np.ndarray:
    """[M, N] float32: one chain per output, acc = +0 then acc = fma(x[m, k], w[n, k], acc) for k in order."""
    acc = np.zeros((xf.shape[0], wf.shape[0]), dtype=np.float32)
    for k in range(xf.shape[1]):
        acc = fma_f32(np.broadcast_to(xf[:, k, None], acc.shape), np.broadcast_to(wf[None, :, k], acc.shape), acc)
    return acc


def lane_tree_f32(xf: np.ndarray, wf: np.ndarray, lanes: int = 8) -> np.ndarray:
    """The `fma` profile's tree before the bias: `lanes` lanes by the floor rule, one chain each, adjacent pairs
    folded level by level (float32 additions, each correctly rounded)."""
    K = xf.shape[1]
    s = [chain_f32(xf[:, (l * K) // lanes : ((l + 1) * K) // lanes], wf[:, (l * K) // lanes : ((l + 1) * K) // lanes])
         for l in range(lanes)]
    while len(s) > 1:
        s = [(s[2 * i] + s[2 * i + 1]).astype(np.float32) for i in range(len(s) // 2)]
    return s[0]


def _finish(acc: np.ndarray, bias, out_dtype) -> torch.Tensor:
    if bias is not None:
        acc = acc + bias.float().numpy()[None, :]  # one float32 add
    return torch.from_numpy(np.ascontiguousarray(acc)).to(out_dtype)


def chain_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_dtype) -> torch.Tensor:
    """round(one chain over all of K (+ bias[n])): the backward's order (and the pre-lanes forward)."""
    return _finish(chain_f32(x.float().numpy(), w.float().numpy()), bias, out_dtype)


def lane_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_dtype) -> torch.Tensor:
    """round(8-lane tree (+ bias[n])): the forward's order."""
    return _finish(lane_tree_f32(x.float().numpy(), w.float().numpy()), bias, out_dtype)


def test_fma_model_matches_rational_arithmetic():
    rng = np.random.default_rng(1)
    a = rng.standard_normal(400).astype(np.float32)
    b = rng.standard_normal(400).astype(np.float32)
    c = rng.standard_normal(400).astype(np.float32)
    # Midpoint cases: a*b + c lands exactly half-way between two float32 only through the low product bits.
    a[:4] = np.float32(1 + 2**-12)
    b[:4] = np.float32(1 + 2**-12)
    c[:4] = np.array([2**-24, -(2**-24), 1.0, -1.0], dtype=np.float32)
    got = fma_f32(a, b, c)
    want = np.array([fma_fraction(a[i], b[i], c[i]) for i in range(a.size)], dtype=np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # ... and the model is not the unfused a*b + c (the check can fail).
    unfused = (a * b) + c
    assert not np.array_equal(unfused.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "M,K,N", [(1, 45, 37), (3, 33, 16), (6, 70, 50), (11, 37, 33), (20, 16, 65), (2, 5, 19), (9, 1, 33), (4, 300, 40)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bitwise_equal_to_contract_lane_tree(dtype, M, K, N, with_bias):
    """Conformance of the CPU kernel (every path: direct, streamed, packed; K < 8 has empty lanes) against the
    plain scalar reference of the contract, through integer views."""
    x, w = rand(M, K, dtype=dtype, seed=1), rand(N, K, dtype=dtype, seed=2)
    b = rand(N, dtype=dtype, seed=3) if with_bias else None
    got = linear(x, w, b)
    want = lane_reference(x, w, b, dtype)
    assert got.dtype == dtype
    assert_bitwise_equal(got, want)


def test_lane_reference_detects_another_order():
    """Negative controls for the exactness check: the pre-lanes single chain and a two-way split-K sum of the
    same products are different bits from the 8-lane tree (and from each other)."""
    x, w = rand(4, 200, seed=4), rand(24, 200, seed=5)
    want = lane_reference(x, w, None, torch.float32)
    one_chain = chain_reference(x, w, None, torch.float32)
    split = chain_reference(x[:, :100], w[:, :100], None, torch.float32) + chain_reference(
        x[:, 100:], w[:, 100:], None, torch.float32
    )
    assert_bitwise_equal(linear(x, w), want)
    assert not bitwise_equal(one_chain, want)
    assert not bitwise_equal(split, want)


def test_backward_bitwise_equal_to_contract_chains():
    M, K, N = 9, 21, 35
    x, w, g = rand(M, K, seed=6), rand(N, K, seed=7), rand(M, N, seed=8)
    dx, dw, db = linear_backward(g, x, w, True, True, True)
    assert bitwise_equal(dx, chain_reference(g, w.T.contiguous(), None, torch.float32))  # chain over n
    assert bitwise_equal(dw, chain_reference(g.T.contiguous(), x.T.contiguous(), None, torch.float32))  # over m
    acc = np.zeros(N, dtype=np.float32)
    for m in range(M):
        acc = acc + g[m].numpy()
    assert bitwise_equal(db, torch.from_numpy(acc))


# ---- accuracy against float64 ----------------------------------------------------------------------------


def ref64(x, w, b=None):
    out = x.double() @ w.double().T
    return out + b.double() if b is not None else out


TOL = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,N", [(3, 423, 213), (1, 1, 1), (17, 129, 31), (2, 3, 100)])
def test_accuracy_vs_float64(dtype, M, K, N):
    x, w, b = rand(M, K, dtype=dtype, seed=9), rand(N, K, dtype=dtype, seed=10), rand(N, dtype=dtype, seed=11)
    rtol, atol = TOL[dtype]
    got = linear(x, w, b)
    torch.testing.assert_close(got.double(), ref64(x, w, b), rtol=rtol, atol=atol * K**0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs_and_batch_dims(dtype):
    x3 = rand(2, 5, 67, dtype=dtype, seed=12)
    w = rand(45, 67, dtype=dtype, seed=13)
    b = rand(45, dtype=dtype, seed=14)
    want = linear(x3.contiguous(), w, b)
    assert want.shape == (2, 5, 45)
    x_nc = x3.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    w_t = w.T.contiguous().T  # weight stored [K, N] (column-major view)
    w_sliced = rand(45, 134, dtype=dtype, seed=13)[:, ::2]
    w_sliced.copy_(w)
    assert not x_nc.is_contiguous() and not w_t.is_contiguous() and not w_sliced.is_contiguous()
    assert bitwise_equal(linear(x_nc, w, b), want)
    assert bitwise_equal(linear(x3, w_t, b), want)
    assert bitwise_equal(linear(x3, w_sliced, b), want)
    assert bitwise_equal(linear(x3[:, ::2], w, b), want[:, ::2])
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(want.double(), ref64(x3, w, b), rtol=rtol, atol=atol * 67**0.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_size(dtype):
    w, b = rand(7, 5, dtype=dtype), rand(7, dtype=dtype)
    assert linear(torch.empty(0, 5, dtype=dtype), w, b).shape == (0, 7)
    assert linear(torch.empty(3, 0, 5, dtype=dtype), w).shape == (3, 0, 7)
    out = linear(torch.empty(4, 0, dtype=dtype), torch.empty(7, 0, dtype=dtype), b)  # K = 0: bias only
    assert bitwise_equal(out, b.expand(4, 7))
    no_bias = linear(torch.empty(4, 0, dtype=dtype), torch.empty(7, 0, dtype=dtype))
    assert bitwise_equal(no_bias, torch.zeros(4, 7, dtype=dtype))
    assert linear(rand(4, 5, dtype=dtype), torch.empty(0, 5, dtype=dtype)).shape == (4, 0)
    dx, dw, db = linear_backward(torch.empty(0, 7, dtype=dtype), torch.empty(0, 5, dtype=dtype), w, True, True, True)
    assert dx.shape == (0, 5)
    assert bitwise_equal(dw, torch.zeros(7, 5, dtype=dtype)) and bitwise_equal(db, torch.zeros(7, dtype=dtype))


def test_special_values_propagate():
    x, w = rand(3, 40, seed=15), rand(20, 40, seed=16)
    x[1, 7] = float("nan")
    w[5, 3] = float("inf")
    out = linear(x, w)
    ref = ref64(x, w)
    assert torch.isnan(out[1]).all()
    assert bitwise_equal(torch.isnan(out), torch.isnan(ref)) and bitwise_equal(torch.isinf(out), torch.isinf(ref))


# ---- invariance -----------------------------------------------------------------------------------------

BATCHES = [1, 2, 3, 7, 64, 513]
K_INV, NS_INV = 131, (40, 100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", NS_INV)
@pytest.mark.parametrize("M", BATCHES)
def test_row_invariance_forward(M, N, dtype):
    x, w, b = rand(M, K_INV, dtype=dtype, seed=M), rand(N, K_INV, dtype=dtype, seed=20), rand(N, dtype=dtype, seed=21)
    rows = sorted({0, M // 2, M - 1})
    assert rows_varying(lambda t: linear(t, w, b), x, rows) == []


def test_negative_control_torch_linear_is_batch_variant():
    """The same check on torch's F.linear (MKL: gemv for one row, blocked sgemm for many) finds a mismatch."""
    x, w = rand(64, 1536, seed=22), rand(256, 1536, seed=23)
    assert rows_varying(lambda t: F.linear(t, w), x, [0, 63]) != []


def test_negative_control_split_k_is_batch_variant():
    """A reduction whose K split depends on the batch size (as split-K kernels do) fails the check."""
    x, w = rand(64, K_INV, seed=24), rand(40, K_INV, seed=25)

    def split_k(t):
        parts = 1 if t.shape[0] == 1 else 2
        chunks = torch.tensor_split(torch.arange(K_INV), parts)
        return sum(linear(t[:, c], w[:, c]) for c in chunks)

    assert rows_varying(split_k, x, [0]) != []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N", [(1, 300), (5, 40), (64, 40), (513, 100)])
def test_threads_and_runs(M, N, dtype):
    x, w, b = rand(M, K_INV, dtype=dtype, seed=26), rand(N, K_INV, dtype=dtype, seed=27), rand(N, dtype=dtype, seed=28)
    g = rand(M, N, dtype=dtype, seed=29)
    torch.set_num_threads(1)
    one = linear(x, w, b), *linear_backward(g, x, w, True, True, True)
    torch.set_num_threads(2)
    two = linear(x, w, b), *linear_backward(g, x, w, True, True, True)
    again = linear(x, w, b), *linear_backward(g, x, w, True, True, True)
    for a, b2, c in zip(one, two, again):
        assert bitwise_equal(a, b2) and bitwise_equal(b2, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", BATCHES)
def test_row_invariance_backward_dx(M, dtype):
    N = 100
    w = rand(N, K_INV, dtype=dtype, seed=30)
    g = rand(M, N, dtype=dtype, seed=31 + M)

    def dx_of(gr):  # dx does not read x's values, only its shape
        return linear_backward(gr, torch.zeros(gr.shape[0], K_INV, dtype=dtype), w, True, False, False)[0]

    assert rows_varying(dx_of, g, sorted({0, M // 2, M - 1})) == []


def test_dw_is_chain_over_tokens_in_order():
    """dw depends on token order only through its fixed chain: the same tokens give the same bits run to run and
    with 1 or 2 threads; reversing the tokens (another chain) changes bits (the check can fail)."""
    M, K, N = 300, 70, 90
    x, g = rand(M, K, seed=32), rand(M, N, seed=33)
    w = rand(N, K, seed=34)
    torch.set_num_threads(1)
    dw1 = linear_backward(g, x, w, False, True, False)[1]
    torch.set_num_threads(2)
    dw2 = linear_backward(g, x, w, False, True, False)[1]
    assert bitwise_equal(dw1, dw2)
    dw_rev = linear_backward(g.flip(0), x.flip(0), w, False, True, False)[1]
    assert not bitwise_equal(dw_rev, dw1)
    torch.testing.assert_close(dw_rev, dw1, rtol=1e-5, atol=1e-4)


_ISA_SCRIPT = r"""
import hashlib, sys, torch, aligned_ops
torch.set_num_threads(2)
h = hashlib.sha256()
for dt in (torch.float32, torch.bfloat16, torch.float16):
    for M, K, N in ((1, 67, 45), (3, 40, 33), (7, 129, 70), (37, 64, 100)):
        g = torch.Generator().manual_seed(M * 1000 + K)
        x = torch.randn(M, K, generator=g).to(dt)
        w = torch.randn(N, K, generator=g).to(dt)
        b = torch.randn(N, generator=g).to(dt)
        go = torch.randn(M, N, generator=g).to(dt)
        outs = [torch.ops.aligned.linear(x, w, b), torch.ops.aligned.linear(x, w.T.contiguous().T),
                *torch.ops.aligned.linear_backward(go, x, w, True, True, True)]
        for o in outs:
            h.update(o.contiguous().view(torch.uint8).numpy().tobytes())
print(h.hexdigest())
"""


ISA_FAMILIES = {"linear": _ISA_SCRIPT}  # run once per level for the whole run by tests/_isa_matrix.py


@pytest.mark.slow
def test_isa_levels_compute_identical_bits(isa_matrix):
    """generic (scalar fma), AVX2 and AVX-512 kernels: same bits (the table is chosen once per process)."""
    digests = {isa: isa_matrix.run(isa, "linear").stdout.strip() for isa in isa_matrix.levels_to_compare()}
    assert all(digests.values()), digests  # every level printed its digest
    assert len(set(digests.values())) == 1, digests


# ---- torch integration ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    x, w, b = rand(5, 19, dtype=dtype), rand(11, 19, dtype=dtype), rand(11, dtype=dtype)
    torch.library.opcheck(linear, (x, w, b))
    torch.library.opcheck(linear, (rand(2, 3, 19, dtype=dtype), w, None))
    g = rand(5, 11, dtype=dtype)
    torch.library.opcheck(linear_backward, (g, x, w, True, True, True))


def test_compile_fullgraph_bitwise_equals_eager():
    x, w, b = rand(6, 45, seed=40), rand(30, 45, seed=41), rand(30, seed=42)

    def f(x, w, b):
        return aligned_ops.linear(torch.relu(x), w, b) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    assert bitwise_equal(compiled(x, w, b), f(x, w, b))
    x2 = rand(9, 45, seed=43)  # another batch size
    assert bitwise_equal(compiled(x2, w, b), f(x2, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_vs_float64(dtype):
    x = rand(2, 7, 33, dtype=dtype, seed=44).requires_grad_()
    w = rand(21, 33, dtype=dtype, seed=45).requires_grad_()
    b = rand(21, dtype=dtype, seed=46).requires_grad_()
    g = rand(2, 7, 21, dtype=dtype, seed=47)
    linear(x, w, b).backward(g)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    F.linear(x64, w64, b64).backward(g.double())
    rtol, atol = TOL[dtype]
    for got, want, red in ((x.grad, x64.grad, 21), (w.grad, w64.grad, 14), (b.grad, b64.grad, 14)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol * red**0.5)
    # No bias, grads for x only.
    x.grad = None
    w2 = w.detach()
    linear(x, w2).sum().backward()
    torch.testing.assert_close(x.grad.double(), w2.double().sum(0).expand(2, 7, 33), rtol=rtol, atol=atol * 5)


def test_backward_matches_float64_formulas():
    """Finite differences in float32 are too coarse for gradcheck; compare with the float64 formulas instead."""
    x, w = rand(3, 4, seed=48), rand(5, 4, seed=49)
    g = rand(3, 5, seed=51)
    dx, dw, db = linear_backward(g, x, w, True, True, True)
    torch.testing.assert_close(dx.double(), g.double() @ w.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dw.double(), g.double().T @ x.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(db.double(), g.double().sum(0), rtol=1e-6, atol=1e-6)
    dx2, dw2, db2 = linear_backward(g, x, w, False, False, False)
    assert dx2 is None and dw2 is None and db2 is None


# ---- bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, match",
    [
        ((rand(2, 3), rand(4, 3).double()), "weight must be float32, bfloat16 or float16"),
        ((rand(2, 3), rand(4, 3, dtype=torch.bfloat16)), "weight dtype .* must equal x dtype"),
        ((rand(2, 3), rand(4, 5)), "x has 3 input features"),
        ((rand(2, 3), rand(4, 3, 1)), r"weight must be \[out_features, in_features\]"),
        ((torch.tensor(1.0), rand(4, 3)), "at least one dimension"),
        ((rand(2, 3), rand(4, 3), rand(5)), r"bias must be \[4\]"),
        ((rand(2, 3), rand(4, 3), rand(4, dtype=torch.bfloat16)), r"bias must be \[4\] with x's dtype"),
        ((torch.ones(2, 3, dtype=torch.int64), torch.ones(4, 3, dtype=torch.int64)), "x must be float32"),
    ],
)
def test_bad_input_forward(args, match):
    with pytest.raises(RuntimeError, match=match):
        linear(*args)


@pytest.mark.parametrize(
    "g, x, w, match",
    [
        (rand(4, 4), rand(2, 3), rand(4, 3), r"grad_out must have shape \[2, 4\]"),
        (rand(2, 5), rand(2, 3), rand(4, 3), r"grad_out must have shape \[2, 4\]"),
        (rand(2, 4).double(), rand(2, 3), rand(4, 3), "grad_out must be float32"),
        (rand(2, 4, dtype=torch.bfloat16), rand(2, 3), rand(4, 3), "must share one dtype"),
        (rand(2, 4), rand(2, 3), rand(4, 5), "x has 3 input features"),
        (rand(2, 4), rand(2, 3), rand(12), r"weight must be \[out_features, in_features\]"),
    ],
)
def test_bad_input_backward(g, x, w, match):
    with pytest.raises(RuntimeError, match=match):
        linear_backward(g, x, w, True, True, True)


def test_meta_tensors_propagate_shapes():
    out = linear(torch.empty(2, 5, 3, device="meta"), torch.empty(4, 3, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 5, 4)
    with pytest.raises(RuntimeError, match="in_features mismatch"):
        linear(torch.empty(2, 3, device="meta"), torch.empty(4, 5, device="meta"))


def test_mixed_devices_rejected():
    # mixed CPU/meta inputs dispatch to the fake impl, which must refuse rather than return garbage
    with pytest.raises(RuntimeError, match="same device"):
        linear(rand(2, 3), torch.empty(4, 3, device="meta"))
