"""Trainer side of the MoE blocks: HF Qwen3-MoE / Qwen2-MoE sparse blocks through ``aligned::moe_*``.

The op sequence is the one the vLLM plugin runs for the same block (``vllm_plugin._moe_runner_forward``):

    router_logits = aligned::linear(x, gate.weight)  (model dtype; LayerRules.router_profile, fma)
    w, ids, scores = aligned::moe_routing(router_logits, top_k, "softmax", norm_topk_prob)   (fp32)
    out = aligned::moe_experts(x, w, ids, experts.gate_up_proj, experts.down_proj,
                               [shared gate_proj|up_proj, shared down_proj, shared_expert_gate],
                               linear_profile)   (LayerRules.moe_experts: the rules' profile, fma or mma)

Routing records (expert ids and fp32 scores per MoE layer) are collected while a :class:`RoutingRecorder` is
active; the patched model uses them for ``routed_experts`` (diagnostics: routing-flip counts) and for the
load-balancing auxiliary loss, which is then computed from the same fp32 scores the routing used.
"""

from __future__ import annotations

import contextvars

import torch

import aligned_ops

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


def is_moe_block(mlp) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, "gate") and hasattr(mlp.experts, "gate_up_proj")


def check_moe_block(mlp, where: str) -> None:
    """Refuse MoE blocks whose arithmetic the ops do not reproduce."""
    experts = mlp.experts
    if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
        raise ValueError(f"aligned_ops ({where}): MoE experts with biases are not supported")
    if not hasattr(mlp.gate, "weight") or not hasattr(mlp.gate, "top_k"):
        raise ValueError(f"aligned_ops ({where}): unsupported MoE router {type(mlp.gate).__name__}")


def _shared_weights(mlp):
    shared = getattr(mlp, "shared_expert", None)
    if shared is None:
        return None, None, None
    w13 = torch.cat([shared.gate_proj.weight, shared.up_proj.weight], dim=0)
    gate = getattr(mlp, "shared_expert_gate", None)
    return w13, shared.down_proj.weight, (gate.weight if gate is not None else None)


def moe_block_forward(mlp, x: torch.Tensor, rules=None) -> torch.Tensor:
    """One HF sparse MoE block on packed tokens ``x [T, H]`` (differentiable); ``rules``: the model's
    :class:`aligned_ops.model_spec.LayerRules` (the router projection's profile)."""
    from ..model_spec import rules_for

    rules = rules or rules_for(None)
    router = mlp.gate
    logits = rules.router_linear(x, router.weight)
    w, ids, scores = aligned_ops.moe_routing(logits, router.top_k, "softmax", bool(router.norm_topk_prob))
    rec = _recorder.get()
    if rec is not None:
        rec.records.append((ids, scores))
    sw13, sw2, sgate = _shared_weights(mlp)
    return rules.moe_experts(x, w, ids, mlp.experts.gate_up_proj, mlp.experts.down_proj, sw13, sw2, sgate)


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
