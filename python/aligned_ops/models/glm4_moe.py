"""GLM-4.5 / GLM-4.5-Air (``Glm4MoeForCausalLM``): the Llama-family decoder layer (q/k/v biased per
``attention_bias``, o_proj unbiased, per-head q/k RMSNorm when ``use_qk_norm``, NeoX rotary on the first
``partial_rotary_factor`` (0.5) of each head) with DeepSeek-V3's MoE: grouped sigmoid routing on fp32 router
logits with the fp32 correction bias (``aligned::moe_grouped_routing``), ``routed_scaling_factor``, routed + shared
experts (one ungated shared expert of ``n_shared_experts * moe_intermediate_size``), dense layers before
``first_k_dense_replace``.

HF 5.19 and vLLM 0.32 compute the same function: HF's router is ``F.linear(h.float(), W.float())``, vLLM's
``GateLinear`` keeps W in fp32 (an exact widening of the checkpoint's) with fp32 logits; HF adds the shared expert's
output to the rounded routed output, vLLM scales the combined output by the routed scaling factor
(``apply_routed_scale_to_output``) — both sides here run moe.h's one fp32 combine instead. vLLM runs the router
before its fused-MoE layer and passes the fp32 logits in (the plugin's ``GateLinear`` hook computes them as the
trainer does: ``linear(x.float(), W.float())``).
"""

from __future__ import annotations

from . import decoder
from .base import Architecture
from .deepseek_v3 import check_grouped_moe, hf_moe_weights, refit_weights, sparse_layers

NAME = "Glm4MoeForCausalLM"


def attention_biases(config) -> tuple[bool, bool]:
    return bool(getattr(config, "attention_bias", False)), False  # HF/vLLM: q/k/v per attention_bias, o_proj none


def check_config(config, where: str) -> None:
    """DeepSeek-V3's routing checks (GLM's config has no scoring_func / topk_method: sigmoid + noaux_tc implied)."""
    check_grouped_moe(config, where, NAME)
    # vLLM's Glm4MoeForCausalLM takes its MoE parameters from a sparse layer and fails building without one
    # (RuntimeError 'No Glm4MoE layer found in model.layers.', after start-up); HF's runs an all-dense model.
    dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    if dense >= int(config.num_hidden_layers):
        raise ValueError(f"aligned_ops ({where}): {NAME} with first_k_dense_replace={dense} >= num_hidden_layers="
                         f"{config.num_hidden_layers} (no MoE layer) is not supported: vLLM's {NAME} needs at least "
                         "one MoE layer")
    if not getattr(config, "head_dim", None):
        raise ValueError(f"aligned_ops ({where}): {NAME} needs head_dim in the config (vLLM reads config.head_dim)")


ARCHITECTURE = Architecture(
    name=NAME,
    model_types=("glm4_moe",),
    block=decoder.block,
    spec=decoder.spec,
    vllm_decoder_layer="vllm.model_executor.models.glm4_moe:Glm4MoeDecoderLayer",
    projections=decoder.PROJECTIONS,
    qk_norm=False,  # per model: config.use_qk_norm (decoder.block reads the attention module's use_qk_norm)
    moe=True,
    attention_biases=attention_biases,
    sparse_layers=sparse_layers,
    hf_moe_weights=hf_moe_weights,
    check_config=check_config,
    required_config=("n_group", "topk_group", "num_experts_per_tok"),
    partial_rotary=True,
    grouped_routing=True,
    refit_weights=refit_weights,
    fp32_weights=("e_score_correction_bias",),
)
