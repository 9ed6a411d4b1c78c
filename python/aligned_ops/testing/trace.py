"""Record which ``torch.ops.aligned`` ops a piece of code runs, and reduce the record to logical steps.

:func:`trace_aligned_ops` is a ``TorchDispatchMode``: every aligned op dispatched while it is active is
recorded with its tensor arguments' shapes and dtypes. vLLM runs attention inside its own opaque custom ops
(``vllm::unified_kv_cache_update`` / ``vllm::unified_attention_with_output``); the tracer runs their Python
bodies with itself still active, so the aligned ops inside (``reshape_and_cache``, ``paged_attention``) are
recorded too. :func:`logical_steps` maps a record to :class:`aligned_ops.model_spec.Step`-comparable tuples
(see that module for why fused and split projections are the same logical step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class OpCall:
    name: str                   # "aligned::linear", ...
    shapes: tuple               # shapes of the tensor arguments, in order
    dtypes: tuple               # their dtypes
    x_ptr: int | None           # data_ptr of the first tensor argument (to group projections of one input)
    has_bias: bool = False


def _vllm_python_bodies():
    try:
        from vllm.model_executor.layers.attention import attention as vattn
    except Exception:  # vLLM absent: nothing to unwrap
        return {}
    bodies = {}
    for name in ("unified_kv_cache_update", "unified_attention_with_output", "unified_attention"):
        fn = getattr(vattn, name, None)
        if fn is not None:
            bodies[f"vllm::{name}"] = fn
    return bodies


class trace_aligned_ops(TorchDispatchMode):
    """``with trace_aligned_ops() as t: ...``; then ``t.calls`` lists the aligned ops run, in order."""

    def __init__(self):
        super().__init__()
        self.calls: list[OpCall] = []
        self._bodies = _vllm_python_bodies()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = f"{func.namespace}::{func._opname}"
        if func.namespace == "aligned":
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            bias = name == "aligned::linear" and len(args) > 2 and isinstance(args[2], torch.Tensor)
            self.calls.append(OpCall(name, tuple(tuple(t.shape) for t in tensors), tuple(t.dtype for t in tensors),
                                     tensors[0].data_ptr() if tensors else None, bias))
        elif name in self._bodies:
            with self:
                return self._bodies[name](*args, **kwargs)
        return func(*args, **kwargs)


def logical_steps(calls: list[OpCall]) -> list[tuple]:
    """Reduce a trace to (op, k, n, bias) tuples in the vocabulary of :mod:`aligned_ops.model_spec`.

    Consecutive linears of the same input tensor are one logical projection (N summed); ``attention_varlen``
    and ``paged_attention`` are ``attention`` (``reshape_and_cache`` is its cache write, folded in);
    ``token_logprobs`` and ``log_softmax`` are ``logprobs``."""
    out: list[tuple] = []
    last_linear_x = None
    for c in calls:
        op = c.name.split("::", 1)[1]
        if op == "linear":
            k, n = c.shapes[1][1], c.shapes[1][0]
            if last_linear_x is not None and c.x_ptr == last_linear_x and out and out[-1][0] == "linear":
                _, k0, n0, b0 = out[-1]
                out[-1] = ("linear", k0, n0 + n, b0 or c.has_bias)
            else:
                out.append(("linear", k, n, c.has_bias))
            last_linear_x = c.x_ptr
            continue
        last_linear_x = None
        if op == "reshape_and_cache":
            continue
        if op in ("attention_varlen", "paged_attention"):
            out.append(("attention", None, c.shapes[0][-1], False))
        elif op == "rotary_embedding":
            out.append(("rotary", None, c.shapes[1][-1], False))
        elif op in ("token_logprobs", "log_softmax"):
            out.append(("logprobs", None, c.shapes[0][-1], False))
        elif op == "silu_and_mul":
            out.append(("silu_and_mul", None, c.shapes[0][-1] // 2, False))
        elif op in ("rms_norm", "fused_add_rms_norm"):
            out.append((op, None, c.shapes[0][-1], False))
        else:
            out.append((op, None, None, False))
    return out


def spec_steps(spec) -> list[tuple]:
    """A :class:`aligned_ops.model_spec.ModelSpec` in the tuples of :func:`logical_steps`."""
    return [(s.op, s.k, s.n, s.bias) for s in spec.steps]
