"""The ``exact`` linear profile: fake impls, autograd, the packed-weight cache and the profile switch.

``linear_exact(x, weight, bias)`` computes every output as the exact integer dot product of the canonical
fixed-point forms of the bf16/fp16/fp32 inputs (``csrc/common/exact_linear.h``, ``docs/exact_linear.md``),
rounded once to fp32 and once to x's dtype. Its bits do not depend on batch, row position, threads, ISA level
(AMX-INT8, AVX512-VNNI, AVX2, generic) or how K is cut.

Backward (training) uses the deterministic ``fma`` path (``aligned::linear_backward``): rollouts never need
backward bits, and the trainer's forward still uses the exact kernel, so forward log-probs match the engine.

The profile as an object (its linear, TP route, capabilities) and the ``ALIGNED_OPS_LINEAR`` switch:
:mod:`aligned_ops.profiles` (``EXACT``).
"""

from __future__ import annotations

import weakref

import torch

from .._dtensor import is_dtensor, local_tensor
from ._registry import linear_grads, register_linear_autograd, save_linear_inputs

ops = torch.ops.aligned
_lib = "aligned::"

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


# ---- packed-weight cache: registered weights only, one packing per observed weight state ---------------------
# Packing a weight costs about what an exact matmul of ~100 rows does, so a decode step (a few rows) must not
# repack: the rollout engine's weights keep their packing across calls. A cached packing is only sound if every
# write to the weight is seen, and torch cannot see all of them: writes through ``param.data`` (vLLM's weight
# loaders, ``dist.broadcast(p.data)``), FSDP2's all-gathers into the unsharded parameter (same tensor, same
# storage pointer, version 0 on every step: measured) and any write to an inference tensor (no version counter)
# leave every observable property of the tensor unchanged. So:
#   * only weights whose owner REGISTERED them (cache_exact_weights) are cached; every other weight is packed
#     on every call (the trainer's forward: hundreds of rows, so the packing is a small part of it). The owner
#     takes on invalidation: the vLLM plugin registers its engine's linear weights, makes vLLM's weight loaders
#     bump the parameter's version counter (every load_weights: what TRL / OpenRLHF / verl call to sync) and
#     clears the cache after vLLM's reload / post-load processing (rollout.refit);
#   * a registered weight's packing is used only while the weight's identity (a weak key: an entry dies with its
#     tensor, so a reused id or pointer cannot hit), storage pointer and size, offset, shape, strides, dtype,
#     device and version counter are the ones it was packed from (in-place ops, optimiser steps, no_grad
#     copy_, ``p.data = t`` all change one of them);
#   * an inference tensor has no version counter: it is never cached, registered or not;
#   * a write that bypasses the version counter of a registered weight must be followed by
#     clear_exact_weight_cache() (or torch.autograd.graph.increment_version(weight)).
# Memory: S bytes per weight element (S = 1..4 digits, 4 for ordinary random-init weights) + 5 bytes per output
# row, padded to 16 rows x 64 columns, plus 4 bytes per row for the CPU fp64 path's bounds (which streams the
# weight itself for the row pairs meeting exact_linear.h's bound).
class IdentityMap:
    """Tensor -> value by identity (tensors compare elementwise), weak: an entry dies with its tensor, so a later
    tensor at the same address cannot hit. torch.utils.weak.WeakIdKeyDictionary's semantics, but a lookup builds
    no weak reference: ~0.2 us instead of ~6 us, and the rollout engine looks up two entries per linear per step
    (the registration and the packing: 17 linears a step for a 4-layer model)."""

    def __init__(self):
        self._entries = {}  # id(tensor) -> (weakref to it, value)

    def get(self, tensor, default=None):
        entry = self._entries.get(id(tensor))
        return default if entry is None or entry[0]() is not tensor else entry[1]

    def __contains__(self, tensor) -> bool:
        entry = self._entries.get(id(tensor))
        return entry is not None and entry[0]() is tensor

    def __setitem__(self, tensor, value) -> None:
        key, entries = id(tensor), self._entries

        def drop(ref):  # the tensor died: remove its entry unless a later tensor at this id replaced it
            if entries.get(key, (None,))[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(tensor, drop), value)

    def values(self):
        return [value for ref, value in list(self._entries.values()) if ref() is not None]

    def clear(self) -> None:
        self._entries.clear()


_registered = IdentityMap()
_cache = IdentityMap()


def cache_exact_weights(*weights) -> int:
    """Let the ``exact`` profile keep the packed digits of these weights (tensors, or every parameter of the
    ``nn.Module``s given) across calls; returns how many tensors were registered.

    The caller vouches for invalidation: in-place changes the version counter sees are picked up by themselves;
    writes that bypass it (through ``.data``, collectives into the storage, FSDP-style storage reuse) need
    :func:`clear_exact_weight_cache` afterwards. Inference tensors are never cached (no version counter).
    Registering also declares a tensor subclass's ``__torch_function__`` a pass-through (vLLM's parameter classes):
    ``aligned_ops.linear_mma`` reads a registered weight as a plain tensor without calling it.
    Refused (ValueError): DTensors (FSDP2/TP), FSDP2-managed modules, and — for models sharded by
    ``integrations.fsdp.shard_aligned`` — any module inside the model and any of its parameters, sharded or
    unsharded (the root's parameters are plain ``nn.Parameter``s between its forward and backward). FSDP2
    all-gathers every step into the same unsharded storage without moving its version counter, and frees it
    between forwards, so a cached packing or derivation (MLA's W_UK / W_UV) would go stale or outlive its
    buffer; an FSDP2 trainer derives per forward."""
    n = 0
    sharded = _fsdp2_views()
    for obj in weights:
        _refuse_fsdp(obj, sharded)
        tensors = obj.parameters() if isinstance(obj, torch.nn.Module) else (obj,)
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"aligned_ops.cache_exact_weights: expected tensors or modules, got {type(t).__name__}")
            _refuse_fsdp(t, sharded)
            _registered[t] = True
            n += 1
    return n


_fsdp2_models = weakref.WeakSet()  # models sharded by integrations.fsdp.shard_aligned (mark_fsdp2_model)


def mark_fsdp2_model(model: torch.nn.Module) -> None:
    """Record a model FSDP2 shards (``shard_aligned`` calls it): :func:`cache_exact_weights` then refuses it, any
    module inside it and any of its parameters, sharded or not (a root FSDP2 module's parameters are plain
    ``nn.Parameter``s between its forward and backward, in storage FSDP2 reuses)."""
    _fsdp2_models.add(model)


def _fsdp2_views():
    """``(module ids, tensor ids, storage pointers)`` of every model :func:`mark_fsdp2_model` recorded: its
    modules, and every tensor through which its parameters are reachable — its current parameters (DTensors, or
    plain Parameters while unsharded) and each FSDPParam's sharded and unsharded parameter — with the storage
    they hold now (a freed unsharded buffer holds none)."""
    modules, tensors, ptrs = set(), set(), set()
    if not _fsdp2_models:
        return modules, tensors, ptrs
    from torch.distributed.fsdp import FSDPModule

    for model in list(_fsdp2_models):
        views = list(model.parameters())
        for m in model.modules():
            modules.add(id(m))
            if isinstance(m, FSDPModule):
                group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)  # private: torch 2.13's layout
                for fp in getattr(group, "fsdp_params", ()):
                    views += [t for t in (getattr(fp, "sharded_param", None), getattr(fp, "_unsharded_param", None))
                              if isinstance(t, torch.Tensor)]
        for t in views:
            tensors.add(id(t))
            ptrs.add(_storage_ptr(t))
    ptrs.discard(0)
    return modules, tensors, ptrs


def _storage_ptr(t: torch.Tensor) -> int:
    t = local_tensor(t)
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse / storage-less tensors: no storage to share
        return 0
    return s.data_ptr() if s.nbytes() > 0 else 0


def _refuse_fsdp(obj, sharded) -> None:
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    modules, tensors, ptrs = sharded
    what = None
    if is_dtensor(obj):
        what = "a DTensor (FSDP2/TP)"
    elif isinstance(obj, torch.nn.Module):
        if any(isinstance(m, FSDPModule) or m in _fsdp2_models for m in obj.modules()):
            what = "an FSDP2-managed module"
        elif id(obj) in modules:
            what = "a module inside an FSDP2-sharded model"
    elif isinstance(obj, torch.Tensor) and (id(obj) in tensors or (ptrs and _storage_ptr(obj) in ptrs)):
        # the tensor itself, or a view of its storage (``p.data``, ``p.detach()``) while that holds memory
        what = "a parameter of an FSDP2-sharded model"
    if what:
        raise ValueError(f"aligned_ops.cache_exact_weights: refused {what}: FSDP2-managed parameters cannot be "
                         "cached (FSDP2 all-gathers into reused storage without a version bump: a cached packing "
                         "or derivation would go stale); register the rollout engine's weights, not the FSDP2 "
                         "trainer's")


def is_registered(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (this tensor object) was registered with :func:`cache_exact_weights`."""
    return weight in _registered


def is_exact_weight_cacheable(weight: torch.Tensor) -> bool:
    """Whether :func:`linear_exact` keeps ``weight``'s packing across calls (registered, not an inference tensor)."""
    return is_registered(weight) and not weight.is_inference()


def _weight_key(weight: torch.Tensor, tag=None):
    # (vLLM's parameters define __torch_function__: each property read below would go through it, ~3 us apiece)
    with torch._C.DisableTorchFunctionSubclass():
        s = weight.untyped_storage()
        return (s.data_ptr(), s.nbytes(), weight.storage_offset(), tuple(weight.shape), tuple(weight.stride()),
                weight.dtype, weight.device, weight._version, tag)


def clear_exact_weight_cache() -> None:
    """Drop every cached packing (registrations stay): call it after writing registered weights behind the version
    counter's back (``param.data.copy_``, a broadcast into the storage)."""
    _cache.clear()
    _tp_cache.clear()
    _derived_cache.clear()


def _pack(weight: torch.Tensor):
    with torch.no_grad():
        w = weight.detach()
        packed = ops.linear_exact_pack_weight(w)
        # the CPU fp64 path's per-row bounds (exact_linear.h): 4 bytes per output row; the path streams the
        # weight itself (bf16 / fp16: 2 bytes per element) for row pairs meeting the bound
        bounds = ops.linear_exact_f64_bounds(w) if w.device.type == "cpu" else None
    return packed, bounds


def _packed(weight: torch.Tensor):
    """``(key, packed, bounds)`` of ``weight``'s current state: the cached one if it is still this state."""
    if not is_exact_weight_cacheable(weight):
        return (None, *_pack(weight))
    key = _weight_key(weight)
    hit = _cache.get(weight)
    if hit is not None and hit[0] == key:
        return hit
    _cache[weight] = hit = (key, *_pack(weight))
    return hit


# TP: a weight SLICE packed against the canonical forms of its full rows (one all-reduce MAX of the slices'
# row scans, once per weight version: ``merge`` does it). Same registration, key and invalidation as above.
_tp_cache = IdentityMap()


def cached_weight_slice(weight: torch.Tensor, tag=None):
    """The cached ``(row_scan, (digits, exponents, nonfinite))`` of a row-parallel weight slice for this weight
    state, or None (then every rank must call :func:`pack_weight_slice` together)."""
    if not is_exact_weight_cacheable(weight):
        return None
    hit = _tp_cache.get(weight)
    if hit is not None and hit[0] == _weight_key(weight, tag):
        return hit[1], hit[2]
    return None


def pack_weight_slice(weight: torch.Tensor, merge, tag=None):
    """Pack the slice ``weight [N, K_r]`` against its full rows' forms: ``merge(local_scan)`` must return the
    elementwise MAX of every rank's scan (an all-reduce MAX; every rank calls this together). Cached for a
    registered weight."""
    with torch.no_grad():
        w = weight.detach()
        scan = merge(ops.linear_exact_row_scan(w))
        packed = ops.linear_exact_pack_weight_scanned(w, scan)
    if is_exact_weight_cacheable(weight):
        _tp_cache[weight] = (_weight_key(weight, tag), scan, packed)
    return scan, packed


def packed_weight(weight: torch.Tensor):
    return _packed(weight)[1]


# Values derived from a registered weight and read every forward (the MoE router's fp32 copy, MLA's absorbed W_UK /
# W_UV): the same registration, key (version counter included) and invalidation as the packings above, one entry
# per (weight, tag), dropped with the weight (weak keys).
_derived_cache = IdentityMap()


def cached_derivation(weight: torch.Tensor, tag, derive):
    """``derive(weight.detach())``, kept across calls for a registered weight (:func:`cache_exact_weights`) while
    its state (:func:`_weight_key`: storage, shape, strides, version counter) and ``tag`` are the ones it was
    derived from; cleared with the packings (:func:`clear_exact_weight_cache`: vLLM's load_weights, refit — writes
    through ``.data`` do not move the version counter). Derived on every call (``derive(weight)``, autograd
    intact) for a weight autograd tracks (grad mode on and ``requires_grad``: the trainer's), one not registered,
    an inference tensor, and under torch.compile (Dynamo cannot trace the weak-keyed lookup, and a value captured
    at trace time would go stale after a refit: vLLM drops the guards)."""
    if torch.compiler.is_compiling() or not is_exact_weight_cacheable(weight) or (
            torch.is_grad_enabled() and weight.requires_grad):
        return derive(weight)
    key = _weight_key(weight, tag)
    entries = _derived_cache.get(weight)
    if entries is not None and tag in entries and entries[tag][0] == key:
        return entries[tag][1]
    with torch.no_grad():
        value = derive(weight.detach())
    if entries is None or any(v[0][:-1] != key[:-1] for v in entries.values()):
        entries = {}  # the weight changed: every derivation of its old state goes
        _derived_cache[weight] = entries
    entries[tag] = (key, value)
    return value


def cached_cast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight.to(dtype)`` through :func:`cached_derivation` (the MoE router's fp32 weight, which DeepSeek-V3's
    routing reads every forward)."""
    if weight.dtype == dtype:
        return weight
    return cached_derivation(weight, ("cast", dtype), lambda w: w.to(dtype))


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


def _check_args(x, weight, bias):
    """What the ops would report under another op's name (the packed run's ``aligned::linear_exact_packed``) or
    with a misleading cause (a 0-d x "has 0 input features"); the rest the op checks as ``aligned::linear_exact``."""
    op = "aligned_ops.linear_exact"
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dimension ([..., in_features]), got a 0-d tensor")
    # a registered weight runs the packed op, which reported these as aligned::linear_exact_packed ("weight
    # must be the packed weight itself", "the packed weight has K") or aligned::linear_exact_pack_weight
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be [out_features, in_features], got {list(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"{op}: weight dtype {weight.dtype} must equal x dtype {x.dtype}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: x has {x.shape[-1]} input features but weight has {weight.shape[1]}")
    if bias is not None and (
            bias.dim() != 1 or bias.shape[0] != weight.shape[0] or bias.dtype != x.dtype):
        raise ValueError(f"{op}: bias must be [{weight.shape[0]}] (weight's out_features) with x's dtype {x.dtype}, "
                         f"got {list(bias.shape)} {bias.dtype}")


def linear_exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` under the ``exact`` profile; the weight's packed digits are cached across calls
    for weights registered with :func:`cache_exact_weights` (see the cache's rules above), packed per call
    otherwise.

    Under torch.compile (or on a non-CPU device) the uncached op runs (it packs the weight each call)."""
    _check_args(x, weight, bias)
    if torch.compiler.is_compiling() or x.device.type != "cpu" or not is_exact_weight_cacheable(weight):
        return ops.linear_exact(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _LinearExactCached.apply(x, weight, bias)
    return _run_packed(x, weight, bias)


# Ops autograd must not differentiate silently (torch's default would return zeros with a warning):
# linear_exact_packed is differentiated through _LinearExactCached above; the reference is a test hook.
from ._registry import register_no_backward  # noqa: E402

register_no_backward("linear_exact_packed", "call aligned_ops.linear_exact, whose autograd wraps it")
register_no_backward("_linear_exact_reference", "a test hook: the scalar int128 model of the exact profile")
# (linear_exact_partial's output is integer: nothing flows through it.)
register_no_backward("linear_exact_finish", "the exact profile's TP forward (rollouts); training runs at TP = 1 / FSDP")
