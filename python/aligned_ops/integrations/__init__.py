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

from types import SimpleNamespace

from ..models import ARCHITECTURES
from ..sampling_rules import finite_in_float32

# Derived from the one list in aligned_ops.models (kept under these names for callers that used them).
SUPPORTED_ARCHITECTURES = tuple(name for name, arch in ARCHITECTURES.items() if not arch.moe)
# Mixture-of-experts architectures (routing + experts through aligned::moe_*).
MOE_ARCHITECTURES = tuple(name for name, arch in ARCHITECTURES.items() if arch.moe)
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


def rope_theta_of(config) -> float:
    """The RoPE base of a HF config (transformers 5 keeps it in ``rope_parameters``), as
    :func:`aligned_ops.rope.hf_rope_theta` reads it."""
    from ..rope import hf_rope_theta

    return hf_rope_theta(config)


# The shape fields every check (and both sides) read, which HF's config class would fill from its own defaults: a
# raw config.json (``aligned-ops verify/train/demo --model``, a SimpleNamespace of its fields) must set them.
REQUIRED_CONFIG_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                          "max_position_embeddings")
# Integer fields the checks read (name -> smallest value), checked where set (and not null). The minimum is 0 where
# the checks themselves read 0 as "none" / "the default" (``n_group or 1``). decoder_sparse_step 0: HF's and vLLM's
# Qwen-MoE divide by it building the model (ZeroDivisionError), so it is refused by name.
INT_CONFIG_FIELDS = {
    "hidden_size": 1, "num_attention_heads": 1, "num_hidden_layers": 1, "vocab_size": 1,
    "max_position_embeddings": 1, "head_dim": 1, "num_key_value_heads": 1, "intermediate_size": 1,
    "num_experts": 0, "num_local_experts": 0, "n_routed_experts": 0, "num_experts_per_tok": 0,
    "moe_intermediate_size": 1, "shared_expert_intermediate_size": 0, "n_shared_experts": 0, "decoder_sparse_step": 1,
    "first_k_dense_replace": 0, "moe_layer_freq": 0, "n_group": 0, "topk_group": 0,
    "kv_lora_rank": 1, "q_lora_rank": 1, "qk_nope_head_dim": 0, "qk_rope_head_dim": 1, "v_head_dim": 1,
}


def check_architectures_field(config, where: str) -> None:
    """``architectures``, where set: a list of class names (what the registry looks the first one up by)."""
    archs = getattr(config, "architectures", None)
    if archs is not None and (not isinstance(archs, (list, tuple)) or not all(isinstance(a, str) for a in archs)):
        raise ValueError(f"aligned_ops ({where}): config field architectures must be a list of class names "
                         f"(e.g. [\"Qwen2ForCausalLM\"]), got {archs!r}")


def check_config_fields(config, where: str, arch) -> None:
    """Raise ``ValueError`` naming the field for a config whose fields the checks cannot read: a missing shape field
    (:data:`REQUIRED_CONFIG_FIELDS`, and ``arch.required_config``), an integer field that is not one or is too small
    (:data:`INT_CONFIG_FIELDS`), rope parameters that are not a mapping. A config object of ``transformers`` always
    passes the presence checks (its class has defaults); a raw config.json may not. (``architectures``: checked by
    :func:`check_hf_config` before it looks the architecture up, with :func:`check_architectures_field`.)"""
    for name in REQUIRED_CONFIG_FIELDS + tuple(arch.required_config):
        if not hasattr(config, name):
            raise ValueError(f"aligned_ops ({where}): config has no {name} (a {arch.name} config must set it)")
    for name, lo in INT_CONFIG_FIELDS.items():
        value = getattr(config, name, None)
        if value is None and name not in REQUIRED_CONFIG_FIELDS:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < lo:
            raise ValueError(f"aligned_ops ({where}): config field {name} must be an integer >= {lo}, got {value!r}")
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(config, name, None)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"aligned_ops ({where}): config field {name} must be a mapping (JSON object), got "
                             f"{value!r}")
    dense = getattr(config, "mlp_only_layers", None)
    if dense is not None and (not isinstance(dense, (list, tuple))
                              or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense)):
        raise ValueError(f"aligned_ops ({where}): config field mlp_only_layers must be a list of layer indices, got "
                         f"{dense!r}")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and (not isinstance(layer_types, (list, tuple))
                                    or not all(isinstance(t, str) for t in layer_types)):
        raise ValueError(f"aligned_ops ({where}): config field layer_types must be a list of layer kinds, got "
                         f"{layer_types!r}")
    theta = getattr(config, "rope_theta", None)
    if theta is not None and (not isinstance(theta, (int, float)) or isinstance(theta, bool)):
        raise ValueError(f"aligned_ops ({where}): config field rope_theta must be a number, got {theta!r}")
    act = getattr(config, "hidden_act", None)
    if act is not None and not isinstance(act, str):
        raise ValueError(f"aligned_ops ({where}): config field hidden_act must be a name, got {act!r}")
    if getattr(config, "is_causal", None) is False:
        # HF's attention reads it as bidirectional; vLLM's (and the aligned) attention is causal
        raise ValueError(f"aligned_ops ({where}): config field is_causal=False (bidirectional attention) is not "
                         "supported: the aligned and the vLLM engine's attention are causal")
    eps = getattr(config, "rms_norm_eps", None)
    if eps is not None and (not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0
                            or not finite_in_float32(eps)):
        # the norm ops' own rule (csrc/torch/checks/dense.h check_eps), here before a model is built
        raise ValueError(f"aligned_ops ({where}): config field rms_norm_eps must be a number >= 0 and finite in "
                         f"float32, got {eps!r}")
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if kv_heads is not None and heads % kv_heads and getattr(config, "kv_lora_rank", None) is None:
        # both sides' grouped-query attention shares each KV head among heads // kv_heads query heads (MLA, which
        # has kv_lora_rank, has no KV heads: vLLM does not read the field)
        raise ValueError(f"aligned_ops ({where}): config field num_key_value_heads ({kv_heads}) must divide "
                         f"num_attention_heads ({heads})")


def _transformers_class_of(model_type) -> str | None:
    """The causal-LM class transformers builds for ``model_type``, read from its auto mapping where that is already
    imported (a transformers model object, vLLM: importing either imports it); None otherwise, so the raw config.json
    check (``--model``) stays transformers-free (importing it takes seconds)."""
    import sys

    auto = sys.modules.get("transformers.models.auto.modeling_auto")
    names = getattr(auto, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", None) or {}
    return names.get(model_type) if isinstance(model_type, str) else None


def check_same_architecture(config, where: str, arch, from_class: bool = False) -> None:
    """Raise ``ValueError`` where the config would make the two sides build different architectures: vLLM builds
    ``architectures[0]``; transformers (``AutoModelForCausalLM``) builds the class of ``model_type``; a model object
    is run as the architecture of its class (``from_class``: ``arch`` is that one). A qwen2 config naming
    LlamaForCausalLM ran Qwen2 in the trainer and Llama in vLLM: 0 % bitwise, no warning. A model_type is compared
    where this library knows its architecture (``Architecture.model_types``) or transformers' mapping is loaded
    (:func:`_transformers_class_of`); a model_type neither knows (a custom registered class) is not refused here."""
    archs = list(getattr(config, "architectures", None) or [])
    if archs and archs[0] != arch.name and archs[0] in ARCHITECTURES:
        raise ValueError(f"aligned_ops ({where}): the model is a {arch.name}, but its config's architectures names "
                         f"{archs[0]} (the class vLLM builds from it): the two sides would run different models")
    model_type = getattr(config, "model_type", None)
    owner = next((a.name for a in ARCHITECTURES.values() if model_type in a.model_types), None)
    owner = owner or _transformers_class_of(model_type)
    if owner is not None and owner != arch.name:
        named = f"the model is run as {arch.name}" if from_class else f"architectures names {arch.name}"
        raise ValueError(f"aligned_ops ({where}): config model_type {model_type!r} is a {owner} config, but {named} "
                         "(transformers builds the model class of model_type, vLLM that of architectures): the two "
                         "sides would run different models")


def check_hf_config(config, where: str, architecture: str | None = None) -> None:
    """Raise ``ValueError`` for a config whose arithmetic we cannot reproduce bit for bit on both sides.

    ``architecture`` (the model class name, when a model object is at hand) is used when the config does not
    name one: a model built in memory (``Qwen2ForCausalLM(config)``) has ``config.architectures = None``.
    A config whose fields the checks cannot read (missing, of the wrong type: a raw config.json) is refused naming
    the field (:func:`check_config_fields`); a raw config.json (a SimpleNamespace) never gets a check's own
    AttributeError / TypeError, a transformers config object does (its class has every field: that error is a bug
    here).
    """
    from ..models import registry

    check_architectures_field(config, where)
    archs = list(getattr(config, "architectures", None) or [])
    if architecture is not None:
        archs = [architecture]
    name = archs[0] if archs else type(config).__name__
    arch = registry.get(name, where)  # ValueError naming the supported architectures
    check_same_architecture(config, where, arch, from_class=architecture is not None)
    check_config_fields(config, where, arch)
    try:
        _check_hf_config(config, where, arch)
    except (AttributeError, TypeError, KeyError, ZeroDivisionError) as e:
        # A raw config.json (a SimpleNamespace of its fields: --model) with a field the checks above do not cover:
        # one line naming the config. A transformers config object has every field its class defines, so there the
        # same error is this library's bug: raised as it is.
        if not isinstance(config, SimpleNamespace):
            raise
        raise ValueError(f"aligned_ops ({where}): {name} config is not usable ({type(e).__name__}: {e})") from e


def _check_hf_config(config, where: str, arch) -> None:
    arch.check_config(config, where)
    from ..rope import SUPPORTED_ROPE_TYPES, hf_rope_params, rope_spec_from_hf_config, rope_type_of

    params = hf_rope_params(config)
    rope_type = rope_type_of(params)
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
    window = sliding_window_setting(config, arch)
    if window:
        raise ValueError(f"aligned_ops ({where}): sliding-window attention is not supported ({window})")
    qc = getattr(config, "quantization_config", None)
    if qc:
        raise ValueError(f"aligned_ops ({where}): quantized checkpoints are not supported ({qc})")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"aligned_ops ({where}): activation {config.hidden_act!r} is not supported (only silu)")


def sliding_window_setting(config, arch) -> str | None:
    """The config setting that makes vLLM run windowed attention (None: none does); the aligned attention has no
    window. vLLM windows every layer by ``sliding_window`` (0 / null: off), or the layers ``layer_types`` marks
    ``sliding_attention``. Qwen's config classes keep ``sliding_window`` only with ``use_sliding_window``
    (``Architecture.sliding_window_switch``); Llama's keeps it as given and HF's Llama forward ignores it, so a Llama
    config with ``sliding_window: 64`` ran full attention in the trainer while vLLM's engine died building its
    attention ("aligned_ops attention does not support: sliding window", a traceback, not a start-up refusal)."""
    switch = arch.sliding_window_switch
    if switch is not None and getattr(config, switch, False):
        return f"{switch}=True"
    window = getattr(config, "sliding_window", None)
    if window and switch is None:
        return f"sliding_window={window}"
    layer_types = getattr(config, "layer_types", None) or ()
    marked = [i for i, t in enumerate(layer_types) if t != "full_attention"]
    if marked:
        return f"layer_types marks layer {marked[0]} {layer_types[marked[0]]!r}"
    return None


def check_moe_config(config, where: str) -> None:
    """MoE-specific refusals of the Qwen-MoE family (:func:`aligned_ops.models.moe.check_qwen_moe_config`)."""
    from ..models.moe import check_qwen_moe_config

    check_qwen_moe_config(config, where)
