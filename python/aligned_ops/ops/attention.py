"""Attention and KV-cache ops: fake (meta) implementations, autograd, and Python wrappers.

The kernels and schemas live in C++ (``csrc/torch/glue/attention.h``, ``csrc/cpu/attention_kernels.cpp``; the
GPU forward and cache write in ``csrc/gpu/attention_kernels.cuh``, whose glue takes the planner metadata —
offsets, seq_lens, block tables — as host tensors);
the reduction order that makes every path bitwise identical (tiles of 32 keys and KV splits of 512 keys,
both aligned to absolute position 0, merged in split order) and the paged cache layout
``[num_blocks, block_size, num_kv_heads, head_dim]`` are written down in ``csrc/common/attention.h``.

Numerics profiles (the schemas' ``profile``): ``"fma"`` (attention.h: fp32 fma chains, every dtype, CPU == CUDA ==
HIP) and ``"mma"`` (``csrc/common/attention_mma.h``: QK^T and PV on the GPU's bf16 matrix instruction, bfloat16
only; bitwise between rollout and trainer on ONE GPU model, not across vendors / generations nor equal to ``fma``).
The CPU refuses ``"mma"`` attention (its mma profile covers linear, the LM head and MoE experts only); under
:func:`aligned_ops.emulate` the GPU kernel runs. The backward of an ``"mma"`` forward runs on the unit too
(attention_mma.h "backward": fixed dK/dV chains over blocks of 16 (row, head) pairs, no atomics).
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
    csrc/torch/glue/attention.h)."""
    for name, t in meta.items():
        torch._check(
            t.device == ref.device or t.device.type == "cpu",
            lambda: f"aligned::{op}: {name} must be on {ref.device} or the CPU, got {t.device}",
        )


# The attention profiles the schemas take (csrc/torch/checks/attention.h check_attention_profile), default first.
ATTENTION_PROFILES = ("fma", "mma")
_BF16_ONLY = frozenset(ATTENTION_PROFILES[1:])  # the matrix unit's profile takes bfloat16 only


def _check_profile(op, profile, q):
    torch._check(profile in ATTENTION_PROFILES,
                 lambda: f"aligned::{op}: profile must be 'fma' or 'mma', got {profile!r}")
    torch._check(profile not in _BF16_ONLY or q.dtype == torch.bfloat16,
                 lambda: f"aligned::{op}: the mma profile's attention takes bfloat16 q/k/v (the matrix unit's input "
                         f"type; float16 / float32 run profile='fma'), got {q.dtype}")


def _profile_name(op, profile):
    """A profile given as a name or as a profile object (aligned_ops.profiles) -> its name."""
    name = getattr(profile, "name", profile)
    if name not in ATTENTION_PROFILES:
        raise ValueError(f"aligned_ops.{op}: profile must be 'fma' or 'mma', got {profile!r}")
    return name


@torch.library.register_fake(_lib + "attention_varlen")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal=True, profile="fma"):
    _check_same_device("attention_varlen", q=q, k=k, v=v)
    _check_profile("attention_varlen", profile, q)
    _check_host_or_same("attention_varlen", q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    torch._check(q.dim() == 3, lambda: "aligned::attention_varlen: q must be [tokens, heads, head_dim]")
    torch._check(k.dim() == 3 and v.dim() == 3, lambda: "aligned::attention_varlen: k, v must be 3-D")
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: "aligned::attention_varlen: num_heads % num_kv_heads != 0")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
    return out, lse


@torch.library.register_fake(_lib + "attention_varlen_backward")
def _(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale, causal, plan_info=None, profile="fma"):
    _check_same_device("attention_varlen_backward", grad_out=grad_out, q=q, k=k, v=v, out=out, lse=lse)
    _check_profile("attention_varlen_backward", profile, q)
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
def _(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, profile="fma"):
    _check_same_device("paged_attention", q=q, k_cache=k_cache, v_cache=v_cache)
    _check_profile("paged_attention", profile, q)
    _check_host_or_same(
        "paged_attention", q, block_table=block_table, seq_lens=seq_lens, query_start_loc=query_start_loc
    )
    torch._check(q.dim() == 3, lambda: "aligned::paged_attention: q must be [tokens, heads, head_dim]")
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake(_lib + "attention_plan")
def _(plan, plan_table, plan_info, query_start_loc, kv_lens, block_table, num_heads, num_kv_heads, head_dim,
      causal=True, num_cache_blocks=0, block_size=0, workspace_floats=0):
    return None


@torch.library.register_fake(_lib + "attention_varlen_planned")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, plan, plan_info, workspace_floats, scale, causal=True, profile="fma"):
    _check_same_device("attention_varlen_planned", q=q, k=k, v=v, plan=plan)
    _check_profile("attention_varlen_planned", profile, q)
    _check_host_or_same("attention_varlen_planned", q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    torch._check(q.dim() == 3, lambda: "aligned::attention_varlen_planned: q must be [tokens, heads, head_dim]")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
    return out, lse


@torch.library.register_fake(_lib + "paged_attention_planned")
def _(q, k_cache, v_cache, plan, plan_table, plan_info, workspace_floats, scale, profile="fma"):
    _check_same_device("paged_attention_planned", q=q, k_cache=k_cache, v_cache=v_cache, plan=plan,
                       plan_table=plan_table)
    _check_profile("paged_attention_planned", profile, q)
    torch._check(q.dim() == 3, lambda: "aligned::paged_attention_planned: q must be [tokens, heads, head_dim]")
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake(_lib + "_attention_mma_reference")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal=True):
    _check_same_device("_attention_mma_reference", q=q, k=k, v=v)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
    return out, lse


@torch.library.register_fake(_lib + "_attention_mma_backward_reference")
def _(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale, causal=True):
    _check_same_device("_attention_mma_backward_reference", grad_out=grad_out, q=q, k=k, v=v, out=out, lse=lse)
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
    )


def _varlen_setup(ctx, inputs, output, plan_info=None):
    q, k, v, cu_q, cu_k, scale, causal = inputs[:7]
    ctx.profile = inputs[7] if len(inputs) > 7 else "fma"
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.scale = scale
    ctx.causal = causal
    # The planned form: a copy of the info of the plan the forward ran (the caller's plan may be replanned before
    # the backward runs); the backward refuses cu_seqlens that plan was not made from.
    ctx.plan_info = None if plan_info is None else plan_info.clone()
    ctx.mark_non_differentiable(lse)


def _varlen_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = ops.attention_varlen_backward(
        grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, ctx.scale, ctx.causal, ctx.plan_info, ctx.profile
    )
    return dq, dk, dv, None, None, None, None, None


torch.library.register_autograd(_lib + "attention_varlen", _varlen_backward, setup_context=_varlen_setup)


def _varlen_planned_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, _plan, plan_info, _workspace_floats, scale, causal = inputs[:10]
    profile = inputs[10] if len(inputs) > 10 else "fma"
    _varlen_setup(ctx, (q, k, v, cu_q, cu_k, scale, causal, profile), output, plan_info)


def _varlen_planned_backward(ctx, grad_out, grad_lse):
    # The backward plans its key tiles from the host cu_seqlens, which it first checks against the forward's plan.
    dq, dk, dv = _varlen_backward(ctx, grad_out, grad_lse)[:3]
    return dq, dk, dv, None, None, None, None, None, None, None, None


torch.library.register_autograd(_lib + "attention_varlen_planned", _varlen_planned_backward,
                                setup_context=_varlen_planned_setup)

from ._registry import checked_bool, checked_int, register_no_backward  # noqa: E402

register_no_backward("attention_varlen_backward", "it is a backward op; double backward is not implemented")
register_no_backward("paged_attention", "inference only: train through attention_varlen, its bitwise twin")
register_no_backward("paged_attention_planned", "inference only: train through attention_varlen, its bitwise twin")
register_no_backward("_attention_mma_reference", "a test hook: attention_mma.h's scalar reference of the mma forward")
register_no_backward("_attention_mma_backward_reference",
                     "a test hook: attention_mma.h's scalar reference of the mma backward")


def _default_scale(op, q):
    """1/sqrt(head_dim), with a clear error for head_dim 0 (and anything that is not [tokens, heads, head_dim])."""
    if q.dim() != 3 or q.shape[-1] < 1:
        raise ValueError(f"aligned_ops.{op}: q must be [tokens, heads, head_dim] with head_dim >= 1, got shape "
                         f"{tuple(q.shape)}")
    return q.shape[-1] ** -0.5


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=None, causal=True, plan=None, profile="fma"):
    """Packed variable-length attention. q [Tq, Hq, D], k/v [Tk, Hkv, D], cu_seqlens_* int32 [B+1].

    Returns (out [Tq, Hq, D] in q's dtype, lse [Tq, Hq] fp32). Causal masks are bottom-right aligned when
    seqlen_q < seqlen_k. ``scale`` defaults to 1/sqrt(D). Differentiable in q, k, v (not through lse).
    ``plan``: an :class:`AttentionPlan` made by ``plan_varlen`` from these cu_seqlens (host tensors): the run form
    (no copy, no read of device memory), same bits. The call is checked against the plan: other offsets, even with
    the same token count, or another head shape raise (naming the argument); the backward checks its cu_seqlens
    against the plan the forward ran.
    ``profile``: ``"fma"`` (default) or ``"mma"`` (bfloat16, the GPU's matrix instruction, forward and backward),
    a name or a profile object; see the module docstring."""
    if scale is None:
        scale = _default_scale("attention_varlen", q)
    profile = _profile_name("attention_varlen", profile)
    causal = checked_bool("attention_varlen", "causal", causal)
    if plan is not None:
        return ops.attention_varlen_planned(q, k, v, cu_seqlens_q, cu_seqlens_k, plan.plan, plan.info,
                                            plan.workspace_floats, float(scale), causal, profile)
    return ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, float(scale), causal, profile)


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    """Writes k/v [T, Hkv, D] into the paged caches [num_blocks, block_size, Hkv, D] at slot_mapping (int64;
    slot = block * block_size + offset; -1 skips the token). In place (the caches' version counters are bumped);
    returns None. A host slot_mapping is checked: every slot in [-1, num_blocks * block_size) and no slot twice
    (which write landed last would depend on the thread count); a device one is not read by the host."""
    ops.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)


def _check_paged_metadata(op, block_table, seq_lens, query_start_loc):
    """Without a plan the paged ops read the batch from these three; a missing one reached the op as None (torch:
    "tensor does not have a device")."""
    missing = [name for name, t in (("block_table", block_table), ("seq_lens", seq_lens),
                                    ("query_start_loc", query_start_loc)) if t is None]
    if missing:
        raise ValueError(f"aligned_ops.{op}: {', '.join(missing)} missing: pass block_table, seq_lens and "
                         "query_start_loc, or plan= (an AttentionPlan made by plan_paged)")


def paged_attention(q, k_cache, v_cache, block_table=None, seq_lens=None, query_start_loc=None, scale=None,
                    plan=None, profile="fma"):
    """Causal attention of the new tokens of several sequences over a paged KV cache (which must already hold
    them). q [Tq, Hq, D]; block_table int32 [B, max_blocks]; seq_lens int32 [B] (context incl. new tokens);
    query_start_loc int32 [B+1]. Bitwise equal to attention_varlen on the same tokens.
    ``plan``: an :class:`AttentionPlan` made by ``plan_paged`` (the metadata arguments are then not needed): the
    run form, no copy and no read of device memory (CUDA-graph safe), same bits; q must have exactly the rows the
    plan covers. ``profile``: ``"fma"`` (default) or ``"mma"``, as :func:`attention_varlen`'s (the same bits as it
    under the same profile)."""
    if scale is None:
        scale = _default_scale("paged_attention", q)
    profile = _profile_name("paged_attention", profile)
    if plan is not None:
        return ops.paged_attention_planned(q, k_cache, v_cache, plan.plan, plan.table, plan.info,
                                           plan.workspace_floats, float(scale), profile)
    _check_paged_metadata("paged_attention", block_table, seq_lens, query_start_loc)
    return ops.paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, float(scale), profile)


# ---- plan/run form (CUDA-graph safe) -------------------------------------------------------------------------
class AttentionPlan:
    """One attention plan, planned once, run by every layer (FlashInfer's plan()/run() split; the plan itself is
    csrc/common/attention_plan.h's AttnPlan).

    ``plan_varlen`` / ``plan_paged`` plan once from HOST metadata (the planner validates it there): the plan's work
    records go into persistent buffers on ``device`` (stream-ordered, no sync) and its info into a host tensor.
    :func:`attention_varlen` and :func:`paged_attention` given ``plan=`` then check the call against the info on
    the host (heads, head_dim, rows — exactly q's —, capacities; varlen: the cu_seqlens too) and only launch: no
    host-to-device copy, no read of device memory, launches fixed by the capacity — CUDA-graph safe, and bitwise
    equal to the per-call form. A plan depends only on the metadata and the head shape, so one plan serves every
    layer of a forward step (the CPU reads its records in place: nothing is unpacked per layer).

    Buffers (their layout is the C++ planner's: ``aligned::attention_plan_layout``): ``plan`` int64 (the info's
    header and the work records; ``capacity`` records per region), ``table`` int32 [table_capacity] (the
    block-table entries the plan uses), ``info`` int64, on the host (what the plan was made for and holds);
    ``workspace_floats``: the capacity of the run's split partials (the run allocates that many floats, a size
    fixed by the capacity, never by data values). ``ensure`` grows them to fit a plan's needs
    (:func:`attention_plan_size`); never grow while a CUDA graph that uses them is captured or replayed (size them
    for the largest batch before capture). Until planned, a run refuses the plan."""

    # Each buffer at most 2**62 bytes (far beyond any memory; torch's byte counts and the plan's int64 offsets
    # cannot overflow): the allowed ranges of the sizes, checked by name (a negative capacity left the buffers
    # unallocated, 2**62 overflowed the layout's row count).
    _MAX_BYTES = 1 << 62

    _LIMITS: dict | None = None

    @staticmethod
    def _limits():
        if AttentionPlan._LIMITS is None:
            rows0, cols, _ = ops.attention_plan_layout(0)  # rows = rows0 + 2 * capacity, int64
            AttentionPlan._LIMITS = {"capacity": (AttentionPlan._MAX_BYTES // (8 * cols) - rows0) // 2,
                                     "table_capacity": AttentionPlan._MAX_BYTES // 4,  # int32 entries
                                     "workspace_floats": AttentionPlan._MAX_BYTES // 4}
        return AttentionPlan._LIMITS

    @staticmethod
    def _checked_sizes(where, **sizes):
        limits = AttentionPlan._limits()
        return [checked_int(where, name, v, 0, limits[name]) for name, v in sizes.items()]

    def __init__(self, capacity=0, table_capacity=0, workspace_floats=0, device="cpu"):
        capacity, table_capacity, workspace_floats = self._checked_sizes(
            "AttentionPlan", capacity=capacity, table_capacity=table_capacity, workspace_floats=workspace_floats)
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"aligned_ops.AttentionPlan: device must be a device or a device string, got "
                             f"{device!r} ({e})") from None
        self.capacity = self.table_capacity = self.workspace_floats = -1
        self.info = None
        self.ensure(capacity, table_capacity, workspace_floats)

    def ensure(self, capacity, table_capacity=0, workspace_floats=0):
        """Reallocate (geometric growth) any buffer smaller than asked; returns self."""
        capacity, table_capacity, workspace_floats = self._checked_sizes(
            "AttentionPlan.ensure", capacity=capacity, table_capacity=table_capacity,
            workspace_floats=workspace_floats)
        limits = self._limits()

        def grow(have, need, name):
            return have if need <= have else min(max(need, 2 * have, 1), limits[name])

        c = grow(self.capacity, capacity, "capacity")
        if c != self.capacity:
            rows, cols, info_len = ops.attention_plan_layout(c)
            self.plan = torch.zeros((rows, cols), dtype=torch.int64, device=self.device)
            if self.info is None:
                self.info = torch.zeros((info_len,), dtype=torch.int64)  # host; zeros: no plan yet
            else:
                self.info.zero_()  # the buffer that held the plan is gone
            self.capacity = c
        t = grow(self.table_capacity, table_capacity, "table_capacity")
        if t != self.table_capacity:
            self.table = torch.zeros((t,), dtype=torch.int32, device=self.device)
            self.table_capacity = t
            self.info.zero_()
        self.workspace_floats = grow(self.workspace_floats, workspace_floats, "workspace_floats")
        return self

    def plan_varlen(self, cu_seqlens_q, cu_seqlens_k, num_heads, num_kv_heads, head_dim, causal=True, grow=True):
        """Plan a packed batch (attention_varlen) from host int32 offsets; grows the buffers if ``grow``."""
        causal = checked_bool("AttentionPlan.plan_varlen", "causal", causal)
        if grow:
            self.ensure(*attention_plan_size(cu_seqlens_q, cu_seqlens_k, None, num_heads, num_kv_heads, head_dim,
                                             causal))
        ops.attention_plan(self.plan, self.table, self.info, cu_seqlens_q, cu_seqlens_k, None, num_heads,
                           num_kv_heads, head_dim, causal, 0, 0, self.workspace_floats)
        self.kind, self.cu_seqlens_q, self.cu_seqlens_k, self.causal = "varlen", cu_seqlens_q, cu_seqlens_k, causal
        return self

    def plan_paged(self, query_start_loc, seq_lens, block_table, num_heads, num_kv_heads, head_dim,
                   num_cache_blocks, block_size, grow=True):
        """Plan a paged batch (paged_attention) from host int32 query_start_loc [B+1], seq_lens [B], block_table
        [B, max_blocks]; block ids are checked against ``num_cache_blocks``."""
        if grow:
            self.ensure(*attention_plan_size(query_start_loc, seq_lens, block_table, num_heads, num_kv_heads,
                                             head_dim, True, num_cache_blocks, block_size))
        ops.attention_plan(self.plan, self.table, self.info, query_start_loc, seq_lens, block_table, num_heads,
                           num_kv_heads, head_dim, True, num_cache_blocks, block_size, self.workspace_floats)
        self.kind = "paged"
        return self

    def __repr__(self):
        return (f"AttentionPlan(capacity={self.capacity}, table={self.table_capacity}, "
                f"workspace={self.workspace_floats}, device={self.device})")


def attention_plan_size(query_start_loc, kv_lens, block_table, num_heads, num_kv_heads, head_dim, causal=True,
                        num_cache_blocks=0, block_size=0):
    """(capacity, table entries, workspace floats) a plan of this host metadata needs (the planner, on the host)."""
    return tuple(ops.attention_plan_size(query_start_loc, kv_lens, block_table, num_heads, num_kv_heads, head_dim,
                                         causal, num_cache_blocks, block_size))
