"""silu_and_mul (+ backward): invariance (bitwise) and accuracy (vs float64)."""

import pytest
import torch
import torch.nn.functional as F

import aligned_ops
from aligned_ops.testing import bitwise_equal
from dense_invariance import batch_mismatches, contracted_for_large_batch, run_mismatches, thread_mismatches

ops = torch.ops.aligned
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-3),
       torch.float16: dict(rtol=2e-3, atol=1e-4)}


def silu_and_mul_ref(x):
    x64 = x.double()
    d = x.shape[-1] // 2
    return F.silu(x64[..., :d]) * x64[..., d:]


def make(shape, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (5, 14), (3, 423, 426), (17, 2 * 896)])
def test_accuracy(dtype, shape):
    x = make(shape, dtype)
    out = aligned_ops.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    torch.testing.assert_close(out.double(), silu_and_mul_ref(x), **TOL[dtype])


def test_extreme_inputs_and_nan():
    a = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 50.0, -50.0, 100.0, -100.0, 1e30, -1e30, float("inf"),
                      -float("inf"), float("nan"), 1.0])
    b = torch.ones_like(a)
    b[-1] = float("nan")
    out = ops.silu_and_mul(torch.cat([a, b])[None])[0]
    ref = silu_and_mul_ref(torch.cat([a, b])[None])[0]
    finite = torch.isfinite(ref)
    # a < -88.7: exp(-a) overflows, so silu(a) = a / inf = -0 where the exact value is a subnormal (~1e-42)
    torch.testing.assert_close(out[finite].double(), ref[finite], rtol=1e-6, atol=1e-40)
    assert out[10].item() == float("inf")  # silu(inf) = inf / (1 + 0)
    assert torch.isnan(out[11]) and torch.isnan(out[12]) and torch.isnan(out[13])  # -inf/inf, NaN a, NaN b


def test_non_contiguous_and_zero_size():
    x = make((40, 2 * 96), torch.bfloat16)
    xt = x.t().contiguous().t()
    xs = make((40, 4 * 96), torch.bfloat16)[:, ::2]
    assert not xt.is_contiguous() and not xs.is_contiguous()
    assert bitwise_equal(ops.silu_and_mul(xt), ops.silu_and_mul(x))
    assert bitwise_equal(ops.silu_and_mul(xs), ops.silu_and_mul(xs.contiguous()))
    g = make((96, 40), torch.bfloat16).t()
    assert bitwise_equal(ops.silu_and_mul_backward(g, xt), ops.silu_and_mul_backward(g.contiguous(), x))
    for shape in [(0, 8), (2, 0, 8), (3, 0)]:
        z = torch.randn(shape)
        assert ops.silu_and_mul(z).shape == (*shape[:-1], shape[-1] // 2)
        assert ops.silu_and_mul_backward(torch.randn(*shape[:-1], shape[-1] // 2), z).shape == z.shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_forward_backward(dtype):
    x = make((600, 2 * 320), dtype, 1)
    g = make((600, 320), dtype, 2, 1.0)
    assert batch_mismatches(ops.silu_and_mul, (x,)) == 0
    assert batch_mismatches(ops.silu_and_mul_backward, (g, x)) == 0


def test_negative_control_batch_dependent_path_is_detected():
    def unfused(x):
        d = x.shape[-1] // 2
        a, b = x[..., :d].float(), x[..., d:].float()
        return a / (1 + torch.exp(-a)) * b

    def fused(x):  # the "large batch" kernel keeps fp64 intermediates (one rounding instead of three)
        return silu_and_mul_ref(x).float()

    x = make((600, 2 * 320), torch.float32, 3)
    assert batch_mismatches(contracted_for_large_batch(unfused, fused), (x,)) > 0


def test_threads_and_runs():
    x = make((256, 2 * 1024), torch.bfloat16, 4)
    g = make((256, 1024), torch.bfloat16, 5, 1.0)
    assert thread_mismatches(ops.silu_and_mul, x) == 0
    assert thread_mismatches(ops.silu_and_mul_backward, g, x) == 0
    assert run_mismatches(ops.silu_and_mul, x) == 0
    assert run_mismatches(ops.silu_and_mul_backward, g, x) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients(dtype):
    x = make((3, 7, 2 * 213), dtype, 6).requires_grad_(True)
    g = make((3, 7, 213), dtype, 7, 1.0)
    (dx,) = torch.autograd.grad(aligned_ops.silu_and_mul(x), x, g)
    x64 = x.detach().double().requires_grad_(True)
    (dx64,) = torch.autograd.grad(silu_and_mul_ref(x64), x64, g.double())
    assert dx.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(dx.double(), dx64, **tol)


def test_opcheck_and_compile():
    x = make((4, 3, 2 * 24), torch.float32, 8)
    torch.library.opcheck(ops.silu_and_mul.default, (x.requires_grad_(True),))
    torch.library.opcheck(ops.silu_and_mul_backward.default, (make((4, 3, 24), torch.float32, 9), x.detach()))
    xb = make((9, 2 * 100), torch.bfloat16, 10)

    def f(x):
        y = ops.silu_and_mul(x)
        return y, ops.silu_and_mul_backward(y, x)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    for a, b in zip(cf(xb), f(xb)):
        assert bitwise_equal(a, b)


def test_bad_inputs():
    with pytest.raises(RuntimeError, match="last dimension of x must be even"):
        ops.silu_and_mul(torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="last dimension of x must be even"):
        ops.silu_and_mul(torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="must be float32, bfloat16 or float16"):
        ops.silu_and_mul(torch.randn(3, 8).double())
    with pytest.raises(RuntimeError, match="must be float32, bfloat16 or float16"):
        ops.silu_and_mul(torch.ones(3, 8, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="grad_out must be x's dtype with half its last dimension"):
        ops.silu_and_mul_backward(torch.randn(3, 8), torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="grad_out must be x's dtype with half its last dimension"):
        ops.silu_and_mul_backward(torch.randn(4, 3), torch.randn(3, 8))  # same numel, wrong shape
    with pytest.raises(RuntimeError, match="grad_out must be x's dtype with half its last dimension"):
        ops.silu_and_mul_backward(torch.randn(3, 4).bfloat16(), torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="must be even"):
        ops.silu_and_mul_backward(torch.randn(3, 4), torch.randn(3, 9))
    with pytest.raises(RuntimeError, match="must be on the same device"):
        ops.silu_and_mul_backward(torch.randn(3, 4), torch.randn(3, 8, device="meta"))


def test_single_row_split_across_threads_gives_the_batch_bits():
    # One row and two threads: the row is cut into column ranges; bits equal the row inside a batch.
    x = make((5, 2 * 8960), torch.bfloat16, 12)
    torch.set_num_threads(2)
    batch = ops.silu_and_mul(x)
    for r in range(5):
        assert bitwise_equal(ops.silu_and_mul(x[r:r + 1]), batch[r:r + 1])
    assert thread_mismatches(ops.silu_and_mul, x[:1]) == 0
