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
    scalars: tuple = ()         # the non-tensor arguments (eps, rotary_dim, is_neox, scale, ...), in order


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
            bias = _linear_bias(name, args)
            scalars = tuple(a for a in args if a is not None and not isinstance(a, torch.Tensor))
            self.calls.append(OpCall(name, tuple(tuple(t.shape) for t in tensors), tuple(t.dtype for t in tensors),
                                     tensors[0].data_ptr() if tensors else None, bias, scalars))
        elif name in self._bodies:
            with self:
                return self._bodies[name](*args, **kwargs)
        return func(*args, **kwargs)


def _linear_bias(name, args) -> bool:
    # aligned::linear / linear_exact / linear_mma (x, weight, bias); linear_exact_packed (x, digits, exponents,
    # nonfinite, N, bias); linear_mma_packed (x, weight, packed, bias)
    at = {"aligned::linear": 2, "aligned::linear_exact": 2, "aligned::linear_mma": 2,
          "aligned::linear_exact_packed": 5, "aligned::linear_mma_packed": 3}.get(name)
    return at is not None and len(args) > at and isinstance(args[at], torch.Tensor)


def _linear_kn(op, c: OpCall):
    """(logical op, K, N) of a linear call: ``linear`` / ``linear_exact`` read the weight's shape; the packed
    exact form reads K from x and N from its per-row ``nonfinite`` flags."""
    if op == "linear_exact_packed":
        return "linear_exact", c.shapes[0][-1], c.shapes[3][0]
    if op == "linear_mma_packed":  # the amx unit's packed form reads the weight's shape too
        return "linear_mma", c.shapes[1][1], c.shapes[1][0]
    return op, c.shapes[1][1], c.shapes[1][0]


def logical_steps(calls: list[OpCall]) -> list[tuple]:
    """Reduce a trace to (op, k, n, bias) tuples in the vocabulary of :mod:`aligned_ops.model_spec`.

    Consecutive linears of the same input tensor are one logical projection (N summed); the exact profile's
    ``linear_exact`` / ``linear_exact_packed`` are ``linear_exact`` and ``linear_mma_packed`` is ``linear_mma``
    (the weight packings, cached per weight, are not steps); ``attention_varlen`` and ``paged_attention`` are ``attention`` (``reshape_and_cache`` is its
    cache write, folded in); ``token_logprobs`` and ``log_softmax`` are ``logprobs``."""
    out: list[tuple] = []
    last_linear_x = None
    for c in calls:
        op = c.name.split("::", 1)[1]
        if op in ("linear_exact_pack_weight", "linear_exact_f64_bounds", "linear_mma_pack_weight"):  # per-weight caches
            continue
        if op in ("linear", "linear_exact", "linear_exact_packed", "linear_mma", "linear_mma_packed"):
            op, k, n = _linear_kn(op, c)
            if last_linear_x is not None and c.x_ptr == last_linear_x and out and out[-1][0] == op:
                _, k0, n0, b0 = out[-1]
                out[-1] = (op, k0, n0 + n, b0 or c.has_bias)
            else:
                out.append((op, k, n, c.has_bias))
            last_linear_x = c.x_ptr
            continue
        last_linear_x = None
        # the cache write; the per-step plan (its sizes, its buffers' layout, the plan itself)
        if op in ("reshape_and_cache", "attention_plan", "attention_plan_size", "attention_plan_layout"):
            continue
        if op in ("attention_varlen", "paged_attention", "attention_varlen_planned", "paged_attention_planned"):
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


def op_scalars(calls: list[OpCall], name: str) -> set:
    """The distinct non-tensor arguments of every call of ``aligned::<name>`` (e.g. rotary's
    ``(rotary_dim, is_neox)``, attention's scale) — what a spec rule sets without changing any shape."""
    return {c.scalars for c in calls if c.name == f"aligned::{name}"}


def spec_steps(spec) -> list[tuple]:
    """A :class:`aligned_ops.model_spec.ModelSpec` in the tuples of :func:`logical_steps`."""
    return [(s.op, s.k, s.n, s.bias) for s in spec.steps]
