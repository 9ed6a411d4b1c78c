"""Every op of torch.ops.aligned, classified: differentiable ops give gradients that flow (finite, non-zero)
and match torch's native op (float64) within a tolerance; every other op taking float tensors raises on
backward() — never torch's default for an op without an autograd formula (a UserWarning and an all-zero
gradient, which silently removed an entropy bonus or KL term: issue 8).

A new op must be added to one of the tables below, so this test fails until its gradient story is decided."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import aligned_ops

ops = torch.ops.aligned


def _rows(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).requires_grad_(True)


def _rms_ref(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotary_ref(pos, x, cache, rot):
    half = rot // 2
    c, s = cache[pos, :half].double()[:, None], cache[pos, half:].double()[:, None]
    x1, x2 = x[..., :half], x[..., half:rot]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., rot:]], -1)


def _attn_ref(q, k, v, lens, scale):
    outs, start = [], 0
    for n in lens:
        qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))
        g = qs.shape[0] // ks.shape[0]
        outs.append(F.scaled_dot_product_attention(qs, ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0),
                                                   is_causal=True, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(outs)


CACHE = aligned_ops.rotary_cos_sin_cache(16, 64)
POS = torch.tensor([0, 5, 9, 63, 2])
IDS = torch.tensor([3, 0, 41, 7, 12])
TEMPS = torch.tensor([0.5, 1.0, 1.3, 0.8, 2.0])
LENS = [3, 1, 5]
CU = torch.tensor([0, 3, 4, 9], dtype=torch.int32)

# name -> (inputs builder, aligned function of the inputs, float64 torch reference of the same inputs).
# The builders return fp32 leaves that require grad (and constants); outputs are reduced with fixed random
# weights so every output element's gradient matters.
DIFFERENTIABLE = {
    "linear": (lambda: (_rows(5, 7), _rows(4, 7, seed=1), _rows(4, seed=2)),
               lambda x, w, b: ops.linear(x, w, b), lambda x, w, b: F.linear(x, w, b)),
    "rms_norm": (lambda: (_rows(5, 33), _rows(33, seed=1) + 1.0),
                 lambda x, w: ops.rms_norm(x, w, 1e-6), lambda x, w: _rms_ref(x, w, 1e-6)),
    "fused_add_rms_norm": (lambda: (_rows(5, 33), _rows(5, 33, seed=1), _rows(33, seed=2) + 1.0),
                           lambda x, r, w: ops.fused_add_rms_norm(x, r, w, 1e-6),
                           lambda x, r, w: (_rms_ref(x + r, w, 1e-6), x + r)),
    "silu_and_mul": (lambda: (_rows(5, 2 * 19, scale=3.0),), lambda x: ops.silu_and_mul(x),
                     lambda x: F.silu(x[..., :19]) * x[..., 19:]),
    "rotary_embedding": (lambda: (_rows(5, 3, 20),), lambda x: ops.rotary_embedding(POS, x, CACHE, 16, True),
                         lambda x: _rotary_ref(POS, x, CACHE, 16)),
    "logsumexp": (lambda: (_rows(5, 50, scale=3.0),), lambda z: ops.logsumexp(z, 1.0, TEMPS),
                  lambda z: torch.logsumexp(z / TEMPS.double()[:, None], -1)),
    "log_softmax": (lambda: (_rows(5, 50, scale=3.0),), lambda z: ops.log_softmax(z, 0.7, None),
                    lambda z: torch.log_softmax(z / 0.7, -1)),
    "token_logprobs": (lambda: (_rows(5, 50, scale=3.0),), lambda z: ops.token_logprobs(z, IDS, 1.0, TEMPS),
                       lambda z: torch.log_softmax(z / TEMPS.double()[:, None], -1).gather(1, IDS[:, None])[:, 0]),
    "attention_varlen": (lambda: (_rows(9, 4, 8), _rows(9, 2, 8, seed=1), _rows(9, 2, 8, seed=2)),
                         lambda q, k, v: ops.attention_varlen(q, k, v, CU, CU, 0.3, True)[0],
                         lambda q, k, v: _attn_ref(q, k, v, LENS, 0.3)),
    # the plan/run form: the backward replans from the host cu_seqlens
    "attention_varlen_planned": (lambda: (_rows(9, 4, 8), _rows(9, 2, 8, seed=1), _rows(9, 2, 8, seed=2)),
                                 lambda q, k, v: aligned_ops.attention_varlen(
                                     q, k, v, CU, CU, 0.3, True, plan=aligned_ops.AttentionPlan().plan_varlen(
                                         CU, CU, 4, 2, 8))[0],
                                 lambda q, k, v: _attn_ref(q, k, v, LENS, 0.3)),
    # MLA: one latent row per token (8 latent + 4 rope dims) as keys, its first 8 dims as values
    "mla_attention_varlen": (lambda: (_rows(9, 3, 12), _rows(9, 12, seed=1)),
                             lambda q, kv: ops.mla_attention_varlen(q, kv, CU, CU, 8, 0.3, True)[0],
                             lambda q, kv: _attn_ref(q, kv[:, None, :], kv[:, None, :8], LENS, 0.3)),
    "mla_attention_varlen_planned": (lambda: (_rows(9, 3, 12), _rows(9, 12, seed=1)),
                                     lambda q, kv: aligned_ops.mla_attention_varlen(
                                         q, kv, CU, CU, 8, 0.3, plan=aligned_ops.AttentionPlan().plan_varlen(
                                             CU, CU, 3, 1, 12))[0],
                                     lambda q, kv: _attn_ref(q, kv[:, None, :], kv[:, None, :8], LENS, 0.3)),
}



def _moe_routing_ref(z):
    p = torch.softmax(z, -1)
    ids = p.detach().topk(2, -1).indices
    w = p.gather(1, ids)
    return w / w.sum(-1, keepdim=True)


GROUPED_BIAS = torch.linspace(-0.5, 0.5, 8, dtype=torch.float32)  # 8 experts in 4 groups; the bias only selects


def _moe_grouped_routing_ref(z):
    # the op's choice (piecewise constant in z, so not differentiated), weights from the unbiased sigmoid scores,
    # renormalised, x the routed scaling factor
    ids = ops.moe_grouped_routing(z.detach().float().contiguous(), GROUPED_BIAS, 2, 4, 2, True, 2.5)[1]
    w = torch.sigmoid(z).gather(1, ids)
    return w / w.sum(-1, keepdim=True) * 2.5


MOE_IDS = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 3]])


def _moe_experts_ref(x, tw, w13, w2):
    out = []
    for t in range(x.shape[0]):
        acc = 0
        for j in range(MOE_IDS.shape[1]):
            e = int(MOE_IDS[t, j])
            h = w13[e] @ x[t]
            inter = h.shape[0] // 2
            acc = acc + tw[t, j] * (w2[e] @ (F.silu(h[:inter]) * h[inter:]))
        out.append(acc)
    return torch.stack(out)


DIFFERENTIABLE.update({
    # exact profile: integer forward, the fma profile's deterministic backward (linear_backward)
    "linear_exact": (lambda: (_rows(5, 7), _rows(4, 7, seed=1), _rows(4, seed=2)),
                     lambda x, w, b: ops.linear_exact(x, w, b), lambda x, w, b: F.linear(x, w, b)),
    "moe_routing": (lambda: (_rows(5, 8, scale=2.0),), lambda z: ops.moe_routing(z, 2, "softmax", True)[0],
                    _moe_routing_ref),
    "moe_grouped_routing": (lambda: (_rows(5, 8, scale=2.0),),
                            lambda z: ops.moe_grouped_routing(z, GROUPED_BIAS, 2, 4, 2, True, 2.5)[0],
                            _moe_grouped_routing_ref),
    "moe_experts": (lambda: (_rows(5, 8), _rows(5, 2, seed=1).detach().abs().requires_grad_(True),
                             _rows(4, 6, 8, seed=2), _rows(4, 8, 3, seed=3)),
                    lambda x, tw, w13, w2: ops.moe_experts(x, tw, MOE_IDS, w13, w2, None, None, None),
                    _moe_experts_ref),
    # fused LM head: token_logprobs(linear(h, W, b)) without the logits (chunks 2 tokens x 7 vocabulary rows)
    "fused_token_logprobs": (lambda: (_rows(5, 7), _rows(50, 7, seed=1), _rows(50, seed=2)),
                             lambda h, w, b: ops.fused_token_logprobs(h, w, b, IDS, 1.0, TEMPS, 2, 7)[0],
                             lambda h, w, b: torch.log_softmax(F.linear(h, w, b) / TEMPS.double()[:, None],
                                                               -1).gather(1, IDS[:, None])[:, 0]),
})

# mma profile (bf16 only: the fp32 leaves are cast, so gradients reach them through the cast): its backward runs on
# the unit with bf16 gradients, hence bf16 tolerances (TOLERANCE); the ops need the CPU's unit (MMA_OPS).
_BF = torch.bfloat16
DIFFERENTIABLE.update({
    "linear_mma": (lambda: (_rows(5, 7), _rows(4, 7, seed=1), _rows(4, seed=2)),
                   lambda x, w, b: ops.linear_mma(x.to(_BF), w.to(_BF), b.to(_BF)),
                   lambda x, w, b: F.linear(x.to(_BF).double(), w.to(_BF).double(), b.to(_BF).double())),
})
TOLERANCE = {"linear_mma": dict(rtol=2e-2, atol=3e-2)}  # default: rtol 1e-4, atol 1e-5
MMA_OPS = {"linear_mma", "linear_mma_partial", "linear_mma_backward"}
AMX_MMA_OPS = {"linear_mma_packed"}  # the amx_bf16 unit's packed weights (refused on any other unit)

# Ops that take float tensors but have no gradient formula: backward() through them must raise.
NO_BACKWARD = {
    "linear_backward": lambda x: ops.linear_backward(x, x, x[:, :5].contiguous(), True, True, True)[0],
    "rms_norm_backward": lambda x: ops.rms_norm_backward(x, x, x[0].detach(), 1e-6)[0],
    "silu_and_mul_backward": lambda x: ops.silu_and_mul_backward(x[:, :2].contiguous(), x[:, :4].contiguous()),
    "rotary_embedding_backward": lambda x: ops.rotary_embedding_backward(
        torch.arange(5), x[:, :4].reshape(5, 1, 4), aligned_ops.rotary_cos_sin_cache(4, 8), 4, True),
    "token_logprobs_backward": lambda x: ops.token_logprobs_backward(x[:, 0].contiguous(), x, IDS % 5, 1.0, None),
    "logsumexp_backward": lambda x: ops.logsumexp_backward(x[:, 0].contiguous(), x, 1.0, None),
    "log_softmax_backward": lambda x: ops.log_softmax_backward(x, x, 1.0, None),
    "_exp_f32": lambda x: ops._exp_f32(x),
    "_log_f32": lambda x: ops._log_f32(x.abs()),
    "attention_varlen_backward": lambda x: ops.attention_varlen_backward(
        *(x[:, :4].reshape(5, 1, 4),) * 5, torch.zeros(5, 1), *(torch.tensor([0, 5], dtype=torch.int32),) * 2, 0.5,
        True)[0],
    "paged_attention": lambda x: ops.paged_attention(
        x[:, :4].reshape(5, 1, 4), torch.randn(2, 4, 1, 4), torch.randn(2, 4, 1, 4),
        torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
        torch.tensor([0, 5], dtype=torch.int32), 0.5),
    "paged_attention_planned": lambda x: aligned_ops.paged_attention(
        x[:, :4].reshape(5, 1, 4), torch.randn(2, 4, 1, 4), torch.randn(2, 4, 1, 4), scale=0.5,
        plan=aligned_ops.AttentionPlan().plan_paged(
            torch.tensor([0, 5], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
            torch.tensor([[0, 1]], dtype=torch.int32), 1, 1, 4, 2, 4)),
    "mla_attention_varlen_backward": lambda x: ops.mla_attention_varlen_backward(
        x[:, :4].reshape(5, 1, 4), x.reshape(5, 1, 5), x, x[:, :4].reshape(5, 1, 4), torch.zeros(5, 1),
        *(torch.tensor([0, 5], dtype=torch.int32),) * 2, 4, 0.5, True)[0],
    "mla_paged_attention": lambda x: ops.mla_paged_attention(
        x.reshape(5, 1, 5), torch.randn(2, 4, 5), torch.tensor([[0, 1]], dtype=torch.int32),
        torch.tensor([5], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32), 4, 0.5),
    "mla_paged_attention_planned": lambda x: aligned_ops.mla_paged_attention(
        x.reshape(5, 1, 5), torch.randn(2, 4, 5), kv_lora_rank=4, scale=0.5,
        plan=aligned_ops.AttentionPlan().plan_paged(
            torch.tensor([0, 5], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
            torch.tensor([[0, 1]], dtype=torch.int32), 1, 1, 5, 2, 4)),
}

_W3 = torch.randn(3, 5)


def _emulated(fn):
    """fn() under aligned_ops.emulate("sm_90") (the mma attention references apply the emulator's unit model)."""
    with aligned_ops.emulate("sm_90"):
        return fn()


_CU5 = torch.tensor([0, 5], dtype=torch.int32)
NO_BACKWARD.update({
    "_attention_mma_reference": lambda x: _emulated(lambda: ops._attention_mma_reference(
        *(x.to(_BF).reshape(5, 1, 5),) * 3, _CU5, _CU5, 0.5, True)[0]),
    "_attention_mma_backward_reference": lambda x: _emulated(lambda: ops._attention_mma_backward_reference(
        *(x.to(_BF).reshape(5, 1, 5),) * 5, torch.zeros(5, 1), _CU5, _CU5, 0.5, True)[0]),
    "linear_partial": lambda x: ops.linear_partial(x, _W3, 8),
    "linear_mma_partial": lambda x: ops.linear_mma_partial(x.to(_BF), _W3.to(_BF), 8),
    "_linear_mma_reference": lambda x: ops._linear_mma_reference(x.to(_BF), _W3.to(_BF), 8),
    "linear_mma_packed": lambda x: ops.linear_mma_packed(x.to(_BF), _W3.to(_BF), ops.linear_mma_pack_weight(
        _W3.to(_BF)), None),
    "linear_mma_backward": lambda x: ops.linear_mma_backward(
        x.to(_BF), x.to(_BF), x[:, :5].contiguous().to(_BF), True, True, True)[0],
    "_linear_partial_reference": lambda x: ops._linear_partial_reference(x, _W3, 8),
    "_linear_exact_reference": lambda x: ops._linear_exact_reference(x, _W3, None),
    "linear_exact_packed": lambda x: ops.linear_exact_packed(x, *ops.linear_exact_pack_weight(_W3), 3, None, 1),
    "linear_exact_finish": lambda x: ops.linear_exact_finish(
        torch.zeros(1, 3, 2, dtype=torch.long), ops.linear_exact_row_scan(torch.ones(1, 4)),
        torch.zeros(4, dtype=torch.int32), torch.zeros(3, dtype=torch.uint8), x[0, :3].contiguous(), x.dtype),
    "_moe_experts_reference": lambda x: ops._moe_experts_reference(
        x[:, :4].contiguous(), torch.ones(5, 1), MOE_IDS[:, :1].contiguous(), torch.randn(4, 6, 4),
        torch.randn(4, 4, 3), None, None, None),
    "moe_routing_backward": lambda x: ops.moe_routing_backward(
        x[:, :2].contiguous(), None, x, MOE_IDS % 5, "softmax", True),
    "moe_grouped_routing_backward": lambda x: ops.moe_grouped_routing_backward(
        x[:, :2].contiguous(), None, x, MOE_IDS % 5, True, 2.5),
    "moe_experts_backward": lambda x: ops.moe_experts_backward(
        x[:, :4].contiguous(), x[:, :4].contiguous(), x[:, :2].contiguous(), MOE_IDS, torch.randn(4, 6, 4),
        torch.randn(4, 4, 3), None, None, None)[0],
    "token_logprobs_pairs": lambda x: ops.token_logprobs_pairs(x, IDS % 5, 1.0, None)[0],
    "token_logprobs_backward_cols": lambda x: ops.token_logprobs_backward_cols(
        x[:, 0].contiguous(), x, IDS % 5, torch.zeros(5, 2), 0, 5, 1.0, None),
    "fused_token_logprobs_backward": lambda x: ops.fused_token_logprobs_backward(
        x[:, 0].contiguous(), x, x, None, IDS % 5, torch.zeros(5, 2), 1.0, None, 0, 0, True, False, False)[0],
})

# Ops with nothing to differentiate: an in-place cache write returning None, string/int diagnostics, the
# packing of a weight into integer digits, the emulation switch (aligned_ops.emulate) and its self-tests.
NOT_DIFFERENTIABLE = {"reshape_and_cache", "mla_reshape_and_cache", "_cpu_isa", "_exact_unit", "_cpu_mma_unit", "linear_exact_pack_weight",
                      "linear_mma_pack_weight",
                      "linear_exact_f64_bounds", "_linear_exact_f64_pairs", "_linear_exact_f64_routes", "_emulate_enter",
                      "_emulate_exit", "_emulate_selftest", "_emulated_archs", "_device_error_flags",
                      "attention_plan", "attention_plan_size", "attention_plan_layout",  # host planning, int buffers
                      # exact TP: integer scans, packing and partials (int outputs; linear_exact_finish refuses)
                      "linear_exact_row_scan", "linear_exact_pack_weight_scanned", "linear_exact_partial"}


def _registered_ops():
    return {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("aligned::")}


def test_every_op_is_classified():
    known = set(DIFFERENTIABLE) | set(NO_BACKWARD) | NOT_DIFFERENTIABLE
    missing = _registered_ops() - known
    assert not missing, (f"ops without a gradient decision: {sorted(missing)}; add each to DIFFERENTIABLE (with a "
                         "torch reference) or NO_BACKWARD in tests/ops/test_gradients.py")
    assert not known - _registered_ops(), f"stale entries: {sorted(known - _registered_ops())}"


def _weights_like(out, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in out]


@pytest.mark.parametrize("name", sorted(DIFFERENTIABLE))
def test_gradient_flows_and_matches_torch(name):
    if name in MMA_OPS and aligned_ops.mma_unit() is None:
        pytest.skip("the mma profile needs avx512_bf16")
    if name in AMX_MMA_OPS and aligned_ops.mma_unit() != "amx_bf16":
        pytest.skip("packed weights are the amx_bf16 unit's")
    build, fn, ref = DIFFERENTIABLE[name]
    inputs = build()
    out = fn(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    ws = _weights_like(out, 123)
    grads = torch.autograd.grad(sum((o.double() * w).sum() for o, w in zip(out, ws)), inputs)
    inputs64 = [x.detach().double().requires_grad_(True) for x in inputs]
    out64 = ref(*inputs64)
    out64 = out64 if isinstance(out64, tuple) else (out64,)
    grads64 = torch.autograd.grad(sum((o * w).sum() for o, w in zip(out64, ws)), inputs64)
    for i, (g, g64) in enumerate(zip(grads, grads64)):
        assert g is not None and torch.isfinite(g).all(), f"{name}: input {i} gradient missing or not finite"
        assert g.abs().sum() > 0, f"{name}: input {i} gradient is all zeros"
        tol = TOLERANCE.get(name, dict(rtol=1e-4, atol=1e-5))
        torch.testing.assert_close(g.double(), g64, **tol, msg=f"{name}: input {i}")


@pytest.mark.parametrize("name", sorted(NO_BACKWARD))
def test_op_without_backward_raises(name):
    if name in MMA_OPS and aligned_ops.mma_unit() is None:
        pytest.skip("the mma profile needs avx512_bf16")
    if name in AMX_MMA_OPS and aligned_ops.mma_unit() != "amx_bf16":
        pytest.skip("packed weights are the amx_bf16 unit's")
    x = _rows(5, 5, scale=0.5)
    out = NO_BACKWARD[name](x)
    assert out.requires_grad  # autograd sees the op, so backward() reaches the formula that refuses
    with pytest.raises(RuntimeError, match=f"aligned::{name} has no backward"):
        out.sum().backward()
    assert x.grad is None  # and nothing was accumulated


def test_negative_control_torch_default_is_silent_zero():
    # What the tests above guard against: a custom op without an autograd formula backpropagates zeros with
    # only a warning (torch's default fallback), so a "gradient flows" test must look at the values.
    lib = torch.library.Library("aligned_test_nograd", "FRAGMENT")
    lib.define("double_it(Tensor x) -> Tensor")
    lib.impl("double_it", lambda x: x.detach() * 2, "CPU")  # a kernel autograd cannot see into, like C++
    x = torch.randn(4, requires_grad=True)
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        torch.ops.aligned_test_nograd.double_it(x).sum().backward()
    assert x.grad is None or not x.grad.any()
