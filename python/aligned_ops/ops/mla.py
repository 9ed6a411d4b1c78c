"""MLA (multi-head latent attention, DeepSeek-V2/V3, Kimi-K2) in the absorbed form: fakes, autograd, wrappers.

Every token has ONE latent KV row ``kv = [c_latent (kv_lora_rank) || k_rope (rope_dim)]`` of width
``D = kv_lora_rank + rope_dim`` (512 + 64 for DeepSeek-V3 / Kimi-K2; both are parameters), shared by all query
heads; the absorbed query is ``q = [q_nope · W_UK || q_rope]`` [T, H, D]. Scores run over the whole row, values
are its first ``kv_lora_rank`` dims, the output is the latent ``o`` [T, H, kv_lora_rank] (then ``· W_UV``).

The contract (``csrc/common/attention.h`` "MLA"): MLA is the aligned attention with one KV head, head_dim D, the
row as keys and values, so it has attention's fixed order — key tiles of 32 and KV splits of 512 keys aligned to
absolute position 0, merged in split order — and its plan. A token's output is the same bits whether it is
computed alone or in a batch, in one prefill or chunked, from a prefix hit, in decode from the paged latent cache
(``mla_paged_attention``) or in the trainer's packed batch (``mla_attention_varlen``), on every CPU ISA level and
(the GPU source) every emulated GPU.
"""

from __future__ import annotations

import torch

from .attention import _check_host_or_same, _check_paged_metadata, _check_same_device

ops = torch.ops.aligned
_lib = "aligned::"


def _latent_out(q, kv_lora_rank):
    return q.new_empty((q.shape[0], q.shape[1], kv_lora_rank))


@torch.library.register_fake(_lib + "mla_attention_varlen")
def _(q, kv, cu_seqlens_q, cu_seqlens_k, kv_lora_rank, scale, causal=True):
    _check_same_device("mla_attention_varlen", q=q, kv=kv)
    _check_host_or_same("mla_attention_varlen", q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    torch._check(q.dim() == 3, lambda: "aligned::mla_attention_varlen: q must be [tokens, heads, kv_lora_rank + "
                 "rope_dim]")
    torch._check(kv.dim() == 2, lambda: "aligned::mla_attention_varlen: kv must be [tokens, kv_lora_rank + rope_dim]")
    return _latent_out(q, kv_lora_rank), q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


@torch.library.register_fake(_lib + "mla_attention_varlen_planned")
def _(q, kv, cu_seqlens_q, cu_seqlens_k, plan, plan_info, workspace_floats, kv_lora_rank, scale, causal=True):
    _check_same_device("mla_attention_varlen_planned", q=q, kv=kv, plan=plan)
    _check_host_or_same("mla_attention_varlen_planned", q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    torch._check(q.dim() == 3, lambda: "aligned::mla_attention_varlen_planned: q must be [tokens, heads, "
                 "kv_lora_rank + rope_dim]")
    return _latent_out(q, kv_lora_rank), q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


@torch.library.register_fake(_lib + "mla_attention_varlen_backward")
def _(grad_out, q, kv, out, lse, cu_seqlens_q, cu_seqlens_k, kv_lora_rank, scale, causal, plan_info=None):
    _check_same_device("mla_attention_varlen_backward", grad_out=grad_out, q=q, kv=kv, out=out, lse=lse)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(kv, memory_format=torch.contiguous_format))


@torch.library.register_fake(_lib + "mla_reshape_and_cache")
def _(kv_c, k_pe, kv_cache, slot_mapping):
    _check_same_device("mla_reshape_and_cache", kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache)
    _check_host_or_same("mla_reshape_and_cache", kv_c, slot_mapping=slot_mapping)
    return None


@torch.library.register_fake(_lib + "mla_paged_attention")
def _(q, kv_cache, block_table, seq_lens, query_start_loc, kv_lora_rank, scale):
    _check_same_device("mla_paged_attention", q=q, kv_cache=kv_cache)
    _check_host_or_same("mla_paged_attention", q, block_table=block_table, seq_lens=seq_lens,
                        query_start_loc=query_start_loc)
    torch._check(q.dim() == 3, lambda: "aligned::mla_paged_attention: q must be [tokens, heads, kv_lora_rank + "
                 "rope_dim]")
    return _latent_out(q, kv_lora_rank)


@torch.library.register_fake(_lib + "mla_paged_attention_planned")
def _(q, kv_cache, plan, plan_table, plan_info, workspace_floats, kv_lora_rank, scale):
    _check_same_device("mla_paged_attention_planned", q=q, kv_cache=kv_cache, plan=plan, plan_table=plan_table)
    torch._check(q.dim() == 3, lambda: "aligned::mla_paged_attention_planned: q must be [tokens, heads, "
                 "kv_lora_rank + rope_dim]")
    return _latent_out(q, kv_lora_rank)


def _mla_setup(ctx, inputs, output, plan_info=None):
    q, kv, cu_q, cu_k, kv_lora_rank, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, out, lse, cu_q, cu_k)
    ctx.kv_lora_rank, ctx.scale, ctx.causal = kv_lora_rank, scale, causal
    # the planned form: a copy of the info of the plan the forward ran (the caller may replan before the backward);
    # the backward refuses cu_seqlens that plan was not made from
    ctx.plan_info = None if plan_info is None else plan_info.clone()
    ctx.mark_non_differentiable(lse)


def _mla_backward(ctx, grad_out, grad_lse):
    q, kv, out, lse, cu_q, cu_k = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dkv = ops.mla_attention_varlen_backward(grad_out.contiguous(), q, kv, out, lse, cu_q, cu_k,
                                                ctx.kv_lora_rank, ctx.scale, ctx.causal, ctx.plan_info)
    return dq, dkv, None, None, None, None, None


torch.library.register_autograd(_lib + "mla_attention_varlen", _mla_backward, setup_context=_mla_setup)


def _mla_planned_setup(ctx, inputs, output):
    q, kv, cu_q, cu_k, _plan, plan_info, _workspace_floats, kv_lora_rank, scale, causal = inputs
    _mla_setup(ctx, (q, kv, cu_q, cu_k, kv_lora_rank, scale, causal), output, plan_info)


def _mla_planned_backward(ctx, grad_out, grad_lse):
    dq, dkv = _mla_backward(ctx, grad_out, grad_lse)[:2]
    return dq, dkv, None, None, None, None, None, None, None, None


torch.library.register_autograd(_lib + "mla_attention_varlen_planned", _mla_planned_backward,
                                setup_context=_mla_planned_setup)

from ._registry import checked_bool, checked_int, register_no_backward  # noqa: E402

register_no_backward("mla_attention_varlen_backward", "it is a backward op; double backward is not implemented")
register_no_backward("mla_paged_attention", "inference only: train through mla_attention_varlen, its bitwise twin")
register_no_backward("mla_paged_attention_planned",
                     "inference only: train through mla_attention_varlen, its bitwise twin")


def _mla_scale(op, q, scale):
    if scale is not None:
        return float(scale)
    if q.dim() != 3 or q.shape[-1] < 1:
        raise ValueError(f"aligned_ops.{op}: q must be [tokens, heads, kv_lora_rank + rope_dim], got shape "
                         f"{tuple(q.shape)}")
    raise ValueError(f"aligned_ops.{op}: scale is required (MLA's softmax scale is the model's "
                     "1/sqrt(qk_nope_head_dim + qk_rope_head_dim) times its YaRN mscale², not 1/sqrt(row width))")


def mla_attention_varlen(q, kv, cu_seqlens_q, cu_seqlens_k, kv_lora_rank, scale, causal=True, plan=None):
    """Packed variable-length MLA (prefill and training). q [Tq, H, D] (absorbed: [q_nope·W_UK || q_rope]),
    kv [Tk, D] (each token's latent row [c_kv || k_rope]), cu_seqlens_* int32 [B+1] host tensors,
    D = kv_lora_rank + rope_dim. Returns (out [Tq, H, kv_lora_rank] in q's dtype, lse [Tq, H] fp32 — natural log
    of the scaled scores' softmax denominator). Scores over all D dims of the row, values = its first kv_lora_rank
    dims, fp32 arithmetic in attention's fixed order (csrc/common/attention.h "MLA"), one rounding. Causal masks
    are bottom-right aligned. Differentiable in q and kv (not through lse): the backward's dkv sums the key and
    value gradients of the shared row in fp32 before its one rounding. Bitwise equal to :func:`mla_paged_attention`
    on the same tokens.
    ``plan``: an :class:`AttentionPlan` made by ``plan_varlen(cu_seqlens_q, cu_seqlens_k, H, 1, D, causal)`` (one
    plan per step serves every layer): the run form, same bits; the call (and the backward's cu_seqlens) are
    checked against it."""
    scale = _mla_scale("mla_attention_varlen", q, scale)
    kv_lora_rank = checked_int("mla_attention_varlen", "kv_lora_rank", kv_lora_rank, None)
    causal = checked_bool("mla_attention_varlen", "causal", causal)
    if plan is not None:
        return ops.mla_attention_varlen_planned(q, kv, cu_seqlens_q, cu_seqlens_k, plan.plan, plan.info,
                                                plan.workspace_floats, int(kv_lora_rank), scale, causal)
    return ops.mla_attention_varlen(q, kv, cu_seqlens_q, cu_seqlens_k, int(kv_lora_rank), scale, causal)


def mla_reshape_and_cache(kv_c, k_pe, kv_cache, slot_mapping):
    """Writes each token's latent row [kv_c (kv_lora_rank) || k_pe (rope_dim)] into the latent cache
    kv_cache [num_blocks, block_size, kv_lora_rank + rope_dim] (vLLM's MLA layout, one row per token: no K/V
    pair, no heads) at slot_mapping (int64; slot = block * block_size + offset; -1 skips). In place (version bumped);
    None. A host slot_mapping is checked as reshape_and_cache's: in range, no slot twice."""
    ops.mla_reshape_and_cache(kv_c, k_pe, kv_cache, slot_mapping)


def mla_paged_attention(q, kv_cache, block_table=None, seq_lens=None, query_start_loc=None, kv_lora_rank=None,
                        scale=None, plan=None):
    """Causal MLA of the new tokens of several sequences (decode, chunked prefill, prefix hits) over the latent
    cache kv_cache [num_blocks, block_size, D], which must already hold them (:func:`mla_reshape_and_cache`).
    q [Tq, H, D]; block_table int32 [B, max_blocks]; seq_lens int32 [B] (context incl. the new tokens);
    query_start_loc int32 [B+1]. Returns out [Tq, H, kv_lora_rank]. Bitwise equal to :func:`mla_attention_varlen`
    on the same tokens, whatever the batch, chunking or block size.
    ``plan``: an :class:`AttentionPlan` made by ``plan_paged(query_start_loc, seq_lens, block_table, H, 1, D,
    num_blocks, block_size)`` (one KV head of width D): the run form — no copy, no read of device memory,
    CUDA-graph safe — same bits; the metadata arguments are then not needed."""
    if kv_lora_rank is None:
        raise ValueError("aligned_ops.mla_paged_attention: kv_lora_rank is required (the latent part of the row)")
    scale = _mla_scale("mla_paged_attention", q, scale)
    kv_lora_rank = checked_int("mla_paged_attention", "kv_lora_rank", kv_lora_rank, None)
    if plan is not None:
        return ops.mla_paged_attention_planned(q, kv_cache, plan.plan, plan.table, plan.info, plan.workspace_floats,
                                               int(kv_lora_rank), scale)
    _check_paged_metadata("mla_paged_attention", block_table, seq_lens, query_start_loc)
    return ops.mla_paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, int(kv_lora_rank), scale)


# ---- the absorbed projections (W_UK, W_UV per head, from kv_b_proj) ------------------------------------------------


def _check_absorb_args(op, kv_b_weight, num_heads, qk_nope_head_dim, v_head_dim):
    """``(H, qk_nope, v_head_dim)`` as ints >= 1 and kv_b_weight [H * (qk_nope + v_head_dim), R], or an error naming
    ``aligned_ops.<op>`` and the argument (negative dims could multiply to the weight's rows and fail in torch)."""
    dims = [checked_int(op, name, v, 1) for name, v in
            (("num_heads", num_heads), ("qk_nope_head_dim", qk_nope_head_dim), ("v_head_dim", v_head_dim))]
    H, dn, dv = dims
    if kv_b_weight.dim() != 2 or kv_b_weight.shape[0] != H * (dn + dv):
        raise ValueError(f"aligned_ops.{op}: kv_b_proj weight must be [num_heads * (qk_nope_head_dim + v_head_dim), "
                         f"kv_lora_rank] = [{H * (dn + dv)}, R], got {tuple(kv_b_weight.shape)}")
    return H, dn, dv


class MlaAbsorbedWeights:
    """The per-head absorbed projections of an MLA layer, derived from its ``kv_b_proj`` weight
    [H · (qk_nope_head_dim + v_head_dim), kv_lora_rank] (the expanded form's up-projection: per head the rows of
    k_nope, then of v):

    * ``w_uk_t`` [H, kv_lora_rank, qk_nope]: head h's ``W_UK`` transposed, the weight (N = kv_lora_rank,
      K = qk_nope) of the linear that maps q_nope[h] into the latent space (:func:`mla_absorb_q`);
    * ``w_uv`` [H, v_head_dim, kv_lora_rank]: head h's ``W_UV``, the weight (N = v_head_dim, K = kv_lora_rank) of
      the linear that maps the latent output o[h] to the head's value space (:func:`mla_absorb_out`).

    Derived with views and one contiguous copy (exact: no arithmetic), so gradients flow back to ``kv_b_proj``.
    :func:`mla_absorbed_weights` caches the derivation per weight version for inference (a refit — any in-place
    write to the weight — bumps the version and invalidates it)."""

    def __init__(self, kv_b_weight, num_heads, qk_nope_head_dim, v_head_dim):
        H, dn, dv = _check_absorb_args("MlaAbsorbedWeights", kv_b_weight, num_heads, qk_nope_head_dim, v_head_dim)
        w = kv_b_weight.view(H, dn + dv, kv_b_weight.shape[1])
        self.num_heads, self.qk_nope_head_dim, self.v_head_dim = H, dn, dv
        self.kv_lora_rank = int(kv_b_weight.shape[1])
        self.w_uk_t = w[:, :dn, :].transpose(1, 2).contiguous()
        self.w_uv = w[:, dn:, :].contiguous()


def mla_absorbed_weights(kv_b_weight, num_heads, qk_nope_head_dim, v_head_dim):
    """:class:`MlaAbsorbedWeights` of ``kv_b_weight``. For a weight registered with
    :func:`aligned_ops.cache_exact_weights` (a rollout engine's) and autograd off, derived once per weight state and
    kept (:func:`aligned_ops.ops.linear_exact.cached_derivation`: the version counter, and
    :func:`aligned_ops.clear_exact_weight_cache` after writes through ``.data`` — vLLM's load_weights and refit
    call it); otherwise (training: gradients reach the weight; unregistered or inference tensors) derived per
    call."""
    from .linear_exact import cached_derivation

    dims = _check_absorb_args("mla_absorbed_weights", kv_b_weight, num_heads, qk_nope_head_dim, v_head_dim)
    return cached_derivation(kv_b_weight, ("mla_absorbed", dims), lambda w: MlaAbsorbedWeights(w, *dims))


def _per_head(x, weights, linear):
    """[T, H, K] x per-head weights [H, N, K] -> [T, H, N]: head h is ``linear(x[:, h], weights[h])``, one aligned
    linear per head (its profile's order over K; rows never depend on the batch)."""
    if x.dim() != 3 or x.shape[1] != weights.shape[0] or x.shape[2] != weights.shape[2]:
        raise ValueError(f"aligned_ops.mla_absorb: x must be [tokens, {weights.shape[0]}, {weights.shape[2]}], got "
                         f"{tuple(x.shape)}")
    return torch.stack([linear(x[:, h], weights[h]) for h in range(weights.shape[0])], 1)


def mla_absorb_q(q_nope, absorbed, linear=None):
    """q_nope [T, H, qk_nope] -> q_latent [T, H, kv_lora_rank] = per head ``q_nope[h] · W_UK[h]``, as the aligned
    linear ``linear(q_nope[:, h], absorbed.w_uk_t[h])`` (``linear``: the model's profile's linear, e.g.
    ``profile.linear``; default the ``fma`` profile's :func:`aligned_ops.linear`). Concatenated with q_rope it is
    the absorbed query of :func:`mla_attention_varlen` / :func:`mla_paged_attention`."""
    from .linear import linear as fma_linear

    return _per_head(q_nope, absorbed.w_uk_t, linear or fma_linear)


def mla_absorb_out(o_latent, absorbed, linear=None):
    """o_latent [T, H, kv_lora_rank] (the MLA ops' output) -> [T, H, v_head_dim] = per head
    ``o_latent[h] · W_UV[h]ᵀ``, as the aligned linear ``linear(o_latent[:, h], absorbed.w_uv[h])``."""
    from .linear import linear as fma_linear

    return _per_head(o_latent, absorbed.w_uv, linear or fma_linear)
