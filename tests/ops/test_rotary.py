"""rotary_embedding (+ backward): neox and gpt-j pairing, partial rotary; invariance and accuracy."""

import pytest
import torch

import aligned_ops
from aligned_ops.testing import bitwise_equal
from dense_invariance import batch_mismatches, contracted_for_large_batch, run_mismatches, thread_mismatches

ops = torch.ops.aligned
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}
MAX_POS = 4096


def rope_ref(positions, x, rot, is_neox, base=10000.0, inverse=False):
    """HF apply_rotary_pos_emb in float64 (neox: rotate_half; gpt-j: interleaved pairs)."""
    x64 = x.double()
    inv_freq = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    ang = positions.double()[:, None] * inv_freq  # [T, rot/2]
    if inverse:
        ang = -ang
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    xr, rest = x64[..., :rot], x64[..., rot:]
    if is_neox:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    return torch.cat([out, rest], -1)


@pytest.fixture(scope="module")
def caches():
    return {rot: aligned_ops.rotary_cos_sin_cache(rot, MAX_POS) for rot in (8, 32, 64, 128)}


def make(T, heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MAX_POS, (T,), generator=g), torch.randn(T, heads, head_dim, generator=g).to(dtype)


def test_cache_matches_float64_angles(caches):
    cache = caches[64]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    ang = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * inv_freq
    assert cache.dtype == torch.float32 and cache.shape == (MAX_POS, 64)
    # correctly rounded (bit for bit against mpmath: tests/test_rope_table.py): within half a float32 ulp
    ref = torch.cat([ang.cos(), ang.sin()], -1)
    assert bool(((cache.double() - ref).abs() <= ref.abs().clamp(min=2.0**-126) * (2.0**-24 + 2.0**-50)).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("T,heads,head_dim,rot", [(1, 1, 8, 8), (7, 12, 128, 128), (13, 5, 96, 32), (3, 2, 64, 64)])
def test_accuracy(caches, dtype, is_neox, T, heads, head_dim, rot):
    pos, x = make(T, heads, head_dim, dtype)
    out = aligned_ops.rotary_embedding(pos, x, caches[rot], rot, is_neox)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), rope_ref(pos, x, rot, is_neox), **TOL[dtype])
    assert bitwise_equal(out[..., rot:], x[..., rot:])  # partial rotary: the rest passes through untouched
    back = ops.rotary_embedding_backward(pos, x, caches[rot], rot, is_neox)
    torch.testing.assert_close(back.double(), rope_ref(pos, x, rot, is_neox, inverse=True), **TOL[dtype])


def test_int32_positions_and_non_contiguous(caches):
    pos, x = make(33, 4, 64, torch.bfloat16, 1)
    ref = ops.rotary_embedding(pos, x, caches[32], 32, True)
    assert bitwise_equal(ops.rotary_embedding(pos.int(), x, caches[32], 32, True), ref)
    xt = x.transpose(0, 1).contiguous().transpose(0, 1)  # [T, heads, D] with heads outermost in memory
    assert not xt.is_contiguous()
    assert bitwise_equal(ops.rotary_embedding(pos, xt, caches[32], 32, True), ref)
    big = torch.zeros(4096, 32)
    big[:, :16] = caches[32][:, :16]
    cache_nc = torch.cat([caches[32], big], 1)[:, :32]  # strided cache view
    assert not cache_nc.is_contiguous()
    assert bitwise_equal(ops.rotary_embedding(pos, x, cache_nc, 32, True), ref)
    pos_nc = torch.stack([pos, pos], 1)[:, 0]
    assert bitwise_equal(ops.rotary_embedding(pos_nc, x, caches[32], 32, True), ref)


def test_zero_size(caches):
    for shape in [(0, 4, 64), (3, 0, 64)]:
        x = torch.randn(shape)
        pos = torch.zeros(shape[0], dtype=torch.long)
        assert ops.rotary_embedding(pos, x, caches[32], 32, True).shape == x.shape
        assert ops.rotary_embedding_backward(pos, x, caches[32], 32, False).shape == x.shape


def test_nan_stays_in_its_pair(caches):
    pos, x = make(2, 1, 16, torch.float32, 2)
    x[0, 0, 3] = float("nan")
    out = ops.rotary_embedding(pos, x, caches[8], 8, True)
    nan = torch.isnan(out[0, 0])
    assert nan[3] and nan[7] and nan.sum() == 2  # neox pair (3, 3 + 4)
    assert torch.isfinite(out[1]).all()


@pytest.mark.parametrize("is_neox", [True, False])
def test_batch_invariant_forward_backward(caches, is_neox):
    pos, x = make(600, 4, 128, torch.bfloat16, 3)
    assert batch_mismatches(lambda p, x: ops.rotary_embedding(p, x, caches[128], 128, is_neox), (pos, x)) == 0
    assert batch_mismatches(lambda p, g: ops.rotary_embedding_backward(p, g, caches[128], 128, is_neox), (pos, x)) == 0


def test_negative_control_batch_dependent_path_is_detected(caches):
    cache = caches[64]

    def unfused(pos, x):
        c, s = cache[pos, :32][:, None], cache[pos, 32:][:, None]
        x1, x2 = x[..., :32], x[..., 32:64]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    def fused(pos, x):  # what an fma-contracting big-batch kernel computes: fp64 intermediates
        c, s = cache[pos, :32][:, None].double(), cache[pos, 32:][:, None].double()
        x1, x2 = x[..., :32].double(), x[..., 32:64].double()
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).float()

    pos, x = make(600, 2, 64, torch.float32, 4)
    assert batch_mismatches(contracted_for_large_batch(unfused, fused), (pos, x)) > 0


def test_threads_and_runs(caches):
    pos, x = make(2048, 12, 128, torch.bfloat16, 5)
    for neox in (True, False):
        assert thread_mismatches(lambda: ops.rotary_embedding(pos, x, caches[128], 128, neox)) == 0
        assert thread_mismatches(lambda: ops.rotary_embedding_backward(pos, x, caches[128], 128, neox)) == 0
        assert run_mismatches(lambda: ops.rotary_embedding(pos, x, caches[128], 128, neox)) == 0


@pytest.mark.parametrize("is_neox", [True, False])
def test_gradients(caches, is_neox):
    pos, x = make(9, 3, 64, torch.float32, 6)
    x.requires_grad_(True)
    g = torch.randn(9, 3, 64)
    (dx,) = torch.autograd.grad(aligned_ops.rotary_embedding(pos, x, caches[32], 32, is_neox), x, g)
    x64 = x.detach().double().requires_grad_(True)
    (dx64,) = torch.autograd.grad(rope_ref(pos, x64, 32, is_neox), x64, g.double())
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-5, atol=1e-5)


def test_opcheck_and_compile(caches):
    pos, x = make(5, 3, 32, torch.float32, 7)
    torch.library.opcheck(ops.rotary_embedding.default, (pos, x.requires_grad_(True), caches[32], 32, True))
    torch.library.opcheck(ops.rotary_embedding_backward.default, (pos, x.detach(), caches[32], 32, False))
    pos, q = make(6, 4, 64, torch.bfloat16, 8)

    def f(p, q):
        return (ops.rotary_embedding(p, q, caches[64], 64, True), ops.rotary_embedding(p, q, caches[32], 32, False),
                ops.rotary_embedding_backward(p, q, caches[64], 64, False))

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    for a, b in zip(cf(pos, q), f(pos, q)):
        assert bitwise_equal(a, b)


def test_bad_inputs(caches):
    pos, x = make(4, 2, 16, torch.float32)
    c8 = caches[8]
    with pytest.raises(RuntimeError, match=r"positions must lie in \[0, 4096\)"):
        ops.rotary_embedding(torch.tensor([0, 1, 4096, 2]), x, c8, 8, True)
    with pytest.raises(RuntimeError, match=r"positions must lie in \[0, 4096\)"):
        ops.rotary_embedding(torch.tensor([0, -1, 2, 3]), x, c8, 8, True)
    with pytest.raises(RuntimeError, match="positions must be int64 or int32"):
        ops.rotary_embedding(pos.float(), x, c8, 8, True)
    with pytest.raises(RuntimeError, match=r"positions must be \[4\]"):
        ops.rotary_embedding(pos[:3], x, c8, 8, True)
    with pytest.raises(RuntimeError, match="rotary_dim must be even"):
        ops.rotary_embedding(pos, x, c8, 7, True)
    with pytest.raises(RuntimeError, match="rotary_dim must be even"):
        ops.rotary_embedding(pos, x, caches[32], 32, True)  # > head_dim 16
    with pytest.raises(RuntimeError, match="rotary_dim must be even"):
        ops.rotary_embedding(pos, x, c8, 0, True)
    with pytest.raises(RuntimeError, match="cos_sin_cache must be float32"):
        ops.rotary_embedding(pos, x, c8.bfloat16(), 8, True)
    with pytest.raises(RuntimeError, match="cos_sin_cache must be float32"):
        ops.rotary_embedding(pos, x, caches[32][:, :16], 8, True)  # width != rotary_dim
    with pytest.raises(RuntimeError, match=r"x must be \[tokens, heads, head_dim\]"):
        ops.rotary_embedding(pos, x.flatten(1), c8, 8, True)
    with pytest.raises(RuntimeError, match="must be float32, bfloat16 or float16"):
        ops.rotary_embedding(pos, x.double(), c8, 8, True)
    with pytest.raises(RuntimeError, match=r"positions must lie in \[0, 4096\)"):
        ops.rotary_embedding_backward(torch.tensor([0, 1, 9999, 2]), x, c8, 8, False)
    with pytest.raises(RuntimeError, match="must be on the same device"):
        ops.rotary_embedding(pos, x, c8.to("meta"), 8, True)


@pytest.mark.parametrize("x_grad", [True, False])
def test_a_cos_sin_cache_that_requires_grad_is_refused(caches, x_grad):
    """The backward treats cos_sin_cache as a constant (no gradient for it): a cache that required grad (a learnable
    rotary table) ran, and its .grad stayed None where torch's x * cos + rotate(x) * sin gives one — silently. It
    is refused at the autograd-recorded call, naming the op and the argument. Positive controls: the detached cache
    runs (and x's gradient flows), and so does the same call under no_grad, to the same bits."""
    pos, x = make(4, 2, 16, torch.float32, 8)
    x.requires_grad_(x_grad)
    cache = caches[8].clone().requires_grad_(True)
    ok = aligned_ops.rotary_embedding(pos, x, cache.detach(), 8)
    if x_grad:
        ok.sum().backward()
        assert x.grad is not None
    with torch.no_grad():
        assert bitwise_equal(aligned_ops.rotary_embedding(pos, x, cache, 8), ok.detach())
    for call in (lambda: aligned_ops.rotary_embedding(pos, x, cache, 8), lambda: ops.rotary_embedding(pos, x, cache, 8, True)):
        with pytest.raises(ValueError, match=r"^aligned::rotary_embedding: cos_sin_cache requires grad, but the op "
                                             r"treats it as a constant"):
            call()


@pytest.mark.parametrize("base", [0.0, -1.0, -10000.0, float("nan"), float("inf")])
def test_rope_base_must_be_finite_and_positive(base):
    """Issue 21.9: base 0 gave ZeroDivisionError, a negative base a TypeError (mpmath's complex power)."""
    from aligned_ops.rope import RopeSpec, cos_sin_cache

    with pytest.raises(ValueError, match="rope_theta \\(the RoPE base\\) must be a finite number > 0"):
        aligned_ops.rotary_cos_sin_cache(8, 4, base)
    for kw in (dict(), dict(rope_type="yarn", factor=2.0, original_max_position=2),
               dict(rope_type="linear", factor=2.0), dict(rope_type="dynamic", factor=2.0)):
        with pytest.raises(ValueError, match="rope_theta \\(the RoPE base\\) must be a finite number > 0"):
            cos_sin_cache(RopeSpec(8, base, 4, **kw))


def test_rope_degenerate_parameters_are_refused_by_name():
    from aligned_ops.rope import RopeSpec

    with pytest.raises(ValueError, match="yarn needs rope_theta != 1"):
        RopeSpec(8, 1.0, 4, rope_type="yarn", factor=2.0, original_max_position=2)
    with pytest.raises(ValueError, match="dynamic NTK needs rotary_dim > 2"):
        RopeSpec(2, 10000.0, 4, rope_type="dynamic", factor=2.0)
    with pytest.raises(ValueError, match="gives a base ratio"):
        RopeSpec(8, 10000.0, 4, rope_type="dynamic", factor=3.0, max_trained_positions=100)
    with pytest.raises(ValueError, match="needs a finite factor > 0"):
        RopeSpec(8, 10000.0, 4, rope_type="linear", factor=float("inf"))
    with pytest.raises(ValueError, match="max_position_embeddings must be an integer >= 1"):
        RopeSpec(8, 10000.0, 0)
    RopeSpec(8, 1.0, 4)  # positive control: base 1 is a (degenerate) plain RoPE, as in HF and vLLM
