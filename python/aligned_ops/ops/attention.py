"""Attention and KV-cache ops: fake (meta) implementations, autograd, and Python wrappers.

The kernels and schemas live in C++ (``csrc/cpu/ops_attention_cpu.cpp``, ``csrc/cpu/attention_kernels.cpp``; the
GPU forward and cache write in ``csrc/gpu/attention_kernels.cuh``, whose glue takes the planner metadata —
offsets, seq_lens, block tables — as host tensors);
the reduction order that makes every path bitwise identical (tiles of 32 keys and KV splits of 512 keys,
both aligned to absolute position 0, merged in split order) and the paged cache layout
``[num_blocks, block_size, num_kv_heads, head_dim]`` are written down in ``csrc/common/attention.h``.
"""

from __future__ import annotations

import torch

ops = torch.ops.aligned
_lib = "aligned::"


def _check_same_device(op, **tensors):
    devs = {name: t.device for name, t in tensors.items()}
    first = next(iter(devs.values()))
    torch._check(
        all(d == first for d in devs.values()),
        lambda: f"aligned::{op}: all tensors must be on the same device, got {devs}",
    )


def _check_host_or_same(op, ref, **meta):
    """Planner metadata: on ref's device or on the host (the GPU path plans from host copies, see
    csrc/cuda/ops_attention_cuda.cpp)."""
    for name, t in meta.items():
        torch._check(
            t.device == ref.device or t.device.type == "cpu",
            lambda: f"aligned::{op}: {name} must be on {ref.device} or the CPU, got {t.device}",
        )


@torch.library.register_fake(_lib + "attention_varlen")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal=True):
    _check_same_device("attention_varlen", q=q, k=k, v=v)
    _check_host_or_same("attention_varlen", q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    torch._check(q.dim() == 3, lambda: "aligned::attention_varlen: q must be [tokens, heads, head_dim]")
    torch._check(k.dim() == 3 and v.dim() == 3, lambda: "aligned::attention_varlen: k, v must be 3-D")
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: "aligned::attention_varlen: num_heads % num_kv_heads != 0")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
    return out, lse


@torch.library.register_fake(_lib + "attention_varlen_backward")
def _(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale, causal):
    _check_same_device("attention_varlen_backward", grad_out=grad_out, q=q, k=k, v=v, out=out, lse=lse)
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
    )


@torch.library.register_fake(_lib + "reshape_and_cache")
def _(k, v, k_cache, v_cache, slot_mapping):
    _check_same_device("reshape_and_cache", k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    _check_host_or_same("reshape_and_cache", k, slot_mapping=slot_mapping)
    return None


@torch.library.register_fake(_lib + "paged_attention")
def _(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale):
    _check_same_device("paged_attention", q=q, k_cache=k_cache, v_cache=v_cache)
    _check_host_or_same(
        "paged_attention", q, block_table=block_table, seq_lens=seq_lens, query_start_loc=query_start_loc
    )
    torch._check(q.dim() == 3, lambda: "aligned::paged_attention: q must be [tokens, heads, head_dim]")
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.scale = scale
    ctx.causal = causal
    ctx.mark_non_differentiable(lse)


def _varlen_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = ops.attention_varlen_backward(
        grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, ctx.scale, ctx.causal
    )
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd(_lib + "attention_varlen", _varlen_backward, setup_context=_varlen_setup)

from ._registry import register_no_backward  # noqa: E402

register_no_backward("attention_varlen_backward", "it is a backward op; double backward is not implemented")
register_no_backward("paged_attention", "inference only: train through attention_varlen, its bitwise twin")


def _default_scale(op, q):
    """1/sqrt(head_dim), with a clear error for head_dim 0 (and anything that is not [tokens, heads, head_dim])."""
    if q.dim() != 3 or q.shape[-1] < 1:
        raise ValueError(f"aligned_ops.{op}: q must be [tokens, heads, head_dim] with head_dim >= 1, got shape "
                         f"{tuple(q.shape)}")
    return q.shape[-1] ** -0.5


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=None, causal=True):
    """Packed variable-length attention. q [Tq, Hq, D], k/v [Tk, Hkv, D], cu_seqlens_* int32 [B+1].

    Returns (out [Tq, Hq, D] in q's dtype, lse [Tq, Hq] fp32). Causal masks are bottom-right aligned when
    seqlen_q < seqlen_k. ``scale`` defaults to 1/sqrt(D). Differentiable in q, k, v (not through lse)."""
    if scale is None:
        scale = _default_scale("attention_varlen", q)
    return ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, float(scale), causal)


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    """Writes k/v [T, Hkv, D] into the paged caches [num_blocks, block_size, Hkv, D] at slot_mapping (int64;
    slot = block * block_size + offset; -1 skips the token). In place; returns None."""
    ops.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale=None):
    """Causal attention of the new tokens of several sequences over a paged KV cache (which must already hold
    them). q [Tq, Hq, D]; block_table int32 [B, max_blocks]; seq_lens int32 [B] (context incl. new tokens);
    query_start_loc int32 [B+1]. Bitwise equal to attention_varlen on the same tokens."""
    if scale is None:
        scale = _default_scale("paged_attention", q)
    return ops.paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, float(scale))
