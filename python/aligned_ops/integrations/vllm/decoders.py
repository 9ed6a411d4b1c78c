"""The decoder layers: vLLM's decoder-layer ``forward`` of every supported architecture is replaced by the
architecture's block function (:mod:`aligned_ops.models`), the same one the trainer patch calls.

Why override the decoder layer rather than keep only per-layer hooks: with hooks alone, the op *sequence* of a
layer is vLLM's model code (``Qwen2Attention.forward``, ``Qwen2MLP.forward``, ...) and the trainer's is ours;
they agree only as long as someone keeps two hand-written sequences in step (the spec test catches a drift,
after the fact). Calling the block function makes the sequence one piece of code. A new architecture (DeepSeek-V3
next: MLA in its expanded form, grouped routing, dense first layers) is then one ``models/<arch>.py`` — its block,
its projections, the vLLM decoder class to override — plus its ops, instead of hook edits in several modules.
What stays a per-layer hook is what the block reaches *through* vLLM's modules, for reasons vLLM owns: the
projections (column-parallel shards, the row-parallel profile route at TP > 1, quantization refusals —
``layers.py``, ``tp.py``), the attention layer (KV cache, paged attention — ``attention.py``) and the fused-MoE
layer (``moe.py``); and what lies outside decoder layers (embedding, final norm, LM head, sampler).

:class:`EngineSide` is the engine's side of a block function: a logical projection is vLLM's fused module
(``qkv_proj``, ``gate_up_proj``) split into its parts by its own ``output_partition_sizes`` (this rank's shard),
attention is the layer's vLLM ``Attention`` module (``reshape_and_cache`` + ``paged_attention`` in our backend,
whose scale is read from the same rules), positions come from the forward's arguments and the RoPE table from
the layer's rotary module (built by ``layers._rotary_init``), a sparse MoE block is vLLM's module (its runner
is hooked, ``moe.py``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from ...models import ARCHITECTURES, Side
from ...profiles import profile_of
from . import patches
from .bind import record_architecture
from .layers import rotary_table


@dataclass(frozen=True)
class EngineContext:
    """The engine's per-forward context of one decoder layer: the forward's ``positions`` and the linear profile
    the layer was built with (the engine's, ``bind.py``), for linears no vLLM module holds (MLA's absorbed
    per-head projections)."""

    positions: torch.Tensor
    profile: object


class EngineSide(Side):
    """The engine's side of a block function (module docstring); ``ctx`` is an :class:`EngineContext`."""

    def parts(self, ctx, owner, projection, x):
        module = getattr(owner, projection.engine_module)
        out, _ = module(x)
        if projection.fused is None:
            return (out,)
        return out.split(module.output_partition_sizes, dim=-1)

    def joined(self, ctx, owner, projection, x):
        out, _ = getattr(owner, projection.engine_module)(x)
        return out

    def rope(self, ctx, attn):
        positions = ctx.positions
        cache = rotary_table(attn.rotary_emb)
        if cache.device != positions.device:  # pragma: no cover - vLLM moves buffers with the module
            cache = cache.to(positions.device)
        return positions.flatten().to(torch.int64), cache

    def linear(self, ctx, x, weight):
        return ctx.profile.linear(x, weight)

    def mla_attention(self, ctx, attn, q, kv, kv_lora_rank, scale):
        # vLLM's MLAAttention layer (its KV-cache write and attention custom ops) -> the aligned MLA backend
        # (mla.py): the latent row into the [blocks, block_size, D] cache, the latent op with the step's plan
        layer = attn.mla_attn.mla_attn
        if float(layer.impl.scale) != scale:
            raise ValueError(f"aligned_ops: {layer.layer_name} MLA scale {layer.impl.scale} != the block's {scale}")
        T, H = q.shape[0], q.shape[1]
        out = layer(q, kv[:, :kv_lora_rank], kv[:, kv_lora_rank:].unsqueeze(1), output_shape=(T, H * kv_lora_rank))
        return out.view(T, H, kv_lora_rank)

    def attention(self, ctx, attn, q, k, v, scale):
        # vLLM's Attention layer -> the aligned backend (attention.py), which applies the same rules' scale
        T = q.shape[0]
        return attn.attn(q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1))

    def is_sparse(self, arch, mlp):
        return hasattr(mlp, "experts")  # vLLM's sparse blocks hold a FusedMoE layer; their dense MLPs do not

    def sparse_mlp(self, arch, ctx, mlp, x, rules):
        return mlp(x)  # the FusedMoE layer's runner is hooked: models.moe.sparse_moe (moe.py)


ENGINE_SIDE = EngineSide()


def vllm_class(path: str):
    """The class ``"module:Class"`` names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _check_mla_scale(layer, arch):
    """vLLM's softmax scale of an MLA layer (``self_attn.scaling``) must be the trainer's
    (``rope.deepseek_attention_scale``): vLLM applies YaRN's mscale**2 only for the rope it calls deepseek_yarn."""
    from vllm.config import get_current_vllm_config

    from ...rope import deepseek_attention_scale

    attn = getattr(layer, "self_attn", None)
    if attn is None or not hasattr(attn, "scaling") or not hasattr(attn, "qk_rope_head_dim"):
        return
    model_config = getattr(get_current_vllm_config(), "model_config", None)
    if model_config is None:  # pragma: no cover - vLLM builds its layers under the engine's config
        return
    cfg = model_config.hf_config
    want = deepseek_attention_scale(attn.qk_nope_head_dim + attn.qk_rope_head_dim, cfg)
    if float(attn.scaling) != want:
        raise ValueError(f"aligned_ops: {arch.name} vLLM softmax scale {float(attn.scaling)!r} != the trainer's "
                         f"{want!r} (config rope_scaling / rope_parameters: factor, mscale_all_dim, attention_factor)")


def _make_init(cls, arch):
    def __init__(self, *args, **kwargs):
        patches.original(cls, "__init__")(self, *args, **kwargs)
        record_architecture(self)  # the block looks the layer's rules up from it
        if arch.mla_forms and hasattr(getattr(self, "self_attn", None), "mla_attn"):
            # vLLM built its MLA modules (use_mla: the plugin's absorbed form, mla.py): the block runs that form;
            # the non-MLA attention (VLLM_MLA_DISABLE=1) keeps the block's default, the expanded form
            self._aligned_mla_form = arch.mla_forms["absorbed"]
        if arch.mla_forms:
            _check_mla_scale(self, arch)

    return __init__


def _make_forward(arch):
    def forward(self, positions, hidden_states, residual, *extra, **options):
        # vLLM's decoder layers take (positions, hidden_states, residual); some add optional inputs (DeepSeek-V2's
        # llama_4_scaling): the block covers none of them, so a layer called with one refuses.
        if any(v is not None for v in extra) or any(v is not None for v in options.values()):
            raise NotImplementedError(f"aligned_ops: {arch.name} decoder layer called with extra inputs "
                                      f"{sorted(options) or len(extra)} the block does not cover")
        ctx = EngineContext(positions, profile_of(self))
        return arch.block(arch, ENGINE_SIDE, ctx, self, hidden_states, residual)

    forward.__qualname__ = f"aligned_{arch.name}_decoder_forward"
    return forward


def decoder_classes() -> dict:
    """``{vLLM decoder-layer class: its Architecture}`` of every supported architecture."""
    return {vllm_class(arch.vllm_decoder_layer): arch for arch in ARCHITECTURES.values()}


def install() -> None:
    why = "a model's decoder layer (plain nn.Module, no hook): its forward becomes the architecture's block"
    for cls, arch in decoder_classes().items():
        patches.patch(cls, "__init__", _make_init(cls, arch), why)
        patches.patch(cls, "forward", _make_forward(arch), why)
