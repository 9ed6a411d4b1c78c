"""Qwen3 (``Qwen3ForCausalLM``): the Llama-family decoder layer with per-head q/k RMSNorm before rotary."""

from __future__ import annotations

from . import decoder
from .base import Architecture

def check_attention_bias(config, where: str, name: str = "Qwen3") -> None:
    """vLLM's Qwen3 / Qwen3-MoE attention biases q/k/v per ``attention_bias`` but builds its o_proj without a bias
    (the checkpoint's ``o_proj.bias`` is skipped at load); HF's adds it. Refused rather than served as two different
    models (found on a tiny Qwen3 with attention_bias=True: 0 % bitwise, no warning)."""
    if getattr(config, "attention_bias", False):
        raise ValueError(f"aligned_ops ({where}): {name} with attention_bias=True is not supported: vLLM's {name} "
                         "attention has no o_proj bias (it drops the checkpoint's), HF's adds it")


ARCHITECTURE = Architecture(
    name="Qwen3ForCausalLM",
    model_types=("qwen3",),
    block=decoder.block,
    spec=decoder.spec,
    vllm_decoder_layer="vllm.model_executor.models.qwen3:Qwen3DecoderLayer",
    projections=decoder.PROJECTIONS,
    qk_norm=True,
    sliding_window_switch="use_sliding_window",
    check_config=check_attention_bias,
)
