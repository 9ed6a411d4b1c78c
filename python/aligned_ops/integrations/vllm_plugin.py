"""vLLM plugin: route a Qwen2/Qwen3/Llama model through ``torch.ops.aligned`` inside vLLM.

Activation: the package declares the entry point ``vllm.general_plugins: aligned_ops =
aligned_ops.integrations.vllm_plugin:register``. vLLM calls :func:`register` in every process it starts
(API process, engine core, workers); it does nothing unless ``ALIGNED_OPS_VLLM=1`` is set in the
environment. (``aligned_ops.integrations.rollout.make_llm(aligned=True)`` sets it and calls
:func:`install` directly, which also works where the package is not pip-installed.)

What it replaces (class-level, for every model vLLM builds in the process afterwards):

- ``RMSNorm.forward`` (plain and fused residual) -> ``aligned::rms_norm`` / ``aligned::fused_add_rms_norm``
- ``SiluAndMul.forward`` -> ``aligned::silu_and_mul``
- ``RotaryEmbedding.forward`` -> ``aligned::rotary_embedding`` with ``aligned_ops.rotary_cos_sin_cache``
  (the same table the trainer uses)
- ``UnquantizedLinearMethod`` (QKV, o_proj, gate_up, down) and ``UnquantizedEmbeddingMethod.apply`` (LM head)
  -> ``aligned::linear``; their CPU weight re-packing is skipped, so ``layer.weight`` stays a plain tensor
  and ``load_weights`` (refit) keeps working
- the attention backend -> :class:`~aligned_ops.integrations.vllm_attention.AlignedAttentionBackend`
  (overrides ``CPU_ATTN`` on CPU; registered as ``CUSTOM`` and selected on CUDA/ROCm)
- ``Sampler.compute_logprobs`` -> ``aligned::log_softmax`` over the full vocabulary in fp32 at the
  request's sampling temperature (greedy / temperature 0 is scored at 1.0). vLLM's stock default returns
  log-probs of the raw logits (temperature 1); with the plugin the returned log-prob is the one of the
  distribution the token was sampled from (before top-k/top-p truncation, which the trainer cannot see).

At engine start-up (``EngineArgs.create_engine_config``) it refuses, with one ``ValueError`` listing every
reason, configurations it cannot keep aligned: other architectures or RoPE variants, quantization, a
non-``auto`` KV-cache dtype, prefix caching, speculative decoding, tensor/pipeline parallelism, compiled
mode (pass ``enforce_eager=True``), and a ``logprobs_mode`` other than ``raw_logprobs``.
"""

from __future__ import annotations

import contextvars
import os

import torch

import aligned_ops

from . import SUPPORTED_DTYPES, check_hf_config

ENV_VAR = "ALIGNED_OPS_VLLM"
SUPPORTED_VLLM_VERSIONS = ("0.32.0",)

_installed = False
_MISSING = object()
_originals: dict = {}
_current_temperature: contextvars.ContextVar = contextvars.ContextVar("aligned_ops_temperature", default=None)


def enabled_by_env() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """Entry point for ``vllm.general_plugins``: inert unless ``ALIGNED_OPS_VLLM=1``."""
    if enabled_by_env():
        install()


def is_installed() -> bool:
    return _installed


def check_vllm_version() -> str:
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    base = version.split("+")[0]
    if base not in SUPPORTED_VLLM_VERSIONS:
        raise RuntimeError(
            f"aligned_ops vLLM plugin supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}; found {version}. "
            f"Install the pinned version or unset {ENV_VAR}."
        )
    return version


# ---- layer hooks ---------------------------------------------------------------------------------------


def _rms_norm_forward(self, x, residual=None):
    if not getattr(self, "has_weight", True) or getattr(self, "variance_size_override", None) is not None:
        raise NotImplementedError("aligned_ops: RMSNorm without weight or with var_hidden_size is not supported")
    if residual is None:
        return aligned_ops.rms_norm(x, self.weight.data, self.variance_epsilon)
    return aligned_ops.fused_add_rms_norm(x, residual, self.weight.data, self.variance_epsilon)


def _silu_and_mul_forward(self, x):
    return aligned_ops.silu_and_mul(x)


def _rotary_forward(self, positions, query, key=None):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if type(self) is not RotaryEmbedding:
        raise NotImplementedError(f"aligned_ops: {type(self).__name__} (scaled RoPE) is not supported")
    cache = getattr(self, "_aligned_cos_sin_cache", None)
    if cache is None or cache.device != query.device:
        # Same builder and arguments as the trainer side (hf.py): fp64 -> fp32, [max_position, rotary_dim].
        cache = aligned_ops.rotary_cos_sin_cache(self.rotary_dim, self.max_position_embeddings, self.base)
        cache = cache.to(query.device)
        self._aligned_cos_sin_cache = cache
    if self.rotary_dim != self.head_size:
        raise NotImplementedError("aligned_ops: partial rotary embeddings are not supported")
    positions = positions.flatten().to(torch.int64)
    T = positions.shape[0]

    def rot(x):
        shape = x.shape
        y = aligned_ops.rotary_embedding(positions, x.reshape(T, -1, self.head_size).contiguous(), cache,
                                         self.rotary_dim, self.is_neox_style)
        return y.view(shape)

    return rot(query), (rot(key) if key is not None else None)


def _linear_apply(self, layer, x, bias=None):
    # ALIGNED_OPS_LINEAR=fma|exact, the same switch the trainer patch reads (aligned_ops._exact).
    return aligned_ops.profile_linear(x, layer.weight, bias)


def _keep_weight_after_loading(self, layer):
    # Skip vLLM's CPU GEMM dispatch: it may re-pack or delete layer.weight (oneDNN / sgl / zentorch);
    # aligned::linear reads the plain [N, K] weight, and refit (load_weights) needs it in place.
    # A (re)load may have rewritten weights in place: the exact profile's packed digits are redone.
    aligned_ops.clear_exact_weight_cache()
    return None


def _sampler_forward(self, logits, sampling_metadata, *args, **kwargs):
    token = _current_temperature.set(sampling_metadata.temperature)
    try:
        return _originals["Sampler.forward"](self, logits, sampling_metadata, *args, **kwargs)
    finally:
        _current_temperature.reset(token)


def _compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary fp32 log-softmax at the sampling temperature (per request row)."""
    temp = _current_temperature.get()
    logits = logits.contiguous()
    if temp is None or temp.numel() != logits.shape[0]:
        # All-greedy batch (vLLM passes no temperatures) or a call outside sampling (prompt log-probs).
        return aligned_ops.log_softmax(logits, 1.0)
    temp = temp.to(device=logits.device, dtype=torch.float32)
    temp = torch.where(temp < 1e-5, torch.ones_like(temp), temp)  # greedy rows are scored at tau = 1
    return aligned_ops.log_softmax(logits, temp.contiguous())


# ---- start-up validation ---------------------------------------------------------------------------------


def validate_vllm_config(vllm_config) -> None:
    """Raise ``ValueError`` listing every reason the configuration cannot be kept aligned."""
    reasons = []
    mc = vllm_config.model_config
    try:
        check_hf_config(mc.hf_config, "vLLM plugin")
    except ValueError as e:
        reasons.append(str(e).split(": ", 1)[-1])
    dtype = str(mc.dtype).replace("torch.", "")
    if dtype not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {dtype} is not supported ({', '.join(SUPPORTED_DTYPES)})")
    if getattr(mc, "quantization", None) or getattr(vllm_config, "quant_config", None) is not None:
        reasons.append(f"quantization ({mc.quantization}) is not supported")
    cc = vllm_config.cache_config
    if cc.enable_prefix_caching:
        reasons.append("prefix caching is not covered; pass enable_prefix_caching=False")
    if str(getattr(cc, "cache_dtype", "auto")) != "auto":
        reasons.append(f"kv_cache_dtype {cc.cache_dtype} is not supported (use 'auto')")
    if getattr(vllm_config, "speculative_config", None) is not None:
        reasons.append("speculative decoding is not covered")
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        reasons.append(
            "tensor/pipeline parallelism splits reductions across ranks and is not covered; use tp=pp=1 "
            "(data-parallel replicas are fine)"
        )
    if not mc.enforce_eager:
        reasons.append("compiled mode is not covered; pass enforce_eager=True")
    if str(getattr(mc, "logprobs_mode", "raw_logprobs")) != "raw_logprobs":
        reasons.append(f"logprobs_mode {mc.logprobs_mode!r} is not supported (use the default 'raw_logprobs')")
    if reasons:
        raise ValueError("aligned_ops vLLM plugin refuses this configuration: " + "; ".join(reasons))


def _create_engine_config(self, *args, **kwargs):
    config = _originals["EngineArgs.create_engine_config"](self, *args, **kwargs)
    validate_vllm_config(config)
    if not config.model_config.enforce_eager:  # pragma: no cover - refused above
        raise AssertionError
    return config


# ---- install / uninstall ---------------------------------------------------------------------------------


def _patch(cls, name, new, key=None):
    key = key or f"{cls.__name__}.{name}"
    if key not in _originals:
        _originals[key] = cls.__dict__.get(name, _MISSING)  # _MISSING: inherited, delete on uninstall
    setattr(cls, name, new)


def install() -> None:
    """Install every hook (idempotent). Raises ``RuntimeError`` on an unsupported vLLM version."""
    global _installed
    if _installed:
        return
    check_vllm_version()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.sample.sampler import Sampler

    _patch(RMSNorm, "forward", _rms_norm_forward)
    _patch(SiluAndMul, "forward", _silu_and_mul_forward)
    _patch(RotaryEmbedding, "forward", _rotary_forward)
    _patch(UnquantizedLinearMethod, "apply", _linear_apply)
    _patch(UnquantizedLinearMethod, "process_weights_after_loading", _keep_weight_after_loading)
    _patch(UnquantizedEmbeddingMethod, "apply", _linear_apply)
    _patch(UnquantizedEmbeddingMethod, "process_weights_after_loading", _keep_weight_after_loading)
    _patch(Sampler, "forward", _sampler_forward)
    _patch(Sampler, "compute_logprobs", staticmethod(_compute_logprobs))
    _patch(EngineArgs, "create_engine_config", _create_engine_config)

    path = "aligned_ops.integrations.vllm_attention.AlignedAttentionBackend"
    if current_platform.is_cpu():
        _originals.setdefault("backend.CPU_ATTN", AttentionBackendEnum.CPU_ATTN.get_path())
        register_backend(AttentionBackendEnum.CPU_ATTN, path)
    else:  # pragma: no cover - CUDA/ROCm: registered as CUSTOM; select with attention_backend="CUSTOM"
        register_backend(AttentionBackendEnum.CUSTOM, path)
    global installed_linear_profile
    installed_linear_profile = aligned_ops.linear_profile()
    _installed = True


# The linear profile the hooks were installed under (`aligned-ops verify` compares it with the trainer's).
installed_linear_profile = None


def uninstall() -> None:
    """Restore vLLM's original classes (engines built while installed keep their aligned layers)."""
    global _installed
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.sample.sampler import Sampler

    classes = {c.__name__: c for c in (EngineArgs, SiluAndMul, RMSNorm, UnquantizedLinearMethod, RotaryEmbedding,
                                       UnquantizedEmbeddingMethod, Sampler)}
    for key, orig in list(_originals.items()):
        if key == "backend.CPU_ATTN":
            register_backend(AttentionBackendEnum.CPU_ATTN, orig)
        else:
            cls_name, attr = key.split(".", 1)
            if orig is _MISSING:
                delattr(classes[cls_name], attr)
            else:
                setattr(classes[cls_name], attr, orig)
        del _originals[key]
    _installed = False
