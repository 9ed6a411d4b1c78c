"""Integrations: the same model, through the same ``torch.ops.aligned`` ops, in vLLM and in the trainer.

- :mod:`aligned_ops.integrations.hf` — ``patch_model(model)`` turns a Hugging Face causal LM of a supported
  architecture into one whose forward and backward run through ``torch.ops.aligned.*``; ``completion_logprobs``
  gives the teacher-forced per-token log-probs the RL loss needs.
- :mod:`aligned_ops.integrations.vllm` — the vLLM plugin (``vllm.general_plugins`` entry point
  ``aligned_ops.integrations.vllm_plugin:register``, a compatibility name), active when ``ALIGNED_OPS_VLLM=1``;
  routes vLLM's decoder layers, attention backend and returned log-probs through the same ops.
- :mod:`aligned_ops.integrations.rollout` — ``make_llm`` / ``generate_with_logprobs`` / ``refit`` helpers.

Both sides share one definition of each architecture (:mod:`aligned_ops.models`: the decoder layer's block
function both call, its rules, its expected op sequence) and one resolved linear profile per model / engine
(:mod:`aligned_ops.profiles`). See ``docs/integrations.md``.
"""

from __future__ import annotations

from ..models import ARCHITECTURES

# Derived from the one list in aligned_ops.models (kept under these names for callers that used them).
SUPPORTED_ARCHITECTURES = tuple(name for name, arch in ARCHITECTURES.items() if not arch.moe)
# Mixture-of-experts architectures (routing + experts through aligned::moe_*).
MOE_ARCHITECTURES = tuple(name for name, arch in ARCHITECTURES.items() if arch.moe)
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


def rope_theta_of(config) -> float:
    """The RoPE base of a HF config (transformers 5 keeps it in ``rope_parameters``)."""
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        raise ValueError("config has no rope_theta")
    return float(theta)


def check_hf_config(config, where: str, architecture: str | None = None) -> None:
    """Raise ``ValueError`` for a config whose arithmetic we cannot reproduce bit for bit on both sides.

    ``architecture`` (the model class name, when a model object is at hand) is used when the config does not
    name one: a model built in memory (``Qwen2ForCausalLM(config)``) has ``config.architectures = None``.
    """
    from ..models import registry

    archs = list(getattr(config, "architectures", None) or [])
    if architecture is not None:
        archs = [architecture]
    name = archs[0] if archs else type(config).__name__
    arch = registry.get(name, where)  # ValueError naming the supported architectures
    arch.check_config(config, where)
    from ..rope import SUPPORTED_ROPE_TYPES, rope_spec_from_hf_config

    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        params.update({k: v for k, v in scaling.items() if k not in params})
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"aligned_ops ({where}): rope_type {rope_type!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    try:
        spec = rope_spec_from_hf_config(config)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"aligned_ops ({where}): rope parameters {params} are not usable: {e}") from e
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if spec.rotary_dim != head_dim and not arch.partial_rotary:
        # HF's Llama/Qwen2/Qwen3 forward rotates the whole head (no partial rotary): no reference semantics.
        raise ValueError(f"aligned_ops ({where}): partial rotary embeddings are not supported")
    if getattr(config, "use_sliding_window", False):
        raise ValueError(f"aligned_ops ({where}): sliding-window attention is not supported")
    qc = getattr(config, "quantization_config", None)
    if qc:
        raise ValueError(f"aligned_ops ({where}): quantized checkpoints are not supported ({qc})")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"aligned_ops ({where}): activation {config.hidden_act!r} is not supported (only silu)")


def check_moe_config(config, where: str) -> None:
    """MoE-specific refusals of the Qwen-MoE family (:func:`aligned_ops.models.moe.check_qwen_moe_config`)."""
    from ..models.moe import check_qwen_moe_config

    check_qwen_moe_config(config, where)
