"""CUDA (and ROCm) backend of the dense ops: bitwise equal to the CPU backend, batch-invariant on the GPU.

Skipped without a GPU (CI has none); run on a lent GPU machine by .ci/gpu_check.sh. The CPU backend is the
reference for bits: every GPU kernel evaluates the same fp32 expression trees (csrc/common/contract.h), so
CPU and GPU results must be equal bit for bit — NaN only compared as "both NaN" (payloads are the hardware's).
"""

from __future__ import annotations

import pytest
import torch

import aligned_ops  # noqa: F401  (registers torch.ops.aligned)

ops = torch.ops.aligned

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) GPU")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BATCHES = [1, 2, 3, 7, 64, 513]
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


# ---- helpers ------------------------------------------------------------------------------------------------


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (so +0 != -0), except that any NaN equals any NaN (payloads differ per vendor)."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    an, bn = torch.isnan(a), torch.isnan(b)
    if not torch.equal(an, bn):
        return False
    iv = _INT_VIEW[a.dtype]
    return torch.equal(a.view(iv)[~an], b.view(iv)[~bn])


def assert_bits_equal(a, b, what=""):
    if isinstance(a, (tuple, list)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bits_equal(x, y, f"{what}[{i}]")
        return
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert bits_equal(a, b), f"{what}: CPU and GPU differ (max abs diff {(a.cpu().double() - b.cpu().double()).abs().max()})"


def to_cuda(args):
    return [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]


def cpu_vs_cuda(op, *args):
    """Runs op on CPU and CUDA copies of the same inputs; asserts bitwise equality; returns the CPU result."""
    ref = op(*args)
    got = op(*to_cuda(args))
    torch.cuda.synchronize()
    assert_bits_equal(ref, got, str(op))
    return ref


def randn(*shape, dtype=torch.float32, scale=1.0, gen=None):
    return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(dtype)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


# ---- CPU == CUDA, bit for bit ------------------------------------------------------------------------------

ROW_SHAPES = [(1, 1), (3, 31), (7, 33), (5, 423), (2, 4099), (3, 0), (0, 64), (2, 3, 96)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_rms_norm_matches_cpu(dtype, shape, gen):
    H = shape[-1]
    x = randn(*shape, dtype=dtype, scale=3.0, gen=gen)
    for wdt in {dtype, torch.float32}:
        w = randn(H, dtype=wdt, gen=gen)
        cpu_vs_cuda(ops.rms_norm, x, w, 1e-6)
    r = randn(*shape, dtype=dtype, gen=gen)
    cpu_vs_cuda(ops.fused_add_rms_norm, x, r, randn(H, dtype=dtype, gen=gen), 1e-5)
    g = randn(*shape, dtype=dtype, gen=gen)
    cpu_vs_cuda(ops.rms_norm_backward, g, x, randn(H, dtype=dtype, gen=gen), 1e-6)


def test_rms_norm_subnormal_and_special_rows():
    # Subnormal squares (no flush-to-zero), a zero row (eps only), huge values (ss overflows to inf).
    x = torch.tensor([[1e-30, -2e-25, 3e-20, 0.0], [0.0, 0.0, 0.0, 0.0], [3e19, -3e19, 1.0, 2.0]])
    w = torch.tensor([1.0, -1.0, 0.5, 2.0])
    out = cpu_vs_cuda(ops.rms_norm, x, w, 0.0)
    assert torch.isfinite(out[0]).all()
    cpu_vs_cuda(ops.rms_norm, x, w, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (3, 46), (7, 2 * 423), (2, 3, 2 * 1409), (0, 8)])
def test_silu_and_mul_matches_cpu(dtype, shape, gen):
    x = randn(*shape, dtype=dtype, scale=6.0, gen=gen)
    y = cpu_vs_cuda(ops.silu_and_mul, x)
    g = randn(*y.shape, dtype=dtype, gen=gen)
    cpu_vs_cuda(ops.silu_and_mul_backward, g, x)


def test_silu_special_values():
    x = torch.tensor([[0.0, -0.0, 100.0, -100.0, -104.5, 89.0, float("inf"), float("-inf"), float("nan"), 1e-40,
                       1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]])
    cpu_vs_cuda(ops.silu_and_mul, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("T,heads,head_dim,rot", [(1, 1, 2, 2), (5, 3, 64, 64), (7, 2, 80, 32), (3, 5, 128, 64),
                                                  (0, 2, 64, 64)])
def test_rotary_matches_cpu(dtype, is_neox, T, heads, head_dim, rot, gen):
    cache = aligned_ops.rotary_cos_sin_cache(rot, 4096)
    pos = torch.randint(0, 4096, (T,), generator=gen)
    x = randn(T, heads, head_dim, dtype=dtype, scale=2.0, gen=gen)
    cpu_vs_cuda(ops.rotary_embedding, pos, x, cache, rot, is_neox)
    cpu_vs_cuda(ops.rotary_embedding_backward, pos.to(torch.int32), x, cache, rot, is_neox)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,V", [(1, 1), (3, 31), (7, 33), (4, 1000), (2, 32000 + 7), (0, 5)])
@pytest.mark.parametrize("per_row_temp", [False, True])
def test_logprob_family_matches_cpu(dtype, T, V, per_row_temp, gen):
    z = randn(T, V, dtype=dtype, scale=4.0, gen=gen)
    ids = torch.randint(0, V, (T,), generator=gen)
    temps = (torch.rand(T, generator=gen) + 0.3) if per_row_temp else None
    tau = 0.7
    cpu_vs_cuda(ops.logsumexp, z, tau, temps)
    lsm = cpu_vs_cuda(ops.log_softmax, z, tau, temps)
    tlp = cpu_vs_cuda(ops.token_logprobs, z, ids, tau, temps)
    if T:
        assert torch.equal(tlp, lsm[torch.arange(T), ids])
    g = torch.randn(T, generator=gen)
    cpu_vs_cuda(ops.token_logprobs_backward, g, z, ids.to(torch.int32), tau, temps)


def test_logprob_nan_policy_matches_cpu():
    inf, nan = float("inf"), float("nan")
    z = torch.tensor([[0.0, 1.0, 2.0, -inf], [-inf, -inf, -inf, -inf], [0.0, inf, 1.0, 2.0], [0.0, nan, 1.0, 2.0],
                      [-0.0, 0.0, -0.0, 0.0], [1e-45, -1e-45, 88.0, -104.0]])
    ids = torch.tensor([1, 0, 2, 3, 1, 2])
    lse = cpu_vs_cuda(ops.logsumexp, z, 1.0, None)
    assert torch.isnan(lse[2]) and torch.isnan(lse[3]) and lse[1] == -inf
    cpu_vs_cuda(ops.log_softmax, z, 1.0, None)
    cpu_vs_cuda(ops.token_logprobs, z, ids, 1.0, None)
    cpu_vs_cuda(ops.token_logprobs_backward, torch.ones(6), z, ids, 1.0, None)


def test_exp_log_match_cpu_and_vendor_exp_does_not(gen):
    # 2^20 random bit patterns (all exponents: subnormals, inf, NaN) plus a dense sweep of the useful range.
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.linspace(-110.0, 90.0, 1 << 18)])
    e = cpu_vs_cuda(ops._exp_f32, x)
    cpu_vs_cuda(ops._log_f32, x)
    # Negative control: the same checker on the vendor's expf (torch.exp on the GPU) must see a difference.
    assert not bits_equal(e, torch.exp(x.cuda())), "control: vendor exp unexpectedly equals exp_f32 everywhere"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (3, 423, 213), (129, 130, 17), (7, 64, 1), (0, 5, 7), (257, 31, 1000)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_cpu(dtype, M, N, K, with_bias, gen):
    x = randn(M, K, dtype=dtype, gen=gen)
    w = randn(N, K, dtype=dtype, scale=0.1, gen=gen)
    b = randn(N, dtype=dtype, gen=gen) if with_bias else None
    y = cpu_vs_cuda(ops.linear, x, w, b)
    g = randn(*y.shape, dtype=dtype, gen=gen)
    cpu_vs_cuda(ops.linear_backward, g, x, w, True, True, with_bias)


@pytest.mark.parametrize("lanes", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 37, 45), (3, 213, 423), (129, 130, 17), (9, 40, 3), (300, 64, 1536)])
def test_linear_partial_matches_cpu(dtype, lanes, M, N, K, gen):
    """The GPU's lane-per-block GEMM + lane_fold_kernel give the CPU's lane tree bit for bit."""
    x = randn(M, K, dtype=dtype, gen=gen)
    w = randn(N, K, dtype=dtype, scale=0.1, gen=gen)
    cpu_vs_cuda(ops.linear_partial, x, w, lanes)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_linear_equals_tree_of_rank_partials_on_gpu(t, gen):
    x = randn(17, 1536, dtype=torch.bfloat16, gen=gen).cuda()
    w = randn(96, 1536, dtype=torch.bfloat16, scale=0.1, gen=gen).cuda()
    b = randn(96, dtype=torch.bfloat16, gen=gen).cuda()
    parts = [ops.linear_partial(x[:, a:c], w[:, a:c], 8 // t) for a, c in aligned_ops.linear_tp_slices(1536, t)]
    tp = (aligned_ops.tree_combine(parts) + b.float()).to(torch.bfloat16)
    assert bits_equal(tp, ops.linear(x, w, b))


def test_linear_noncontiguous_weight_and_3d_input(gen):
    x = randn(2, 3, 96, gen=gen)
    w = randn(96, 130, gen=gen).t()  # [130, 96], strides (1, 130)
    cpu_vs_cuda(ops.linear, x, w, None)


def test_linear_signed_zero_chain():
    # fma chains that end in -0: the K tail must not be padded with fma(0, 0, acc) (which gives +0).
    x = torch.tensor([[-1e-30] * 9])
    w = torch.tensor([[1e-30] * 9])
    y = cpu_vs_cuda(ops.linear, x, w, None)
    assert y.item() == 0.0 and torch.signbit(y).item()


# ---- float64 references (the GPU results are also accurate, not only equal to the CPU) --------------------


def ref_log_softmax(z, tau):
    return torch.log_softmax(z.double() / tau, dim=-1)


def ref_linear(x, w, b):
    y = x.double() @ w.double().t()
    return y + b.double() if b is not None else y


def test_accuracy_vs_float64(gen):
    z = randn(5, 3001, scale=5.0, gen=gen).cuda()
    got = ops.log_softmax(z, 0.8, None)
    torch.testing.assert_close(got.double(), ref_log_softmax(z, 0.8), rtol=0, atol=2e-5)
    x, w, b = randn(33, 257, gen=gen).cuda(), randn(65, 257, gen=gen).cuda(), randn(65, gen=gen).cuda()
    torch.testing.assert_close(ops.linear(x, w, b).double(), ref_linear(x, w, b), rtol=1e-5, atol=1e-4)


# ---- batch invariance on the GPU ------------------------------------------------------------------------


def rows_invariant(fn, x_full, batches=BATCHES) -> bool:
    """fn(x[:b]) == fn(x_full)[:b] and fn(x[s:s+b]) == fn(x_full)[s:s+b], bitwise, for every b."""
    full = fn(x_full)
    n = x_full.shape[0]
    for b in batches:
        for start in {0, n - b, (n - b) // 2}:
            part = fn(x_full[start:start + b].clone())
            if not bits_equal(part, full[start:start + b]):
                return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariance_gpu(dtype, gen):
    n = max(BATCHES)
    H = 1000
    x = randn(n, H, dtype=dtype, scale=2.0, gen=gen).cuda()
    w = randn(H, dtype=dtype, gen=gen).cuda()
    assert rows_invariant(lambda t: ops.rms_norm(t, w, 1e-6), x)
    # the residual is a per-row function of the row (its mirror image), so slicing keeps rows aligned
    assert rows_invariant(lambda t: ops.fused_add_rms_norm(t, t.flip(-1), w, 1e-6)[0], x)
    assert rows_invariant(lambda t: ops.rms_norm_backward(t, t, w, 1e-6)[0], x)
    assert rows_invariant(ops.silu_and_mul, x)
    assert rows_invariant(lambda t: ops.log_softmax(t, 1.0, None), x)
    assert rows_invariant(lambda t: ops.logsumexp(t, 0.9, None), x)
    ids = torch.randint(0, H, (n,), generator=gen).cuda()
    tl_full = ops.token_logprobs(x, ids, 1.0, None)
    for b in BATCHES:
        assert bits_equal(ops.token_logprobs(x[:b].clone(), ids[:b].clone(), 1.0, None), tl_full[:b])
    wl = randn(300, H, dtype=dtype, scale=0.05, gen=gen).cuda()
    assert rows_invariant(lambda t: ops.linear(t, wl, None), x)
    cache = aligned_ops.rotary_cos_sin_cache(64, 2048).cuda()
    pos = torch.randint(0, 2048, (n,), generator=gen).cuda()
    xr = randn(n, 4, 64, dtype=dtype, gen=gen).cuda()
    full = ops.rotary_embedding(pos, xr, cache, 64, True)
    for b in BATCHES:
        assert bits_equal(ops.rotary_embedding(pos[-b:].clone(), xr[-b:].clone(), cache, 64, True), full[-b:])


def test_repeated_runs_and_streams_identical(gen):
    x = randn(97, 777, gen=gen).cuda()
    w = randn(513, 777, gen=gen).cuda()
    ref = ops.linear(x, w, None)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        other = ops.linear(x, w, None)
    s.synchronize()
    for _ in range(3):
        assert bits_equal(ops.linear(x, w, None), ref)
    assert bits_equal(other, ref)


def test_invariance_negative_control(gen):
    """The checker detects a batch-variant reduction: a split-K row sum whose split count follows the batch."""
    x = randn(max(BATCHES), 4096, gen=gen).cuda()

    def batch_variant_rowsum(t):
        splits = 1 if t.shape[0] < 64 else 8  # what a heuristic split-K does
        parts = t.view(t.shape[0], splits, -1).sum(-1)
        out = parts[:, 0].clone()
        for i in range(1, splits):
            out = out + parts[:, i]
        return out

    assert not rows_invariant(batch_variant_rowsum, x), "control: the split-K row sum should be batch-variant"


# ---- autograd: CPU and GPU gradients are the same bits ---------------------------------------------------


def test_autograd_chain_matches_cpu(gen):
    T, H, V = 9, 96, 301
    base = {
        "x": randn(T, H, gen=gen),
        "wn": randn(H, gen=gen),
        "w1": randn(2 * H, H, scale=0.1, gen=gen),
        "w2": randn(V, H, scale=0.1, gen=gen),
    }
    ids = torch.randint(0, V, (T,), generator=gen)
    cache = aligned_ops.rotary_cos_sin_cache(32, 64)
    pos = torch.arange(T)

    def run(device):
        p = {k: v.to(device).requires_grad_() for k, v in base.items()}
        h = aligned_ops.rms_norm(p["x"], p["wn"], 1e-6)
        h = aligned_ops.rotary_embedding(pos.to(device), h.view(T, 3, 32), cache.to(device), 32, True).view(T, H)
        h = aligned_ops.silu_and_mul(aligned_ops.linear(h, p["w1"]))
        lp = aligned_ops.token_logprobs(aligned_ops.linear(h, p["w2"]), ids.to(device))
        lp.sum().backward()
        return [lp] + [p[k].grad for k in base]

    for a, b in zip(run("cpu"), run("cuda")):
        assert_bits_equal(a, b, "autograd")


# ---- opcheck / torch.compile on CUDA -----------------------------------------------------------------------


def _opcheck_cases(gen):
    x = randn(5, 67, gen=gen).cuda()
    w = randn(67, gen=gen).cuda()
    z = randn(4, 50, gen=gen).cuda()
    ids = torch.randint(0, 50, (4,), generator=gen).cuda()
    cache = aligned_ops.rotary_cos_sin_cache(16, 32).cuda()
    xr = randn(3, 2, 16, gen=gen).cuda()
    pos = torch.tensor([0, 5, 31]).cuda()
    wl = randn(9, 67, gen=gen).cuda()
    return [
        (ops.rms_norm.default, (x, w, 1e-6)),
        (ops.rms_norm_backward.default, (x, x, w, 1e-6)),
        (ops.fused_add_rms_norm.default, (x, x, w, 1e-6)),
        (ops.silu_and_mul.default, (randn(5, 8, gen=gen).cuda(),)),
        (ops.silu_and_mul_backward.default, (randn(5, 4, gen=gen).cuda(), randn(5, 8, gen=gen).cuda())),
        (ops.rotary_embedding.default, (pos, xr, cache, 16, True)),
        (ops.rotary_embedding_backward.default, (pos, xr, cache, 16, False)),
        (ops.logsumexp.default, (z, 1.0, None)),
        (ops.log_softmax.default, (z, 0.5, None)),
        (ops.token_logprobs.default, (z, ids, 1.0, None)),
        (ops.token_logprobs_backward.default, (torch.ones(4).cuda(), z, ids, 1.0, None)),
        (ops.linear.default, (x, wl, None)),
        (ops.linear_backward.default, (randn(5, 9, gen=gen).cuda(), x, wl, True, True, True)),
        (ops._exp_f32.default, (x,)),
        (ops._log_f32.default, (x.abs(),)),
    ]


def test_opcheck_cuda(gen):
    for op, args in _opcheck_cases(gen):
        torch.library.opcheck(op, args)


def test_opcheck_cuda_with_grad(gen):
    x = randn(5, 67, gen=gen).cuda().requires_grad_()
    w = randn(67, gen=gen).cuda().requires_grad_()
    torch.library.opcheck(ops.rms_norm.default, (x, w, 1e-6))
    wl = randn(9, 67, gen=gen).cuda().requires_grad_()
    torch.library.opcheck(ops.linear.default, (x, wl, None))


def test_torch_compile_fullgraph_cuda(gen):
    x = randn(6, 64, dtype=torch.bfloat16, gen=gen).cuda()
    wn = randn(64, dtype=torch.bfloat16, gen=gen).cuda()
    w = randn(100, 64, dtype=torch.bfloat16, scale=0.1, gen=gen).cuda()
    ids = torch.randint(0, 100, (6,), generator=gen).cuda()

    def f(x):
        h = aligned_ops.rms_norm(x, wn, 1e-6)
        return aligned_ops.token_logprobs(aligned_ops.linear(h, w), ids)

    eager = f(x)
    compiled = torch.compile(f, fullgraph=True)(x)
    assert bits_equal(eager, compiled)


# ---- bad input: clear errors, no out-of-bounds access ---------------------------------------------------


def test_bad_inputs_cuda(gen):
    x = randn(4, 8, gen=gen).cuda()
    with pytest.raises(RuntimeError, match="weight must be a CUDA tensor"):
        ops.rms_norm(x, torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="must be float32, bfloat16 or float16"):
        ops.rms_norm(x.double(), torch.ones(8, dtype=torch.float64).cuda(), 1e-6)
    with pytest.raises(RuntimeError, match="weight must have shape"):
        ops.rms_norm(x, torch.ones(7).cuda(), 1e-6)
    # Data values (token ids, positions, per-row temperatures) are checked in the kernel, not on the host (a host
    # read of device data would sync every decode step): the call returns, the bad row is NaN, the other rows are
    # exact, and aligned_ops.check_device_errors() raises with the CPU glue's words (csrc/gpu/dense_api.h).
    aligned_ops.check_device_errors(x)  # clean before
    good = ops.token_logprobs(x, torch.tensor([0, 1, 7, 2]).cuda(), 1.0, None)
    for bad_ids, bad_row in (([0, 1, 8, 2], 2), ([0, -1, 2, 2], 1)):
        out = ops.token_logprobs(x, torch.tensor(bad_ids).cuda(), 1.0, None)  # no raise at the call
        with pytest.raises(RuntimeError, match=r"token_ids must lie in \[0, vocab\)"):
            aligned_ops.check_device_errors(x)
        assert torch.isnan(out[bad_row]).item()
        keep = [r for r in range(4) if r != bad_row and bad_ids[r] == [0, 1, 7, 2][r]]
        assert bits_equal(out[keep], good[keep])
    cache = aligned_ops.rotary_cos_sin_cache(8, 16).cuda()
    xr = randn(2, 1, 8, gen=gen).cuda()
    out = ops.rotary_embedding(torch.tensor([0, 16]).cuda(), xr, cache, 8, True)
    with pytest.raises(RuntimeError, match=r"positions must lie in \[0, max_position\)"):
        aligned_ops.check_device_errors(x)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()
    aligned_ops.check_device_errors(x)  # reading cleared the words
    # the CPU backend checks the same values at the call (negative control: these inputs are bad)
    with pytest.raises(RuntimeError, match=r"token_ids must lie in"):
        ops.token_logprobs(x.cpu(), torch.tensor([0, 1, 8, 2]), 1.0, None)
    with pytest.raises(RuntimeError, match="in_features|input features"):
        ops.linear(x, torch.ones(3, 7).cuda(), None)
    with pytest.raises(RuntimeError, match="temperature must be finite and > 0"):
        ops.log_softmax(x, 0.0, None)
    with pytest.raises(RuntimeError, match="must be even"):
        ops.silu_and_mul(randn(2, 5, gen=gen).cuda())
    # the device is still healthy afterwards (no sticky error from a bad launch)
    torch.cuda.synchronize()
    assert bits_equal(ops.rms_norm(x, torch.ones(8).cuda(), 1e-6), ops.rms_norm(x.cpu(), torch.ones(8), 1e-6))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_mixed_devices_rejected(gen):
    x = randn(4, 8, gen=gen).cuda(0)
    with pytest.raises(RuntimeError, match="all tensors must be on the same device"):
        ops.rms_norm(x, torch.ones(8).cuda(1), 1e-6)
