"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (q/k norms) and sparse MoE MLPs (softmax top-k routing,
optionally renormalised; dense MLP layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say so)."""

from __future__ import annotations

from . import decoder, moe
from .base import Architecture
from .qwen3 import check_attention_bias


def check_config(config, where: str) -> None:
    moe.check_qwen_moe_config(config, where)
    check_attention_bias(config, where, "Qwen3-MoE")


ARCHITECTURE = Architecture(
    name="Qwen3MoeForCausalLM",
    model_types=("qwen3_moe",),
    block=decoder.block,
    spec=decoder.spec,
    vllm_decoder_layer="vllm.model_executor.models.qwen3_moe:Qwen3MoeDecoderLayer",
    projections=decoder.PROJECTIONS,
    qk_norm=True,
    moe=True,
    sparse_layers=moe.qwen_sparse_layers,
    hf_moe_weights=moe.qwen_hf_moe_weights,
    sliding_window_switch="use_sliding_window",
    check_config=check_config,
    check_hf_model=moe.check_hf_sparse_model,
)
