"""What every op family's Python module uses to register its ops' Python side with torch.library."""

from __future__ import annotations

import operator

import torch

ops = torch.ops.aligned
LIB = "aligned::"


def reg_fake(name):
    """``torch.library.register_fake`` for ``aligned::<name>``."""
    return torch.library.register_fake(LIB + name)


def checked_int(where: str, name: str, value, lo: int | None = 0, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi]`` (numpy / torch integer scalars too; a bool is not a size), or an error
    naming ``aligned_ops.<where>`` and the argument: ``TypeError`` for a non-integer, ``ValueError`` out of range.
    The one check of the Python-side integer arguments (sizes, capacities, head counts, top_k, chunk sizes).
    ``lo=None``: any integer (the op checks the range, naming it: e.g. ``top_k`` against the expert count) — what
    this then refuses is a float, a string or a bool, which ``int()`` would have truncated or read silently."""
    try:
        iv = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        iv = None
    if lo is None:
        want = "an integer"
    else:
        want = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    if iv is None:
        raise TypeError(f"aligned_ops.{where}: {name} must be {want}, got {value!r}")
    if lo is not None and (iv < lo or (hi is not None and iv > hi)):
        raise ValueError(f"aligned_ops.{where}: {name} must be {want}, got {iv}")
    return iv


def checked_bool(where: str, name: str, value) -> bool:
    """``value`` as a bool (a Python or numpy bool, or a 0-d bool tensor), or a ``TypeError`` naming
    ``aligned_ops.<where>`` and the argument. The ops' ``bool`` arguments take None as False (torch's schema
    conversion: ``causal=None`` ran non-causal attention) and ``bool()`` reads any string as True."""
    if isinstance(value, bool):
        return value
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() == 0:
        return bool(value)
    if type(value).__module__ == "numpy" and getattr(getattr(value, "dtype", None), "kind", None) == "b" \
            and getattr(value, "ndim", None) == 0:  # numpy.bool_ (numpy 2: numpy.bool)
        return bool(value)
    raise TypeError(f"aligned_ops.{where}: {name} must be a bool, got {value!r}")


def same_device(op, *tensors):
    """Mixed devices (e.g. a meta weight with a CPU x) would otherwise reach this fake impl and return garbage."""
    devs = {t.device for t in tensors if t is not None}
    torch._check(len(devs) <= 1, lambda: f"aligned::{op}: all tensors must be on the same device, got {devs}")


def save_linear_inputs(ctx, inputs, output):
    """setup_context of every linear profile's ``(x, weight, bias) -> y`` op: what ``linear_grads`` reads."""
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def linear_grads(ctx, grad):
    """``(dx, dw, db)`` of ``y = x @ weight.T + bias`` through ``aligned::linear_backward`` (the fma profile's
    deterministic chains, csrc/common/contract.h), each only where autograd asks for it. Every linear profile
    differentiates this way: rollouts never need backward bits, so one backward serves fma and exact."""
    x, weight = ctx.saved_tensors
    return ops.linear_backward(grad.contiguous(), x, weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                               ctx.has_bias and ctx.needs_input_grad[2])


def register_linear_autograd(name: str) -> None:
    """Autograd for a linear op ``aligned::<name>(x, weight, bias)``: ``linear_grads``."""
    torch.library.register_autograd(LIB + name, linear_grads, setup_context=save_linear_inputs)


def register_no_backward(name: str, why: str) -> None:
    """Make ``backward()`` through op ``name`` raise instead of torch's default for an op without an autograd
    formula (a UserWarning and an all-zero gradient, which silently drops a loss term)."""

    def backward(ctx, *grads):
        raise RuntimeError(f"aligned::{name} has no backward ({why}); differentiate the op it belongs to instead")

    torch.library.register_autograd(LIB + name, backward)


def refuse_constant_grad(op: str, what: str, tensor) -> None:
    """For a tensor input an op's backward treats as a constant (returns no gradient for it: the logits ops'
    temperatures, rotary_embedding's cos_sin_cache): one that requires grad would get none, silently, where torch's
    own formula (``log_softmax(z / t)``, ``x * cos + rotate(x) * sin``) gives it one. Called from the autograd setup
    (so the raw op is covered as well as its wrapper): a ValueError naming ``aligned::<op>`` and ``what``."""
    if tensor is not None and tensor.requires_grad:
        raise ValueError(f"aligned::{op}: {what} requires grad, but the op treats it as a constant (no gradient "
                         f"flows to it); pass a detached tensor (.detach())")
