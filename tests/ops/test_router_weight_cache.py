"""The MoE router's fp32 weight copy (DeepSeek-V3 routes on fp32 logits of a bf16 router) is kept per weight state
for registered weights (the engine's: ``cache_exact_weights``), not redone every forward, and every weight change
is seen: an optimiser-style in-place step (version counter), ``clear_exact_weight_cache()`` after a write behind
the counter's back (vLLM's load_weights / refit call it). Negative control: a ``.data`` write without the clear
leaves the stale copy in use — the reason the invalidation exists. Bits through integer views."""

import torch

import aligned_ops
from aligned_ops.models.moe import MoEWeights, sparse_moe
from aligned_ops.ops.linear_exact import cached_cast
from aligned_ops.testing import bits


class _Rules:
    @staticmethod
    def router_linear(x, w, bias=None):
        return aligned_ops.linear(x, w, bias)


def _router(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter((torch.randn(8, 32, generator=g) * 0.2).to(torch.bfloat16), requires_grad=False)


def test_registered_weight_cast_once_per_state_and_steps_seen():
    w = _router()
    aligned_ops.cache_exact_weights(w)
    a = cached_cast(w, torch.float32)
    assert a.dtype == torch.float32 and torch.equal(bits(a), bits(w.float()))
    assert cached_cast(w, torch.float32) is a  # the same copy: not redone per call
    with torch.no_grad():  # an optimiser step: in place, the version counter moves
        w.add_(torch.full_like(w, 0.5))
    b = cached_cast(w, torch.float32)
    assert b is not a and torch.equal(bits(b), bits(w.float()))


def test_write_behind_the_version_counter_needs_the_clear_negative_control():
    w = _router(1)
    aligned_ops.cache_exact_weights(w)
    a = cached_cast(w, torch.float32)
    w.data.copy_(_router(2).data)  # vLLM's weight loaders write through .data: the counter does not move
    stale = cached_cast(w, torch.float32)
    assert stale is a and not torch.equal(bits(stale), bits(w.float()))  # negative control: stale without the clear
    aligned_ops.clear_exact_weight_cache()  # what load_weights / refit do after writing
    fresh = cached_cast(w, torch.float32)
    assert torch.equal(bits(fresh), bits(w.float()))


def test_unregistered_or_tracked_weights_are_cast_every_call():
    w = _router(3)
    assert cached_cast(w, torch.float32) is not cached_cast(w, torch.float32)  # not registered: no cache
    t = torch.nn.Parameter(_router(4).data.clone())  # requires_grad: the trainer's router
    aligned_ops.cache_exact_weights(t)
    c = cached_cast(t, torch.float32)
    assert c.requires_grad and c.grad_fn is not None
    c.sum().backward()
    assert t.grad is not None and torch.equal(bits(t.grad), bits(torch.ones_like(t)))


def test_sparse_moe_fp32_router_sees_a_step():
    """The grouped (DeepSeek-V3) block with router_dtype fp32: after a step its routing is the new weight's."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 32, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(8, 32, 32, generator=g) * 0.2).to(torch.bfloat16)
    w2 = (torch.randn(8, 32, 16, generator=g) * 0.2).to(torch.bfloat16)
    router = _router(6)
    aligned_ops.cache_exact_weights(router)

    def run(r):
        seen = []
        mw = MoEWeights(r, 2, "sigmoid_grouped", True, w13, w2, correction_bias=torch.zeros(8), n_group=4,
                        topk_group=2, routed_scaling_factor=2.5, router_dtype=torch.float32)
        out = sparse_moe(_Rules, x, mw, record=lambda ids, s: seen.append(s))
        return out, seen[0]

    run(router)
    with torch.no_grad():
        router.mul_(-1.0)
    out, scores = run(router)
    ref_out, ref_scores = run(router.detach().clone())  # a fresh, unregistered copy of the new weight
    assert torch.equal(bits(scores), bits(ref_scores)) and torch.equal(bits(out), bits(ref_out))


def test_compiled_forward_casts_plainly_and_sees_a_refit():
    # vLLM's compiled mode traces the MoE forward with fullgraph=True: the cached lookup must not be traced (Dynamo
    # cannot inline the weak-keyed dictionary), and a copy captured at trace time would go stale after a refit
    # that writes behind the version counter (vLLM drops the guards after the first compile).
    w = _router(5)
    aligned_ops.cache_exact_weights(w)
    x = torch.randn(3, 32).to(torch.bfloat16)
    fn = torch.compile(lambda x: x.float() @ cached_cast(w, torch.float32).t(), fullgraph=True, dynamic=False)
    first = fn(x)
    assert torch.equal(bits(first), bits(x.float() @ w.float().t()))
    w.data.copy_(_router(6).data)  # a refit through .data: no version bump, no clear
    second = fn(x)
    assert torch.equal(bits(second), bits(x.float() @ w.float().t()))
    assert not torch.equal(bits(first), bits(second))  # control: the refit changed the result
