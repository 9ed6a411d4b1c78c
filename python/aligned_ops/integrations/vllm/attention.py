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

Plan once per step, run per layer (CUDA-graph safe; ``aligned_ops.AttentionPlan``): the metadata builder plans
from vLLM's HOST copies of the step's metadata (``query_start_loc_cpu``, ``seq_lens_cpu_upper_bound`` — exact
without speculative decoding, which the plugin refuses — and the block table's CPU mirror, which
``BlockTable.get_device_tensor`` tags onto the device view it returns, see :func:`tag_host_block_table`) into
persistent device buffers; every layer's forward then calls ``paged_attention`` with that plan: no host read, no
host-to-device copy in the forward. The plan's upload is stream-ordered after the previous step's kernels, so an
overlapping (async-scheduled) build never races the step still running. On the CPU platform the "device" is the
host: same plan, same run, same bits as the per-call op.
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

from ...models import rules_of
from . import patches
from ...profiles import profile_of
from .bind import record_architecture


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
    plan: aligned_ops.AttentionPlan | None = None  # this step's plan, shared by every layer


# ---- host copies of the step's metadata ------------------------------------------------------------------------
_HOST_TABLE_ATTR = "_aligned_host_block_table"


def tag_host_block_table(block_table, device_view: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """``BlockTable.get_device_tensor`` hook (installed by the plugin): the device view it returns carries its CPU
    mirror (``block_table.block_table.cpu[:num_reqs]``, what ``commit_block_table`` copied to the device), so the
    metadata builder plans from host memory."""
    if device_view.device.type != "cpu":
        setattr(device_view, _HOST_TABLE_ATTR, block_table.block_table.cpu[:num_reqs])
    return device_view


def _block_table_get_device_tensor(self, num_reqs):
    from vllm.v1.worker.block_table import BlockTable

    return tag_host_block_table(self, patches.original(BlockTable, "get_device_tensor")(self, num_reqs), num_reqs)


def install() -> None:
    """Register this backend (the CPU platform's CPU_ATTN slot; CUSTOM elsewhere, where ``gpu_platform``
    replaces the platform's selector) and tag the block table's device view with its host mirror."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.worker.block_table import BlockTable

    patches.patch(BlockTable, "get_device_tensor", _block_table_get_device_tensor,
                  "not a layer: its device view carries the host mirror the planner reads")
    path = f"{__name__}.AlignedAttentionBackend"
    if current_platform.is_cpu():
        stock = AttentionBackendEnum.CPU_ATTN.get_path()
        patches.on_restore("backend.CPU_ATTN", lambda: register_backend(AttentionBackendEnum.CPU_ATTN, stock))
        register_backend(AttentionBackendEnum.CPU_ATTN, path)
    else:  # CUDA/ROCm: registered as CUSTOM and selected by the platform itself (gpu_platform.py), or refused
        register_backend(AttentionBackendEnum.CUSTOM, path)


_warned_sync = set()


def _host(t: torch.Tensor, what: str) -> torch.Tensor:
    """t on the host; a device tensor without a host mirror costs one sync per step here, in the builder
    (never in the forward), and says so once."""
    if t.device.type == "cpu":
        return t
    if what not in _warned_sync:
        _warned_sync.add(what)
        import warnings

        warnings.warn(f"aligned_ops attention: vLLM gave no host copy of {what}; the metadata builder copies it "
                      "back once per step (a sync outside the forward)", stacklevel=3)
    return t.cpu()


def host_metadata(m: CommonAttentionMetadata):
    """(query_start_loc, seq_lens, block_table) of the step as host int32 tensors, from vLLM's host copies."""
    qsl = m.query_start_loc_cpu if getattr(m, "query_start_loc_cpu", None) is not None else _host(
        m.query_start_loc, "query_start_loc")
    if m.seq_lens.device.type == "cpu":
        seq_lens = m.seq_lens
    elif getattr(m, "seq_lens_cpu_upper_bound", None) is not None:  # exact: speculative decoding is refused
        seq_lens = m.seq_lens_cpu_upper_bound
    else:
        seq_lens = _host(m.seq_lens, "seq_lens")
    bt = m.block_table_tensor
    host_bt = getattr(bt, _HOST_TABLE_ATTR, None)
    if bt.device.type == "cpu":
        host_bt = bt
    elif host_bt is None or tuple(host_bt.shape) != tuple(bt.shape):
        host_bt = _host(bt, "the block table")
    return qsl.to(torch.int32), seq_lens.to(torch.int32), host_bt.to(torch.int32)


class AlignedAttentionMetadataBuilder(AttentionMetadataBuilder[AlignedAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._num_heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        self._cache_config = vllm_config.cache_config
        # persistent plan buffers on the engine's device (grown, never shrunk; one plan per step)
        self._plan = aligned_ops.AttentionPlan(device=device)
        from vllm.platforms import current_platform

        self._check_device_errors = not current_platform.is_cpu()

    def _report_device_errors(self):
        """The in-kernel error words of the previous step (aligned_ops.check_device_errors), read here: once per
        engine step, outside the forward (one small device-to-host read; on the CPU every value is checked at
        the call, so nothing is read)."""
        try:
            aligned_ops.check_device_errors(self.device)
        except RuntimeError as e:
            raise RuntimeError(f"aligned_ops vLLM plugin: a GPU op of the previous engine step met a bad input: {e}"
                               ) from None

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        m = common_attn_metadata
        if not isinstance(m.causal, bool) or not m.causal:
            raise NotImplementedError("aligned_ops attention: only causal decoder attention is supported")
        if common_prefix_len:
            raise NotImplementedError("aligned_ops attention: cascade (common prefix) attention is not supported")
        if self._check_device_errors:
            self._report_device_errors()
        spec = self.kv_cache_spec
        num_blocks = self._cache_config.num_gpu_blocks
        if not num_blocks:
            raise RuntimeError("aligned_ops attention: the KV cache's block count is not known when the metadata "
                               "is built (cache_config.num_gpu_blocks is unset)")
        qsl, seq_lens, block_table = host_metadata(m)
        plan = self._plan.plan_paged(qsl, seq_lens, block_table, self._num_heads, spec.num_kv_heads, spec.head_size,
                                     num_blocks, spec.block_size)
        return AlignedAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            query_start_loc=qsl,
            max_seq_len=m.max_seq_len,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=m.slot_mapping.to(torch.int64),
            plan=plan,
        )


def split_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int):
    """``[num_blocks, 2, block_size, Hkv*D]`` (LHBNC) -> two contiguous ``[num_blocks, block_size, Hkv, D]``."""
    num_blocks, _, block_size, _ = kv_cache.shape
    k_cache = kv_cache[:, 0].view(num_blocks, block_size, num_kv_heads, head_size)
    v_cache = kv_cache[:, 1].view(num_blocks, block_size, num_kv_heads, head_size)
    return k_cache, v_cache


def unsupported_attention_features(alibi_slopes, sliding_window, logits_soft_cap, attn_type, kv_cache_dtype,
                                   kv_sharing_target_layer_name) -> list[str]:
    """The vLLM attention-impl arguments the aligned kernels do not implement (the standard and the MLA impl
    refuse them by name at construction)."""
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
    if kv_sharing_target_layer_name is not None:
        unsupported.append("KV sharing")
    return unsupported


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
        unsupported = unsupported_attention_features(alibi_slopes, sliding_window, logits_soft_cap, attn_type,
                                                     kv_cache_dtype, kv_sharing_target_layer_name)
        if sinks is not None:
            unsupported.append("attention sinks")
        if unsupported:
            raise NotImplementedError("aligned_ops attention does not support: " + ", ".join(unsupported))
        record_architecture(self)  # the scale is the model spec's (LayerRules.scale), read per call
        from ...models import ARCHITECTURES

        arch = ARCHITECTURES.get(getattr(self, "_aligned_arch", None))
        # DeepSeek: the layer's own scale (YaRN's mscale^2), the number the trainer's block passes (checked there
        # against aligned_ops.rope.deepseek_attention_scale)
        self._own_scale = bool(arch is not None and arch.own_attention_scale)
        if not self._own_scale:
            rules_of(self).check_attention_scale(head_size, scale, "vLLM attention")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)  # read by vLLM (Attention.extra_repr); the forward uses rules_of(self).scale
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        self._paged_attention, self._reshape_and_cache = aligned_ops.paged_attention, aligned_ops.reshape_and_cache
        # the engine's linear profile (bound by record_architecture) and whether this is an MLA architecture's
        # expanded attention: the attention profile is decided from them and the device on the first forward
        self._mla = bool(arch is not None and arch.mla_forms)
        self._attention_profile = None

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
        # the step's plan (built once by the metadata builder from host metadata): no host work per layer
        if self._attention_profile is None:  # once per layer (the trainer: once per forward, hf._backbone)
            self._attention_profile = profile_of(self).attention_profile(query.device, mla=self._mla)
        out = self._paged_attention(query[:n], k_cache, v_cache, scale=self.scale if self._own_scale else rules_of(self).scale(self.head_size),
                                    plan=attn_metadata.plan, profile=self._attention_profile)
        output[:n].copy_(out.view(output[:n].shape))
        return output
