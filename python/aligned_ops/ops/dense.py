"""Fake (meta) implementations, autograd formulas and Python wrappers of the dense ops.

The kernels live in C++ (``csrc/``); their reduction orders are written down in ``csrc/common/contract.h``.
Every backward is itself an ``aligned`` op with a fixed reduction order, so gradients are deterministic
(same bits run to run, independent of thread count) and contain no atomics.
"""

from __future__ import annotations

import math

import torch

ops = torch.ops.aligned
_lib = "aligned::"


def _reg_fake(name):
    return torch.library.register_fake(_lib + name)


# ---- fake implementations (shape/dtype propagation for torch.compile and meta tensors) -----------------


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


def _same_device(op, *tensors):
    """Mixed devices (e.g. a meta weight with a CPU x) would otherwise reach this fake impl and return garbage."""
    devs = {t.device for t in tensors if t is not None}
    torch._check(len(devs) <= 1, lambda: f"aligned::{op}: all tensors must be on the same device, got {devs}")


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


@_reg_fake("logsumexp")
def _(logits, temperature=1.0, temperatures=None):
    _same_device("logsumexp", logits, temperatures)
    return logits.new_empty((logits.shape[0],), dtype=torch.float32)


@_reg_fake("log_softmax")
def _(logits, temperature=1.0, temperatures=None):
    _same_device("log_softmax", logits, temperatures)
    return logits.new_empty(logits.shape, dtype=torch.float32)


@_reg_fake("token_logprobs")
def _(logits, token_ids, temperature=1.0, temperatures=None):
    _same_device("token_logprobs", logits, token_ids, temperatures)
    return logits.new_empty((logits.shape[0],), dtype=torch.float32)


@_reg_fake("token_logprobs_backward")
def _(grad, logits, token_ids, temperature=1.0, temperatures=None):
    _same_device("token_logprobs_backward", grad, logits, token_ids, temperatures)
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@_reg_fake("logsumexp_backward")
def _(grad, logits, temperature=1.0, temperatures=None):
    _same_device("logsumexp_backward", grad, logits, temperatures)
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@_reg_fake("log_softmax_backward")
def _(grad, logits, temperature=1.0, temperatures=None):
    _same_device("log_softmax_backward", grad, logits, temperatures)
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@_reg_fake("_exp_f32")
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_reg_fake("_log_f32")
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ---- autograd ------------------------------------------------------------------------------------------


def _linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dw, db = ops.linear_backward(
        grad.contiguous(),
        x,
        weight,
        ctx.needs_input_grad[0],
        ctx.needs_input_grad[1],
        ctx.has_bias and ctx.needs_input_grad[2],
    )
    return dx, dw, db


torch.library.register_autograd(_lib + "linear", _linear_backward, setup_context=_linear_setup)


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
    ctx.save_for_backward(positions, cache)
    ctx.rotary_dim = rotary_dim
    ctx.is_neox = is_neox


def _rotary_backward(ctx, grad):
    positions, cache = ctx.saved_tensors
    dx = ops.rotary_embedding_backward(positions, grad.contiguous(), cache, ctx.rotary_dim, ctx.is_neox)
    return None, dx, None, None, None


torch.library.register_autograd(_lib + "rotary_embedding", _rotary_backward, setup_context=_rotary_setup)


def _tlp_setup(ctx, inputs, output):
    logits, token_ids, temperature, temperatures = inputs
    ctx.save_for_backward(logits, token_ids, temperatures)
    ctx.temperature = temperature


def _tlp_backward(ctx, grad):
    logits, token_ids, temperatures = ctx.saved_tensors
    dz = ops.token_logprobs_backward(grad.contiguous(), logits, token_ids, ctx.temperature, temperatures)
    return dz, None, None, None


torch.library.register_autograd(_lib + "token_logprobs", _tlp_backward, setup_context=_tlp_setup)


# logsumexp and log_softmax: the backward recomputes the row's (m, L) pair from the saved logits (like
# token_logprobs_backward), so the [T, V] fp32 log_softmax output need not be kept alive for autograd.
# The temperature is a constant (no gradient flows to it).
def _logits_setup(ctx, inputs, output):
    logits, temperature, temperatures = inputs
    ctx.save_for_backward(logits, temperatures)
    ctx.temperature = temperature


def _lse_backward(ctx, grad):
    logits, temperatures = ctx.saved_tensors
    return ops.logsumexp_backward(grad.contiguous(), logits, ctx.temperature, temperatures), None, None


def _log_softmax_backward(ctx, grad):
    logits, temperatures = ctx.saved_tensors
    return ops.log_softmax_backward(grad.contiguous(), logits, ctx.temperature, temperatures), None, None


torch.library.register_autograd(_lib + "logsumexp", _lse_backward, setup_context=_logits_setup)
torch.library.register_autograd(_lib + "log_softmax", _log_softmax_backward, setup_context=_logits_setup)


def register_no_backward(name: str, why: str) -> None:
    """Make ``backward()`` through op ``name`` raise instead of torch's default for an op without an autograd
    formula (a UserWarning and an all-zero gradient, which silently drops a loss term)."""

    def backward(ctx, *grads):
        raise RuntimeError(f"aligned::{name} has no backward ({why}); differentiate the op it belongs to instead")

    torch.library.register_autograd(_lib + name, backward)


for _name in ("linear_backward", "rms_norm_backward", "silu_and_mul_backward", "rotary_embedding_backward",
              "token_logprobs_backward", "logsumexp_backward", "log_softmax_backward"):
    register_no_backward(_name, "it is a backward op; double backward is not implemented")
for _name in ("_exp_f32", "_log_f32"):
    register_no_backward(_name, "a test hook of the contract's scalar math")


# ---- Python wrappers (documented entry points) -----------------------------------------------------------


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, the ``fma`` profile: 8 lanes of K, one fp32 fma chain each, a fixed tree, + bias
    once (csrc/common/contract.h) — batch-, thread-, backend- and TP-degree-invariant."""
    return ops.linear(x, weight, bias)


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
    return ops.rotary_embedding(positions, x, cos_sin_cache, rotary_dim, is_neox)


def rotary_cos_sin_cache(rotary_dim: int, max_position: int, base: float = 10000.0) -> torch.Tensor:
    """The fp32 ``[max_position, rotary_dim]`` cache (cos half, sin half) of plain RoPE both sides share.

    ``aligned_ops.rope.cos_sin_cache`` with a ``default`` spec: float64 arithmetic rounded once to float32,
    independent of the device, the table length and torch's fp32 ``cos``/``sin`` (scaled RoPE variants:
    ``aligned_ops.rope``).
    """
    from ..rope import RopeSpec, cos_sin_cache

    return cos_sin_cache(RopeSpec(rotary_dim=int(rotary_dim), base=float(base), max_position=int(max_position)))


def _temperature_args(temperature):
    if isinstance(temperature, torch.Tensor):
        if temperature.dim() == 0:
            return float(temperature), None
        return 1.0, temperature
    temperature = float(temperature)
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    as_f32 = torch.tensor(temperature, dtype=torch.float32).item()
    if not (_FP32_MIN_NORMAL <= as_f32 < math.inf):
        raise ValueError(
            f"temperature {temperature} is not representable in float32 (the ops divide by it in fp32): it must "
            f"lie in [{_FP32_MIN_NORMAL}, {torch.finfo(torch.float32).max}]")
    return temperature, None


_FP32_MIN_NORMAL = torch.finfo(torch.float32).tiny


def log_softmax(logits: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """fp32 ``log_softmax(logits / temperature)`` over the full vocabulary (float or per-row tensor)."""
    t, ts = _temperature_args(temperature)
    return ops.log_softmax(logits, t, ts)


def logsumexp(logits: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """fp32 ``logsumexp(logits / temperature)`` per row."""
    t, ts = _temperature_args(temperature)
    return ops.logsumexp(logits, t, ts)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """fp32 ``z[id]/tau - logsumexp(z/tau)`` per row; equals ``log_softmax(z)[id]`` bit for bit."""
    t, ts = _temperature_args(temperature)
    return ops.token_logprobs(logits, token_ids, t, ts)
