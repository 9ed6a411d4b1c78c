"""A planned attention run is checked against its plan (issue 21 item 2), on the CPU and on the emulated GPUs:

* attention_varlen(q, k, v, cu_b, cu_b, plan=plan_for_cu_a) with the same token count raises, naming the offsets —
  it used to compute cu_a's segmentation silently (the positive control shows that result differs from cu_b's);
* a plan covering fewer rows than q raises (varlen and paged) — it used to leave the other rows uninitialised;
* the backward checks its cu_seqlens against the plan the forward ran (a copy of its info, so replanning the same
  AttentionPlan before the backward changes nothing), and refuses other offsets;
* a never-planned AttentionPlan, and a plan buffer that holds another plan than its info, are refused.
Errors are asserted by message, results through integer views."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, bits, bitwise_equal

ops = torch.ops.aligned
HQ, HKV, D = 4, 2, 8
TARGETS = [None, "sm_90", "gfx942"]  # the CPU backend and the GPU glue (emulated, both warp widths)


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def qkv(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, D, generator=g) for h in (HQ, HKV, HKV)]


class _Target:
    def __init__(self, arch):
        self.ctx = aligned_ops.emulate(arch) if arch else None

    def __enter__(self):
        return self.ctx.__enter__() if self.ctx else None

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc) if self.ctx else False


def _paged(seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(9, 4, HKV, D, generator=g)
    vc = torch.randn(9, 4, HKV, D, generator=g)
    table = torch.tensor([[3, 0, 7, 1], [5, 2, 8, 6]], dtype=torch.int32)
    seq_lens = torch.tensor([13, 2], dtype=torch.int32)
    qsl = cu([6, 1])
    q = torch.randn(7, HQ, D, generator=g)
    return q, kc, vc, table, seq_lens, qsl


@pytest.mark.parametrize("arch", TARGETS)
def test_varlen_plan_of_other_offsets_with_the_same_token_count_is_refused(arch):
    cu_a, cu_b = cu([5, 7]), cu([8, 4])  # 12 tokens each, another segmentation
    q, k, v = qkv(12)
    with _Target(arch):
        plan_a = aligned_ops.AttentionPlan().plan_varlen(cu_a, cu_a, HQ, HKV, D)
        with pytest.raises(RuntimeError, match=r"aligned::attention_varlen_planned: cu_seqlens_q / cu_seqlens_k are "
                                               r"not the offsets the plan was made from"):
            aligned_ops.attention_varlen(q, k, v, cu_b, cu_b, 0.3, plan=plan_a)
        # only k's offsets differ (cu_q the same): refused too
        with pytest.raises(RuntimeError, match="cu_seqlens_q / cu_seqlens_k are not the offsets"):
            aligned_ops.attention_varlen(q, k, v, cu_a, cu([4, 8]), 0.3, causal=False,
                                         plan=aligned_ops.AttentionPlan().plan_varlen(cu_a, cu_a, HQ, HKV, D, False))
        # the plan of these offsets runs, and equals the per-call form; the plan of cu_a would have computed
        # another result (positive control: the refusal guards against a real difference)
        plan_b = aligned_ops.AttentionPlan().plan_varlen(cu_b, cu_b, HQ, HKV, D)
        out_b = aligned_ops.attention_varlen(q, k, v, cu_b, cu_b, 0.3, plan=plan_b)[0]
        assert_bitwise_equal(out_b, aligned_ops.attention_varlen(q, k, v, cu_b, cu_b, 0.3)[0])
        out_a = aligned_ops.attention_varlen(q, k, v, cu_a, cu_a, 0.3, plan=plan_a)[0]
        assert not torch.equal(bits(out_a), bits(out_b))


@pytest.mark.parametrize("arch", TARGETS)
def test_plan_covering_fewer_rows_than_q_is_refused(arch):
    q, k, v = qkv(12)
    c = cu([5, 7])
    q_more, k_more, v_more = (torch.cat([t, t[:3]]) for t in (q, k, v))  # 15 rows, the plan covers 12
    with _Target(arch):
        plan = aligned_ops.AttentionPlan().plan_varlen(c, c, HQ, HKV, D)
        with pytest.raises(RuntimeError, match=r"aligned::attention_varlen_planned: plan covers fewer query rows "
                                               r"than q has"):
            ops.attention_varlen_planned(q_more, k_more, v_more, cu([5, 10]), cu([5, 10]), plan.plan, plan.info,
                                         plan.workspace_floats, 0.3, True)
        pq, kc, vc, table, seq_lens, qsl = _paged()
        pplan = aligned_ops.AttentionPlan().plan_paged(qsl, seq_lens, table, HQ, HKV, D, kc.shape[0], 4)
        with pytest.raises(RuntimeError, match=r"aligned::paged_attention_planned: plan covers fewer query rows "
                                               r"than q has"):
            aligned_ops.paged_attention(torch.cat([pq, pq[:2]]), kc, vc, scale=0.3, plan=pplan)
        # the exact row count runs (positive control)
        assert_bitwise_equal(aligned_ops.paged_attention(pq, kc, vc, scale=0.3, plan=pplan),
                             ops.paged_attention(pq, kc, vc, table, seq_lens, qsl, 0.3))


@pytest.mark.parametrize("arch", TARGETS)
def test_backward_uses_the_plan_the_forward_ran(arch):
    cu_a, cu_b = cu([5, 7]), cu([8, 4])
    q, k, v = qkv(12, seed=1)
    with _Target(arch):
        plan = aligned_ops.AttentionPlan().plan_varlen(cu_a, cu_a, HQ, HKV, D)
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = aligned_ops.attention_varlen(*x, cu_a, cu_a, 0.3, plan=plan)[0]
        plan.plan_varlen(cu_b, cu_b, HQ, HKV, D)  # the same object replanned before the backward: no effect
        grads = torch.autograd.grad(out.square().sum(), x)
        y = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = torch.autograd.grad(aligned_ops.attention_varlen(*y, cu_a, cu_a, 0.3)[0].square().sum(), y)
        for a, b in zip(grads, ref):
            assert_bitwise_equal(a, b)
        # the backward op given the forward's plan refuses other offsets (same token count)
        plan_a = aligned_ops.AttentionPlan().plan_varlen(cu_a, cu_a, HQ, HKV, D)
        o, lse = ops.attention_varlen(q, k, v, cu_a, cu_a, 0.3, True)
        with pytest.raises(RuntimeError, match=r"aligned::attention_varlen_backward: cu_seqlens_q / cu_seqlens_k are "
                                               r"not the offsets the forward's plan was made from"):
            ops.attention_varlen_backward(torch.ones_like(o), q, k, v, o, lse, cu_b, cu_b, 0.3, True, plan_a.info)
        with pytest.raises(RuntimeError, match=r"aligned::attention_varlen_backward: the forward's plan was made for "
                                               r"another problem"):
            ops.attention_varlen_backward(torch.ones_like(o), q, k, v, o, lse, cu_a, cu_a, 0.3, False, plan_a.info)
        dq = ops.attention_varlen_backward(torch.ones_like(o), q, k, v, o, lse, cu_a, cu_a, 0.3, True, plan_a.info)
        dq_ref = ops.attention_varlen_backward(torch.ones_like(o), q, k, v, o, lse, cu_a, cu_a, 0.3, True)
        for a, b in zip(dq, dq_ref):
            assert_bitwise_equal(a, b)


@pytest.mark.parametrize("arch", TARGETS)
def test_unplanned_and_crossed_plans_are_refused(arch):
    q, k, v = qkv(12)
    c, c2 = cu([5, 7]), cu([6, 6])
    with _Target(arch):
        with pytest.raises(RuntimeError, match="aligned::attention_varlen_planned: plan is not an attention plan"):
            aligned_ops.attention_varlen(q, k, v, c, c, 0.3, plan=aligned_ops.AttentionPlan(8, 8, 4096))
        a = aligned_ops.AttentionPlan().plan_varlen(c, c, HQ, HKV, D)
        b = aligned_ops.AttentionPlan().plan_varlen(c2, c2, HQ, HKV, D)
        crossed = SimpleNamespace(plan=b.plan, info=a.info, workspace_floats=max(a.workspace_floats,
                                                                                 b.workspace_floats))
        if arch is None:  # the host buffer is read here: a clear error
            with pytest.raises(RuntimeError, match="aligned::attention_varlen_planned: plan buffer holds another "
                                                   "plan than plan_info"):
                aligned_ops.attention_varlen(q, k, v, c, c, 0.3, plan=crossed)
        else:  # on a device only the kernels see the buffer, and it is the plan (a replayed CUDA graph's buffer is
            # rewritten every step): the buffer's segmentation runs — == b's per-call result, not a's, no error.
            # What does not fit the tensors is NaN + the error word (test_emulated_attention_plan.py).
            aligned_ops.check_device_errors(q)
            out, lse = aligned_ops.attention_varlen(q, k, v, c, c, 0.3, plan=crossed)
            aligned_ops.check_device_errors(q)
            ref_b, lse_b = ops.attention_varlen(q, k, v, c2, c2, 0.3, True)
            ref_a, _ = ops.attention_varlen(q, k, v, c, c, 0.3, True)
            assert_bitwise_equal(out, ref_b)
            assert_bitwise_equal(lse, lse_b)
            assert not bitwise_equal(out, ref_a)  # the two segmentations differ (the comparison can fail)
        with pytest.raises(RuntimeError, match="aligned::attention_varlen_planned: plan_info must be a contiguous "
                                               r"int64 \[13\]"):
            ops.attention_varlen_planned(q, k, v, c, c, a.plan, a.info[:5], a.workspace_floats, 0.3, True)


def test_plan_layout_is_the_buffers_the_planner_writes():
    rows, cols, info_len = ops.attention_plan_layout(5)
    plan = aligned_ops.AttentionPlan(capacity=5)
    assert tuple(plan.plan.shape) == (rows, cols) and plan.info.shape == (info_len,) and plan.info.device.type == "cpu"
    with pytest.raises(RuntimeError, match="aligned::attention_plan_layout: capacity must be >= 0"):
        ops.attention_plan_layout(-1)
