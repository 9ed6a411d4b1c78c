"""Llama (``LlamaForCausalLM``): the Llama-family decoder layer (``attention_bias`` / ``mlp_bias`` from the config;
Llama-3 RoPE scaling through aligned_ops.rope)."""

from __future__ import annotations

from . import decoder
from .base import Architecture

def check_config(config, where: str) -> None:
    """vLLM's Llama reads two bias switches HF's does not (its loader's support for other checkpoints): ``bias``
    (biases q/k/v/o like ``attention_bias``) and ``qkv_bias`` (overrides the q/k/v bias alone). HF's Llama biases
    all four per ``attention_bias`` only: a config where the two readings differ is refused."""
    attention_bias = bool(getattr(config, "attention_bias", False))
    vllm_o = attention_bias or bool(getattr(config, "bias", False))
    vllm_qkv = bool(config.qkv_bias) if hasattr(config, "qkv_bias") else vllm_o
    if (vllm_qkv, vllm_o) != (attention_bias, attention_bias):
        raise ValueError(f"aligned_ops ({where}): Llama with attention_bias={attention_bias} and "
                         f"bias={getattr(config, 'bias', None)} / qkv_bias={getattr(config, 'qkv_bias', None)} is "
                         f"not supported: vLLM's Llama biases q/k/v={vllm_qkv}, o_proj={vllm_o}; HF's follows "
                         "attention_bias alone")


ARCHITECTURE = Architecture(
    name="LlamaForCausalLM",
    model_types=("llama",),
    block=decoder.block,
    spec=decoder.spec,
    vllm_decoder_layer="vllm.model_executor.models.llama:LlamaDecoderLayer",
    projections=decoder.PROJECTIONS,
    check_config=check_config,
)
