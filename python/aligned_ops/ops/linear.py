"""The linear family, ``fma`` profile: ``aligned::linear`` (fake impls, autograd, wrapper) and its lane
structure for tensor parallelism: ``aligned::linear_partial`` (fake impl, no-backward rule, wrapper) and the
Python reference of how rank partials combine. (The ``exact`` profile: ``linear_exact.py``.)

The contract (csrc/common/contract.h, ``fma`` profile): ``linear`` cuts K into 8 lanes of contiguous
elements, lane ``l`` = ``[floor(l*K/8), floor((l+1)*K/8))``, runs one fp32 fma chain per lane, and combines
the 8 lane sums in the fixed tree ``((0+1)+(2+3))+((4+5)+(6+7))`` before adding the bias once and rounding
once. ``linear_partial(x, w, lanes)`` is the sub-tree over ``lanes`` lanes of its LOCAL K (cut by the same
floor rule), fp32, no bias.

A t-way row-parallel layer (t in 1, 2, 4, 8): rank r holds the K slice ``linear_tp_slices(K, t)[r]``, which
is exactly the global lanes ``r*8/t .. (r+1)*8/t - 1``, and computes ``linear_partial(x_r, w_r, 8 // t)``.
``tree_combine`` of the t partials (adjacent pairs first, level by level), ``+ bias`` in fp32 and one rounding
give ``linear(x, w, bias)`` bit for bit. A tree all-reduce (aligned_ops.tree_all_reduce, issue 12) must
compute exactly ``tree_combine``.
"""

from __future__ import annotations

import torch

from ._registry import checked_int, ops, register_linear_autograd, register_no_backward
from ._registry import reg_fake as _reg_fake
from ._registry import same_device as _same_device

LINEAR_LANES = 8
_LANES = (1, 2, 4, 8)


def _check_features(op: str, K) -> int:
    """K (input features) as an int >= 0, or an error naming ``op`` and K."""
    return checked_int(op, "K (input features)", K, 0)


def linear_lane_bounds(K: int, lanes: int = LINEAR_LANES) -> list[tuple[int, int]]:
    """The ``[k0, k1)`` of each lane when K is cut into ``lanes`` lanes (floor rule of contract.h)."""
    K = _check_features("linear_lane_bounds", K)
    if lanes not in _LANES:
        raise ValueError(f"aligned_ops.linear_lane_bounds: lanes must be 1, 2, 4 or 8, got {lanes}")
    return [((l * K) // lanes, ((l + 1) * K) // lanes) for l in range(lanes)]


def linear_tp_slices(K: int, t: int) -> list[tuple[int, int]]:
    """The K slice ``[k0, k1)`` of each rank of a t-way row-parallel linear with K input features.

    Rank r holds the global lanes ``r*8/t .. (r+1)*8/t - 1``, i.e. ``[floor(r*K/t), floor((r+1)*K/t))``, and
    calls ``linear_partial(..., lanes=8 // t)`` on it, which cuts the LOCAL K by the floor rule. That local cut
    reproduces the global lanes for every t when ``K % 8 == 0``; otherwise only for some (K, t) — for the rest
    this raises ValueError, because no split into whole lanes exists that linear_partial would see as such."""
    K = _check_features("linear_tp_slices", K)
    if t not in _LANES:
        raise ValueError(f"aligned_ops.linear_tp_slices: t (TP degree) must be 1, 2, 4 or 8, got {t}")
    glob = linear_lane_bounds(K)
    per = LINEAR_LANES // t
    slices = []
    for r in range(t):
        k0, k1 = glob[r * per][0], glob[(r + 1) * per - 1][1]
        local = [(a + k0, b + k0) for a, b in linear_lane_bounds(k1 - k0, per)]
        if local != glob[r * per : (r + 1) * per]:
            raise ValueError(
                f"aligned_ops.linear_tp_slices: K={K} cannot be split {t} ways into whole lanes: rank {r} holds "
                f"K[{k0}:{k1}], whose own {per}-lane cut {local} is not the global lanes "
                f"{glob[r * per : (r + 1) * per]} (K % 8 == 0 always works)"
            )
        slices.append((k0, k1))
    return slices


def tree_combine(partials) -> torch.Tensor:
    """Reference of the tree all-reduce: fold t in 1, 2, 4, 8 fp32 rank partials (rank order) adjacent pairs
    first, level by level — ``(p0+p1)``, ``((p0+p1)+(p2+p3))``, ... — the top of the 8-lane tree."""
    parts = list(partials)
    if len(parts) not in _LANES:
        raise ValueError(f"aligned_ops.tree_combine: needs 1, 2, 4 or 8 partials, got {len(parts)}")
    for i, p in enumerate(parts):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"aligned_ops.tree_combine: partials[{i}] must be a tensor, got {type(p).__name__}")
        if p.dtype != torch.float32:
            raise ValueError(f"aligned_ops.tree_combine: partials must be float32, got {p.dtype}")
        # every rank's partial covers the same outputs: a [1, N] beside [M, N] would broadcast (a silent wrong sum)
        if p.shape != parts[0].shape or p.device != parts[0].device:
            raise ValueError(f"aligned_ops.tree_combine: every partial must have partials[0]'s shape and device "
                             f"{tuple(parts[0].shape)} on {parts[0].device}, got partials[{i}] {tuple(p.shape)} "
                             f"on {p.device}")
    while len(parts) > 1:
        parts = [parts[2 * i] + parts[2 * i + 1] for i in range(len(parts) // 2)]
    return parts[0]


def finish_linear(acc: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The linear epilogue on a combined fp32 tree: ``+ bias`` once in fp32 (none: no add), one rounding."""
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(dtype)


@torch.library.register_fake("aligned::linear_partial")
def _(x, weight, lanes):
    devs = {x.device, weight.device}
    torch._check(len(devs) == 1, lambda: f"aligned::linear_partial: all tensors must be on the same device, got {devs}")
    torch._check(lanes in _LANES, lambda: f"aligned::linear_partial: lanes must be 1, 2, 4 or 8, got {lanes}")
    torch._check(x.dim() >= 1, lambda: "aligned::linear_partial: x must have at least one dimension")
    torch._check(weight.dim() == 2, lambda: "aligned::linear_partial: weight must be 2-D")
    torch._check(x.shape[-1] == weight.shape[1], lambda: "aligned::linear_partial: in_features mismatch")
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


@torch.library.register_fake("aligned::_linear_partial_reference")
def _(x, weight, lanes):
    torch._check(x.shape[-1] == weight.shape[1], lambda: "aligned::_linear_partial_reference: in_features mismatch")
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


def _partial_setup(ctx, inputs, output):
    pass


def _partial_backward(ctx, grad):
    raise RuntimeError(
        "aligned::linear_partial has no backward: it is the forward half of a row-parallel linear whose "
        "gradient is linear_backward on the local slice (dx = g @ w_r, dw_r = g^T @ x_r); differentiate "
        "aligned.linear or the TP layer instead"
    )


torch.library.register_autograd("aligned::linear_partial", _partial_backward, setup_context=_partial_setup)


def linear_partial(x: torch.Tensor, weight: torch.Tensor, lanes: int) -> torch.Tensor:
    """fp32 sub-tree over ``lanes`` lanes of the local K (see the module docstring); no bias, no rounding."""
    return ops.linear_partial(x, weight, lanes)


register_no_backward("_linear_partial_reference", "a test hook: contract.h's scalar linear_partial_dot")


# ---- aligned::linear (the fma profile's full tree + bias, one rounding): fake impls, autograd, wrapper -------

@_reg_fake("linear")
def _(x, weight, bias=None):
    _same_device("linear", x, weight, bias)
    torch._check(x.dim() >= 1, lambda: "aligned::linear: x must have at least one dimension")
    torch._check(weight.dim() == 2, lambda: "aligned::linear: weight must be 2-D")
    torch._check(x.shape[-1] == weight.shape[1], lambda: "aligned::linear: in_features mismatch")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_reg_fake("linear_backward")
def _(grad_out, x, weight, needs_x_grad, needs_w_grad, needs_b_grad):
    _same_device("linear_backward", grad_out, x, weight)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if needs_x_grad else None
    dw = weight.new_empty(weight.shape) if needs_w_grad else None
    db = x.new_empty((weight.shape[0],)) if needs_b_grad else None
    return dx, dw, db


register_linear_autograd("linear")  # dx, dw, db through aligned::linear_backward (_registry.linear_grads)

register_no_backward("linear_backward", "it is a backward op; double backward is not implemented")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, the ``fma`` profile: 8 lanes of K, one fp32 fma chain each, a fixed tree, + bias
    once (csrc/common/contract.h) — batch-, thread-, backend- and TP-degree-invariant."""
    return ops.linear(x, weight, bias)
