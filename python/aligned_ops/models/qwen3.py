"""Qwen3 (``Qwen3ForCausalLM``): the Llama-family decoder layer with per-head q/k RMSNorm before rotary."""

from __future__ import annotations

from . import decoder
from .base import Architecture

ARCHITECTURE = Architecture(
    name="Qwen3ForCausalLM",
    block=decoder.block,
    spec=decoder.spec,
    vllm_decoder_layer="vllm.model_executor.models.qwen3:Qwen3DecoderLayer",
    projections=decoder.PROJECTIONS,
    qk_norm=True,
)
