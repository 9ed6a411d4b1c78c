"""What a vLLM layer carries: the architecture and the linear profile of the engine that built it.

When vLLM builds a layer the plugin hooks, :func:`record_architecture` records on it the model's architecture
(whose :class:`~aligned_ops.models.spec.LayerRules` the hooks look up per call, ``models.rules_of``) and the
engine's linear profile (an :mod:`aligned_ops.profiles` object, read by ``profiles.profile_of``). The profile is
resolved once per engine, when its config is created (``config.py``), and travels to every worker process in
``vllm_config.additional_config[PROFILE_KEY]``; a worker binds it from there, never from its own environment.
"""

from __future__ import annotations

from ... import profiles
from ...models import architecture_of, rules_for

# vllm_config.additional_config key carrying the engine's linear profile name (also a user's explicit choice:
# LLM(..., additional_config={"aligned_ops_linear": "exact"})).
PROFILE_KEY = "aligned_ops_linear"


def engine_profile(vllm_config) -> profiles.Profile:
    """The linear profile of the engine ``vllm_config`` describes: the one its architecture's rules pin, else
    ``additional_config[PROFILE_KEY]`` (set at config creation, or by the user), else ``ALIGNED_OPS_LINEAR``."""
    hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    try:
        rules = rules_for(architecture_of(hf) if hf is not None else None)
    except ValueError:  # an architecture we do not support (refused by the start-up validation): no pin
        rules = rules_for(None)
    extra = getattr(vllm_config, "additional_config", None)
    requested = extra.get(PROFILE_KEY) if isinstance(extra, dict) else None
    return rules.resolve_profile(requested)


def record_architecture(layer) -> None:
    """Remember, on a layer vLLM is building, which architecture's rules it runs and the engine's linear profile.
    vLLM's get_rope caches rotary modules by their shape parameters, not by model, so a second engine in one
    process would reuse the first model's module and what is recorded on it: the plugin clears that cache when it
    creates an engine config (``config._clear_rope_cache``)."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    hf = getattr(getattr(cfg, "model_config", None), "hf_config", None)
    if hf is not None:
        layer._aligned_arch = architecture_of(hf)
        layer._aligned_profile = engine_profile(cfg)
