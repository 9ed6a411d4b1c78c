"""Trainer patch: one attention plan per forward, from host cu_seqlens, reused by every layer; the same bits and
gradients as planning per layer (the per-call op). The plan form's negative controls (copies, launches) are in
tests/emulated/test_emulated_attention_plan.py."""

import pytest
import torch

import aligned_ops
from aligned_ops.integrations import hf
from aligned_ops.integrations.hf import completion_logprobs, patch_model
from aligned_ops.testing import assert_bitwise_equal
from aligned_ops.testing.rollouts import padded_batch, random_sequences
from aligned_ops.testing.tiny_model import build_tiny_qwen2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = build_tiny_qwen2(tmp_path_factory.mktemp("hfplan") / "m", torch.float32, seed=5)
    return patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32))


def test_one_plan_per_forward_same_bits_and_gradients(model, monkeypatch):
    seqs = random_sequences([7, 40, 3], 1)
    ids, mask, cm, _ = padded_batch(seqs, [1, 5, 1])
    plans, runs = [], []
    real_plan, real_run = aligned_ops.AttentionPlan.plan_varlen, torch.ops.aligned.attention_varlen_planned

    def spy_plan(self, cu_q, cu_k, *a, **k):
        plans.append((cu_q.device.type, cu_k.device.type))
        return real_plan(self, cu_q, cu_k, *a, **k)

    monkeypatch.setattr(aligned_ops.AttentionPlan, "plan_varlen", spy_plan)

    def score():
        model.zero_grad()
        lp = completion_logprobs(model, ids, cm, attention_mask=mask, temperature=0.8)
        lp.sum().backward()
        return lp.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    lp_plan, g_plan = score()
    n_layers = len(model.model.layers)
    assert plans == [("cpu", "cpu")], f"one plan per forward from host cu_seqlens, got {plans} ({n_layers} layers)"
    monkeypatch.setattr(hf._ForwardPlans, "get", lambda self, *a: None)  # plan inside every call, per layer
    lp_call, g_call = score()
    assert len(plans) == 1
    assert_bitwise_equal(lp_plan, lp_call)
    assert len(g_plan) == len(g_call) > 0
    for a, b in zip(g_plan, g_call):
        assert_bitwise_equal(a, b)
