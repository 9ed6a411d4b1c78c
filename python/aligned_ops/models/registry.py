"""The architecture registry: every supported architecture by name, and the per-call lookup of its rules.

:data:`ARCHITECTURES` is filled by :mod:`aligned_ops.models` (its ``__init__`` holds the one list) and read by
everything that needs to know what is supported: the trainer patch, the vLLM plugin's start-up validation and
decoder-layer overrides, the CLI's model-folder check, ``model_spec``. :data:`RULES` maps each name to its
:class:`~aligned_ops.models.spec.LayerRules` (the same dict ``aligned_ops.model_spec.RULES`` names; tests change
an entry to show both sides follow it).
"""

from __future__ import annotations

from .base import Architecture
from .spec import DECODER_RULES, LayerRules, ModelSpec

ARCHITECTURES: dict[str, Architecture] = {}
RULES: dict[str, LayerRules] = {}


def register(arch: Architecture) -> Architecture:
    if arch.name in ARCHITECTURES and ARCHITECTURES[arch.name] is not arch:
        raise ValueError(f"aligned_ops.models: architecture {arch.name!r} is already registered")
    ARCHITECTURES[arch.name] = arch
    RULES.setdefault(arch.name, arch.rules)
    return arch


def supported() -> tuple[str, ...]:
    """Every supported architecture name, in registration order."""
    return tuple(ARCHITECTURES)


def get(name: str, where: str = "aligned_ops") -> Architecture:
    """The :class:`Architecture` named ``name``; ``ValueError`` naming the supported ones otherwise."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"aligned_ops ({where}): unsupported architecture {name!r}; supported: "
                         f"{', '.join(supported())}") from None


def rules_for(architecture: str | None) -> LayerRules:
    """The :class:`LayerRules` of ``architecture`` (None: a layer whose model is not known, the decoder rules)."""
    if architecture is None:
        return DECODER_RULES
    try:
        return RULES[architecture]
    except KeyError:
        raise ValueError(f"aligned_ops.model_spec: no layer rules for architecture {architecture!r}") from None


def rules_of(layer) -> LayerRules:
    """The rules of a layer (a patched trainer module or a hooked vLLM layer), looked up now from the
    architecture recorded on it (``_aligned_arch``; none recorded: the decoder rules). In vLLM's compiled mode
    "now" is when the forward is traced, once."""
    return rules_for(getattr(layer, "_aligned_arch", None))


def architecture_of(config) -> str:
    """The architecture name of a HF config (``architectures[0]``, or derived from the config class)."""
    archs = list(getattr(config, "architectures", None) or [])
    if archs:
        return archs[0]
    name = type(config).__name__  # a config built in memory: Qwen2Config -> Qwen2ForCausalLM
    return name[: -len("Config")] + "ForCausalLM" if name.endswith("Config") else name


def model_spec(config, profile=None) -> ModelSpec:
    """The aligned op sequence of one forward of a supported causal LM (HF config): its architecture's ``spec``
    under its rules and the linear profile (``profile``, else the rules' pin, else ``ALIGNED_OPS_LINEAR``)."""
    name = architecture_of(config)
    arch = get(name, "model_spec")
    rules = rules_for(name)
    steps = arch.spec(arch, config, rules, rules.resolve_profile(profile))
    H, Hq = config.hidden_size, config.num_attention_heads
    return ModelSpec(name, H, Hq, getattr(config, "num_key_value_heads", None) or Hq,
                     getattr(config, "head_dim", None) or H // Hq, config.intermediate_size, config.vocab_size,
                     config.num_hidden_layers, arch.attention_biases(config)[0],
                     arch.qk_norm or bool(getattr(config, "use_qk_norm", False)),
                     float(config.rms_norm_eps), tuple(steps))
