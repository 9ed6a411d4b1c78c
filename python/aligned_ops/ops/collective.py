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

A MoE block at TP > 1 (:func:`row_parallel_moe_experts`; vLLM shards every expert's intermediate dimension I, as a
column-parallel gate/up and a row-parallel down projection, and the shared expert likewise) is the same idea one
level up: moe.h's experts keep each expert's down projection ``y_r`` in fp32 and combine ``sum_r w_r * y_r`` (+
``g * y_s``) before the one rounding, so the cross-rank part must finish each ``y_r``'s tree BEFORE the weighted
sum: every rank computes the 8/t-lane sub-trees of its I slice for every (token, rank) slot and the shared
expert, :func:`tree_all_reduce` finishes them, and the combine runs on the full ``y`` — moe_experts' bits at
every t. (vLLM all-reduces the already weighted and summed outputs: another order.)

The ``exact`` profile (csrc/common/exact_linear.h, "tensor parallelism"; docs/exact_linear.md, "TP") needs no
tree: its sum is an exact integer, so :func:`exact_row_parallel_linear` exchanges integers only. The full
rows' canonical forms come from an all-reduce MAX of the ranks' row scans (int32 [rows, 3]: of x per call,
of the weight once per weight version); each rank's exact integer partials (two int64 per output element,
``aligned::linear_exact_partial``) are summed by an int64 all-reduce SUM — integer addition, exact and
order-free, so the backend's (gloo's, NCCL's) own order is fine here, unlike the fp32 tree — and
``aligned::linear_exact_finish`` rounds once, as the single-device op.

Agreement first (``check=True``, the default): a collective whose ranks pass different sizes does not fail
cleanly — gloo aborts the process (SIGABRT) or waits for the process-group timeout (30 minutes by default), and
equal element counts with different shapes or dtypes return garbage. So every entry point here first runs ONE
small all-gather (``_META_LEN`` int64 per rank: a status, dtypes, shapes, the algorithm; ``row_parallel_linear``
adds x's dtype, the bias and its K slice, ``sharded_rows_all_reduce`` its lookup's dtype — what the fp32 partials
cannot show) and every rank compares what the others passed; a mismatch, or an input one rank cannot use (ANY
exception before the exchange), raises on EVERY rank (``ValueError`` / ``TypeError`` naming the ranks and what
each passed; the failing rank its own error) before any exchange of data. Cost: one latency-bound
collective per call; ``check=False`` skips it where the caller already guarantees agreement (then a mismatch
is undefined behaviour of the backend, as with torch.distributed itself).

For the ``fma`` tree: no division, no atomics, no backend reduction (NCCL's/gloo's/vLLM-CPU's SUM order is
theirs, not ours): the only arithmetic is fp32 ``lower + upper`` in torch, which is one correctly rounded IEEE
addition per element on every device. Point-to-point goes through ``torch.distributed.batch_isend_irecv`` (gloo
on CPU; NCCL/RCCL on GPU, where grouping the send with the receive avoids the p2p deadlock).
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
    "row_parallel_moe_experts",
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


# ---- agreement: one fixed-size all-gather of every rank's metadata before any data moves -----------------------
_META_LEN = 40
_MAX_DIMS = 16
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)


_DEVICE_TYPES = ("cpu", "cuda")  # what the agreement record names (another type: -1, "another device")


def _dtype_code(dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]).replace("torch.", "") if 0 <= code < len(_DTYPES) else "another dtype"


def _shape_fields(shape) -> list:
    dims = list(shape)
    if len(dims) > _MAX_DIMS:  # more dims than the record holds: compare their product too
        dims = dims[: _MAX_DIMS - 1] + [int(torch.Size(dims[_MAX_DIMS - 1:]).numel())]
    return [len(shape)] + dims + [-1] * (_MAX_DIMS - len(dims))


def _shape_of(fields) -> tuple:
    n = fields[0]
    return tuple(fields[1 : 1 + min(n, _MAX_DIMS)])


def _check_tensor_args(what: str, optional: tuple = (), **args) -> None:
    """TypeError naming ``aligned_ops.<what>`` and the argument for one that is not a tensor (None allowed for the
    names in ``optional``): raised inside an entry point's local-error block, so on every rank."""
    for name, value in args.items():
        if not isinstance(value, torch.Tensor) and not (value is None and name in optional):
            raise TypeError(f"aligned_ops.{what}: {name} must be a tensor{' or None' if name in optional else ''}, "
                            f"got {type(value).__name__}")


def _meta_device(group, like=None):
    """The agreement record's device: its type from the group's backend alone — never the input's: a rank that failed
    before having one must meet the others in the same collective (with torch's default ``cpu:gloo,cuda:nccl`` a
    CUDA input put the healthy ranks on NCCL and the failing rank on gloo, where they never met)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        # the device type from the backend; the index from the input where there is one (a script that moved its
        # tensors to cuda:<rank> without torch.cuda.set_device), else the current device
        if isinstance(like, torch.Tensor) and like.device.type == "cuda":
            return like.device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(group, what: str, fields: list, local_error: BaseException | None, like, describe) -> list:
    """All-gather every rank's ``fields`` (ints) and its local error status; returns every rank's fields.

    Raises on EVERY rank when any rank had a local error (the erring rank re-raises its own, the others a
    ``ValueError`` quoting it: the messages travel in a second, error-path-only all_gather_object) or when
    ``describe`` finds the ranks' fields incompatible (``describe(all_fields) -> message or None``)."""
    t = dist.get_world_size(group)
    rank = dist.get_rank(group)
    row = [1 if local_error is not None else 0] + [int(v) for v in fields]
    if len(row) > _META_LEN:
        raise AssertionError(f"aligned_ops.{what}: agreement record too long ({len(row)})")
    meta = torch.tensor(row + [0] * (_META_LEN - len(row)), dtype=torch.int64, device=_meta_device(group, like))
    gathered = [torch.empty_like(meta) for _ in range(t)]
    dist.all_gather(gathered, meta, group=group)
    rows = [g.cpu().tolist() for g in gathered]
    if any(r[0] for r in rows):
        msgs = [None] * t
        dist.all_gather_object(msgs, None if local_error is None else f"{type(local_error).__name__}: {local_error}",
                               group=group)
        if local_error is not None:
            raise local_error
        bad = [(j, m) for j, m in enumerate(msgs) if m is not None]
        raise ValueError(f"aligned_ops.{what}: group rank {bad[0][0]} could not run its part, so no rank does "
                         f"(this is rank {rank}): " + "; ".join(f"rank {j}: {m}" for j, m in bad))
    fields_all = [r[1 : 1 + len(fields)] for r in rows]
    problem = describe(fields_all)
    if problem:
        raise ValueError(f"aligned_ops.{what}: the ranks of the group disagree (this is rank {rank}): {problem}")
    return fields_all


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


def tree_all_reduce(partial: torch.Tensor, group=None, *, algorithm: str = "auto", check: bool = True) -> torch.Tensor:
    """Finish the 8-lane linear tree across the ranks of ``group``; returns a new fp32 tensor (same shape).

    ``partial``: this rank's fp32 sub-tree (``aligned_ops.linear_partial(x_r, w_r, 8 // t)``), the same
    shape on every rank. The result on every rank is the tree over group ranks 0..t-1 (see the module
    docstring), so a row-parallel linear equals the unsplit linear bit for bit. ``group``: a
    ``torch.distributed`` process group (default: the world) of t in {1, 2, 4, 8} ranks. ``algorithm``:
    ``"halving"`` (recursive halving, bandwidth-optimal), ``"allgather"`` (one all-gather, then the tree:
    fewer rounds) or ``"auto"`` (all-gather up to ``AUTO_ALLGATHER_MAX_NUMEL`` elements, else halving); the
    same bits whichever runs. ``check`` (default True): first agree with the other ranks on shape, dtype and
    algorithm (one small all-gather); a mismatch or a bad input on any rank raises on every rank (module
    docstring, "Agreement first").
    ``partial`` is not modified.
    """
    return _tree_all_reduce(partial, group, algorithm, check, "tree_all_reduce", None)


def _tree_all_reduce(partial, group, algorithm, check, what, local_error, extra=None):
    """``extra``: ``(fields, describe)`` of the caller's own inputs, agreed in the same all-gather as the partial's
    (``fields`` a fixed-length int list, valid only without a local error; ``describe(all_ranks_fields) -> message
    or None``, asked once the partials agree)."""
    t, r = _group_info(group, what)
    check_tp_degree(t, what)
    if local_error is None:
        try:
            if not isinstance(partial, torch.Tensor):
                raise TypeError(f"aligned_ops.{what}: partial must be a tensor, got {type(partial).__name__}")
            if partial.dtype != torch.float32:
                raise TypeError(f"aligned_ops.{what}: partial must be float32 (the fp32 sub-tree of linear_partial), "
                                f"got {partial.dtype}")
            # NCCL alone: a CPU partial fails in its collective. (A CUDA partial, the GPU hot path, skips the lookup.)
            if t > 1 and partial.device.type != "cuda" and _meta_device(group).type == "cuda":
                raise TypeError(f"aligned_ops.{what}: partial must be a CUDA tensor for this group's backend "
                                f"({dist.get_backend(group)}), got one on {partial.device}")
            if partial.layout != torch.strided or partial.is_meta:
                raise TypeError(f"aligned_ops.{what}: partial must be a dense tensor with data (strided layout, not "
                                f"meta), got layout {partial.layout} on {partial.device}")
            if algorithm not in ALGORITHMS:
                raise ValueError(f"aligned_ops.{what}: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        except Exception as e:  # noqa: BLE001 - any rank-local failure is raised on every rank (_LOCAL_ERRORS)
            local_error = e
    if t > 1 and check:
        ok = local_error is None
        # the device type too: in a mixed group (torch's default cpu:gloo,cuda:nccl) a CPU partial on one rank and a
        # CUDA one on another would send their data over different backends and wait for each other for ever
        n_own = 3 + _MAX_DIMS + 1
        fields = [_dtype_code(partial.dtype) if ok else -1, ALGORITHMS.index(algorithm) if ok else -1,
                  _DEVICE_TYPES.index(partial.device.type) if ok and partial.device.type in _DEVICE_TYPES else -1,
                  *(_shape_fields(partial.shape) if ok else [0] * (_MAX_DIMS + 1))]
        if extra is not None:
            fields += list(extra[0])

        def describe(all_fields):
            keys = {tuple(f[:n_own]) for f in all_fields}
            if len(keys) == 1:
                return None if extra is None else extra[1]([f[n_own:] for f in all_fields])
            return "every rank must pass a partial of the same shape, dtype and device type, with the same " \
                "algorithm; " + ", ".join(
                    f"rank {j}: {_shape_of(f[3:])} {_dtype_name(f[0])} on "
                    f"{_DEVICE_TYPES[f[2]] if f[2] >= 0 else 'another device'} algorithm={ALGORITHMS[f[1]]!r}"
                    for j, f in enumerate(all_fields))

        _agree(group, what, fields, local_error, partial if ok else None, describe)
    elif local_error is not None:
        raise local_error
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


# What a rank-local failure before a collective may be: ANY exception (a None weight's AttributeError included).
# The entry points catch it, carry it through the agreement and raise it on every rank; a narrower tuple let an
# AttributeError escape on one rank while the others waited in the collective until the process-group timeout.
_LOCAL_ERRORS = (Exception,)


def exact_row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                              group=None, *, in_features: int | None = None, check: bool = True) -> torch.Tensor:
    """A row-parallel ``aligned_ops.linear_exact``: rank r holds ``x[..., K_r]`` and ``weight[:, K_r]`` (any
    split of K, uneven included, a rank with K_r = 0 included); every rank returns the full
    ``linear_exact(x, weight, bias)``, bit for bit.

    Exchanged: the agreement record (module docstring; it also carries K_r, so the unsplit K is its sum), the
    x rows' scans plus a "weight packing needed" row (int32 [M + 1, 3], all-reduce MAX) per call, the weight
    rows' scans (int32 [N, 3]) once per weight version, and the partials (int64 [M, N, 2], all-reduce SUM): 16
    bytes per output element (the ``fma`` tree: 4). Every rank of ``group`` must call it together (as any
    row-parallel layer). CPU only (the digit path; the fp64 fast path does not take part). ``check=False``
    skips the agreement when ``in_features`` is given (without it the record is still exchanged: it carries K_r).
    A rank holding no input feature (K_r = 0) computes with one zero column: zeros leave the exact sum and the
    rows' scans unchanged (exact_linear.h: zero elements are skipped, an exact zero sum is +0).
    """
    what = "exact_row_parallel_linear"
    t, r = _group_info(group, what)
    local_error = None
    k_local = n_out = -1
    try:
        _check_tensor_args(what, ("bias",), x=x, weight=weight, bias=bias)
        if x.device.type != "cpu" or weight.device.type != "cpu":
            raise NotImplementedError(
                f"aligned_ops.{what}: the exact profile's tensor-parallel route runs on the CPU only (x on "
                f"{x.device}, weight on {weight.device}); GPU glue for aligned::linear_exact_partial is not built")
        if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[-1]:
            raise ValueError(f"aligned_ops.{what}: x {tuple(x.shape)} and weight {tuple(weight.shape)} must hold "
                             f"the same K slice (weight [out_features, K_r])")
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
            raise ValueError(f"aligned_ops.{what}: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
        k_local, n_out = int(weight.shape[-1]), int(weight.shape[0])
        if in_features is not None and not (0 <= k_local <= in_features):
            raise ValueError(f"aligned_ops.{what}: rank {r} holds {k_local} of K = {in_features} input features")
    except _LOCAL_ERRORS as e:
        local_error = e
    ok = local_error is None
    if t > 1 and (check or in_features is None):
        lead = _shape_fields(x.shape[:-1]) if ok else [0] * (_MAX_DIMS + 1)
        fields = [_dtype_code(x.dtype) if ok else -1, _dtype_code(weight.dtype) if ok else -1, n_out, k_local,
                  -1 if in_features is None else int(in_features), -2 if not ok else (-1 if bias is None else
                  _dtype_code(bias.dtype)), *lead]

        def describe(all_fields):
            same = {tuple(f[:3] + f[4:]) for f in all_fields}
            k_sum = sum(f[3] for f in all_fields)
            if len(same) > 1:
                return ("every rank must pass x of the same dtype and leading shape, a weight slice of the same "
                        "dtype and out_features, the same in_features and a bias alike (present, dtype); " +
                        ", ".join(f"rank {j}: x {_dtype_name(f[0])} {_shape_of(f[6:])}, weight {_dtype_name(f[1])} "
                                  f"[{f[2]}, {f[3]}], bias {'none' if f[5] == -1 else _dtype_name(f[5])}"
                                  for j, f in enumerate(all_fields)))
            if in_features is not None and k_sum != in_features:
                return (f"the ranks' slices hold {k_sum} input features in all, in_features is {in_features} ("
                        + ", ".join(f"rank {j}: {f[3]}" for j, f in enumerate(all_fields)) + ")")
            if k_sum == 0:
                return "no rank holds any input feature (K = 0)"
            return None

        all_fields = _agree(group, what, fields, local_error, x if ok else None, describe)
        k_full = sum(f[3] for f in all_fields)
    elif local_error is not None:
        raise local_error
    else:
        k_full = in_features if in_features is not None else k_local
    if k_full > EXACT_MAX_K:
        raise ValueError(f"aligned_ops.{what}: K = {k_full} exceeds the exact profile's {EXACT_MAX_K} input features "
                         f"(the int64 partials' bound)")
    if k_local == 0:  # one zero column: the same exact sum and row scans (see the docstring); never cached
        x = x.new_zeros((*x.shape[:-1], 1))
        weight = weight.new_zeros((weight.shape[0], 1))
    merge = _all_reduce_max(group)
    tag = (group, t)
    cached = cached_weight_slice(weight, tag)
    # One all-reduce MAX per call carries the x rows' scans and one more row: whether any rank lacks the
    # weight's packing for this version (then every rank packs it, together: no rank can skip a collective
    # the others run, whatever its cache holds).
    need = torch.tensor([[1 if cached is None else 0, 0, 0]], dtype=torch.int32)
    merged = merge(torch.cat([ops.linear_exact_row_scan(x).reshape(-1, 3), need]))
    x_scan = merged[:-1].contiguous()
    if int(merged[-1, 0]) > 0:
        cached = pack_weight_slice(weight, merge, tag)
    _, (wd, we, wb) = cached
    partial = ops.linear_exact_partial(x, wd, we, wb, weight.shape[0], x_scan)
    if t > 1:
        dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)  # int64: exact in any order
    return ops.linear_exact_finish(partial, x_scan, we, wb, bias, x.dtype)


def _check_lane_slice(what: str, label: str, k: int, k_local: int, t: int, r: int) -> None:
    """Rank r's contiguous slice of a reduction dim (``label``, ``k`` long, ``k_local`` held: the row-parallel
    linear's K, a MoE expert's I as vLLM shards it) must be whole lanes: exactly ``linear_tp_slices(k, t)[r]``."""
    try:
        k0, k1 = linear_tp_slices(k, t)[r]
    except ValueError as e:
        raise ValueError(f"aligned_ops.{what}: {label} = {k} does not split into whole lanes over {t} ranks ({e})") \
            from None
    if k1 - k0 != k_local:
        raise ValueError(f"aligned_ops.{what}: {label} = {k} does not split into whole lanes over {t} ranks as this "
                         f"rank's weight does: rank {r} must hold {label}[{k0}:{k1}] ({k1 - k0} features), it holds "
                         f"{k_local}")


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None,
                        *, in_features: int | None = None, algorithm: str = "auto",
                        check: bool = True, sub_tree=linear_partial) -> torch.Tensor:
    """The ``fma`` profile's row-parallel linear: rank r holds ``x[..., K_r]`` and ``weight[:, K_r]`` (K_r its
    slice ``linear_tp_slices(K, t)[r]``, vLLM's contiguous 1/t of K); every rank returns the full
    ``linear(x, weight, bias)``, bit for bit. (The ``exact`` profile's route: :func:`exact_row_parallel_linear`;
    the route of a profile object: ``aligned_ops.profiles.<profile>.row_parallel_linear``.)

    ``partial = linear_partial(x, weight, 8 // t)``, ``s = tree_all_reduce(partial)``, then the linear's
    epilogue: the bias once (fp32) and one rounding to ``x.dtype``. ``in_features`` (the unsplit K), when
    given, is checked: the rank's slice must be whole lanes and K_r long. ``bias``: ``[out_features]`` with x's
    dtype (as ``linear``). ``check`` (default True): the agreement also compares x's dtype, the bias (present,
    dtype) and the ranks' K slices, which must be ``linear_tp_slices(sum of K_r, t)`` (an uneven split, e.g. 40 +
    24 of K = 64, is other lanes: other bits), so a mismatch raises on every rank even without ``in_features``.

    ``sub_tree``: the op computing the rank's lanes — ``linear_partial`` (``fma``), or ``linear_mma_partial``
    (the ``mma`` profile keeps the 8 lanes and the tree, only each lane's chain is the matrix unit's:
    ``aligned_ops.profiles.MMA.row_parallel_linear``).
    """
    what = "row_parallel_linear"
    t, r = _group_info(group, what)
    check_tp_degree(t, what)
    # Every rank-local failure below is raised on every rank by the agreement of the tree all-reduce (a rank
    # raising alone would leave the others waiting in the collective).
    partial, local_error, extra = None, None, None
    try:
        _check_tensor_args(what, ("bias",), x=x, weight=weight, bias=bias)
        k_local = weight.shape[-1]
        if in_features is not None:
            _check_lane_slice(what, "K", in_features, k_local, t, r)
        partial = sub_tree(x, weight, LINEAR_LANES // t)
        if bias is not None and (bias.dtype != x.dtype or tuple(bias.shape) != (weight.shape[0],)):
            raise ValueError(f"aligned_ops.{what}: bias must be [{weight.shape[0]}] with x's dtype ({x.dtype}), got "
                             f"{list(bias.shape)} {bias.dtype}")
        # What the partials' agreement cannot see: x's dtype (the output's), the bias, and this rank's K slice (the
        # slices must be linear_tp_slices(sum of K_r, t): an uneven split gives other lanes, silently other bits)
        extra = ([_dtype_code(x.dtype), -1 if bias is None else _dtype_code(bias.dtype), int(k_local)],
                 lambda all_f: _describe_row_parallel(all_f, t))
    except _LOCAL_ERRORS as e:
        local_error = e
    return finish_linear(_tree_all_reduce(partial, group, algorithm, check, what, local_error,
                                          extra if extra is not None else ([0, 0, 0], None)), bias, x.dtype)


def _describe_row_parallel(all_fields, t):
    """row_parallel_linear's agreement beyond the partials: the same x dtype and bias on every rank, and K slices
    that are the whole-lane split of their sum."""
    def each():
        return ", ".join(f"rank {j}: x {_dtype_name(f[0])}, bias {'none' if f[1] == -1 else _dtype_name(f[1])}, "
                         f"K slice {f[2]}" for j, f in enumerate(all_fields))

    if len({tuple(f[:2]) for f in all_fields}) > 1:
        return "every rank must pass x of the same dtype and a bias alike (present, dtype); " + each()
    k = sum(f[2] for f in all_fields)
    try:
        want = [b - a for a, b in linear_tp_slices(k, t)]
    except ValueError as e:
        return f"K = {k} (the sum of the ranks' slices) does not split into whole lanes over {t} ranks ({e})"
    if [f[2] for f in all_fields] != want:
        return (f"the ranks' K slices must be the whole-lane split of K = {k} over {t} ranks, {want} features "
                f"(aligned_ops.linear_tp_slices); " + each())
    return None


def sharded_rows_all_reduce(local: torch.Tensor, not_owned: torch.Tensor, group=None, *,
                            check: bool = True) -> torch.Tensor:
    """Combine a vocab-sharded embedding lookup exactly: every row is owned by exactly one rank.

    ``local [..., H]``: this rank's lookup (float32, bfloat16 or float16, the same on every rank; rows it does not
    own are ignored), ``not_owned [...]`` bool. Rows this rank does not own contribute ``-0.0``: ``x + (-0.0) == x``
    for every x (-0.0, NaN and inf included) and ``(-0.0) + (-0.0) == -0.0``, so the sum over ranks — in any order
    — is a copy of the owner's row, sign of zero kept. (Filling with +0.0, as vLLM does, turns an owner's -0.0 into
    +0.0.) The sum runs through :func:`tree_all_reduce` in fp32; widening these dtypes and narrowing back are
    exact (float64 or integers would not be: refused).
    """
    what = "sharded_rows_all_reduce"
    t, _ = _group_info(group, what)
    filled, local_error = None, None
    try:
        if not isinstance(local, torch.Tensor) or local.dtype not in _EXACT_IN_FP32:
            got = local.dtype if isinstance(local, torch.Tensor) else type(local).__name__
            raise TypeError(f"aligned_ops.{what}: local must be float32, bfloat16 or float16 (the sum runs in fp32, "
                            f"which holds these exactly), got {got}")
        _check_tensor_args(what, not_owned=not_owned)
        filled = local.masked_fill(not_owned.unsqueeze(-1), -0.0)
    except _LOCAL_ERRORS as e:
        local_error = e
    if t == 1:
        if local_error is not None:
            raise local_error
        return filled
    dtype_code = [_dtype_code(local.dtype) if local_error is None else -1]

    def same_dtype(all_fields):
        if len({f[0] for f in all_fields}) == 1:
            return None
        return "every rank must pass local of the same dtype; " + ", ".join(
            f"rank {j}: {_dtype_name(f[0])}" for j, f in enumerate(all_fields))

    out = _tree_all_reduce(None if filled is None else filled.to(torch.float32), group, "auto", check, what,
                           local_error, (dtype_code, same_dtype))
    return out.to(local.dtype)


_EXACT_IN_FP32 = (torch.float32, torch.bfloat16, torch.float16)  # dtypes fp32 holds exactly (widen, add -0.0, narrow)


# ---- MoE experts at TP > 1 ------------------------------------------------------------------------------------

MOE_COMBINES = ("tree", "late")  # "late": NEGATIVE CONTROL ONLY (vLLM's order: each rank's output, then the sum)


def _moe_expert_linears(linear_profile: str):
    """(first projection -> model dtype, the rank's down-projection sub-tree -> fp32, the shared gate's fp32 logit)
    of an experts profile: the ops ``aligned::moe_experts`` runs (ops/moe.py's recomputation table)."""
    from .linear_mma import linear_mma_partial

    table = {  # keyed by moe_experts' linear_profile values (ops/moe.py EXPERT_PROFILES)
        "fma": (lambda x, w: ops.linear(x, w, None),
                lambda a, w, lanes: linear_partial(a.float(), w.float(), lanes),
                lambda x, g: ops.linear(x.float(), g.float(), None)),
        "mma": (lambda x, w: ops.linear_mma(x, w, None),
                lambda a, w, lanes: linear_mma_partial(a, w, lanes),
                lambda x, g: linear_mma_partial(x, g, LINEAR_LANES)),
    }
    if linear_profile not in table:
        raise ValueError(f"aligned_ops.row_parallel_moe_experts: linear_profile must be one of {tuple(table)}, got "
                         f"{linear_profile!r}")
    return table[linear_profile]


def _moe_expert_partials(x, topk_ids, w13, w2, shared_w13, shared_w2, lanes, linear_profile):
    """This rank's fp32 sub-trees ``[T, k (+1), H]``: slot r = expert ids[:, r]'s down projection over this rank's
    I slice, the last slot the shared expert's (moe.h's y_r / y_s before the cross-rank part of their trees)."""
    first, sub_tree, _ = _moe_expert_linears(linear_profile)
    T, H = x.shape
    k = topk_ids.shape[1]
    routed = torch.zeros((T * k, H), dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.sort(flat, stable=True).indices  # expert-major; the slots are independent rows
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start:start + n]
        start += n
        a = ops.silu_and_mul(first(x.index_select(0, sel // k).contiguous(), w13[e]))
        routed[sel] = sub_tree(a, w2[e], lanes)
    parts = [routed.view(T, k, H)]
    if shared_w13 is not None:
        a = ops.silu_and_mul(first(x, shared_w13))
        parts.append(sub_tree(a, shared_w2, lanes).view(T, 1, H))
    return torch.cat(parts, dim=1)


def _moe_combine(y, topk_weights, gate, dtype):
    """moe.h's combine on full fp32 rows: acc = +0; acc = acc + w_r * y_r (rank order, product rounded, then
    added); + g * y_s (``gate`` [T, 1] fp32, None: g = 1); one rounding."""
    k = topk_weights.shape[1]
    acc = torch.zeros((y.shape[0], y.shape[2]), dtype=torch.float32, device=y.device)
    w = topk_weights.float()
    for r in range(k):
        acc = acc + w[:, r:r + 1] * y[:, r]
    if y.shape[1] > k:  # the shared expert: g * y_s, g = 1 without a gate (1 * y == y)
        acc = acc + (y[:, k] if gate is None else gate * y[:, k])
    return acc.to(dtype)


def row_parallel_moe_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                             w2: torch.Tensor, shared_w13: torch.Tensor | None = None,
                             shared_w2: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
                             group=None, *, linear_profile: str = "fma", combine: str = "tree",
                             algorithm: str = "auto", check: bool = True, intermediate_size: int | None = None,
                             shared_intermediate_size: int | None = None) -> torch.Tensor:
    """``aligned::moe_experts`` of a tensor-parallel MoE block, bit for bit at every t in {1, 2, 4, 8}.

    Rank r holds every expert's I slice (vLLM's layout): ``w13 [E, 2I/t, H]`` (its gate rows, then its up rows),
    ``w2 [E, H, I/t]``, and the shared expert's ``shared_w13 [2Is/t, H]``, ``shared_w2 [H, Is/t]``; ``x [T, H]``,
    the routing (``topk_weights`` fp32, ``topk_ids``) and ``shared_gate [1, H]`` are the same on every rank (the
    router and the gate are replicated). The first projection and silu_and_mul are column-parallel (whole
    elements); each down projection's 8/t-lane sub-tree over the rank's I slice goes through
    :func:`tree_all_reduce` (one call for all slots), then moe.h's combine and one rounding (module docstring).
    ``linear_profile``: the experts' profile ("fma", "mma"), as ``moe_experts``. ``combine="late"``: NEGATIVE
    CONTROL ONLY — each rank weights and sums its own sub-trees into an output in the model dtype and the ranks'
    outputs are then added (vLLM's order: its fused-MoE kernel writes each rank's output, the all-reduce sums
    them); it breaks the contract. ``intermediate_size`` / ``shared_intermediate_size``: the model's whole I (and
    the shared expert's), checked to split into whole lanes with this rank holding exactly its slice (None: taken
    as t times the local width, which only checks that width). No backward (rollout only)."""
    what = "row_parallel_moe_experts"
    t, r = _group_info(group, what)
    check_tp_degree(t, what)
    partial, local_error = None, None
    try:
        if combine not in MOE_COMBINES:
            raise ValueError(f"aligned_ops.{what}: combine must be one of {MOE_COMBINES}, got {combine!r}")
        _check_tensor_args(what, ("shared_w13", "shared_w2", "shared_gate"), x=x, topk_weights=topk_weights,
                           topk_ids=topk_ids, w13=w13, w2=w2, shared_w13=shared_w13, shared_w2=shared_w2,
                           shared_gate=shared_gate)
        if (x.dim() != 2 or topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape
                or x.shape[0] != topk_ids.shape[0]):
            raise ValueError(f"aligned_ops.{what}: x must be [T, H] and topk_weights, topk_ids [T, k], got "
                             f"{list(x.shape)}, {list(topk_weights.shape)}, {list(topk_ids.shape)}")
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] != 2 * w2.shape[2] or w13.shape[2] != x.shape[1]:
            raise ValueError(f"aligned_ops.{what}: w13 must be [E, 2I/t, H] and w2 [E, H, I/t], got "
                             f"{list(w13.shape)}, {list(w2.shape)}")
        if (shared_w13 is None) != (shared_w2 is None) or (shared_gate is not None and shared_w13 is None):
            raise ValueError(f"aligned_ops.{what}: shared_w13 and shared_w2 (and shared_gate) go together")
        i_full = w2.shape[2] * t if intermediate_size is None else int(intermediate_size)
        _check_lane_slice(what, "intermediate_size (w2's I)", i_full, w2.shape[2], t, r)
        if shared_w2 is not None:
            is_full = shared_w2.shape[1] * t if shared_intermediate_size is None else int(shared_intermediate_size)
            _check_lane_slice(what, "shared_intermediate_size (shared_w2's I)", is_full, shared_w2.shape[1], t, r)
        partial = _moe_expert_partials(x, topk_ids, w13, w2, shared_w13, shared_w2, LINEAR_LANES // t, linear_profile)
        gate = None
        if shared_gate is not None:
            logit = _moe_expert_linears(linear_profile)[2](x, shared_gate.reshape(1, x.shape[1]))
            gate = 1.0 / (1.0 + ops._exp_f32(-logit))  # moe.h moe_shared_gate, fp32 [T, 1]
        if combine == "late":  # negative control: each rank's weighted sum in the model dtype first (vLLM's)
            partial = _moe_combine(partial, topk_weights, gate, x.dtype).float().unsqueeze(1)
    except _LOCAL_ERRORS as e:
        local_error = e
    y = _tree_all_reduce(partial, group, algorithm, check, what, local_error)
    if combine == "late":
        return y[:, 0].to(x.dtype)
    return _moe_combine(y, topk_weights, gate, x.dtype)
