"""The logits family (log_softmax, logsumexp, token_logprobs): fake impls, autograd formulas and wrappers.

fp32 outputs at a temperature (a float, or one value per row); the row's (max, log-sum) pair is computed in
the order of csrc/common/contract.h, so ``token_logprobs(z, id)`` equals ``log_softmax(z)[id]`` bit for bit.
The backward ops recompute that pair from the saved logits. ``_exp_f32`` / ``_log_f32`` are test hooks of
the contract's scalar math.
"""

from __future__ import annotations

import functools
import math
import struct

import torch

from ._registry import LIB as _lib
from ._registry import ops, refuse_constant_grad, register_no_backward
from ._registry import reg_fake as _reg_fake
from ._registry import same_device as _same_device

# ---- fake implementations ------------------------------------------------------------------------------


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


def refuse_temperature_grad(op: str, temperatures) -> None:
    """The logits ops' backward treats the temperature as a constant (see :func:`refuse_constant_grad`)."""
    refuse_constant_grad(op, "the temperature tensor", temperatures)


def _tlp_setup(ctx, inputs, output):
    logits, token_ids, temperature, temperatures = inputs
    refuse_temperature_grad("token_logprobs", temperatures)
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
def _logits_setup(op, ctx, inputs, output):
    logits, temperature, temperatures = inputs
    refuse_temperature_grad(op, temperatures)
    ctx.save_for_backward(logits, temperatures)
    ctx.temperature = temperature


def _lse_backward(ctx, grad):
    logits, temperatures = ctx.saved_tensors
    return ops.logsumexp_backward(grad.contiguous(), logits, ctx.temperature, temperatures), None, None


def _log_softmax_backward(ctx, grad):
    logits, temperatures = ctx.saved_tensors
    return ops.log_softmax_backward(grad.contiguous(), logits, ctx.temperature, temperatures), None, None


torch.library.register_autograd(_lib + "logsumexp", _lse_backward,
                                setup_context=functools.partial(_logits_setup, "logsumexp"))
torch.library.register_autograd(_lib + "log_softmax", _log_softmax_backward,
                                setup_context=functools.partial(_logits_setup, "log_softmax"))


for _name in ("token_logprobs_backward", "logsumexp_backward", "log_softmax_backward"):
    register_no_backward(_name, "it is a backward op; double backward is not implemented")
for _name in ("_exp_f32", "_log_f32"):
    register_no_backward(_name, "a test hook of the contract's scalar math")


# ---- Python wrappers (documented entry points) -----------------------------------------------------------


def _temperature_args(op: str, temperature, logits: torch.Tensor):
    """``(temperature float, temperatures tensor or None)`` for op ``aligned_ops.<op>`` on ``logits [T, V]``.

    A 0-d tensor is passed as the per-row temperatures (its value expanded to the T rows, on the logits' device):
    the kernels read ``temps[row]`` where they would read the scalar, so the bits are the scalar's (tested), and
    no ``float(tensor)`` runs — which would sync on a GPU and, under torch.compile(fullgraph=True), hand the op a
    SymFloat its ``float temperature`` argument cannot take. On the CPU in eager the value is checked here, as a
    float's is; otherwise the op checks it (per row: ``every temperature must be ...``)."""
    if isinstance(temperature, torch.Tensor):
        if temperature.dim() != 0:
            return 1.0, temperature
        if temperature.device.type == "cpu" and not torch.compiler.is_compiling():
            _check_temperature(f"aligned_ops.{op}", float(temperature.detach()))
        rows = logits.shape[0] if logits.dim() >= 1 else 0  # a bad logits shape: the op names it
        return 1.0, temperature.reshape(1).to(logits.device).expand(rows).contiguous()
    if torch.compiler.is_compiling():
        # Under torch.compile the op checks the temperature when it runs (the same rules, csrc/torch/checks/logits.h),
        # so a bad value still raises, naming the op; checking it here would trace float() / struct.pack on a
        # symbolic float with dynamic=True (Dynamo died in it: RecursionError)
        return temperature, None
    return _check_temperature(f"aligned_ops.{op}", temperature), None


def _check_temperature(op: str, temperature) -> float:
    """``temperature`` as a float: finite, > 0 and a normal float32 value (the ops divide by its fp32 rounding);
    ``op``: the name the errors give (``aligned_ops.<function>`` or ``aligned::<op>``)."""
    try:
        temperature = float(temperature)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: temperature must be a float or a float tensor (0-d, or one value per "
                        f"row), got {type(temperature).__name__}") from None
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"{op}: temperature must be finite and > 0, got {temperature}")
    try:  # its fp32 rounding, in Python (no tensor op: this runs on every decode step)
        as_f32 = struct.unpack("f", struct.pack("f", temperature))[0]
    except OverflowError:
        as_f32 = math.inf
    if not (_FP32_MIN_NORMAL <= as_f32 < math.inf):
        raise ValueError(
            f"{op}: temperature {temperature} is not representable in float32 (the ops divide by it in "
            f"fp32): it must lie in [{_FP32_MIN_NORMAL}, {torch.finfo(torch.float32).max}]")
    return temperature


_FP32_MIN_NORMAL = torch.finfo(torch.float32).tiny


def log_softmax(logits: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """fp32 ``log_softmax(logits / temperature)`` over the full vocabulary (float or per-row tensor)."""
    t, ts = _temperature_args("log_softmax", temperature, logits)
    return ops.log_softmax(logits, t, ts)


def logsumexp(logits: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """fp32 ``logsumexp(logits / temperature)`` per row."""
    t, ts = _temperature_args("logsumexp", temperature, logits)
    return ops.logsumexp(logits, t, ts)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """fp32 ``z[id]/tau - logsumexp(z/tau)`` per row; equals ``log_softmax(z)[id]`` bit for bit."""
    t, ts = _temperature_args("token_logprobs", temperature, logits)
    return ops.token_logprobs(logits, token_ids, t, ts)
