"""The ``mma`` linear profile: ``aligned::linear_mma`` (+ its backward and the TP partial), fake impls, autograd,
wrappers, and the unit check that refuses the profile where the machine has no unit.

The contract (``csrc/common/mma.h``): bfloat16 x, weight, bias; K cut into the ``fma`` profile's 8 lanes
(``linear_lane_bounds``), each lane ONE chain of the matrix unit's instruction (on the CPU: AMX-BF16
``tdpbf16ps`` in blocks of 32 k on the ``amx`` level, else AVX512-BF16 ``vdpbf16ps``: pairs (k, k+1) in ascending
order, odd element first, subnormals flushed), the 8 lane sums folded by the same tree
``((0+1)+(2+3))+((4+5)+(6+7))``, + bias once, one rounding. The bits are the unit's: the same for a row whatever
the batch, position, tiling, threads, chunking or TP degree, on one unit (vdpbf16ps: on every CPU that runs it,
Intel and AMD: one semantics; tdpbf16ps: one AMX CPU model) — not equal to ``fma``'s or ``exact``'s, nor to a GPU's.

TP (row-parallel): rank r of t in 1, 2, 4, 8 holds the K slice ``linear_tp_slices(K, t)[r]`` and computes
``linear_mma_partial(x_r, w_r, 8 // t)``; ``tree_all_reduce`` (``tree_combine``), + bias, one rounding give
``linear_mma`` bit for bit — ``aligned_ops.profiles.MMA.row_parallel_linear``.

The profile as an object (its linear, TP route, MoE experts, capabilities, start-up refusals) and the
``ALIGNED_OPS_LINEAR=mma`` switch: :mod:`aligned_ops.profiles` (``MMA``).

Backward (``aligned::linear_mma_backward``, on the unit): dx = the profile's linear of g and w^T (8 lanes of N),
dw = of g^T and x^T (8 fixed token blocks of the batch, tokens in order), db = fp32 column chains. Deterministic;
dx is batch-invariant, dw / db follow the batch by design.
"""

from __future__ import annotations

import functools

import torch

from .. import emulation as _emulation
from . import linear_exact as _exact
from ._registry import ops, register_no_backward
from ._registry import reg_fake as _reg_fake
from ._registry import same_device as _same_device

_LANES = (1, 2, 4, 8)
MMA_REFUSAL = "mma needs avx512_bf16; use ALIGNED_OPS_LINEAR=fma"


@functools.lru_cache(maxsize=None)
def mma_unit() -> str | None:
    """The CPU's matrix unit the ``mma`` profile runs on (``"amx_bf16"``: tdpbf16ps, on the ``amx`` level;
    ``"avx512_bf16"``: vdpbf16ps), or None where the CPU has none (or ``ALIGNED_CPU_ISA`` forces a level below
    AVX-512). Fixed for the process (chosen once in C++; ``ALIGNED_CPU_ISA=avx512`` picks vdpbf16ps on an AMX CPU)."""
    return ops._cpu_mma_unit() or None


def check_mma_available(where: str) -> str:
    """The unit name, or a ``RuntimeError`` in one line naming the profile's requirement and the way out."""
    unit = mma_unit()
    if unit is None:
        raise RuntimeError(f"aligned_ops ({where}): {MMA_REFUSAL} (this CPU has no bf16 dot-product unit the "
                           f"profile's bits are defined on)")
    return unit


@functools.lru_cache(maxsize=None)
def gpu_kernels_built() -> bool:
    """Whether this build of the extension holds the ``mma`` profile's GPU kernels (csrc/gpu/mma_linear_kernels.cuh:
    bf16 mma.sync on CUDA, MFMA on ROCm), i.e. ``aligned::linear_mma`` has a CUDA-key kernel."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key("aligned::linear_mma", "CUDA"))


def gpu_refusal(device: str) -> str | None:
    """Why the ``mma`` profile cannot run on the GPU ``device`` type with this build (None: it can)."""
    if gpu_kernels_built():
        return None
    return (f"the mma profile has no {device} kernels in this build (aligned_ops was built without CUDA / ROCm); "
            f"use ALIGNED_OPS_LINEAR=fma")


def mma_model_reasons(dtype, device: str = "cpu") -> list[str]:
    """Why a model of ``dtype`` cannot run the ``mma`` profile on this machine's ``device`` (empty: it can): no unit
    (the CPU's avx512_bf16; on a GPU, kernels in this build), or not bfloat16 — each one line
    (``aligned_ops.profiles.MMA.model_refusals``: the start-up refusals of the trainer patch, the vLLM plugin and
    ``aligned-ops verify``). Under ``aligned_ops.emulate`` the CPU tensors run the emulated GPU's kernels and its
    modelled unit, so the CPU's own unit is not needed there (outside the scope, the op itself refuses by name)."""
    if device == "cpu":
        reasons = [MMA_REFUSAL] if _emulation.active() is None and mma_unit() is None else []
    else:
        refusal = gpu_refusal(device)
        reasons = [] if refusal is None else [refusal]
    name = str(dtype).replace("torch.", "")
    if name != "bfloat16":
        reasons.append(f"the mma profile takes bfloat16 models (its matrix units multiply bf16), got {name}; "
                       f"use ALIGNED_OPS_LINEAR=fma")
    return reasons


def _check_bf16(op, **tensors):
    for name, t in tensors.items():
        if t is not None:
            torch._check(t.dtype == torch.bfloat16,
                         lambda: f"aligned::{op}: {name} must be bfloat16 (the mma profile's matrix units take bf16; "
                                 f"float32 / float16 models run ALIGNED_OPS_LINEAR=fma), got {t.dtype}")


def _check_shapes(op, x, weight):
    torch._check(x.dim() >= 1, lambda: f"aligned::{op}: x must have at least one dimension")
    torch._check(weight.dim() == 2, lambda: f"aligned::{op}: weight must be 2-D")
    torch._check(x.shape[-1] == weight.shape[1], lambda: f"aligned::{op}: in_features mismatch")


@_reg_fake("linear_mma")
def _(x, weight, bias=None):
    _same_device("linear_mma", x, weight, bias)
    _check_bf16("linear_mma", x=x, weight=weight, bias=bias)
    _check_shapes("linear_mma", x, weight)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_reg_fake("linear_mma_partial")
def _(x, weight, lanes):
    _same_device("linear_mma_partial", x, weight)
    torch._check(lanes in _LANES, lambda: f"aligned::linear_mma_partial: lanes must be 1, 2, 4 or 8, got {lanes}")
    _check_bf16("linear_mma_partial", x=x, weight=weight)
    _check_shapes("linear_mma_partial", x, weight)
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


def _packed_weight_elems(N: int, K: int) -> int:
    """Size of ``linear_mma_pack_weight``'s packing (csrc/common/mma.h ``mma_amx_lane_blocks``)."""
    blocks = sum(((l + 1) * K // 8 - l * K // 8 + 31) // 32 for l in range(8))
    return (N + 15) // 16 * blocks * 512


@_reg_fake("linear_mma_pack_weight")
def _(weight):
    torch._check(weight.dim() == 2, lambda: "aligned::linear_mma_pack_weight: weight must be 2-D")
    _check_bf16("linear_mma_pack_weight", weight=weight)
    return weight.new_empty((_packed_weight_elems(weight.shape[0], weight.shape[1]),), dtype=torch.int16)


@_reg_fake("linear_mma_packed")
def _(x, weight, packed, bias=None):
    _same_device("linear_mma_packed", x, weight, packed, bias)
    _check_bf16("linear_mma_packed", x=x, weight=weight, bias=bias)
    _check_shapes("linear_mma_packed", x, weight)
    want = _packed_weight_elems(weight.shape[0], weight.shape[1])
    torch._check(packed.dtype == torch.int16 and packed.dim() == 1 and packed.shape[0] == want,
                 lambda: f"aligned::linear_mma_packed: packed must be linear_mma_pack_weight(weight): int16 [{want}]")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_reg_fake("_linear_mma_reference")
def _(x, weight, lanes):
    _check_shapes("_linear_mma_reference", x, weight)
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


@_reg_fake("linear_mma_backward")
def _(grad_out, x, weight, needs_x_grad, needs_w_grad, needs_b_grad):
    _same_device("linear_mma_backward", grad_out, x, weight)
    _check_bf16("linear_mma_backward", grad_out=grad_out, x=x, weight=weight)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if needs_x_grad else None
    dw = weight.new_empty(weight.shape) if needs_w_grad else None
    db = x.new_empty((weight.shape[0],)) if needs_b_grad else None
    return dx, dw, db


def _save_inputs(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _grads(ctx, grad):
    """(dx, dw, db) through ``aligned::linear_mma_backward`` (autograd hands the bf16 gradient of the bf16
    output), each only where autograd asks for it."""
    x, weight = ctx.saved_tensors
    return ops.linear_mma_backward(grad.contiguous(), x, weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                   ctx.has_bias and ctx.needs_input_grad[2])


torch.library.register_autograd("aligned::linear_mma", _grads, setup_context=_save_inputs)


def _partial_backward(ctx, grad):
    raise RuntimeError(
        "aligned::linear_mma_partial has no backward: it is the forward half of a row-parallel mma linear (the "
        "rollout side); differentiate aligned.linear_mma or the TP layer instead"
    )


torch.library.register_autograd("aligned::linear_mma_partial", _partial_backward,
                                setup_context=lambda ctx, inputs, output: None)
register_no_backward("linear_mma_backward", "it is a backward op; double backward is not implemented")
register_no_backward("_linear_mma_reference", "a test hook: mma.h's scalar model of the CPU unit")
register_no_backward("linear_mma_packed", "it is the rollout side's cached-weight form of linear_mma (no grad "
                     "taken through it: aligned_ops.linear_mma reads the weight in place where autograd needs it)")


# ---- the AMX unit's packed weights: registered weights only, one packing per observed weight state --------------
# On the amx_bf16 unit a weight packed once into the instruction's tile layout streams as one sequence (decode reads
# every weight once per step: measured 0.71-0.76x oneDNN reading the rows in place, 0.97-1.13x packed, K = 896 /
# 4864). The packing is the exact profile's cached derivation (ops/linear_exact.py: weights the owner registered
# with cache_exact_weights — the vLLM plugin registers its engine's — keyed by storage, shape, strides and version
# counter, dropped by clear_exact_weight_cache on refit); every other weight, a weight autograd tracks, and any call
# under torch.compile read the weight in place. The bits are the same either way (the same products in the same
# instructions). Memory: one more copy of each registered weight, each lane padded to whole 32-k blocks. Under
# torch.compile (vLLM without enforce_eager) the weight is read in place.
def _uses_packing(x, weight, bias) -> bool:
    # (under aligned_ops.emulate the emulated GPU's kernel must run: the packed op is the CPU unit's)
    return (not torch.compiler.is_compiling() and x.device.type == "cpu" and _emulation.active() is None
            and mma_unit() == "amx_bf16"
            and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and _exact.is_exact_weight_cacheable(weight)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad))))


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The cached ``linear_mma_pack_weight(weight)`` of a registered weight (packed on first use)."""
    return _exact.cached_derivation(weight, "linear_mma_pack_weight", ops.linear_mma_pack_weight)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def linear_mma(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` under the ``mma`` profile (bf16; the matrix unit's chains in the 8 fixed lanes, the
    fixed tree, + bias once, one rounding — csrc/common/mma.h). Batch-, thread- and TP-degree-invariant on one
    unit; refuses by name where the machine has none. On the amx_bf16 unit a registered weight's packing is
    cached and read instead of its rows (same bits; see ``_uses_packing``)."""
    if (not torch.compiler.is_compiling() and _exact.is_registered(weight) and type(x) is torch.Tensor
            and (bias is None or type(bias) in _PLAIN or _exact.is_registered(bias))):
        # The rollout's hot path: a registered weight is the engine's, a vLLM parameter, whose __torch_function__
        # (a pass-through) every property read and op call would go through (~3 us each, two dozen a call): the
        # checks and the op run on the plain tensor (cache_exact_weights: registering declares it a pass-through).
        # A subclass activation, an unregistered subclass bias and every unregistered weight keep their hooks.
        with torch._C.DisableTorchFunctionSubclass():
            if _uses_packing(x, weight, bias):
                return ops.linear_mma_packed(x, weight, packed_weight(weight), bias)
            return ops.linear_mma(x, weight, bias)
    return ops.linear_mma(x, weight, bias)


def linear_mma_partial(x: torch.Tensor, weight: torch.Tensor, lanes: int) -> torch.Tensor:
    """fp32 sub-tree over ``lanes`` lanes of the local K under the ``mma`` profile; no bias, no rounding."""
    return ops.linear_mma_partial(x, weight, lanes)
