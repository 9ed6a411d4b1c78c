"""Qwen2 (``Qwen2ForCausalLM``): the Llama-family decoder layer with biased q/k/v (always) and an unbiased o_proj."""

from __future__ import annotations

from . import decoder
from .base import Architecture, check_head_dim_is_derived


def attention_biases(config) -> tuple[bool, bool]:
    return True, False  # HF Qwen2Attention: q/k/v always biased, o_proj never (attention_bias is not read)


def check_config(config, where: str) -> None:
    if getattr(config, "qk_norm", False):  # vLLM's Qwen2 honours it (BAGEL-style checkpoints); HF's Qwen2 does not
        raise ValueError(f"aligned_ops ({where}): Qwen2 with qk_norm (a vLLM-only variant) is not supported")
    check_head_dim_is_derived(config, where, "Qwen2")


ARCHITECTURE = Architecture(
    name="Qwen2ForCausalLM",
    model_types=("qwen2",),
    block=decoder.block,
    spec=decoder.spec,
    vllm_decoder_layer="vllm.model_executor.models.qwen2:Qwen2DecoderLayer",
    projections=decoder.PROJECTIONS,
    attention_biases=attention_biases,
    sliding_window_switch="use_sliding_window",
    check_config=check_config,
)
