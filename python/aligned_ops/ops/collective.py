"""The ``collective`` family: finishing the 8-lane linear tree across tensor-parallel ranks, bit for bit.

The ``fma`` linear contract (csrc/common/contract.h) cuts K into 8 lanes of contiguous elements (lane l
covers [floor(l*K/8), floor((l+1)*K/8))), runs one fp32 fma chain per lane, and combines the 8 lane sums
in the fixed tree ``((0+1)+(2+3))+((4+5)+(6+7))``; the bias is added once to the tree's result and the sum
is rounded once. A t-way row-parallel layer (t in {1, 2, 4, 8}, vLLM's o_proj/down_proj) gives rank r the
contiguous K slice [r*K/t, (r+1)*K/t), which is exactly the lanes [r*8/t, (r+1)*8/t) whenever t divides K
(floor((r*8/t + j)*K/8) = r*K/t + floor(j*(K/t)/(8/t))), so ``aligned_ops.linear_partial(x_r, w_r, 8/t)``
is that rank's sub-tree (fp32), and the cross-rank part of the tree is the same halving tree over ranks:

    t = 2:  p0 + p1          t = 4:  (p0+p1)+(p2+p3)          t = 8:  ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7))

:func:`tree_all_reduce` computes that sum on every rank. Bandwidth-optimal algorithm: recursive halving
(reduce-scatter with partners r^1, r^2, r^4 in that order, then the mirror all-gather): at step k the
ranks whose bit k is 0 hold the left operand and the ranks whose bit k is 1 the right one, so every
element is the tree above, with its operand order (so even NaN payloads match the single-device kernel).
That is exactly ``aligned_ops.tree_combine`` (the linear family's reference of the cross-rank fold, over
``csrc/common/contract.h::linear_lane_fold``). Every rank sends and receives (t-1)/t of the tensor twice —
the bytes of a ring all-reduce. The fallback
(``algorithm="allgather"``) gathers all t partials and folds them with the same tree; it moves t-1 whole
tensors per rank but needs one collective instead of 2*log2(t) exchange rounds. Both give the same bits;
the default ``"auto"`` takes the all-gather for small (latency-bound, decode-step) tensors, halving above.

The ``mma`` profile (csrc/common/mma.h) keeps the ``fma`` profile's 8 lanes and tree — only each lane's chain
is the matrix unit's instruction — so its row-parallel route is :func:`row_parallel_linear` with
``aligned::linear_mma_partial`` for the rank's sub-tree: the same slices, the same :func:`tree_all_reduce`, the
same epilogue.

The ``exact`` profile (csrc/common/exact_linear.h, "tensor parallelism"; docs/exact_linear.md, "TP") needs no
tree: its sum is an exact integer, so :func:`exact_row_parallel_linear` exchanges integers only. The full
rows' canonical forms come from an all-reduce MAX of the ranks' row scans (int32 [rows, 3]: of x per call,
of the weight once per weight version); each rank's exact integer partials (two int64 per output element,
``aligned::linear_exact_partial``) are summed by an int64 all-reduce SUM — integer addition, exact and
order-free, so the backend's (gloo's, NCCL's) own order is fine here, unlike the fp32 tree — and
``aligned::linear_exact_finish`` rounds once, as the single-device op.

For the ``fma`` tree: no division, no atomics, no backend reduction (NCCL's/gloo's/vLLM-CPU's SUM order is theirs, not ours):
the only arithmetic is fp32 ``lower + upper`` in torch, which is one correctly rounded IEEE addition per
element on every device. Point-to-point goes through ``torch.distributed.batch_isend_irecv`` (gloo on
CPU; NCCL/RCCL on GPU, where grouping the send with the receive avoids the p2p deadlock).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ops = torch.ops.aligned

from .linear import finish_linear, linear_partial, linear_tp_slices, tree_combine
from .linear_exact import cached_weight_slice, pack_weight_slice

EXACT_MAX_K = 131072  # exact_linear.h kMaxK: the full K of a row-parallel layer (the int64 partial bound)

__all__ = [
    "LINEAR_LANES",
    "TP_DEGREES",
    "check_tp_degree",
    "lanes_per_rank",
    "tree_all_reduce",
    "row_parallel_linear",
    "exact_row_parallel_linear",
    "sharded_rows_all_reduce",
]

LINEAR_LANES = 8  # the fma linear's lanes (contract.h); the cross-rank tree is the top of that tree
TP_DEGREES = (1, 2, 4, 8)
ALGORITHMS = ("auto", "halving", "allgather")
# "auto": below this many fp32 elements per rank the exchange is latency-bound (decode steps) and one
# all-gather (1 collective) beats 2·log2(t) point-to-point rounds; above it halving moves t/2 x fewer bytes.
AUTO_ALLGATHER_MAX_NUMEL = 1 << 18


def check_tp_degree(t: int, what: str = "tree_all_reduce") -> int:
    """Raise ``ValueError`` unless ``t`` ranks each hold whole lanes of the 8-lane tree (t in 1, 2, 4, 8)."""
    if t not in TP_DEGREES:
        raise ValueError(
            f"aligned_ops.{what}: TP degree {t} is not supported; the 8-lane linear tree splits into whole "
            f"lanes only over {', '.join(map(str, TP_DEGREES))} ranks"
        )
    return t


def lanes_per_rank(t: int) -> int:
    """Lanes of the 8-lane tree each of ``t`` ranks holds (8 / t)."""
    return LINEAR_LANES // check_tp_degree(t, "lanes_per_rank")


def _group_info(group, what):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"aligned_ops.{what}: torch.distributed is not initialized (call init_process_group)")
    t = dist.get_world_size(group)
    r = dist.get_rank(group)
    if r < 0:
        raise RuntimeError(f"aligned_ops.{what}: this process is not a member of the given group")
    return t, r


def _exchange(send: torch.Tensor | None, recv: torch.Tensor | None, peer: int, group) -> None:
    """Send ``send`` to and receive ``recv`` from group rank ``peer`` (either may be None: empty half)."""
    ops = []
    if send is not None and send.numel() > 0:
        ops.append(dist.P2POp(dist.isend, send, group=group, group_peer=peer))
    if recv is not None and recv.numel() > 0:
        ops.append(dist.P2POp(dist.irecv, recv, group=group, group_peer=peer))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _halving(buf: torch.Tensor, t: int, r: int, group) -> torch.Tensor:
    """Recursive halving reduce-scatter then recursive doubling all-gather on the flat fp32 ``buf`` (in place)."""
    lo, hi = 0, buf.numel()
    path = []  # (lo, hi, mid, bit, partner) per step, replayed backwards by the all-gather
    step = 1
    while step < t:
        partner = r ^ step
        bit = (r // step) & 1
        mid = lo + (hi - lo) // 2
        if bit == 0:  # this rank's group is the left operand: keep the lower half, send the upper
            keep, give = (lo, mid), (mid, hi)
        else:
            keep, give = (mid, hi), (lo, mid)
        theirs = torch.empty(keep[1] - keep[0], dtype=buf.dtype, device=buf.device)
        _exchange(buf[give[0]:give[1]], theirs, partner, group)
        mine = buf[keep[0]:keep[1]]
        if bit == 0:
            mine.copy_(mine + theirs)  # lower group + upper group
        else:
            mine.copy_(theirs + mine)
        path.append((lo, hi, keep, give, partner))
        lo, hi = keep
        step *= 2
    for lo, hi, keep, give, partner in reversed(path):
        _exchange(buf[keep[0]:keep[1]], buf[give[0]:give[1]], partner, group)
    return buf


def _allgather(flat: torch.Tensor, t: int, group) -> torch.Tensor:
    gathered = [torch.empty_like(flat) for _ in range(t)]
    dist.all_gather(gathered, flat, group=group)
    return tree_combine(gathered)


def tree_all_reduce(partial: torch.Tensor, group=None, *, algorithm: str = "auto") -> torch.Tensor:
    """Finish the 8-lane linear tree across the ranks of ``group``; returns a new fp32 tensor (same shape).

    ``partial``: this rank's fp32 sub-tree (``aligned_ops.linear_partial(x_r, w_r, 8 // t)``), the same
    shape on every rank. The result on every rank is the tree over group ranks 0..t-1 (see the module
    docstring), so a row-parallel linear equals the unsplit linear bit for bit. ``group``: a
    ``torch.distributed`` process group (default: the world) of t in {1, 2, 4, 8} ranks. ``algorithm``:
    ``"halving"`` (recursive halving, bandwidth-optimal), ``"allgather"`` (one all-gather, then the tree:
    fewer rounds) or ``"auto"`` (all-gather up to ``AUTO_ALLGATHER_MAX_NUMEL`` elements, else halving); the
    same bits whichever runs.
    ``partial`` is not modified.
    """
    what = "tree_all_reduce"
    if not isinstance(partial, torch.Tensor):
        raise TypeError(f"aligned_ops.{what}: partial must be a tensor, got {type(partial).__name__}")
    if partial.dtype != torch.float32:
        raise TypeError(
            f"aligned_ops.{what}: partial must be float32 (the fp32 sub-tree of linear_partial), got {partial.dtype}"
        )
    if algorithm not in ALGORITHMS:
        raise ValueError(f"aligned_ops.{what}: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    t, r = _group_info(group, what)
    check_tp_degree(t, what)
    flat = partial.detach().reshape(-1).clone()  # contiguous, ours to overwrite
    if t > 1:
        if algorithm == "auto":
            algorithm = "allgather" if flat.numel() <= AUTO_ALLGATHER_MAX_NUMEL else "halving"
        if algorithm == "halving":
            flat = _halving(flat, t, r, group)
        else:
            flat = _allgather(flat, t, group)
    return flat.view(partial.shape)


def _all_reduce_max(group):
    def merge(scan):
        out = scan.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
        return out

    return merge


def exact_row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                              group=None, *, in_features: int | None = None) -> torch.Tensor:
    """A row-parallel ``aligned_ops.linear_exact``: rank r holds ``x[..., K_r]`` and ``weight[:, K_r]`` (any
    split of K, uneven included); every rank returns the full ``linear_exact(x, weight, bias)``, bit for bit.

    Exchanged: the x rows' scans plus a "weight packing needed" row (int32 [M + 1, 3], all-reduce MAX) per
    call, the weight rows' scans (int32 [N, 3]) once per weight version, and the partials (int64 [M, N, 2],
    all-reduce SUM): 16 bytes per output element (the ``fma`` tree: 4). Every rank of ``group`` must call it
    together (as any row-parallel layer). CPU only (the digit path; the fp64 fast path does not take part).
    """
    what = "exact_row_parallel_linear"
    t, r = _group_info(group, what)
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise NotImplementedError(
            f"aligned_ops.{what}: the exact profile's tensor-parallel route runs on the CPU only (x on {x.device}, "
            f"weight on {weight.device}); GPU glue for aligned::linear_exact_partial is not built")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"aligned_ops.{what}: x {tuple(x.shape)} and weight {tuple(weight.shape)} must hold the "
                         f"same K slice (weight [out_features, K_r])")
    k_local = weight.shape[-1]
    if in_features is not None:
        k_full = in_features
    else:  # the unsplit K, agreed by every rank (a rank-local guess could make one rank raise while others wait)
        kt = torch.tensor([k_local], dtype=torch.int64)
        dist.all_reduce(kt, op=dist.ReduceOp.SUM, group=group)
        k_full = int(kt.item())
    if in_features is not None and not (0 < k_local <= in_features):
        raise ValueError(f"aligned_ops.{what}: rank {r} holds {k_local} of K = {in_features} input features")
    if k_full > EXACT_MAX_K:
        raise ValueError(f"aligned_ops.{what}: K = {k_full} exceeds the exact profile's {EXACT_MAX_K} input features "
                         f"(the int64 partials' bound)")
    merge = _all_reduce_max(group)
    tag = (group, t)
    cached = cached_weight_slice(weight, tag)
    # One all-reduce MAX per call carries the x rows' scans and one more row: whether any rank lacks the
    # weight's packing for this version (then every rank packs it, together: no rank can skip a collective
    # the others run, whatever its cache holds).
    need = torch.tensor([[1 if cached is None else 0, 0, 0]], dtype=torch.int32)
    merged = merge(torch.cat([ops.linear_exact_row_scan(x), need]))
    x_scan = merged[:-1].contiguous()
    if int(merged[-1, 0]) > 0:
        cached = pack_weight_slice(weight, merge, tag)
    _, (wd, we, wb) = cached
    partial = ops.linear_exact_partial(x, wd, we, wb, weight.shape[0], x_scan)
    if t > 1:
        dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)  # int64: exact in any order
    return ops.linear_exact_finish(partial, x_scan, we, wb, bias, x.dtype)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None,
                        *, in_features: int | None = None, algorithm: str = "auto",
                        sub_tree=linear_partial) -> torch.Tensor:
    """The ``fma`` profile's row-parallel linear: rank r holds ``x[..., K_r]`` and ``weight[:, K_r]`` (K_r its
    slice ``linear_tp_slices(K, t)[r]``, vLLM's contiguous 1/t of K); every rank returns the full
    ``linear(x, weight, bias)``, bit for bit. (The ``exact`` profile's route: :func:`exact_row_parallel_linear`;
    the route of a profile object: ``aligned_ops.profiles.<profile>.row_parallel_linear``.)

    ``partial = linear_partial(x, weight, 8 // t)``, ``s = tree_all_reduce(partial)``, then the linear's
    epilogue: the bias once (fp32) and one rounding to ``x.dtype``. ``in_features`` (the unsplit K), when
    given, is checked: the rank's slice must be whole lanes and K_r long.

    ``sub_tree``: the op computing the rank's lanes — ``linear_partial`` (``fma``), or ``linear_mma_partial``
    (the ``mma`` profile keeps the 8 lanes and the tree, only each lane's chain is the matrix unit's:
    ``aligned_ops.profiles.MMA.row_parallel_linear``).
    """
    what = "row_parallel_linear"
    t, r = _group_info(group, what)
    check_tp_degree(t, what)
    k_local = weight.shape[-1]
    if in_features is not None:
        try:
            k0, k1 = linear_tp_slices(in_features, t)[r]
        except ValueError as e:
            raise ValueError(f"aligned_ops.{what}: K = {in_features} does not split into whole lanes over {t} "
                             f"ranks ({e})") from None
        if k1 - k0 != k_local:
            raise ValueError(
                f"aligned_ops.{what}: K = {in_features} does not split into whole lanes over {t} ranks as "
                f"this rank's weight does: rank {r} must hold K[{k0}:{k1}] ({k1 - k0} features), it holds {k_local}"
            )
    partial = sub_tree(x, weight, LINEAR_LANES // t)
    return finish_linear(tree_all_reduce(partial, group, algorithm=algorithm), bias, x.dtype)


def sharded_rows_all_reduce(local: torch.Tensor, not_owned: torch.Tensor, group=None) -> torch.Tensor:
    """Combine a vocab-sharded embedding lookup exactly: every row is owned by exactly one rank.

    ``local [..., H]``: this rank's lookup (any float dtype; rows it does not own are ignored), ``not_owned
    [...]`` bool. Rows this rank does not own contribute ``-0.0``: ``x + (-0.0) == x`` for every x (-0.0, NaN
    and inf included) and ``(-0.0) + (-0.0) == -0.0``, so the sum over ranks — in any order — is a copy of the
    owner's row, sign of zero kept. (Filling with +0.0, as vLLM does, turns an owner's -0.0 into +0.0.) The
    sum runs through :func:`tree_all_reduce` in fp32; widening and narrowing back are exact.
    """
    t, _ = _group_info(group, "sharded_rows_all_reduce")
    filled = local.masked_fill(not_owned.unsqueeze(-1), -0.0)
    if t == 1:
        return filled
    return tree_all_reduce(filled.to(torch.float32), group).to(local.dtype)
