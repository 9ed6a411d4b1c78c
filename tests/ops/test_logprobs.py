"""logsumexp, log_softmax, token_logprobs (+ backward): invariance, accuracy, temperature, NaN policy."""

import math

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, bitwise_equal
from dense_invariance import batch_mismatches, batch_variant_sum, run_mismatches, thread_mismatches

ops = torch.ops.aligned
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INF = float("inf")


def log_softmax_ref(z, tau=1.0):
    tau = tau.double()[:, None] if isinstance(tau, torch.Tensor) else tau
    return torch.log_softmax(z.double() / tau, -1)


def make(T, V, dtype, seed=0, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(T, V, generator=g) * scale).to(dtype)
    return z, torch.randint(0, V, (T,), generator=g)


# ---- accuracy ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,V", [(1, 1), (3, 7), (5, 423), (4, 32000)])
@pytest.mark.parametrize("tau", [1.0, 0.6])
def test_accuracy(dtype, T, V, tau):
    z, ids = make(T, V, dtype, V)
    ref = log_softmax_ref(z, tau)
    logp = aligned_ops.log_softmax(z, tau)
    assert logp.dtype == torch.float32 and logp.shape == (T, V)
    torch.testing.assert_close(logp.double(), ref, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(aligned_ops.logsumexp(z, tau).double(), torch.logsumexp(z.double() / tau, -1),
                               rtol=1e-6, atol=1e-5)
    tlp = aligned_ops.token_logprobs(z, ids, tau)
    assert tlp.dtype == torch.float32 and tlp.shape == (T,)
    assert_bitwise_equal(tlp, logp.gather(1, ids[:, None])[:, 0])  # bit for bit


def test_qwen_sized_vocab_few_rows():
    z, ids = make(2, 151936, torch.bfloat16, 1, scale=3.0)
    logp = ops.log_softmax(z, 0.8, None)
    torch.testing.assert_close(logp.double(), log_softmax_ref(z, 0.8), rtol=1e-5, atol=5e-5)
    assert_bitwise_equal(ops.token_logprobs(z, ids, 0.8, None), logp.gather(1, ids[:, None])[:, 0])


def test_per_row_temperatures():
    z, ids = make(6, 1000, torch.bfloat16, 2)
    temps = torch.tensor([0.5, 1.0, 0.7, 1.3, 0.7, 2.0])
    tlp = aligned_ops.token_logprobs(z, ids, temps)
    logp = aligned_ops.log_softmax(z, temps)
    torch.testing.assert_close(logp.double(), log_softmax_ref(z, temps), rtol=1e-5, atol=2e-5)
    assert_bitwise_equal(tlp, logp.gather(1, ids[:, None])[:, 0])
    for i, t in enumerate(temps.tolist()):  # tensor temperature == scalar temperature, bit for bit
        assert_bitwise_equal(tlp[i], ops.token_logprobs(z[i:i + 1], ids[i:i + 1], t, None)[0])
        assert_bitwise_equal(logp[i], ops.log_softmax(z[i:i + 1], t, None)[0])
    full = torch.full((6,), 0.7)
    assert_bitwise_equal(ops.log_softmax(z, 1.0, full), ops.log_softmax(z, 0.7, None))
    assert_bitwise_equal(ops.logsumexp(z, 1.0, full), ops.logsumexp(z, 0.7, None))
    # float64 / bf16 temperature tensors are converted to fp32 first, like the scalar
    assert_bitwise_equal(ops.token_logprobs(z, ids, 1.0, full.double()), ops.token_logprobs(z, ids, 0.7, None))
    # a 0-d tensor in the wrapper means a scalar
    assert_bitwise_equal(aligned_ops.token_logprobs(z, ids, torch.tensor(0.7)), ops.token_logprobs(z, ids, 0.7, None))


def test_nan_policy():
    z, ids = make(6, 300, torch.float32, 3)
    z[1, 17] = float("nan")
    z[2, 200] = INF
    z[3] = -INF
    z[4, :150] = -INF  # masked logits are fine: they get logp = -inf
    ids[4] = 3
    logp = ops.log_softmax(z, 1.0, None)
    lse = ops.logsumexp(z, 1.0, None)
    assert torch.isnan(logp[1]).all() and torch.isnan(lse[1])  # a NaN logit poisons its row
    assert torch.isnan(logp[2]).all() and lse[2].item() == INF  # +inf: logp NaN, lse +inf (as torch.logsumexp)
    assert torch.logsumexp(z[2:3], -1).item() == INF and torch.isnan(torch.log_softmax(z[2:3], -1)).all()
    assert lse[3].item() == -INF and torch.isnan(logp[3]).all()  # all -inf: lse = -inf, logp = NaN
    assert (logp[4, :150] == -INF).all() and torch.isfinite(logp[4, 150:]).all()
    assert torch.isfinite(logp[[0, 5]]).all()
    assert_bitwise_equal(logp[[0, 4, 5]], ops.log_softmax(z[[0, 4, 5]], 1.0, None))  # other rows untouched
    tlp = ops.token_logprobs(z, ids, 1.0, None)
    assert torch.isnan(tlp[1:4]).all() and tlp[4].item() == -INF and torch.isfinite(tlp[[0, 5]]).all()
    dz = ops.token_logprobs_backward(torch.ones(6), z, ids, 1.0, None)
    assert torch.isnan(dz[1]).all() and torch.isfinite(dz[[0, 5]]).all()
    # exp(-inf) = 0: masked logits get no gradient except the (masked) chosen token, d/dz_id = 1 - p_id = 1
    assert_bitwise_equal(dz[4, :150], torch.nn.functional.one_hot(torch.tensor(3), 150).float())


def _f32(bits: int) -> float:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32).item()


CANONICAL_NAN = 0x7FC00000


def test_a_nan_log_prob_is_the_canonical_nan():
    """Which NaN a log-prob or logsumexp holds is contracted (contract.h logp_value / lse_value): 0x7fc00000, whatever
    NaN the row had. (s - m) - L passed on the chosen logit's own NaN (its sign and payload: a linear leaves them to
    the hardware's operand order, so they varied with M: tests/emulated/test_emulated_small_m_linear.py) and -inf - -inf
    gave x86's default NaN 0xffc00000 (NVIDIA: 0x7fffffff)."""
    z, _ = make(6, 40, torch.float32, 5)
    z[0, 3] = _f32(0x7FC00123)  # a quiet NaN with a payload
    z[1, 3] = _f32(0xFFC00000)  # the negative default NaN
    z[2, 3] = _f32(0x7F800001)  # a signalling NaN
    z[3, 3] = INF
    z[4] = -INF
    ids = torch.full((6,), 3)
    canonical_rows = [0, 1, 2, 3, 4]
    for tau in (1.0, 0.7):
        logp = ops.log_softmax(z, tau, None)
        tlp = ops.token_logprobs(z, ids, tau, None)
        lse = ops.logsumexp(z, tau, None)
        assert (aligned_ops.testing.bits(logp[canonical_rows]) == CANONICAL_NAN).all()
        assert (aligned_ops.testing.bits(tlp[canonical_rows]) == CANONICAL_NAN).all()
        assert (aligned_ops.testing.bits(lse[:3]) == CANONICAL_NAN).all()  # NaN rows (+inf: +inf, all -inf: -inf)
        assert torch.isfinite(logp[5]).all() and torch.isfinite(tlp[5])  # control: an ordinary row is a number
        # the fused head: a NaN hidden element makes the whole logit row NaN (of mixed signs: 0 * NaN, NaN + x)
        h = torch.randn(6, 16)
        h[0, 2] = _f32(0xFFC00123)
        w = torch.randn(40, 16)
        fused = aligned_ops.fused_token_logprobs(h, w, ids, tau)
        assert aligned_ops.testing.bits(fused)[0] == CANONICAL_NAN and torch.isfinite(fused[1:]).all()


def test_non_contiguous_and_zero_size():
    z, ids = make(40, 500, torch.bfloat16, 4)
    zt = z.t().contiguous().t()
    zs = make(40, 1000, torch.bfloat16, 4)[0][:, ::2]
    ids_nc = torch.stack([ids, ids], 1)[:, 0]
    assert not zt.is_contiguous() and not zs.is_contiguous() and not ids_nc.is_contiguous()
    assert_bitwise_equal(ops.log_softmax(zt, 0.9, None), ops.log_softmax(z, 0.9, None))
    assert_bitwise_equal(ops.token_logprobs(zs, ids_nc, 1.0, None), ops.token_logprobs(zs.contiguous(), ids, 1.0, None))
    e = torch.empty(0, 100)
    ei = torch.empty(0, dtype=torch.long)
    assert ops.log_softmax(e, 1.0, None).shape == (0, 100)
    assert ops.logsumexp(e, 1.0, None).shape == (0,)
    assert ops.token_logprobs(e, ei, 1.0, torch.empty(0)).shape == (0,)
    assert ops.token_logprobs_backward(torch.empty(0), e, ei, 1.0, None).shape == (0, 100)


# ---- invariance ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant(dtype):
    z, ids = make(600, 1000, dtype, 5)
    temps = torch.rand(600) + 0.5
    assert batch_mismatches(lambda z: ops.log_softmax(z, 0.7, None), (z,)) == 0
    assert batch_mismatches(lambda z, i, t: ops.token_logprobs(z, i, 1.0, t), (z, ids, temps)) == 0
    g = torch.randn(600)
    assert batch_mismatches(lambda g, z, i, t: ops.token_logprobs_backward(g, z, i, 1.0, t), (g, z, ids, temps)) == 0


def test_negative_control_batch_variant_lse_is_detected():
    z, ids = make(600, 1000, torch.float32, 6)

    def variant_token_logprobs(z, ids):
        m = z.max(-1).values
        lse = m + torch.log(batch_variant_sum(torch.exp(z - m[:, None])))
        return z.gather(1, ids[:, None])[:, 0] - lse

    assert batch_mismatches(variant_token_logprobs, (z, ids)) > 0


def test_threads_and_runs():
    z, ids = make(64, 32000, torch.bfloat16, 7)
    temps = torch.rand(64) + 0.5
    g = torch.randn(64)
    assert thread_mismatches(lambda: ops.log_softmax(z, 0.7, None)) == 0
    assert thread_mismatches(lambda: ops.token_logprobs(z, ids, 1.0, temps)) == 0
    assert thread_mismatches(lambda: ops.token_logprobs_backward(g, z, ids, 1.0, temps)) == 0
    assert run_mismatches(lambda: ops.token_logprobs(z, ids, 0.7, None)) == 0


# ---- autograd --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6, "tensor"])
def test_gradients(dtype, temperature):
    z, ids = make(5, 777, dtype, 8)
    tau = torch.tensor([0.5, 0.9, 1.0, 1.7, 0.7]) if temperature == "tensor" else temperature
    z.requires_grad_(True)
    g = torch.randn(5)
    (dz,) = torch.autograd.grad(aligned_ops.token_logprobs(z, ids, tau), z, g)
    z64 = z.detach().double().requires_grad_(True)
    (dz64,) = torch.autograd.grad(log_softmax_ref(z64, tau).gather(1, ids[:, None])[:, 0], z64, g.double())
    assert dz.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-4)
    torch.testing.assert_close(dz.double(), dz64, **tol)


# ---- opcheck / compile ----------------------------------------------------------------------------------------------


def test_opcheck():
    z, ids = make(4, 50, torch.float32, 9)
    temps = torch.rand(4) + 0.5
    for t, ts in [(0.8, None), (1.0, temps)]:
        torch.library.opcheck(ops.logsumexp.default, (z, t, ts))
        torch.library.opcheck(ops.log_softmax.default, (z, t, ts))
        torch.library.opcheck(ops.token_logprobs.default, (z.clone().requires_grad_(True), ids, t, ts))
        torch.library.opcheck(ops.token_logprobs_backward.default, (torch.randn(4), z, ids, t, ts))
    torch.library.opcheck(ops._exp_f32.default, (torch.randn(33),))
    torch.library.opcheck(ops._log_f32.default, (torch.rand(33),))


def test_torch_compile_fullgraph_bitwise():
    z, ids = make(7, 300, torch.bfloat16, 10)
    temps = torch.rand(7) + 0.5

    def f(z, ids, temps):
        return (ops.token_logprobs(z, ids, 1.0, temps), ops.log_softmax(z, 0.7, None), ops.logsumexp(z, 1.0, temps),
                ops.token_logprobs_backward(torch.ones(7), z, ids, 0.9, None))

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    for a, b in zip(cf(z, ids, temps), f(z, ids, temps)):
        assert_bitwise_equal(a, b)


# ---- bad input ---------------------------------------------------------------------------------------------------------


def test_bad_inputs():
    z, ids = make(4, 10, torch.float32)
    with pytest.raises(RuntimeError, match="must be float32, bfloat16 or float16"):
        ops.token_logprobs(z.double(), ids, 1.0, None)
    with pytest.raises(RuntimeError, match="must be float32, bfloat16 or float16"):
        ops.log_softmax(z.to(torch.int32), 1.0, None)
    with pytest.raises(RuntimeError, match=r"logits must be \[tokens, vocab\]"):
        ops.log_softmax(z[None], 1.0, None)
    with pytest.raises(RuntimeError, match=r"logits must be \[tokens, vocab\]"):
        ops.logsumexp(z[0], 1.0, None)
    with pytest.raises(RuntimeError, match=r"token_ids must lie in \[0, 10\)"):
        ops.token_logprobs(z, torch.tensor([0, 1, 10, 2]), 1.0, None)
    with pytest.raises(RuntimeError, match=r"token_ids must lie in \[0, 10\)"):
        ops.token_logprobs_backward(torch.ones(4), z, torch.tensor([0, -1, 2, 2]), 1.0, None)
    with pytest.raises(RuntimeError, match="token_ids must be int64 or int32"):
        ops.token_logprobs(z, ids.float(), 1.0, None)
    with pytest.raises(RuntimeError, match=r"token_ids must be \[4\]"):
        ops.token_logprobs(z, ids[:3], 1.0, None)
    for bad in (0.0, -1.0, INF, float("nan")):
        with pytest.raises(RuntimeError, match="temperature must be finite and > 0"):
            ops.token_logprobs(z, ids, bad, None)
        with pytest.raises(ValueError, match="temperature must be finite and > 0"):
            aligned_ops.log_softmax(z, bad)
    for bad in (torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([1.0, -2.0, 1.0, 1.0]),
                torch.tensor([1.0, float("nan"), 1.0, 1.0]), torch.tensor([INF, 1.0, 1.0, 1.0])):
        with pytest.raises(RuntimeError, match="every temperature must be finite and > 0"):
            ops.token_logprobs(z, ids, 1.0, bad)
        with pytest.raises(RuntimeError, match="every temperature must be finite and > 0"):
            aligned_ops.logsumexp(z, bad)
    with pytest.raises(RuntimeError, match=r"temperatures must be \[4\]"):
        ops.log_softmax(z, 1.0, torch.ones(3))
    with pytest.raises(RuntimeError, match=r"temperatures must be \[4\]"):
        ops.log_softmax(z, 1.0, torch.ones(4, 1))
    with pytest.raises(RuntimeError, match=r"grad must be \[4\]"):
        ops.token_logprobs_backward(torch.ones(5), z, ids, 1.0, None)
    with pytest.raises(RuntimeError, match="vocab size must be > 0"):
        ops.log_softmax(torch.empty(3, 0), 1.0, None)
    with pytest.raises(RuntimeError, match="must be on the same device"):
        ops.token_logprobs(z, ids.to("meta"), 1.0, None)
    assert math.isfinite(ops.token_logprobs(z, ids, 1e-3, None).sum().item())  # tiny but valid temperature


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_rows_shared_by_threads_give_the_batch_bits(dtype):
    # With fewer rows than threads the threads share a row (v ranges for the max, lane groups for the sum);
    # the result must equal the same row computed inside a batch (one thread per row) and with 1 thread.
    V = 32003  # not a multiple of 32: the last chunk is partial
    z, ids = make(8, V, dtype, 11)
    z[2, 100:200] = -INF
    z[5] = -INF
    z[6, 7] = float("nan")
    temps = torch.rand(8) + 0.5
    g = torch.randn(8)
    torch.set_num_threads(2)
    batch = [ops.logsumexp(z, 1.0, temps), ops.log_softmax(z, 0.7, None), ops.token_logprobs(z, ids, 1.0, temps),
             ops.token_logprobs_backward(g, z, ids, 0.8, None)]
    for r in range(8):
        s = slice(r, r + 1)
        one = [ops.logsumexp(z[s], 1.0, temps[s]), ops.log_softmax(z[s], 0.7, None),
               ops.token_logprobs(z[s], ids[s], 1.0, temps[s]), ops.token_logprobs_backward(g[s], z[s], ids[s], 0.8, None)]
        for a, b in zip(batch, one):
            assert_bitwise_equal(a[s], b, f"row {r}")
    assert thread_mismatches(lambda: ops.log_softmax(z[:1], 0.7, None)) == 0
    assert thread_mismatches(lambda: ops.token_logprobs(z[3:4], ids[3:4], 1.0, None)) == 0


def test_compiled_forward_and_backward_match_eager_bitwise():
    z, ids = make(6, 400, torch.bfloat16, 12)
    temps = torch.rand(6) + 0.5
    g = torch.randn(6)

    def f(z):
        return aligned_ops.token_logprobs(z, ids, temps)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    ze, zc = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    ye, yc = f(ze), cf(zc)
    assert_bitwise_equal(ye, yc)
    ye.backward(g)
    yc.backward(g)
    assert_bitwise_equal(ze.grad, zc.grad)


# ---- issue 8: shift-exact rows, special rows, the backward of log_softmax and logsumexp --------------------


def _within_ulps(got, ref, ulps=2.0, atol=1e-6):
    """|got - ref| <= ulps * eps_fp32 * |ref| + atol elementwise, -inf where ref is -inf (ref: float64)."""
    got = got.double()
    inf = torch.isinf(ref)
    assert bitwise_equal(got[inf], ref[inf])
    err = (got[~inf] - ref[~inf]).abs()
    tol = ulps * torch.finfo(torch.float32).eps * ref[~inf].abs() + atol
    return float((err / tol).max()) if err.numel() else 0.0


@pytest.mark.parametrize("max_logit", [1e2, 1e4, 1e6])
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_accuracy_at_large_max_logit(max_logit, tau):
    # Old z/tau - lse rounded lse to the ulp of the max logit: 3.6e-6 at 1e2, 2.8e-4 at 1e4, 2.7e-2 at 1e6.
    g = torch.Generator().manual_seed(int(max_logit))
    z = (max_logit + 3 * torch.randn(5, 3001, generator=g)).float()
    z[1, 17] = max_logit * 1.5  # one dominant logit: its logp is ~0, the others ~ -max_logit/2
    z[2, :100] = -INF  # mixed with -inf
    ids = torch.randint(0, 3001, (5,), generator=g)
    ids[1] = 17
    # Reference: float64 log_softmax of the contract's fp32 s = z / tau (the division's own rounding is the
    # input's, not the log-softmax's; torch's fp32 division is the same IEEE operation).
    s = z / torch.tensor(tau, dtype=torch.float32)
    ref = torch.log_softmax(s.double(), -1)
    assert _within_ulps(ops.log_softmax(z, tau, None), ref) <= 1.0
    tlp = ops.token_logprobs(z, ids, tau, None)
    assert _within_ulps(tlp, ref.gather(1, ids[:, None])[:, 0]) <= 1.0
    assert_bitwise_equal(tlp, ops.log_softmax(z, tau, None).gather(1, ids[:, None])[:, 0])
    lse_ref = torch.logsumexp(s.double(), -1)
    assert _within_ulps(ops.logsumexp(z, tau, None), lse_ref) <= 1.0


@pytest.mark.parametrize("dtype,masked", [(torch.float32, -3e38), (torch.bfloat16, None), (torch.float16, None)])
def test_fully_masked_rows_give_minus_log_v(dtype, masked):
    # All logits equal to the dtype's most negative finite value: uniform, logp = -log V (was 0 for every token).
    low = torch.finfo(dtype).min if masked is None else masked
    V = 1000
    z = torch.randn(4, V).to(dtype)
    z[1] = low
    z[3] = low
    z[3, 5] = 0.0  # one live token among masked ones: p = 1 exactly, the others exp(-huge) = 0
    ids = torch.tensor([0, 7, 3, 5])
    logp = ops.log_softmax(z, 1.0, None)
    minus_log_v = torch.tensor(-math.log(V), dtype=torch.float32)
    assert torch.allclose(logp[1], minus_log_v.expand(V), rtol=0, atol=4e-7)
    assert_bitwise_equal(logp[1], logp[1, :1].expand(V).contiguous())  # every token alike
    assert logp[3, 5].item() == 0.0 and (logp[3, :5] == float(low)).all()  # (s - 0) - log(1)
    tlp = ops.token_logprobs(z, ids, 1.0, None)
    assert_bitwise_equal(tlp[1], logp[1, 7])
    lse = ops.logsumexp(z, 1.0, None)
    assert lse[1].item() == pytest.approx(float(low) + math.log(V), rel=1e-7)
    # backward: p = 1/V on the masked row
    dz = ops.token_logprobs_backward(torch.ones(4), z, ids, 1.0, None).float()
    assert torch.allclose(dz[1, :7], torch.full((7,), -1.0 / V).to(dtype).float())
    assert torch.isfinite(dz).all()
    # the row's probabilities sum to 1 (they summed to V before)
    assert logp[1].double().exp().sum().item() == pytest.approx(1.0, rel=1e-5)


def test_logsumexp_plus_inf_row_is_plus_inf_like_torch():
    z = torch.randn(3, 50)
    z[1, 4] = INF
    z[2, 4] = INF
    z[2, 9] = float("nan")  # NaN wins over +inf: NaN
    lse = ops.logsumexp(z, 1.0, None)
    ref = torch.logsumexp(z, -1)
    assert lse[1].item() == INF == ref[1].item()
    assert torch.isnan(lse[2]) and torch.isnan(ref[2])
    assert torch.isfinite(lse[0])


def _entropy_and_kl_terms(fn_lsm, fn_lse, z, tau):
    logp = fn_lsm(z, tau)[torch.isfinite(z)]  # masked (-inf) logits: p * logp would be 0 * -inf
    entropy = -(logp.exp() * logp).sum()
    return entropy + (fn_lse(z, tau) * torch.linspace(-1, 2, z.shape[0], dtype=logp.dtype)).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6, "tensor"])
def test_log_softmax_and_logsumexp_gradients_match_torch(dtype, temperature):
    # Was: backward() ran with a UserWarning and gave an all-zero gradient (an entropy bonus silently vanished).
    z, _ = make(5, 777, dtype, 13)
    z[3, :200] = -INF  # masked logits: no gradient
    tau = torch.tensor([0.5, 0.9, 1.0, 1.7, 0.7]) if temperature == "tensor" else temperature
    z.requires_grad_(True)
    (dz,) = torch.autograd.grad(_entropy_and_kl_terms(aligned_ops.log_softmax, aligned_ops.logsumexp, z, tau), z)
    z64 = z.detach().double().requires_grad_(True)
    t64 = tau.double()[:, None] if isinstance(tau, torch.Tensor) else tau
    (dz64,) = torch.autograd.grad(_entropy_and_kl_terms(
        lambda z, t: torch.log_softmax(z / t64, -1),
        lambda z, t: torch.logsumexp(z / t64, -1), z64, tau), z64)
    assert dz.dtype == dtype and torch.isfinite(dz).all() and dz.abs().sum() > 0
    assert (dz[3, :200] == 0).all()
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-4)
    torch.testing.assert_close(dz.double(), dz64, **tol)


def test_backward_ops_match_float64_formulas():
    z, _ = make(6, 513, torch.float32, 14)
    gen = torch.Generator().manual_seed(14)  # seeded: the tolerance below must not depend on the tests run before
    g_rows, g_full = torch.randn(6, generator=gen), torch.randn(6, 513, generator=gen)
    p = torch.softmax(z.double() / 0.8, -1)
    torch.testing.assert_close(ops.logsumexp_backward(g_rows, z, 0.8, None).double(), p * g_rows.double()[:, None] / 0.8,
                               rtol=1e-5, atol=1e-7)
    ref = (g_full.double() - p * g_full.double().sum(-1, keepdim=True)) / 0.8
    torch.testing.assert_close(ops.log_softmax_backward(g_full, z, 0.8, None).double(), ref, rtol=1e-5, atol=1e-6)


def test_new_backward_ops_are_batch_and_thread_invariant():
    z, _ = make(600, 1000, torch.bfloat16, 15)
    temps = torch.rand(600) + 0.5
    g_rows, g_full = torch.randn(600), torch.randn(600, 1000)
    assert batch_mismatches(lambda g, z, t: ops.logsumexp_backward(g, z, 1.0, t), (g_rows, z, temps)) == 0
    assert batch_mismatches(lambda g, z, t: ops.log_softmax_backward(g, z, 1.0, t), (g_full, z, temps)) == 0
    zb, _ = make(64, 32000, torch.bfloat16, 16)
    gb = torch.randn(64, 32000)
    assert thread_mismatches(lambda: ops.log_softmax_backward(gb, zb, 0.7, None)) == 0
    assert thread_mismatches(lambda: ops.logsumexp_backward(gb[:, 0].contiguous(), zb, 0.7, None)) == 0
    # one row shared by the threads (pairs computed by the split path) == the row inside a batch
    torch.set_num_threads(2)
    one = ops.log_softmax_backward(gb[:1], zb[:1], 0.7, None)
    assert_bitwise_equal(one, ops.log_softmax_backward(gb[:3], zb[:3], 0.7, None)[:1])


def test_negative_control_gradient_sum_in_batch_order_is_detected():
    # The checker above can fail: a log_softmax backward whose row sum G depends on the batch.
    z, _ = make(600, 1000, torch.float32, 17)
    g = torch.randn(600, 1000)

    def variant(g, z):
        p = torch.softmax(z, -1)
        return g - p * batch_variant_sum(g)[:, None]

    assert batch_mismatches(variant, (g, z)) > 0


def test_new_backward_ops_opcheck_compile_and_bad_inputs():
    z, _ = make(4, 50, torch.float32, 18)
    temps = torch.rand(4) + 0.5
    for t, ts in [(0.8, None), (1.0, temps)]:
        torch.library.opcheck(ops.logsumexp_backward.default, (torch.randn(4), z, t, ts))
        torch.library.opcheck(ops.log_softmax_backward.default, (torch.randn(4, 50), z, t, ts))
        torch.library.opcheck(ops.logsumexp.default, (z.clone().requires_grad_(True), t, ts))
        torch.library.opcheck(ops.log_softmax.default, (z.clone().requires_grad_(True), t, ts))

    def f(z):
        return aligned_ops.log_softmax(z, temps).square().sum() + aligned_ops.logsumexp(z, 0.9).sum()

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    ze, zc = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    ye, yc = f(ze), cf(zc)
    ye.backward()
    yc.backward()
    assert_bitwise_equal(ze.grad, zc.grad)
    with pytest.raises(RuntimeError, match=r"aligned::log_softmax_backward: grad must be \[4, 50\]"):
        ops.log_softmax_backward(torch.randn(4), z, 1.0, None)
    with pytest.raises(RuntimeError, match=r"aligned::logsumexp_backward: grad must be \[4\]"):
        ops.logsumexp_backward(torch.randn(4, 50), z, 1.0, None)
    with pytest.raises(RuntimeError, match="aligned::logsumexp_backward: grad must be a float tensor"):
        ops.logsumexp_backward(torch.ones(4, dtype=torch.long), z, 1.0, None)


def test_temperature_must_be_representable_in_fp32():
    # Was: range-checked as float64 but used as float32: 1e-50 -> 0 (all NaN), 1e39 -> inf (uniform rows).
    z, ids = make(4, 10, torch.float32)
    for bad in (1e-50, 1e39, 1e-40):
        with pytest.raises(RuntimeError, match=r"aligned::token_logprobs: temperature .* not representable in float32"):
            ops.token_logprobs(z, ids, bad, None)
        with pytest.raises(RuntimeError, match=r"aligned::log_softmax: temperature .* not representable in float32"):
            ops.log_softmax(z, bad, None)
        with pytest.raises(ValueError, match="not representable in float32"):
            aligned_ops.logsumexp(z, bad)
    with pytest.raises(RuntimeError, match="every temperature must be finite and > 0, and a normal float32"):
        ops.log_softmax(z, 1.0, torch.tensor([1.0, 1e-40, 1.0, 1.0]))
    with pytest.raises(RuntimeError, match="every temperature must be finite and > 0"):
        ops.log_softmax(z, 1.0, torch.tensor([1.0, 1e39, 1.0, 1.0], dtype=torch.float64))
    # the extremes of the normal fp32 range are accepted (what they do to a row is the row's business)
    assert ops.log_softmax(z, 1.2e-38, None).shape == (4, 10)
    assert torch.isfinite(ops.log_softmax(z, 3.0e38, None)).all()
