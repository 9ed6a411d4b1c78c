"""The dense family (norms, activation, rotary): fake (meta) implementations, autograd formulas and wrappers.

The kernels live in C++ (``csrc/``); their reduction orders are written down in ``csrc/common/contract.h``.
Every backward is itself an ``aligned`` op with a fixed reduction order, so gradients are deterministic
(same bits run to run, independent of thread count) and contain no atomics.
"""

from __future__ import annotations

import torch

from ._registry import LIB as _lib
from ._registry import checked_bool, checked_int, ops, refuse_constant_grad, register_no_backward
from ._registry import reg_fake as _reg_fake
from ._registry import same_device as _same_device


# ---- fake implementations (shape/dtype propagation for torch.compile and meta tensors) -----------------


def _check_norm(op, x, weight):
    _same_device(op, x, weight)
    torch._check(x.dim() >= 1, lambda: f"aligned::{op}: x must have at least one dimension")
    torch._check(
        weight.dim() == 1 and weight.shape[0] == x.shape[-1],
        lambda: f"aligned::{op}: weight must have shape [{x.shape[-1]}], got {tuple(weight.shape)}",
    )


@_reg_fake("rms_norm")
def _(x, weight, eps):
    _check_norm("rms_norm", x, weight)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_reg_fake("rms_norm_backward")
def _(grad_out, x, weight, eps):
    _same_device("rms_norm_backward", grad_out, x, weight)
    _check_norm("rms_norm_backward", x, weight)
    return torch.empty_like(x, memory_format=torch.contiguous_format), weight.new_empty(weight.shape)


@_reg_fake("fused_add_rms_norm")
def _(x, residual, weight, eps):
    _same_device("fused_add_rms_norm", x, residual, weight)
    _check_norm("fused_add_rms_norm", x, weight)
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(x, memory_format=torch.contiguous_format),
    )


@_reg_fake("silu_and_mul")
def _(x):
    torch._check(x.dim() >= 1 and x.shape[-1] % 2 == 0, lambda: "aligned::silu_and_mul: last dimension must be even")
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@_reg_fake("silu_and_mul_backward")
def _(grad_out, x):
    _same_device("silu_and_mul_backward", grad_out, x)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_reg_fake("rotary_embedding")
def _(positions, x, cos_sin_cache, rotary_dim, is_neox):
    _same_device("rotary_embedding", positions, x, cos_sin_cache)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_reg_fake("rotary_embedding_backward")
def _(positions, grad_out, cos_sin_cache, rotary_dim, is_neox):
    _same_device("rotary_embedding_backward", positions, grad_out, cos_sin_cache)
    return torch.empty_like(grad_out, memory_format=torch.contiguous_format)


# ---- autograd ------------------------------------------------------------------------------------------


def _rms_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dw = ops.rms_norm_backward(grad.contiguous(), x, weight, ctx.eps)
    return dx, dw, None


torch.library.register_autograd(_lib + "rms_norm", _rms_backward, setup_context=_rms_setup)


def _fused_setup(ctx, inputs, output):
    x, residual, weight, eps = inputs
    _, residual_out = output
    ctx.save_for_backward(residual_out, weight)
    ctx.eps = eps


def _fused_backward(ctx, grad_out, grad_residual_out):
    # out = rms_norm(r), residual_out = r, r = round(x + residual): dx = dresidual = dr.
    r, weight = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(r)
    dr, dw = ops.rms_norm_backward(grad_out.contiguous(), r, weight, ctx.eps)
    if grad_residual_out is not None:
        dr = dr + grad_residual_out
    return dr, dr, dw, None


torch.library.register_autograd(_lib + "fused_add_rms_norm", _fused_backward, setup_context=_fused_setup)


def _silu_setup(ctx, inputs, output):
    (x,) = inputs
    ctx.save_for_backward(x)


def _silu_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return ops.silu_and_mul_backward(grad.contiguous(), x)


torch.library.register_autograd(_lib + "silu_and_mul", _silu_backward, setup_context=_silu_setup)


def _rotary_setup(ctx, inputs, output):
    positions, x, cache, rotary_dim, is_neox = inputs
    refuse_constant_grad("rotary_embedding", "cos_sin_cache", cache)
    ctx.save_for_backward(positions, cache)
    ctx.rotary_dim = rotary_dim
    ctx.is_neox = is_neox


def _rotary_backward(ctx, grad):
    positions, cache = ctx.saved_tensors
    dx = ops.rotary_embedding_backward(positions, grad.contiguous(), cache, ctx.rotary_dim, ctx.is_neox)
    return None, dx, None, None, None


torch.library.register_autograd(_lib + "rotary_embedding", _rotary_backward, setup_context=_rotary_setup)

for _name in ("rms_norm_backward", "silu_and_mul_backward", "rotary_embedding_backward"):
    register_no_backward(_name, "it is a backward op; double backward is not implemented")


# ---- Python wrappers (documented entry points) -----------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension; the row statistic uses the fixed 32-lane tree of ``reduce.h``."""
    return ops.rms_norm(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps: float = 1e-6):
    """Returns ``(rms_norm(r), r)`` with ``r = round(x + residual)`` (the rounded residual is normalised)."""
    return ops.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU as vLLM defines it: ``silu(x[..., :d]) * x[..., d:]``."""
    return ops.silu_and_mul(x)


def rotary_embedding(positions, x, cos_sin_cache, rotary_dim: int | None = None, is_neox: bool = True):
    """Rotary embedding of ``x [tokens, heads, head_dim]`` at ``positions`` (neox or gpt-j pairing)."""
    if rotary_dim is None:
        rotary_dim = cos_sin_cache.shape[-1]
    op = "rotary_embedding"
    return ops.rotary_embedding(positions, x, cos_sin_cache, checked_int(op, "rotary_dim", rotary_dim, None),
                                checked_bool(op, "is_neox", is_neox))


def rotary_cos_sin_cache(rotary_dim: int, max_position: int, base: float = 10000.0) -> torch.Tensor:
    """The fp32 ``[max_position, rotary_dim]`` cache (cos half, sin half) of plain RoPE both sides share.

    ``aligned_ops.rope.cos_sin_cache`` with a ``default`` spec: float64 arithmetic rounded once to float32,
    independent of the device, the table length and torch's fp32 ``cos``/``sin`` (scaled RoPE variants:
    ``aligned_ops.rope``).
    """
    from ..rope import RopeSpec, cos_sin_cache

    op = "rotary_cos_sin_cache"
    return cos_sin_cache(RopeSpec(rotary_dim=checked_int(op, "rotary_dim", rotary_dim, None), base=float(base),
                                  max_position=checked_int(op, "max_position", max_position, None)))


