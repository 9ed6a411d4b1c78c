"""Trainer side of the MoE blocks: HF Qwen3-MoE / Qwen2-MoE sparse blocks through ``aligned::moe_*``.

The op sequence is :func:`aligned_ops.models.moe.sparse_moe`, the one the vLLM plugin's ``MoERunner`` hook runs
for the same block (:mod:`aligned_ops.integrations.vllm.moe`)::

    router_logits = aligned::linear(x, gate.weight)  (model dtype; LayerRules.router_profile, fma)
    w, ids, scores = aligned::moe_routing(router_logits, top_k, "softmax", norm_topk_prob)   (fp32)
    out = aligned::moe_experts(x, w, ids, experts.gate_up_proj, experts.down_proj,
                               [shared gate_proj|up_proj, shared down_proj, shared_expert_gate])

Routing records (expert ids and fp32 scores per MoE layer) are collected while a :class:`RoutingRecorder` is
active; the patched model uses them for ``routed_experts`` (diagnostics: routing-flip counts) and for the
load-balancing auxiliary loss, which is then computed from the same fp32 scores the routing used.
"""

from __future__ import annotations

import contextvars

import torch

from ..models import moe as _moe

_recorder: contextvars.ContextVar = contextvars.ContextVar("aligned_ops_moe_recorder", default=None)


class RoutingRecorder:
    """Collects ``(topk_ids [T, k], scores [T, E])`` of every MoE layer, in layer order, while active."""

    def __init__(self):
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._token = None

    def __enter__(self):
        self._token = _recorder.set(self)
        return self

    def __exit__(self, *exc):
        _recorder.reset(self._token)
        return False


def record_routing(ids: torch.Tensor, scores: torch.Tensor) -> None:
    """Append one MoE layer's choices to the active :class:`RoutingRecorder` (none active: nothing)."""
    rec = _recorder.get()
    if rec is not None:
        rec.records.append((ids, scores))


is_moe_block = _moe.is_hf_sparse_block
check_moe_block = _moe.check_hf_sparse_block


def moe_block_forward(mlp, x: torch.Tensor, rules=None, weights=None, profile=None) -> torch.Tensor:
    """One HF sparse MoE block on packed tokens ``x [T, H]`` (differentiable); ``rules``: the model's
    :class:`aligned_ops.model_spec.LayerRules` (the router projection's profile); ``weights``: the block's
    :class:`aligned_ops.models.moe.MoEWeights` (default: the Qwen-MoE layout); ``profile``: the model's linear
    profile (its ``moe_experts``; default: the one the block carries, ``aligned_ops.profiles.profile_of``)."""
    from ..profiles import profile_of

    from ..models.registry import rules_for

    rules = rules or rules_for(None)
    weights = weights if weights is not None else _moe.qwen_hf_moe_weights(mlp)
    profile = profile if profile is not None else profile_of(mlp)
    return _moe.sparse_moe(rules, x, weights, record=record_routing, profile=profile)
def load_balancing_loss(records, num_experts: int, top_k: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss (HF's ``load_balancing_loss_func``) from the routing's own fp32
    scores and expert choices; padding never enters (the patched model routes only real tokens).

    ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of top-k assignments to expert e and ``P_e`` the mean
    score of expert e, both averaged over every (layer, token) row.
    """
    if not records:
        return torch.zeros((), dtype=torch.float32)
    dev = records[0][1].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=dev)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=dev)
    rows = 0
    for ids, scores in records:
        counts = counts + torch.bincount(ids.reshape(-1), minlength=num_experts).to(torch.float32)
        probs = probs + scores.sum(dim=0)
        rows += scores.shape[0]
    rows = max(rows, 1)
    return torch.sum((counts / rows) * (probs / rows)) * num_experts
