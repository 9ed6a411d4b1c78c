"""vLLM plugin: route a supported model (:mod:`aligned_ops.models`) through ``torch.ops.aligned`` inside vLLM.

Activation: the package declares the entry point ``vllm.general_plugins: aligned_ops =
aligned_ops.integrations.vllm_plugin:register`` (a compatibility name of :func:`register`). vLLM calls it in
every process it starts (API process, engine core, workers); it does nothing unless ``ALIGNED_OPS_VLLM=1`` is
set in the environment. (``aligned_ops.integrations.rollout.make_llm(aligned=True)`` sets it and calls
:func:`install` directly, which also works where the package is not pip-installed.)

What it replaces (for every model vLLM builds in the process afterwards), one module per concern, every change
recorded in the patch registry (``patches.py``: vLLM's out-of-tree ``register_oot`` where vLLM offers it,
a class patch with its reason where it does not):

- ``decoders.py`` — each supported architecture's decoder-layer ``forward`` -> its block function, the one the
  trainer patch calls (why a decoder override: that module's docstring);
- ``layers.py`` — RMSNorm, SiluAndMul, rotary (the shared RoPE table), the linear and LM-head methods (the
  engine's linear profile; plain weights, so refit works);
- ``tp.py`` — tensor parallelism (TP = 2, 4, 8): row-parallel layers on their profile's route, the
  vocab-parallel embedding's exact copy, a guard on vLLM's own TP all-reduce;
- ``moe.py`` — Qwen3-MoE / Qwen2-MoE: the router and the fused-MoE runner through ``models.moe.sparse_moe``;
- ``sampler.py`` — the returned log-probs (``aligned::log_softmax`` at the request's temperature; the
  processed_logprobs truncation recipe);
- ``attention.py`` — the attention backend (``CPU_ATTN`` slot on CPU; ``CUSTOM`` on CUDA/ROCm, selected by
  ``gpu_platform.py``, which replaces the platform's selector or refuses);
- ``mla.py`` — MLA models (DeepSeek-V3 / Kimi-K2) in the absorbed (latent) form, the default: the latent backend
  in vLLM's MLA slot (``CPU_MLA`` / ``AMX_MLA`` on CPU), one 576-value row per token and layer in the KV cache;
  ``ALIGNED_OPS_MLA_FORM=expanded`` (or ``additional_config={"aligned_ops_mla_form": "expanded"}``) selects the
  expanded form (vLLM's non-MLA path). The trainer pairs with ``patch_model(mla_form=engine_mla_form(llm))``;
- ``config.py`` — start-up validation (one ``ValueError`` listing every reason) and the engine's linear profile,
  resolved once and carried to every worker (``bind.py``: what a built layer records).

Covered (tested end to end, ``tests/integrations/test_vllm_rl_features.py``): prefix caching (a cache hit is
one more chunk boundary: attention tiles are aligned to absolute positions), ``n`` samples per prompt,
eviction/preemption, compiled mode (``enforce_eager=False``; vLLM-CPU's inductor compile; bitwise equal to
eager), chunked prefill.
"""

from __future__ import annotations

import os

from . import compat, config, decoders, layers, moe, patches, sampler, tp
from .bind import record_architecture

ENV_VAR = "ALIGNED_OPS_VLLM"
# The same switch under a VLLM_ name: vLLM's Ray executor forwards only VLLM_* variables to its workers, so a
# variable set after ray.init (or outside the actors' runtime_env) still reaches every worker under this name.
ENV_ALIASES = ("VLLM_ALIGNED_OPS",)
# The releases the end-to-end proof ran on; install() accepts [first, last] (compat.py: the gate and every
# per-release difference of the hooks).
SUPPORTED_VLLM_VERSIONS = compat.TESTED_VLLM_VERSIONS

_installed = False


def enabled_by_env() -> bool:
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
               for name in (ENV_VAR, *ENV_ALIASES))


def register() -> None:
    """Entry point for ``vllm.general_plugins``: inert unless ``ALIGNED_OPS_VLLM=1``."""
    if enabled_by_env():
        install()


def is_installed() -> bool:
    return _installed


def check_vllm_version() -> str:
    """The installed vLLM's version; ``RuntimeError`` (one line naming the supported range) outside it."""
    return compat.check_version(compat.installed_version())


def oot_hooks() -> dict:
    """The layers hooked through vLLM's own out-of-tree registry (``register_oot``), with our methods.

    ``register_oot`` matches the exact class name: a subclass of one of these is built stock (not hooked). None
    is used by the supported architectures (RotaryEmbedding, whose variants are subclasses, is a class patch for
    that reason, see ``patches.patched_classes()``)."""
    return {**layers.oot_hooks(), **tp.oot_hooks(), **moe.oot_hooks()}


def install() -> None:
    """Install every hook (idempotent). Raises ``RuntimeError`` on an unsupported vLLM version."""
    global _installed
    if _installed:
        return
    combine = tp.combine_from_env()
    check_vllm_version()
    from vllm.platforms import current_platform

    from . import attention, gpu_platform, mla

    for base, methods in oot_hooks().items():
        patches.register_oot(base, on_init=record_architecture, **methods)
    layers.install()
    decoders.install()
    sampler.install()
    config.install()
    tp.install(combine)
    attention.install()
    mla.install()
    if not current_platform.is_cpu():  # CUDA/ROCm: the platform selects the aligned backend, or refuses
        gpu_platform.install_gpu_attention_selection(current_platform)
    _installed = True


def uninstall() -> None:
    """Restore vLLM's original classes (engines built while installed keep their aligned layers)."""
    global _installed
    from . import gpu_platform

    gpu_platform.uninstall_gpu_attention_selection()
    patches.restore_all()
    _installed = False


def model_status(model) -> dict:
    """Whether a vLLM model (one worker's) runs aligned: ``{"plugin_installed", "aligned", "profile",
    "aligned_modules"}``. ``aligned``: the plugin is installed in that process and the model's layers carry
    an aligned_ops profile (the plugin records it on every layer it hooks when vLLM builds it)."""
    carried = [m._aligned_profile for m in model.modules() if getattr(m, "_aligned_profile", None) is not None]
    names = sorted({p.name for p in carried})
    return {"plugin_installed": is_installed(), "aligned": is_installed() and bool(carried),
            "profile": names[0] if len(names) == 1 else (names or None), "aligned_modules": len(carried)}


def vllm_status(llm) -> dict:
    """Whether the engine ``llm`` (a ``vllm.LLM``) runs aligned, asked of its workers (``LLM.apply_model``):
    ``{"aligned": bool, "profile": name or None, "vllm": version, "mla_form": the MLA form of an MLA model
    (``patch_model(mla_form=...)`` of the trainer) or None, "workers": [model_status of each]}``.
    ``aligned`` is True only if every worker runs the plugin with one profile. A multi-process engine needs
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to run the probe in its workers (vLLM's rule for apply_model)."""
    import vllm

    workers = llm.apply_model(model_status)
    profiles = {w["profile"] for w in workers if isinstance(w["profile"], str)}
    aligned = bool(workers) and all(w["aligned"] and isinstance(w["profile"], str) for w in workers) \
        and len(profiles) == 1
    return {"aligned": aligned, "profile": profiles.pop() if aligned else None,
            "vllm": getattr(vllm, "__version__", "unknown"), "mla_form": config.engine_mla_form(llm),
            "workers": workers}
