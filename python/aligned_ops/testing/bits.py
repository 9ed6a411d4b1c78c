"""Bit-level views of tensors (see the package docstring)."""

import torch

_INT_OF_WIDTH = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's storage reinterpreted as signed integers of the same width (a copy if not contiguous).

    Integer and bool tensors are returned as they are."""
    if not (t.is_floating_point() or t.is_complex()):
        return t
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view(_INT_OF_WIDTH[t.element_size()])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a and b have the same dtype, shape and bits (+0 differs from -0; NaN equals the same NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def count_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of a and b (same dtype and shape) have identical bits."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"count_bitwise_equal: dtype/shape differ ({a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)})")
    ia, ib = bits(a), bits(b)
    if ia.dim() > a.dim():  # complex: both halves must match
        return int((ia == ib).all(dim=-1).sum())
    return int((ia == ib).sum())


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, msg: str = "") -> None:
    """Raise AssertionError (with the count and first differing index) unless a and b are bitwise equal."""
    prefix = f"{msg}: " if msg else ""
    assert a.dtype == b.dtype, f"{prefix}dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{prefix}shape {tuple(a.shape)} != {tuple(b.shape)}"
    ia, ib = bits(a), bits(b)
    if torch.equal(ia, ib):
        return
    diff = ia != ib
    if diff.dim() > a.dim():
        diff = diff.any(dim=-1)
    n = int(diff.sum())
    first = tuple(int(i) for i in diff.nonzero()[0])
    raise AssertionError(
        f"{prefix}{n} of {a.numel()} elements differ in bits; first at {first}: "
        f"{a[first].item()!r} vs {b[first].item()!r}")
