"""The sparse MoE block's op sequence, written once, and the Qwen-MoE family's HF side of it.

    router_logits = LayerRules.router_linear(x, router_weight)             (model dtype; router_profile: fma)
    w, ids, scores = aligned::moe_routing(router_logits, top_k, scoring, renormalize)          (fp32)
    out = aligned::moe_experts(x, w, ids, w13, w2, [shared w13, shared w2, shared gate])     (the model's profile:
          Profile.moe_experts — the fma chains, or the mma profile's matrix unit)

:func:`sparse_moe` runs it. The trainer calls it with the HF block's weights (:func:`qwen_hf_moe_weights`,
through ``Architecture.hf_moe_weights``); the vLLM plugin's ``MoERunner`` hook
(:mod:`aligned_ops.integrations.vllm.moe`) calls it with the fused-MoE layer's weights (``w13_weight
[E, 2I, H]`` / ``w2_weight [E, H, I]``, the same layout as HF's ``gate_up_proj`` / ``down_proj``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import aligned_ops


@dataclass(frozen=True)
class MoEWeights:
    """What one sparse MoE block computes with (routing semantics and weights)."""

    router: torch.Tensor | None      # [E, H] (None: the router logits are computed by the caller)
    top_k: int
    scoring: str                     # "softmax" | "sigmoid" (aligned::moe_routing) | "sigmoid_grouped" (below)
    renormalize: bool
    w13: torch.Tensor                # [E, 2I, H] (gate rows, then up rows)
    w2: torch.Tensor                 # [E, H, I]
    shared_w13: torch.Tensor | None = None   # [2Is, H]
    shared_w2: torch.Tensor | None = None    # [H, Is]
    shared_gate: torch.Tensor | None = None  # [1, H] sigmoid gate of the shared expert (Qwen2-MoE)
    # scoring "sigmoid_grouped" (DeepSeek-V3 noaux_tc, aligned::moe_grouped_routing): the fp32 [E] correction bias,
    # the groups, the routed scaling factor
    correction_bias: torch.Tensor | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_dtype: torch.dtype | None = None  # None: the router runs in the model dtype; else x and W cast to it


def sparse_moe(rules, x: torch.Tensor, w: MoEWeights, router_logits: torch.Tensor | None = None,
               record=None, profile=None, experts=None) -> torch.Tensor:
    """One sparse MoE block on packed tokens ``x [T, H]`` (differentiable). ``router_logits``: given when the
    caller computed them (vLLM's Qwen2-MoE block runs its gate before the fused-MoE layer); else computed here
    with ``rules.router_linear``. ``record(ids, scores)``: called with the routing's choices (diagnostics).
    ``profile``: the model's linear profile (an :mod:`aligned_ops.profiles` object; None: ``fma``), whose
    ``moe_experts`` runs the experts' projections. ``experts``: a callable with ``moe_experts``' arguments that
    replaces it (the vLLM plugin's tensor-parallel route: the profile's ``row_parallel_moe_experts``)."""
    if router_logits is not None:
        logits = router_logits
    elif w.router_dtype is not None:
        # the weight's copy in the router dtype is kept per weight state where its owner registered it (the
        # engine's weights: ops.linear_exact.cached_cast), not redone every forward
        from ..ops.linear_exact import cached_cast

        logits = rules.router_linear(x.to(w.router_dtype), cached_cast(w.router, w.router_dtype))
    else:
        logits = rules.router_linear(x, w.router)
    if w.scoring == "sigmoid_grouped":
        weights, ids, scores = aligned_ops.moe_grouped_routing(logits.contiguous(), w.correction_bias, w.top_k,
                                                               w.n_group, w.topk_group, w.renormalize,
                                                               w.routed_scaling_factor)
    else:
        weights, ids, scores = aligned_ops.moe_routing(logits.contiguous(), w.top_k, w.scoring, w.renormalize)
    if record is not None:
        record(ids, scores)
    if experts is None:
        experts = aligned_ops.moe_experts if profile is None else profile.moe_experts
    return experts(x, weights, ids, w.w13, w.w2, w.shared_w13, w.shared_w2, w.shared_gate)


# ---- the Qwen-MoE family on the HF side (Qwen3-MoE, Qwen2-MoE) ---------------------------------------------


def is_hf_sparse_block(mlp) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, "gate") and hasattr(mlp.experts, "gate_up_proj")


def check_hf_sparse_block(mlp, where: str) -> None:
    """Refuse HF MoE blocks whose arithmetic the ops do not reproduce."""
    experts = mlp.experts
    if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
        raise ValueError(f"aligned_ops ({where}): MoE experts with biases are not supported")
    if not hasattr(mlp.gate, "weight") or not hasattr(mlp.gate, "top_k"):
        raise ValueError(f"aligned_ops ({where}): unsupported MoE router {type(mlp.gate).__name__}")


def check_hf_sparse_model(model, where: str) -> None:
    for layer in model.model.layers:
        mlp = getattr(layer, "mlp", None)
        if is_hf_sparse_block(mlp):
            check_hf_sparse_block(mlp, where)


def qwen_hf_moe_weights(mlp) -> MoEWeights:
    """A HF Qwen3-MoE / Qwen2-MoE sparse block's routing and weights (softmax scoring; Qwen2-MoE's shared
    expert with its sigmoid gate folded into ``moe_experts``)."""
    shared = getattr(mlp, "shared_expert", None)
    sw13 = sw2 = sgate = None
    if shared is not None:
        sw13 = torch.cat([shared.gate_proj.weight, shared.up_proj.weight], dim=0)
        sw2 = shared.down_proj.weight
        gate = getattr(mlp, "shared_expert_gate", None)
        sgate = gate.weight if gate is not None else None
    router = mlp.gate
    return MoEWeights(router.weight, router.top_k, "softmax", bool(router.norm_topk_prob), mlp.experts.gate_up_proj,
                      mlp.experts.down_proj, sw13, sw2, sgate)


def check_qwen_moe_config(config, where: str) -> None:
    """MoE-specific refusals (Qwen3-MoE / Qwen2-MoE): only what aligned::moe_* reproduces."""
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts (an attribute_map alias): a raw
    # config.json read by check_model_dir has only that name.
    experts = num_experts(config)
    top_k = getattr(config, "num_experts_per_tok", 0)
    if not (1 <= top_k <= experts):
        raise ValueError(f"aligned_ops ({where}): num_experts_per_tok must be in [1, num_experts], got {top_k}/{experts}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"aligned_ops ({where}): MoE experts need silu, got {config.hidden_act!r}")


def num_experts(config) -> int:
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0) or 0)


def qwen_sparse_layers(config) -> tuple[int, ...]:
    """The layers whose MLP is sparse (HF's and vLLM's rule for Qwen3-MoE / Qwen2-MoE): not in
    ``mlp_only_layers``, experts present, and ``(i + 1) % decoder_sparse_step == 0``."""
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return tuple(i for i in range(config.num_hidden_layers)
                 if i not in dense and num_experts(config) > 0 and (i + 1) % step == 0)
