"""vLLM's MLA slot: DeepSeek-V3-style models in the ABSORBED (latent) form, one latent row of
``kv_lora_rank + qk_rope_head_dim`` values (576 for DeepSeek-V3 / Kimi-K2) per token and layer in the KV cache.

The form (``config.resolve_mla_form``): ``absorbed`` (default) or ``expanded``, chosen per engine by
``additional_config["aligned_ops_mla_form"]``, else ``ALIGNED_OPS_MLA_FORM`` (or ``VLLM_ALIGNED_OPS_MLA_FORM``,
the name vLLM's Ray executor forwards), read when the engine config is created. ``expanded`` runs vLLM's non-MLA
path (``VLLM_MLA_DISABLE=1``: the standard attention layer, full K/V per head, ``attention.py``); ``absorbed``
runs vLLM's MLA modules with this backend. The trainer must run the same form: ``patch_model(model,
mla_form=<the engine's form>)`` (``config.engine_mla_form`` names it; ``vllm_status`` reports it).

One form everywhere: prefill, chunked prefill, prefix hits and decode all run the same absorbed arithmetic. The
decoder layer's block (``models.deepseek_v3.absorbed_attention``, the trainer's code) computes
``q_latent = q_nope · W_UK`` per head and, after attention, ``o_latent · W_UV`` per head as aligned linears under
the engine's profile (W_UK / W_UV derived from ``kv_b_proj`` once per weight version:
``aligned_ops.mla_absorbed_weights``; vLLM's load_weights / a refit clears the derivation). Between them it calls
vLLM's ``MLAAttention`` layer with the absorbed query ``[q_latent || rope(q_pe)]`` [T, H, D], the normed latent
and the rotated k_pe; vLLM's own custom ops (``unified_mla_kv_cache_update``, ``unified_mla_attention_with_output``:
opaque to torch.compile) then reach this backend:

- ``do_kv_cache_update`` -> ``aligned::mla_reshape_and_cache``: one row ``[c || k_pe]`` per token into vLLM's MLA
  cache ``[num_blocks, block_size, D]`` (``MLAAttentionSpec``: no V, one head);
- ``MLAAttention.forward_impl`` (a class patch: the stock body splits prefill from decode and runs the expanded
  form for prefill) -> ``aligned::mla_paged_attention`` with the step's plan: every scheduled token attends to its
  request's cached rows, whatever the chunking, prefix hit or batch. Output: ``o_latent`` [T, H * kv_lora_rank].

Plan once per step, run per layer: the metadata builder is the aligned attention backend's
(:class:`~.attention.AlignedAttentionMetadataBuilder`: host metadata, one ``AttentionPlan`` of one KV head of
width D serves every layer). The CPU platform turns chunked prefill and prefix caching off for any MLA model (its
reference backend cannot chunk); with this backend they stay as the user asked (:func:`_cpu_check_and_update_config`).

Tested (tests/integrations/test_vllm_deepseek_v3_mla*_e2e.py): CPU, eager, TP 1 and 2. Compiled mode is refused at
start-up (config.py) until tested; an AMX CPU selects the ``AMX_MLA`` slot, which holds this backend too (not run
here: no AMX on the test machines).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType, MLAAttentionImpl

import aligned_ops

from . import patches
from .attention import AlignedAttentionMetadata, AlignedAttentionMetadataBuilder, unsupported_attention_features

# ---- the backend ------------------------------------------------------------------------------------------------


class AlignedMLABackend(AttentionBackend):
    """Batch-invariant latent MLA over vLLM's MLA cache (``aligned::mla_paged_attention``)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        # the slot it occupies on the CPU platform (AttentionBackendEnum looks the name up)
        return "CPU_MLA"

    @staticmethod
    def get_impl_cls():
        return AlignedMLAImpl

    @staticmethod
    def get_builder_cls():
        return AlignedMLAMetadataBuilder

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class AlignedMLAMetadata(AlignedAttentionMetadata):
    # read by vLLM's MLAAttention.update_kv_cache (its context-parallel gather, which the plugin's refusals keep
    # off); the aligned op does not split decode from prefill
    num_decode_tokens: int = 0


class AlignedMLAMetadataBuilder(AlignedAttentionMetadataBuilder):
    """The aligned attention builder (host metadata, one plan per step) for the latent cache: one KV head of
    width D = kv_lora_rank + rope_dim (the MLA spec's head_size)."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        m = super().build(common_prefix_len, common_attn_metadata, fast_build)
        return AlignedMLAMetadata(**m.__dict__)


class AlignedMLAImpl(MLAAttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args) -> None:
        unsupported = unsupported_attention_features(alibi_slopes, sliding_window, logits_soft_cap, attn_type,
                                                     kv_cache_dtype, kv_sharing_target_layer_name)
        if mla_args.get("indexer") is not None:
            unsupported.append("sparse MLA (an indexer: DeepSeek-V3.2)")
        if unsupported:
            raise NotImplementedError("aligned_ops MLA does not support: " + ", ".join(unsupported))
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_lora_rank = int(mla_args["kv_lora_rank"])
        self.qk_rope_head_dim = int(mla_args["qk_rope_head_dim"])
        self.v_head_dim = int(mla_args["v_head_dim"])
        if head_size != self.kv_lora_rank + self.qk_rope_head_dim:  # pragma: no cover - vLLM's own rule
            raise ValueError(f"aligned_ops MLA: head_size {head_size} != kv_lora_rank + qk_rope_head_dim")

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):  # pragma: no cover - never reached
        raise NotImplementedError("aligned_ops MLA: MLAAttention.forward_impl runs the latent op (forward_latent)")

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale) -> None:
        if kv_cache.numel() == 0:  # profiling run
            return
        n = min(kv_c_normed.shape[0], slot_mapping.shape[0])
        aligned_ops.mla_reshape_and_cache(kv_c_normed[:n], k_pe.reshape(k_pe.shape[0], -1)[:n], kv_cache,
                                          slot_mapping[:n].to(torch.int64))

    def forward_latent(self, q, kv_cache, attn_metadata, output) -> torch.Tensor:
        """``q`` [T, H, D] (absorbed) -> ``output[:n]`` = o_latent [n, H * kv_lora_rank]."""
        if attn_metadata is None:  # profiling / warm-up run
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        # fma under every linear profile: no mma MLA kernel is built (profiles.Profile.attention_profile, mla=True);
        # the trainer's latent op runs the same (hf.TrainerSide.mla_attention)
        out = aligned_ops.mla_paged_attention(q[:n], kv_cache, kv_lora_rank=self.kv_lora_rank, scale=self.scale,
                                              plan=attn_metadata.plan)
        output[:n].copy_(out.reshape(n, -1))
        output[n:].zero_()  # padded rows (CUDA-graph padding): defined values, not torch.empty's
        return output


def _mla_forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, output_scale=None,
                      output_block_scale=None, *args, **kwargs):
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    if not isinstance(self.impl, AlignedMLAImpl):
        return patches.original(MLAAttention, "forward_impl")(self, q, k_c_normed, k_pe, kv_cache, attn_metadata,
                                                              output, output_scale, output_block_scale, *args,
                                                              **kwargs)
    if output_scale is not None or output_block_scale is not None:
        raise NotImplementedError("aligned_ops MLA: fused output quantization is not supported")
    return self.impl.forward_latent(q, kv_cache, attn_metadata, output)


# ---- the CPU platform: chunked prefill and prefix caching stay on ------------------------------------------------

_KEPT = (("scheduler_config", "enable_chunked_prefill"), ("cache_config", "enable_prefix_caching"),
         ("scheduler_config", "max_num_batched_tokens"))


def _cpu_check_and_update_config(cls, vllm_config):
    """The CPU platform's config update, except for an MLA model with this backend: vLLM's CPU platform turns
    chunked prefill and prefix caching off for any MLA model (and raises the token budget to the model length)
    because its reference MLA backend cannot chunk; the aligned latent op has no such limit (a chunk boundary or
    a prefix hit is one more boundary of the same fixed-order computation), so the user's settings are kept."""
    from vllm.platforms.cpu import CpuPlatform

    original = patches.original(CpuPlatform, "check_and_update_config")  # bound to the class
    mc = getattr(vllm_config, "model_config", None)
    if mc is None or not getattr(mc, "use_mla", False):
        return original(vllm_config)
    kept = [(getattr(vllm_config, owner), name, getattr(getattr(vllm_config, owner), name)) for owner, name in _KEPT]
    original(vllm_config)
    for obj, name, value in kept:
        setattr(obj, name, value)


def install() -> None:
    """Register the backend in the CPU platform's MLA slots (``CPU_MLA``, and ``AMX_MLA``, which an AMX CPU
    selects), route ``MLAAttention.forward_impl`` to it, keep chunked prefill / prefix caching for MLA on CPU."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    patches.patch(MLAAttention, "forward_impl", _mla_forward_impl,
                  "a layer's own method, no hook: the stock body splits prefill (expanded) from decode (absorbed); "
                  "with the aligned MLA backend every token runs the latent op")
    if not current_platform.is_cpu():  # CUDA/ROCm: the absorbed form is refused at start-up (config.py)
        return
    from vllm.platforms.cpu import CpuPlatform

    path = f"{__name__}.AlignedMLABackend"
    for slot in (AttentionBackendEnum.CPU_MLA, AttentionBackendEnum.AMX_MLA):
        stock = slot.get_path()
        patches.on_restore(f"backend.{slot.name}", lambda s=slot, p=stock: register_backend(s, p))
        register_backend(slot, path)
    patches.patch(CpuPlatform, "check_and_update_config", classmethod(_cpu_check_and_update_config),
                  "a platform classmethod, no hook: it turns chunked prefill and prefix caching off for every MLA "
                  "model (its reference backend's limit, not the aligned one's)")
