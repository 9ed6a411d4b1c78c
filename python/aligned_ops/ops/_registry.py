"""What every op family's Python module uses to register its ops' Python side with torch.library."""

from __future__ import annotations

import torch

ops = torch.ops.aligned
LIB = "aligned::"


def reg_fake(name):
    """``torch.library.register_fake`` for ``aligned::<name>``."""
    return torch.library.register_fake(LIB + name)


def same_device(op, *tensors):
    """Mixed devices (e.g. a meta weight with a CPU x) would otherwise reach this fake impl and return garbage."""
    devs = {t.device for t in tensors if t is not None}
    torch._check(len(devs) <= 1, lambda: f"aligned::{op}: all tensors must be on the same device, got {devs}")


def register_no_backward(name: str, why: str) -> None:
    """Make ``backward()`` through op ``name`` raise instead of torch's default for an op without an autograd
    formula (a UserWarning and an all-zero gradient, which silently drops a loss term)."""

    def backward(ctx, *grads):
        raise RuntimeError(f"aligned::{name} has no backward ({why}); differentiate the op it belongs to instead")

    torch.library.register_autograd(LIB + name, backward)
