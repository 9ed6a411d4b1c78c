"""Llama (``LlamaForCausalLM``): the Llama-family decoder layer (``attention_bias`` / ``mlp_bias`` from the config;
Llama-3 RoPE scaling through aligned_ops.rope)."""

from __future__ import annotations

from . import decoder
from .base import Architecture

ARCHITECTURE = Architecture(
    name="LlamaForCausalLM",
    block=decoder.block,
    spec=decoder.spec,
    vllm_decoder_layer="vllm.model_executor.models.llama:LlamaDecoderLayer",
    projections=decoder.PROJECTIONS,
)
