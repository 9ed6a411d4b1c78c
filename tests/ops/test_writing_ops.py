"""The ops that write into their arguments — reshape_and_cache, mla_reshape_and_cache (the KV caches) and
attention_plan (the plan buffers) — behave as torch's own in-place ops under autograd (csrc/torch/register_autograd.cpp),
and a cache write is a function of the tokens (csrc/common/attention_plan.h check_slots):

- each written tensor's version counter is bumped, so a backward that saved it before the write raises instead of
  silently using the new values (control: the same backward without the write runs);
- a call with a tensor that requires grad, in grad mode, is refused by name (the ops have no backward); under
  torch.no_grad() / torch.inference_mode() the same call runs;
- two tokens mapped to one cache slot are refused naming both (which write lands last depends on the thread count
  and the run); padding slots (-1) may repeat. On the CPU and the emulated GPUs (a host slot mapping).
"""

import pytest
import torch

import aligned_ops
from aligned_ops.testing import bits

ops = torch.ops.aligned
BLOCKS, BLOCK, HKV, D = 2, 4, 2, 8
LATENT, ROPE = 12, 4


def _kv_write(slots, k_cache=None, v_cache=None, k=None):
    n = len(slots)
    k = torch.ones(n, HKV, D) if k is None else k
    kc = torch.zeros(BLOCKS, BLOCK, HKV, D) if k_cache is None else k_cache
    vc = torch.zeros(BLOCKS, BLOCK, HKV, D) if v_cache is None else v_cache
    ops.reshape_and_cache(k, torch.ones(n, HKV, D), kc, vc, torch.tensor(slots, dtype=torch.int64))
    return kc, vc


def _mla_write(slots, cache=None, kv_c=None):
    n = len(slots)
    cache = torch.zeros(BLOCKS, BLOCK, LATENT + ROPE) if cache is None else cache
    kv_c = torch.ones(n, LATENT) if kv_c is None else kv_c
    ops.mla_reshape_and_cache(kv_c, torch.ones(n, ROPE), cache, torch.tensor(slots, dtype=torch.int64))
    return cache


CU = torch.tensor([0, 3, 5], dtype=torch.int32)


def _plan_buffers():
    p = aligned_ops.AttentionPlan().ensure(*aligned_ops.attention_plan_size(CU, CU, None, 2, 1, D, True))
    return p.plan, p.table, p.info, p.workspace_floats


def _plan(plan, table, info, workspace):
    ops.attention_plan(plan, table, info, CU, CU, None, 2, 1, D, True, 0, 0, workspace)


def test_every_written_tensor_gets_a_new_version():
    kc, vc = torch.zeros(BLOCKS, BLOCK, HKV, D), torch.zeros(BLOCKS, BLOCK, HKV, D)
    _kv_write([0, 5], kc, vc)
    assert (kc._version, vc._version) == (1, 1)
    cache = torch.zeros(BLOCKS, BLOCK, LATENT + ROPE)
    _mla_write([1, 6], cache)
    assert cache._version == 1
    plan, table, info, workspace = _plan_buffers()
    before = (plan._version, table._version, info._version)
    _plan(plan, table, info, workspace)
    assert (plan._version, table._version, info._version) == tuple(v + 1 for v in before)


@pytest.mark.parametrize("write", ["reshape_and_cache", "mla_reshape_and_cache"])
def test_backward_through_a_tensor_saved_before_the_write_raises(write):
    """y = sum(cache * w) saves the cache; writing into it afterwards must make y.backward() raise (it would use
    the new values: w.grad would be the written rows, not the zeros y was computed from)."""
    cache = torch.zeros(BLOCKS, BLOCK, HKV, D) if write == "reshape_and_cache" else torch.zeros(BLOCKS, BLOCK,
                                                                                                LATENT + ROPE)

    def run(do_write):
        w = torch.ones_like(cache, requires_grad=True)
        y = (cache * w).sum()
        if do_write:
            if write == "reshape_and_cache":
                _kv_write([0, 5], cache, torch.zeros_like(cache))
            else:
                _mla_write([1, 6], cache)
        y.backward()
        return w.grad

    assert run(False).abs().sum() == 0  # control: without the write the same backward runs (the zeros' gradient)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(True)


def test_exact_weight_cache_sees_a_cache_write():
    """The exact profile caches a weight's packing by its version: a weight that is a view of a cache written by
    reshape_and_cache must be repacked (cached == fresh after the write)."""
    kc = torch.zeros(BLOCKS, BLOCK, HKV, D, dtype=torch.bfloat16)
    weight = kc.view(-1, D)[:6]  # a [6, 8] view of the cache
    assert aligned_ops.cache_exact_weights(weight) == 1  # its packing is kept across calls while its version holds
    x = torch.randn(3, D, dtype=torch.bfloat16)
    aligned_ops.linear_exact(x, weight)  # packs and caches the zeros
    k = torch.randn(2, HKV, D, dtype=torch.bfloat16)
    ops.reshape_and_cache(k, k, kc, torch.zeros_like(kc), torch.tensor([0, 1]))
    cached = aligned_ops.linear_exact(x, weight)
    fresh = aligned_ops.linear_exact(x, weight.clone())
    assert torch.equal(bits(cached), bits(fresh))
    assert bits(cached).ne(0).any()  # the written rows count (not the stale zeros)


@pytest.mark.parametrize("which", ["leaf cache", "input"])
def test_a_tensor_that_requires_grad_is_refused_by_name_in_grad_mode(which):
    kc = torch.zeros(BLOCKS, BLOCK, HKV, D, requires_grad=which == "leaf cache")
    k = torch.ones(2, HKV, D, requires_grad=which == "input") * 1
    arg = "k_cache" if which == "leaf cache" else "k"
    with pytest.raises(RuntimeError, match=f"aligned::reshape_and_cache: {arg} requires grad, but the op writes into "
                                           "its arguments and has no backward"):
        _kv_write([0, 5], kc, k=k)
    with torch.no_grad():  # control: the same call outside grad mode runs
        _kv_write([0, 5], kc, k=k)
    cache = torch.zeros(BLOCKS, BLOCK, LATENT + ROPE, requires_grad=which == "leaf cache")
    kv_c = torch.ones(2, LATENT, requires_grad=which == "input") * 1
    arg = "kv_cache" if which == "leaf cache" else "kv_c"
    with pytest.raises(RuntimeError, match=f"aligned::mla_reshape_and_cache: {arg} requires grad"):
        _mla_write([1, 6], cache, kv_c=kv_c)
    with torch.inference_mode():
        _mla_write([1, 6], cache.detach().clone(), kv_c=kv_c.detach())


def test_inference_mode_writes_inference_tensors_and_bumps_normal_ones():
    """Caches allocated under inference mode (inference tensors: no version counter) are written inside it and
    outside it (no_grad, or no guard: an AttentionPlan made in one mode and replanned in another), as before; normal
    tensors written under inference mode (vLLM 0.32's KV cache: allocated outside, written inside) are bumped, as
    torch's own in-place ops do there."""
    with torch.inference_mode():
        kc, vc = _kv_write([0, 5])
        plan = aligned_ops.AttentionPlan().plan_varlen(CU, CU, 2, 1, D, True)
        buffers = _plan_buffers()
        _plan(*buffers)
    assert plan.plan.is_inference() and buffers[0].is_inference()
    assert kc[0, 0].eq(1).all() and kc.is_inference()
    for guard in (torch.no_grad, torch.enable_grad):
        with guard():
            _kv_write([1, 6], kc, vc)  # an inference cache written outside inference mode
            _mla_write([1, 6], torch.inference_mode()(torch.zeros)(BLOCKS, BLOCK, LATENT + ROPE))
            _plan(*buffers)
            plan.plan_varlen(CU, CU, 2, 1, D, True)
    assert kc[0, 1].eq(1).all()
    normal = torch.zeros(BLOCKS, BLOCK, HKV, D)
    with torch.inference_mode():
        _kv_write([0, 5], normal, torch.zeros_like(normal))
    assert normal._version == 1


def test_planned_attention_still_matches_after_replanning():
    """The plan buffers are written by attention_plan (now a versioned write): a plan made, used, remade for another
    batch and used again gives the per-call form's bits each time."""
    q = torch.randn(5, 2, D)
    k = torch.randn(5, 1, D)
    plan = aligned_ops.AttentionPlan()
    for cu in ([0, 3, 5], [0, 1, 5]):
        cu = torch.tensor(cu, dtype=torch.int32)
        plan.plan_varlen(cu, cu, 2, 1, D, True)
        out, _ = ops.attention_varlen_planned(q, k, k, cu, cu, plan.plan, plan.info, plan.workspace_floats, 0.5, True)
        ref, _ = ops.attention_varlen(q, k, k, cu, cu, 0.5, True)
        assert torch.equal(bits(out), bits(ref))


@pytest.mark.parametrize("device", ["cpu", "sm_90", "gfx942"])
def test_two_tokens_in_one_slot_are_refused_naming_both(device):
    """Which of two writes to one slot lands last depends on the thread count and the run: refused, naming both
    tokens; padding (-1) may repeat; the same write with distinct slots runs (control)."""
    import contextlib

    scope = contextlib.nullcontext() if device == "cpu" else aligned_ops.emulate(device)
    with scope:
        with pytest.raises(RuntimeError, match=r"aligned::reshape_and_cache: slot_mapping\[1\] and slot_mapping\[3\] "
                                               r"are both 6: two tokens cannot be written to one cache slot"):
            _kv_write([0, 6, -1, 6])
        with pytest.raises(RuntimeError, match=r"aligned::mla_reshape_and_cache: slot_mapping\[0\] and "
                                               r"slot_mapping\[2\] are both 2"):
            _mla_write([2, 3, 2])
        # a cache with more than 256 slots per written token: found by sorting (above: by a bitmap of the cache)
        big = torch.zeros(1024, BLOCK, HKV, D)
        with pytest.raises(RuntimeError, match=r"slot_mapping\[0\] and slot_mapping\[2\] are both 4000: two tokens"):
            _kv_write([4000, 9, 4000], big, torch.zeros_like(big))
        _kv_write([4000, 9, -1, 4001], big, torch.zeros_like(big))  # control: distinct, not increasing
        # several repeats: both paths name the first token whose slot an earlier one took, and that earlier token
        with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] and slot_mapping\[2\] are both 7: two"):
            _kv_write([5, 7, 7, 5])  # bitmap
        with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] and slot_mapping\[2\] are both 4007: two"):
            _kv_write([4005, 4007, 4007, 4005], big, torch.zeros_like(big))  # sort
        with pytest.raises(RuntimeError, match=r"slot_mapping\[0\] and slot_mapping\[3\] are both 127: two"):
            ops.mla_reshape_and_cache(torch.ones(4, LATENT), torch.ones(4, ROPE), torch.zeros(64, BLOCK, LATENT + ROPE),
                                      torch.tensor([127, 64, 200, 127]))  # bitmap, past its first word
        kc, _ = _kv_write([0, 6, -1, -1, 7])  # controls: distinct slots, repeated padding
        assert kc.view(-1, HKV, D)[[0, 6, 7]].eq(1).all() and kc.view(-1, HKV, D)[[1, 2, 3, 4, 5]].eq(0).all()
        _mla_write([2, 3, -1, -1])


def test_many_tokens_one_slot_no_longer_depend_on_threads():
    """The probe's case: 4000 tokens into slot 0 gave token 3999's row at 1 thread and sometimes token 1999's at 2.
    Now refused whatever the thread count; each token in its own slot gives the same cache at 1 and 2 threads."""
    n = 4000
    k = torch.randn(n, HKV, D)
    slots = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    caches, before = [], torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with pytest.raises(RuntimeError, match="are both 0: two tokens cannot be written to one cache slot"):
                ops.reshape_and_cache(k, k, torch.zeros(1, 4, HKV, D), torch.zeros(1, 4, HKV, D),
                                      torch.zeros(n, dtype=torch.int64))
            kc, vc = torch.zeros(n // 16, 16, HKV, D), torch.zeros(n // 16, 16, HKV, D)
            ops.reshape_and_cache(k, k, kc, vc, slots)
            caches.append(bits(kc))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(caches[0], caches[1])
