"""vLLM attention backend over the paged KV cache, computed by ``aligned::paged_attention``.

One kernel serves prefill, chunked prefill and decode: every scheduled token attends to its own request's
context (cached blocks + the tokens of this step), and the op's result for a token depends only on that
token's query and its context — not on how the prompt was chunked, which other requests share the step,
or whether the token came from prefill or decode. ``aligned::attention_varlen`` (the trainer side) gives the
same bits over the full sequence.

KV cache layout: our ops want two contiguous caches ``[num_blocks, block_size, num_kv_heads, head_dim]``.
The backend publishes its page as two "head slots" (K, V) of ``num_kv_heads * head_dim`` elements per token
and asks for the ``LHBNC`` layout (slot outermost within a layer), so vLLM's per-layer view is logically
``[num_blocks, 2, block_size, Hkv*D]`` with physical order ``[2, num_blocks, block_size, Hkv*D]``:
``kv_cache[:, 0]`` / ``kv_cache[:, 1]`` are then the two contiguous caches (viewed as 4-D), no copy.
This is the same arrangement vLLM's ROCm backend uses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

import aligned_ops

from ..model_spec import architecture_of, rules_of


def record_architecture(layer) -> None:
    """Remember, on a layer vLLM is building, which architecture's rules it runs (``model_spec.rules_of``
    reads it per call). A module vLLM shares between models (get_rope caches rotary modules by their
    parameters) keeps the architecture of the first; the rules of every supported architecture agree."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    hf = getattr(getattr(cfg, "model_config", None), "hf_config", None)
    if hf is not None:
        layer._aligned_arch = architecture_of(hf)


class AlignedAttentionBackend(AttentionBackend):
    """Batch-invariant paged attention (``torch.ops.aligned.paged_attention``)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        # vLLM looks the name up in AttentionBackendEnum: we occupy the CPU_ATTN slot on CPU (the only one
        # the CPU platform selects) and the CUSTOM slot elsewhere.
        from vllm.platforms import current_platform

        return "CPU_ATTN" if current_platform.is_cpu() else "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return AlignedAttentionImpl

    @staticmethod
    def get_builder_cls():
        return AlignedAttentionMetadataBuilder

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        if spec.state_content_bytes is not None:
            return spec
        if spec.head_size != spec.head_size_v:
            raise ValueError("aligned_ops attention: K and V head sizes must be equal")
        return replace(
            spec,
            num_head_slots=2,
            state_content_bytes=spec.num_kv_heads * spec.head_size * get_dtype_size(spec.dtype),
        )

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LHBNC,)


@dataclass
class AlignedAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # [B+1] int32
    max_seq_len: int
    seq_lens: torch.Tensor  # [B] int32, context including this step's tokens
    block_table: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    causal: bool = True


class AlignedAttentionMetadataBuilder(AttentionMetadataBuilder[AlignedAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        m = common_attn_metadata
        if not isinstance(m.causal, bool) or not m.causal:
            raise NotImplementedError("aligned_ops attention: only causal decoder attention is supported")
        if common_prefix_len:
            raise NotImplementedError("aligned_ops attention: cascade (common prefix) attention is not supported")
        return AlignedAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc.to(torch.int32),
            max_seq_len=m.max_seq_len,
            seq_lens=m.seq_lens.to(torch.int32),
            block_table=m.block_table_tensor.to(torch.int32),
            slot_mapping=m.slot_mapping.to(torch.int64),
        )


def split_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int):
    """``[num_blocks, 2, block_size, Hkv*D]`` (LHBNC) -> two contiguous ``[num_blocks, block_size, Hkv, D]``."""
    num_blocks, _, block_size, _ = kv_cache.shape
    k_cache = kv_cache[:, 0].view(num_blocks, block_size, num_kv_heads, head_size)
    v_cache = kv_cache[:, 1].view(num_blocks, block_size, num_kv_heads, head_size)
    return k_cache, v_cache


class AlignedAttentionImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes,
        sliding_window,
        kv_cache_dtype: str,
        logits_soft_cap=None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name=None,
        sinks=None,
    ) -> None:
        unsupported = []
        if alibi_slopes is not None:
            unsupported.append("ALiBi")
        if sliding_window is not None:
            unsupported.append("sliding window")
        if logits_soft_cap:
            unsupported.append("logit soft-capping")
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"attention type {attn_type}")
        if kv_cache_dtype != "auto":
            unsupported.append(f"kv_cache_dtype {kv_cache_dtype}")
        if sinks is not None:
            unsupported.append("attention sinks")
        if kv_sharing_target_layer_name is not None:
            unsupported.append("KV sharing")
        if unsupported:
            raise NotImplementedError("aligned_ops attention does not support: " + ", ".join(unsupported))
        record_architecture(self)  # the scale is the model spec's (LayerRules.scale), read per call
        rules_of(self).check_attention_scale(head_size, scale, "vLLM attention")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        self._paged_attention, self._reshape_and_cache = aligned_ops.paged_attention, aligned_ops.reshape_and_cache

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        k_cache, v_cache = split_kv_cache(kv_cache, self.num_kv_heads, self.head_size)
        n = min(key.shape[0], slot_mapping.shape[0])
        self._reshape_and_cache(key[:n], value[:n], k_cache, v_cache, slot_mapping[:n].to(torch.int64))

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AlignedAttentionMetadata | None,
        output: torch.Tensor,
        output_scale=None,
        output_block_scale=None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("aligned_ops attention: fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        n = attn_metadata.num_actual_tokens
        k_cache, v_cache = split_kv_cache(kv_cache, self.num_kv_heads, self.head_size)
        out = self._paged_attention(
            query[:n],
            k_cache,
            v_cache,
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            rules_of(self).scale(self.head_size),
        )
        output[:n].copy_(out.view(output[:n].shape))
        return output
