"""The plan/run form of the attention ops on the CPU backend (aligned_ops.AttentionPlan; the GPU side and the
CUDA-graph-safety proof: tests/emulated/test_emulated_attention_plan.py): the same bits as the per-call form, one
plan reused for several layers, clear errors, opcheck and torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal

ops = torch.ops.aligned


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _paged(seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(9, 4, 2, 8, generator=g, dtype=torch.bfloat16)
    vc = torch.randn(9, 4, 2, 8, generator=g, dtype=torch.bfloat16)
    table = torch.tensor([[3, 0, 7, 1], [5, 2, 8, 6]], dtype=torch.int32)
    seq_lens = torch.tensor([13, 2], dtype=torch.int32)
    qsl = cu([6, 1])  # a chunk of 6 new tokens after 7 cached, and a decode token
    q = torch.randn(7, 4, 8, generator=g, dtype=torch.bfloat16)
    return q, kc, vc, table, seq_lens, qsl


def test_one_plan_serves_every_layer_bitwise():
    q, kc, vc, table, seq_lens, qsl = _paged()
    plan = aligned_ops.AttentionPlan().plan_paged(qsl, seq_lens, table, 4, 2, 8, kc.shape[0], 4)
    for layer in range(3):  # different caches / q per layer, one plan
        ql, kl, vl = q * (layer + 1), kc.roll(layer, 0), vc.roll(-layer, 0)
        assert_bitwise_equal(aligned_ops.paged_attention(ql, kl, vl, scale=0.3, plan=plan),
                             ops.paged_attention(ql, kl, vl, table, seq_lens, qsl, 0.3))
    lens = [5, 1, 40]
    g = torch.Generator().manual_seed(1)
    qv, kv, vv = (torch.randn(sum(lens), h, 8, generator=g) for h in (4, 2, 2))
    c = cu(lens)
    vplan = aligned_ops.AttentionPlan().plan_varlen(c, c, 4, 2, 8)
    for a, b in zip(aligned_ops.attention_varlen(qv, kv, vv, c, c, 0.3, plan=vplan),
                    ops.attention_varlen(qv, kv, vv, c, c, 0.3, True)):
        assert_bitwise_equal(a, b)


def test_planned_varlen_gradient_equals_per_call():
    lens = [3, 6]
    c = cu(lens)
    g = torch.Generator().manual_seed(2)
    base = [torch.randn(9, h, 8, generator=g) for h in (4, 2, 2)]
    plan = aligned_ops.AttentionPlan().plan_varlen(c, c, 4, 2, 8)
    grads = []
    for use_plan in (False, True):
        x = [t.clone().requires_grad_(True) for t in base]
        out = aligned_ops.attention_varlen(*x, c, c, 0.3, plan=plan if use_plan else None)[0]
        grads.append(torch.autograd.grad(out.square().sum(), x))
    for a, b in zip(*grads):
        assert_bitwise_equal(a, b)


def test_plan_mismatch_is_a_clear_error():
    q, kc, vc, table, seq_lens, qsl = _paged()
    plan = aligned_ops.AttentionPlan().plan_paged(qsl, seq_lens, table, 4, 2, 8, kc.shape[0], 4)
    with pytest.raises(RuntimeError, match="aligned::paged_attention_planned: plan addresses more query or key rows"):
        aligned_ops.paged_attention(q[:3], kc, vc, scale=0.3, plan=plan)
    with pytest.raises(RuntimeError, match="aligned::paged_attention_planned: plan was made for other heads"):
        aligned_ops.paged_attention(q[:, :2].contiguous(), kc[:, :, :1].contiguous(), vc[:, :, :1].contiguous(),
                                    scale=0.3, plan=plan)
    with pytest.raises(RuntimeError, match="aligned::paged_attention_planned: plan is not an attention plan"):
        aligned_ops.paged_attention(q, kc, vc, scale=0.3, plan=aligned_ops.AttentionPlan(4, 4, 64))


def test_opcheck_and_compile():
    q, kc, vc, table, seq_lens, qsl = _paged()
    plan = aligned_ops.AttentionPlan().plan_paged(qsl, seq_lens, table, 4, 2, 8, kc.shape[0], 4)
    torch.library.opcheck(ops.paged_attention_planned,
                          (q, kc, vc, plan.plan, plan.table, plan.info, plan.workspace_floats, 0.3))
    c = cu([3, 4])
    qv, kv, vv = (torch.randn(7, h, 8) for h in (4, 2, 2))
    vplan = aligned_ops.AttentionPlan().plan_varlen(c, c, 4, 2, 8)
    torch.library.opcheck(ops.attention_varlen_planned,
                          (qv, kv, vv, c, c, vplan.plan, vplan.info, vplan.workspace_floats, 0.3, True))
    fn = torch.compile(lambda x: aligned_ops.paged_attention(x, kc, vc, scale=0.3, plan=plan), fullgraph=True)
    assert_bitwise_equal(fn(q), aligned_ops.paged_attention(q, kc, vc, scale=0.3, plan=plan))
