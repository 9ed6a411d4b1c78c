"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention (biased q/k/v per ``qkv_bias``) and sparse MoE MLPs
with a shared expert behind a sigmoid gate (folded into ``moe_experts``)."""

from __future__ import annotations

from . import decoder, moe
from .base import Architecture, check_head_dim_is_derived


def attention_biases(config) -> tuple[bool, bool]:
    return bool(getattr(config, "qkv_bias", True)), False  # HF Qwen2MoeAttention: bias=config.qkv_bias; o_proj none


def check_config(config, where: str) -> None:
    moe.check_qwen_moe_config(config, where)
    if not getattr(config, "qkv_bias", True):  # vLLM's Qwen2-MoE always builds a q/k/v bias
        raise ValueError(f"aligned_ops ({where}): Qwen2-MoE with qkv_bias=False is not supported (vLLM biases q/k/v)")
    check_head_dim_is_derived(config, where, "Qwen2-MoE")
    # HF builds a zero-width shared expert (and its gate) and saves them; vLLM builds none for size 0 and its loader
    # then fails on the checkpoint's shared_expert weights with a traceback
    if not getattr(config, "shared_expert_intermediate_size", 1):
        raise ValueError(f"aligned_ops ({where}): Qwen2-MoE with shared_expert_intermediate_size=0 is not supported "
                         "(vLLM builds no shared expert for it and cannot load the checkpoint's)")


ARCHITECTURE = Architecture(
    name="Qwen2MoeForCausalLM",
    model_types=("qwen2_moe",),
    block=decoder.block,
    spec=decoder.spec,
    vllm_decoder_layer="vllm.model_executor.models.qwen2_moe:Qwen2MoeDecoderLayer",
    projections=decoder.PROJECTIONS,
    moe=True,
    attention_biases=attention_biases,
    sparse_layers=moe.qwen_sparse_layers,
    hf_moe_weights=moe.qwen_hf_moe_weights,
    sliding_window_switch="use_sliding_window",
    check_config=check_config,
    check_hf_model=moe.check_hf_sparse_model,
)
