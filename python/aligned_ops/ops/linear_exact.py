"""The ``exact`` linear profile: fake impls, autograd, the packed-weight cache and the profile switch.

``linear_exact(x, weight, bias)`` computes every output as the exact integer dot product of the canonical
fixed-point forms of the bf16/fp16/fp32 inputs (``csrc/common/exact_linear.h``, ``docs/exact_linear.md``),
rounded once to fp32 and once to x's dtype. Its bits do not depend on batch, row position, threads, ISA level
(AMX-INT8, AVX512-VNNI, AVX2, generic) or how K is cut.

Backward (training) uses the deterministic ``fma`` path (``aligned::linear_backward``): rollouts never need
backward bits, and the trainer's forward still uses the exact kernel, so forward log-probs match the engine.

Profile switch: ``ALIGNED_OPS_LINEAR=fma|exact|mma`` (process-wide, read by the vLLM plugin and the trainer
patch through :func:`linear_profile`; ``fma`` when unset; ``mma``: ``linear_mma.py``).
"""

from __future__ import annotations

import os
import torch
from torch.utils.weak import WeakIdKeyDictionary

from ._registry import linear_grads, register_linear_autograd, save_linear_inputs

ops = torch.ops.aligned
_lib = "aligned::"

PROFILES = ("fma", "exact", "mma")


def linear_profile() -> str:
    """The process-wide linear numerics profile from ``ALIGNED_OPS_LINEAR`` (``fma`` when unset)."""
    p = os.environ.get("ALIGNED_OPS_LINEAR", "fma").strip().lower() or "fma"
    if p not in PROFILES:
        raise ValueError(f"ALIGNED_OPS_LINEAR must be one of {PROFILES}, got {p!r}")
    return p


def _same_device(op, *ts):
    devs = {t.device for t in ts if t is not None}
    torch._check(len(devs) <= 1, lambda: f"aligned::{op}: all tensors must be on one device, got {sorted(map(str, devs))}")


def _ceil(v, m):
    return (v + m - 1) // m * m


@torch.library.register_fake(_lib + "linear_exact")
def _(x, weight, bias=None):
    _same_device("linear_exact", x, weight, bias)
    torch._check(x.dim() >= 1, lambda: "aligned::linear_exact: x must have at least one dimension")
    torch._check(weight.dim() == 2, lambda: "aligned::linear_exact: weight must be 2-D")
    torch._check(x.shape[-1] == weight.shape[1], lambda: "aligned::linear_exact: in_features mismatch")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake(_lib + "linear_exact_packed")
def _(x, weight_digits, weight_exponents, weight_nonfinite, out_features, bias=None, k_parts=1, weight=None,
      weight_f64_bounds=None):
    _same_device("linear_exact_packed", x, weight_digits, bias)
    return x.new_empty((*x.shape[:-1], out_features))


def _packed_weight_fake(weight):
    # The digit count is data-dependent (the fewest digits that hold every row exactly).
    ctx = torch.library.get_ctx()
    s = ctx.new_dynamic_size(min=1, max=4)
    n, k = weight.shape
    return (
        weight.new_empty((s, _ceil(n, 16) * _ceil(k, 64)), dtype=torch.int8),
        weight.new_empty((n + 1,), dtype=torch.int32),
        weight.new_empty((n,), dtype=torch.uint8),
    )


@torch.library.register_fake(_lib + "linear_exact_pack_weight")
def _(weight):
    return _packed_weight_fake(weight)


@torch.library.register_fake(_lib + "linear_exact_f64_bounds")
def _(weight):
    return weight.new_empty((weight.shape[0],), dtype=torch.int32)


@torch.library.register_fake(_lib + "_linear_exact_f64_pairs")
def _(x, weight_f64_bounds):
    return x.new_empty((x.shape[:-1].numel(), weight_f64_bounds.shape[0]), dtype=torch.bool)


@torch.library.register_fake(_lib + "_linear_exact_f64_routes")
def _(x, weight, weight_f64_bounds):
    return x.new_empty((x.shape[:-1].numel(), weight.shape[0]), dtype=torch.int8)


@torch.library.register_fake(_lib + "_linear_exact_reference")
def _(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# ---- tensor parallelism (exact_linear.h, "tensor parallelism"; ops/collective.py exact_row_parallel_linear) ----
@torch.library.register_fake(_lib + "linear_exact_row_scan")
def _(v):
    torch._check(v.dim() >= 1, lambda: "aligned::linear_exact_row_scan: v must have at least one dimension")
    return v.new_empty((v.shape[:-1].numel(), 3), dtype=torch.int32)


@torch.library.register_fake(_lib + "linear_exact_pack_weight_scanned")
def _(weight, row_scan):
    return _packed_weight_fake(weight)


@torch.library.register_fake(_lib + "linear_exact_partial")
def _(x, weight_digits, weight_exponents, weight_nonfinite, out_features, x_scan):
    _same_device("linear_exact_partial", x, weight_digits, x_scan)
    return x.new_empty((*x.shape[:-1], out_features, 2), dtype=torch.int64)


@torch.library.register_fake(_lib + "linear_exact_finish")
def _(partial, x_scan, weight_exponents, weight_nonfinite, bias, dtype):
    _same_device("linear_exact_finish", partial, x_scan, bias)
    torch._check(partial.dim() >= 2 and partial.shape[-1] == 2,
                 lambda: "aligned::linear_exact_finish: partial must be int64 [..., out_features, 2]")
    return partial.new_empty(partial.shape[:-1], dtype=dtype)


# The fma profile's deterministic backward (contract.h chains; see the module docstring), shared with linear.
register_linear_autograd("linear_exact")


# ---- packed-weight cache: one packing per weight version --------------------------------------------------
# Keyed by the weight tensor (weakly) and validated by (data_ptr, version, shape, dtype). A refit that writes
# through ``param.data`` does not bump the version counter: call clear_exact_weight_cache() after it (the
# vLLM plugin does after weight loading). Memory: S bytes per weight element (S = 1..4 digits, 4 for
# ordinary random-init weights) + 5 bytes per output row, padded to 16 rows x 64 columns. The cache keeps the
# weight itself referenced (the key): the CPU's fp64 path (rows meeting exact_linear.h's bound) streams it.
_cache = WeakIdKeyDictionary()  # tensors compare elementwise, so key them by identity


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors carry no version counter
        return -1


def clear_exact_weight_cache() -> None:
    _cache.clear()
    _tp_cache.clear()


def _packed(weight: torch.Tensor):
    key = (weight.data_ptr(), _version(weight), tuple(weight.shape), weight.dtype)
    hit = _cache.get(weight)
    if hit is not None and hit[0] == key:
        return hit
    with torch.no_grad():
        w = weight.detach()
        packed = ops.linear_exact_pack_weight(w)
        # the CPU fp64 path's per-row bounds (exact_linear.h): 4 bytes per output row; the path streams the
        # weight itself (bf16 / fp16: 2 bytes per element) for row pairs meeting the bound
        bounds = ops.linear_exact_f64_bounds(w) if w.device.type == "cpu" else None
    _cache[weight] = hit = (key, packed, bounds)
    return hit


# TP: a weight SLICE packed against the canonical forms of its full rows (one all-reduce MAX of the slices'
# row scans, once per weight version: ``merge`` does it). Same key and invalidation as above.
_tp_cache = WeakIdKeyDictionary()


def _slice_key(weight, tag):
    return (weight.data_ptr(), _version(weight), tuple(weight.shape), weight.dtype, tag)


def cached_weight_slice(weight: torch.Tensor, tag=None):
    """The cached ``(row_scan, (digits, exponents, nonfinite))`` of a row-parallel weight slice for this weight
    version, or None (then every rank must call :func:`pack_weight_slice` together)."""
    hit = _tp_cache.get(weight)
    if hit is not None and hit[0] == _slice_key(weight, tag):
        return hit[1], hit[2]
    return None


def pack_weight_slice(weight: torch.Tensor, merge, tag=None):
    """Pack the slice ``weight [N, K_r]`` against its full rows' forms: ``merge(local_scan)`` must return the
    elementwise MAX of every rank's scan (an all-reduce MAX; every rank calls this together). Cached."""
    with torch.no_grad():
        w = weight.detach()
        scan = merge(ops.linear_exact_row_scan(w))
        packed = ops.linear_exact_pack_weight_scanned(w, scan)
    _tp_cache[weight] = (_slice_key(weight, tag), scan, packed)
    return scan, packed


def packed_weight(weight: torch.Tensor):
    return _packed(weight)[1]


def exact_weight_cache_bytes() -> int:
    return sum(sum(t.numel() * t.element_size() for t in (*v[1], *(() if v[2] is None else (v[2],))))
               for v in _cache.values())


def _run_packed(x, weight, bias):
    _, (wd, we, wb), bounds = _packed(weight)
    if bounds is None:
        return ops.linear_exact_packed(x, wd, we, wb, weight.shape[0], bias, 1)
    return ops.linear_exact_packed(x, wd, we, wb, weight.shape[0], bias, 1, weight.detach(), bounds)


class _LinearExactCached(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        save_linear_inputs(ctx, (x, weight, bias), None)
        return _run_packed(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        return linear_grads(ctx, grad)


def linear_exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` under the ``exact`` profile, with the weight's packed digits cached.

    Under torch.compile (or on a non-CPU device) the uncached op runs (it packs the weight each call)."""
    if torch.compiler.is_compiling() or x.device.type != "cpu":
        return ops.linear_exact(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _LinearExactCached.apply(x, weight, bias)
    return _run_packed(x, weight, bias)


def profile_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The aligned linear of the process's profile (``ALIGNED_OPS_LINEAR``)."""
    profile = linear_profile()
    if profile == "exact":
        return linear_exact(x, weight, bias)
    if profile == "mma":
        return ops.linear_mma(x, weight, bias)
    return ops.linear(x, weight, bias)


# Ops autograd must not differentiate silently (torch's default would return zeros with a warning):
# linear_exact_packed is differentiated through _LinearExactCached above; the reference is a test hook.
from ._registry import register_no_backward  # noqa: E402

register_no_backward("linear_exact_packed", "call aligned_ops.linear_exact, whose autograd wraps it")
register_no_backward("_linear_exact_reference", "a test hook: the scalar int128 model of the exact profile")
# (linear_exact_partial's output is integer: nothing flows through it.)
register_no_backward("linear_exact_finish", "the exact profile's TP forward (rollouts); training runs at TP = 1 / FSDP")
