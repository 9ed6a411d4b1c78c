"""rms_norm, fused_add_rms_norm and rms_norm_backward: invariance (bitwise) and accuracy (vs float64)."""

import pytest
import torch

import aligned_ops
from aligned_ops.testing import bitwise_equal
from dense_invariance import (
    batch_mismatches,
    batch_variant_sum,
    run_mismatches,
    run_variant_sum,
    thread_mismatches,
    thread_variant_sum,
)

ops = torch.ops.aligned
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-6
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
       torch.float16: dict(rtol=2e-3, atol=1e-3)}


def rms_norm_ref(x, w, eps=EPS):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def make(shape, dtype, seed=0, wdtype=None):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(wdtype or dtype)
    return x, w


# ---- accuracy -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (3, 423, 213), (17, 1536), (2, 3, 4, 33)])
def test_rms_norm_accuracy(dtype, shape):
    x, w = make(shape, dtype)
    out = aligned_ops.rms_norm(x, w, EPS)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), rms_norm_ref(x, w), **TOL[dtype])
    # fp32 weight with low-precision activations (HF keeps norm weights in fp32 sometimes)
    torch.testing.assert_close(ops.rms_norm(x, w.float(), EPS).double(), rms_norm_ref(x, w.float()), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 100), (3, 423, 213)])
def test_fused_add_rms_norm_accuracy(dtype, shape):
    x, w = make(shape, dtype, 1)
    res = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    out, res_out = aligned_ops.fused_add_rms_norm(x, res, w, EPS)
    r = (x.double() + res.double()).to(dtype)  # the residual stream is stored in the activation dtype
    assert bitwise_equal(res_out, r)
    torch.testing.assert_close(out.double(), rms_norm_ref(r, w), **TOL[dtype])
    # fused == unfused composition, bit for bit
    assert bitwise_equal(out, ops.rms_norm(res_out, w, EPS))


def test_non_contiguous_inputs():
    x, w = make((64, 300), torch.bfloat16)
    xt = x.t().contiguous().t()  # same values, column-major
    xs = torch.randn(64, 600).to(torch.bfloat16)[:, ::2]
    wn = torch.rand(600).add(0.5).to(torch.bfloat16)[::2]
    assert not xt.is_contiguous() and not xs.is_contiguous() and not wn.is_contiguous()
    assert bitwise_equal(ops.rms_norm(xt, w, EPS), ops.rms_norm(x, w, EPS))
    assert bitwise_equal(ops.rms_norm(xs, wn, EPS), ops.rms_norm(xs.contiguous(), wn.contiguous(), EPS))
    res = torch.randn(300, 64).to(torch.bfloat16).t()
    a = ops.fused_add_rms_norm(xt, res, w, EPS)
    b = ops.fused_add_rms_norm(x, res.contiguous(), w, EPS)
    assert bitwise_equal(a[0], b[0]) and bitwise_equal(a[1], b[1])


def test_zero_size():
    for shape in [(0, 64), (3, 0, 64), (4, 0)]:
        x = torch.randn(shape)
        w = torch.ones(shape[-1])
        assert ops.rms_norm(x, w, EPS).shape == x.shape
        out, r = ops.fused_add_rms_norm(x, x, w, EPS)
        assert out.shape == x.shape and r.shape == x.shape
        dx, dw = ops.rms_norm_backward(x, x, w, EPS)
        assert dx.shape == x.shape and dw.shape == w.shape


def test_nan_propagates_to_its_row_only():
    x, w = make((4, 64), torch.float32)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    out = ops.rms_norm(x, w, EPS)
    assert torch.isnan(out[1]).all()
    assert torch.isnan(out[2]).any()  # inf/inf
    assert torch.isfinite(out[[0, 3]]).all()
    assert bitwise_equal(out[[0, 3]], ops.rms_norm(x[[0, 3]], w, EPS))


# ---- invariance --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_batch_invariant(dtype):
    x, w = make((600, 1536), dtype)
    assert batch_mismatches(lambda x: ops.rms_norm(x, w, EPS), (x,)) == 0
    res = torch.randn(600, 1536).to(dtype)
    assert batch_mismatches(lambda x, r: ops.fused_add_rms_norm(x, r, w, EPS), (x, res)) == 0


def test_rms_norm_backward_dx_batch_invariant():
    x, w = make((600, 256), torch.bfloat16, 3)
    g = torch.randn(600, 256).to(torch.bfloat16)
    assert batch_mismatches(lambda g, x: ops.rms_norm_backward(g, x, w, EPS)[0], (g, x)) == 0


def _batch_variant_rms_norm(x, w):
    x32 = x.float()
    ss = batch_variant_sum(x32 * x32)
    return x32 * torch.rsqrt(ss / x.shape[-1] + EPS)[:, None] * w.float()


def test_negative_control_batch_variant_norm_is_detected():
    x, w = make((600, 1536), torch.float32)
    assert batch_mismatches(lambda x: _batch_variant_rms_norm(x, w), (x,)) > 0


def test_thread_count_invariant_forward_and_backward():
    x, w = make((1024, 1536), torch.bfloat16, 4)
    r = torch.randn(1024, 1536).to(torch.bfloat16)
    g = torch.randn(1024, 1536).to(torch.bfloat16)
    assert thread_mismatches(lambda: ops.rms_norm(x, w, EPS)) == 0
    assert thread_mismatches(lambda: ops.fused_add_rms_norm(x, r, w, EPS)) == 0
    assert thread_mismatches(lambda: ops.rms_norm_backward(g, x, w, EPS)) == 0  # dx and dw
    # control: a reduction split across threads is detected by the same checker
    t = torch.randn(64, 1 << 14) * torch.logspace(-3, 3, 1 << 14)
    assert thread_mismatches(thread_variant_sum, t) > 0


def test_repeated_runs_identical():
    x, w = make((257, 1536), torch.float16, 5)
    g = torch.randn(257, 1536).to(torch.float16)
    assert run_mismatches(lambda: ops.rms_norm(x, w, EPS)) == 0
    assert run_mismatches(lambda: ops.rms_norm_backward(g, x, w, EPS)) == 0
    t = torch.randn(8, 4096) * torch.logspace(-3, 3, 4096)
    assert run_mismatches(run_variant_sum, t) > 0  # control


def test_dw_is_one_chain_per_column_in_row_order():
    # dw sums over rows, so it legitimately depends on the batch; it must be the row-ordered chain, i.e.
    # adding a zero-gradient row at the end changes nothing, and it must not depend on threads (above).
    x, w = make((300, 96), torch.float32, 6)
    g = torch.randn(300, 96)
    _, dw = ops.rms_norm_backward(g, x, w, EPS)
    _, dw2 = ops.rms_norm_backward(torch.cat([g, torch.zeros(5, 96)]), torch.cat([x, torch.randn(5, 96)]), w, EPS)
    assert bitwise_equal(dw, dw2)


# ---- autograd ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gradients(dtype):
    x, w = make((3, 5, 213), dtype, 7)
    g = torch.randn(3, 5, 213).to(dtype)
    x.requires_grad_(True)
    w.requires_grad_(True)
    dx, dw = torch.autograd.grad(aligned_ops.rms_norm(x, w, EPS), (x, w), g)
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    dx64, dw64 = torch.autograd.grad(rms_norm_ref(x64, w64), (x64, w64), g.double())
    assert dx.dtype == dtype and dw.dtype == dtype
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(dx.double(), dx64, **tol)
    torch.testing.assert_close(dw.double(), dw64, **tol)


def test_fused_add_rms_norm_gradients_both_outputs():
    x, w = make((7, 130), torch.float32, 8)
    res = torch.randn(7, 130)
    g_out, g_res = torch.randn(7, 130), torch.randn(7, 130)
    leaves = [t.clone().requires_grad_(True) for t in (x, res, w)]
    out, r = aligned_ops.fused_add_rms_norm(*leaves, EPS)
    grads = torch.autograd.grad((out, r), leaves, (g_out, g_res))
    l64 = [t.double().requires_grad_(True) for t in (x, res, w)]
    r64 = l64[0] + l64[1]
    grads64 = torch.autograd.grad((rms_norm_ref(r64, l64[2]), r64), l64, (g_out.double(), g_res.double()))
    for a, b in zip(grads, grads64):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)
    # only the residual output used
    (dx,) = torch.autograd.grad(aligned_ops.fused_add_rms_norm(*leaves, EPS)[1].sum(), leaves[0])
    assert bitwise_equal(dx, torch.ones_like(dx))


# ---- opcheck / compile ----------------------------------------------------------------------------------------


def test_opcheck():
    x, w = make((4, 3, 40), torch.float32, 9)
    r = torch.randn(4, 3, 40)
    torch.library.opcheck(ops.rms_norm.default, (x.requires_grad_(True), w.requires_grad_(True), EPS))
    torch.library.opcheck(ops.fused_add_rms_norm.default, (x, r.requires_grad_(True), w, EPS))
    torch.library.opcheck(ops.rms_norm_backward.default, (torch.randn(4, 3, 40), x.detach(), w.detach(), EPS))
    xb, wb = make((5, 64), torch.bfloat16, 10)
    torch.library.opcheck(ops.rms_norm.default, (xb, wb.float(), EPS))


def test_torch_compile_fullgraph_bitwise():
    x, w = make((9, 200), torch.bfloat16, 11)
    r = torch.randn(9, 200).to(torch.bfloat16)

    def f(x, r, w):
        out, res = ops.fused_add_rms_norm(x, r, w, EPS)
        dx, dw = ops.rms_norm_backward(r, x, w, EPS)
        return ops.rms_norm(out, w, EPS), res, dx, dw

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    for a, b in zip(cf(x, r, w), f(x, r, w)):
        assert bitwise_equal(a, b)


# ---- bad input ---------------------------------------------------------------------------------------------------


def test_bad_inputs():
    x, w = make((4, 16), torch.float32)
    with pytest.raises(RuntimeError, match="must be float32, bfloat16 or float16"):
        ops.rms_norm(x.to(torch.int32), w, EPS)
    with pytest.raises(RuntimeError, match="must be float32, bfloat16 or float16"):
        ops.rms_norm(x.double(), w.double(), EPS)
    with pytest.raises(RuntimeError, match=r"weight must have shape \[16\]"):
        ops.rms_norm(x, torch.ones(15), EPS)
    with pytest.raises(RuntimeError, match=r"weight must have shape \[16\]"):
        ops.rms_norm(x, torch.ones(2, 16), EPS)
    with pytest.raises(RuntimeError, match="weight dtype must equal x dtype or be float32"):
        ops.rms_norm(x.bfloat16(), w.half(), EPS)
    with pytest.raises(RuntimeError, match="at least one dimension"):
        ops.rms_norm(torch.tensor(1.0), w, EPS)
    with pytest.raises(RuntimeError, match="eps must be >= 0"):
        ops.rms_norm(x, w, -1.0)
    with pytest.raises(RuntimeError, match="residual must match x"):
        ops.fused_add_rms_norm(x, torch.randn(4, 15), w, EPS)
    with pytest.raises(RuntimeError, match="residual must match x"):
        ops.fused_add_rms_norm(x, x.bfloat16(), w, EPS)
    with pytest.raises(RuntimeError, match="grad_out must match x"):
        ops.rms_norm_backward(torch.randn(4, 15), x, w, EPS)
    with pytest.raises(RuntimeError, match=r"weight must have shape \[16\]"):
        ops.rms_norm_backward(x, x, torch.ones(3), EPS)
    with pytest.raises(RuntimeError, match="must be on the same device"):
        ops.rms_norm(x, w.to("meta"), EPS)


def test_compiled_forward_and_backward_match_eager_bitwise():
    x, w = make((9, 200), torch.bfloat16, 12)
    g = torch.randn(9, 200).to(torch.bfloat16)

    def f(x, w):
        return aligned_ops.rms_norm(aligned_ops.silu_and_mul(x), w[:100], EPS)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    le = [t.clone().requires_grad_(True) for t in (x, w)]
    lc = [t.clone().requires_grad_(True) for t in (x, w)]
    ye, yc = f(*le), cf(*lc)
    assert bitwise_equal(ye, yc)
    ye.backward(g[:, :100])
    yc.backward(g[:, :100])
    assert bitwise_equal(le[0].grad, lc[0].grad) and bitwise_equal(le[1].grad, lc[1].grad)
