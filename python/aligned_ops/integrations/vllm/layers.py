"""Layer hooks: RMSNorm, SiluAndMul, rotary embedding, the linear and LM-head methods.

Each hook applies its layer's :class:`~aligned_ops.models.spec.LayerRules` (``models.rules_of``: looked up per
call in eager mode, once at tracing in compiled mode, for the architecture recorded when vLLM built the layer)
and its engine's linear profile (``profiles.profile_of``: bound once): the same rules and profile the trainer
patch applies. Inside a supported decoder layer the block function (``decoders.py``) calls the norms, rotary and
activation itself and reaches these hooks through the projections it calls as modules; outside it (the final
norm, the LM head, any layer the block does not cover) the hooks keep every op aligned.

- ``RMSNorm`` (plain and fused residual) -> ``aligned::rms_norm`` / ``aligned::fused_add_rms_norm``
- ``SiluAndMul`` -> ``aligned::silu_and_mul``
- ``RotaryEmbedding`` (plain, llama3, yarn, linear, dynamic NTK) -> ``aligned::rotary_embedding`` with the table
  of ``aligned_ops.rope.cos_sin_cache`` (the same builder and spec the trainer uses), built when vLLM
  constructs the module
- ``UnquantizedLinearMethod`` (QKV, o_proj, gate_up, down) and ``UnquantizedEmbeddingMethod.apply`` (LM head)
  -> the profile's linear; their CPU weight re-packing is skipped, so ``layer.weight`` stays a plain tensor
  and ``load_weights`` (refit) keeps working. Their weights are registered for the exact profile's packed-weight
  cache, and their loaders bump the weight's version counter (:func:`track_weight_writes`), so every weight sync
  reaches the cached packing
"""

from __future__ import annotations

import torch

import aligned_ops

from ...models import rules_of
from ...profiles import profile_of
from . import patches
from .bind import record_architecture


def _rms_norm_forward(self, x, residual=None):
    if not getattr(self, "has_weight", True) or getattr(self, "variance_size_override", None) is not None:
        raise NotImplementedError("aligned_ops: RMSNorm without weight or with var_hidden_size is not supported")
    return rules_of(self).apply_norm(x, self.weight.data, self.variance_epsilon, residual)


def _silu_and_mul_forward(self, x):
    return rules_of(self).activate(x)


def rope_spec_from_vllm(rot):
    """The :class:`aligned_ops.rope.RopeSpec` of a rotary module vLLM built (``get_rope``).

    Raises ``NotImplementedError`` for rotary classes whose table we do not reproduce (mrope, DeepSeek YaRN,
    LongRoPE, NTK-alpha, several linear factors, ...). The trainer describes the same RoPE from the HF config
    (``aligned_ops.rope.rope_spec_from_hf_config``); both feed ``aligned_ops.rope.cos_sin_cache``.
    """
    from vllm.model_executor.layers.rotary_embedding import (
        DynamicNTKScalingRotaryEmbedding,
        Llama3RotaryEmbedding,
        LinearScalingRotaryEmbedding,
        RotaryEmbedding,
        YaRNScalingRotaryEmbedding,
    )

    from ...rope import RopeSpec

    kind = type(rot)
    common = dict(rotary_dim=int(rot.rotary_dim), base=float(rot.base), max_position=int(rot.max_position_embeddings))
    if kind is RotaryEmbedding:
        return RopeSpec(**common)
    if kind is Llama3RotaryEmbedding:
        return RopeSpec(**common, rope_type="llama3", factor=float(rot.scaling_factor),
                        low_freq_factor=float(rot.low_freq_factor), high_freq_factor=float(rot.high_freq_factor),
                        original_max_position=int(rot.orig_max_position))
    if kind is LinearScalingRotaryEmbedding:
        if len(rot.scaling_factors) != 1:
            raise NotImplementedError("aligned_ops: linear RoPE with several scaling factors (LoRA) is not supported")
        return RopeSpec(**common, rope_type="linear", factor=float(rot.scaling_factors[0]))
    if kind is DynamicNTKScalingRotaryEmbedding:
        return RopeSpec(**common, rope_type="dynamic", factor=float(rot.scaling_factor),
                        max_trained_positions=int(rot.max_trained_positions))
    if kind is YaRNScalingRotaryEmbedding:
        # vLLM's yarn module keeps original_max_position in max_position_embeddings.
        return RopeSpec(**common, rope_type="yarn", factor=float(rot.scaling_factor),
                        original_max_position=int(rot.max_position_embeddings), beta_fast=float(rot.beta_fast),
                        beta_slow=float(rot.beta_slow), truncate=bool(rot.truncate),
                        attention_factor=float(rot.mscale))
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import DeepseekScalingRotaryEmbedding

    if kind is DeepseekScalingRotaryEmbedding:
        # DeepSeek YaRN: max_position_embeddings is the original length; cos/sin carry mscale / mscale_all_dim
        # (rot.mscale); the attention scale's mscale_all_dim^2 is the attention layer's (DeepseekV2Attention).
        orig, factor = int(rot.max_position_embeddings), float(rot.scaling_factor)
        return RopeSpec(rotary_dim=int(rot.rotary_dim), base=float(rot.base), max_position=int(orig * factor),
                        rope_type="yarn", factor=factor, original_max_position=orig, beta_fast=float(rot.beta_fast),
                        beta_slow=float(rot.beta_slow), truncate=True, attention_factor=float(rot.mscale))
    raise NotImplementedError(f"aligned_ops: {kind.__name__} (this RoPE variant) is not supported")


def _rotary_init(self, *args, **kwargs):
    """After vLLM's own init: build the shared table once (outside any traced forward, so compiled mode sees a
    plain buffer). Unsupported variants keep ``None`` and raise when called."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    patches.original(RotaryEmbedding, "__init__")(self, *args, **kwargs)
    _build_table(self)


def _deepseek_rotary_init(self, *args, **kwargs):
    """DeepseekScalingRotaryEmbedding (not a RotaryEmbedding subclass): its own init, then the same table."""
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import DeepseekScalingRotaryEmbedding

    patches.original(DeepseekScalingRotaryEmbedding, "__init__")(self, *args, **kwargs)
    _build_table(self)


def _build_table(self):
    from ...rope import cos_sin_cache

    record_architecture(self)
    try:
        spec = rope_spec_from_vllm(self)
    except NotImplementedError as e:
        self._aligned_unsupported = str(e)
        return
    if bool(self.is_neox_style) != rules_of(self).rotary_neox:
        self._aligned_unsupported = (f"aligned_ops: rotary is_neox_style={self.is_neox_style} is not the model "
                                     "spec's rotary style")
        return
    self._aligned_unsupported = None
    self.register_buffer("_aligned_cos_sin_cache", cos_sin_cache(spec), persistent=False)


def rotary_table(rot) -> torch.Tensor:
    """The aligned cos/sin table of a rotary module vLLM built (raises ``NotImplementedError`` for a variant we do
    not reproduce, or a module built before the plugin was installed)."""
    reason = getattr(rot, "_aligned_unsupported", "aligned_ops: rotary module built before the plugin was installed")
    if reason:
        raise NotImplementedError(reason)
    return rot._aligned_cos_sin_cache


def _rotary_forward(self, positions, query, key=None):
    cache = rotary_table(self)
    if cache.device != query.device:  # pragma: no cover - vLLM moves buffers with the module
        cache = cache.to(query.device)
    positions = positions.flatten().to(torch.int64)
    T = positions.shape[0]

    rules = rules_of(self)

    def rot(x):
        shape = x.shape
        y = rules.rotary(positions, x.reshape(T, -1, self.head_size).contiguous(), cache, self.rotary_dim)
        return y.view(shape)

    return rot(query), (rot(key) if key is not None else None)


def _linear_apply(self, layer, x, bias=None):
    # The engine's linear profile (resolved once, carried by the layer), as in the trainer.
    return profile_of(layer).linear(x, layer.weight, bias)


def _lm_head_apply(self, layer, x, bias=None):
    # UnquantizedEmbeddingMethod.apply is the LM head's logits (LogitsProcessor); the rules' head dtype.
    return rules_of(layer).head_logits(profile_of(layer), x, layer.weight, bias)


def _make_create_weights(cls):
    def create_weights(self, layer, *args, **kwargs):
        """vLLM's own, then record the model architecture and profile on the layer, and let the exact profile
        cache the weight's packing, its writes tracked (:func:`track_weight_writes`)."""
        out = patches.original(cls, "create_weights")(self, layer, *args, **kwargs)
        record_architecture(layer)
        weight = getattr(layer, "weight", None)
        if isinstance(weight, torch.Tensor):
            track_weight_writes(weight)
            aligned_ops.cache_exact_weights(weight)
        return out

    return create_weights


def track_weight_writes(param) -> None:
    """Make the vLLM weight loader of ``param`` bump the version counter of the parameter it writes.

    vLLM's loaders write through ``param.data`` (``param.data.copy_``), which the version counter does not see,
    so the exact profile's cached packing (keyed by it, ``ops.linear_exact``) would outlive a weight sync: every
    ``load_weights`` (what TRL / OpenRLHF / verl call to sync, and vLLM's own reload) goes through these loaders."""
    import functools

    from torch.autograd.graph import increment_version

    loader = getattr(param, "weight_loader", None)
    if loader is None or getattr(loader, "_aligned_bumps_version", False):
        return

    # functools.wraps: callers read the loader's signature (vLLM's layerwise reload binds its arguments by name
    # and replays it with another `param`), so the wrapper must look like the loader it wraps.
    @functools.wraps(loader)
    def weight_loader(*args, **kwargs):
        out = loader(*args, **kwargs)
        target = kwargs.get("param", args[0] if args else None)
        if isinstance(target, torch.Tensor) and not target.is_inference():
            increment_version(target)
        return out

    weight_loader._aligned_bumps_version = True
    param.weight_loader = weight_loader


def keep_weight_after_loading(self, layer, *args, **kwargs):
    # Skip vLLM's CPU GEMM dispatch: it may re-pack or delete layer.weight (oneDNN / sgl / zentorch);
    # aligned::linear reads the plain [N, K] weight, and refit (load_weights) needs it in place.
    # A (re)load may have rewritten weights in place: the exact profile's packed digits are redone.
    aligned_ops.clear_exact_weight_cache()
    return None


def _load_weights_then_clear(self, *args, **kwargs):
    # Every supported model's load_weights goes through AutoWeightsLoader: the initial load, vLLM's
    # reload_weights, and the refit of every RL framework (TRL colocate and server, OpenRLHF, verl call
    # model.load_weights). It writes through param.data (no version bump), so every derived cache of the old
    # weights (the exact profile's packed digits) goes here, whoever called it.
    try:
        from vllm.model_executor.models.utils import AutoWeightsLoader

        return patches.original(AutoWeightsLoader, "load_weights")(self, *args, **kwargs)
    finally:
        aligned_ops.clear_exact_weight_cache()


def oot_hooks() -> dict:
    """The layers of this module hooked through vLLM's out-of-tree registry."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    return {
        RMSNorm: dict(forward=_rms_norm_forward),                          # CustomOp
        SiluAndMul: dict(forward=_silu_and_mul_forward),                   # CustomOp
    }


def install() -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    # a CustomOp, but register_oot matches the exact class name: the llama3/yarn/linear/NTK subclasses inherit
    # this patch, and unsupported ones raise
    why = "register_oot matches the exact class name; the RoPE variants are subclasses that must follow"
    patches.patch(RotaryEmbedding, "forward", _rotary_forward, why)
    patches.patch(RotaryEmbedding, "__init__", _rotary_init, why)
    from vllm.model_executor.models.utils import AutoWeightsLoader

    patches.patch(AutoWeightsLoader, "load_weights", _load_weights_then_clear,
                  "a plain helper class, not a layer: vLLM offers no hook after a model's load_weights")
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import DeepseekScalingRotaryEmbedding

    why = "DeepSeek YaRN's rotary is a RotaryEmbeddingBase, not a RotaryEmbedding: it needs its own patch"
    patches.patch(DeepseekScalingRotaryEmbedding, "forward", _rotary_forward, why)
    patches.patch(DeepseekScalingRotaryEmbedding, "__init__", _deepseek_rotary_init, why)
    for cls, apply in ((UnquantizedLinearMethod, _linear_apply), (UnquantizedEmbeddingMethod, _lm_head_apply)):
        # a QuantizeMethodBase, not a CustomOp: no registry (every Linear's / the embedding's and LM head's apply)
        why = "a QuantizeMethodBase, not a CustomOp: vLLM offers no out-of-tree hook"
        patches.patch(cls, "apply", apply, why)
        patches.patch(cls, "create_weights", _make_create_weights(cls), why)
        patches.patch(cls, "process_weights_after_loading", keep_weight_after_loading, why)
