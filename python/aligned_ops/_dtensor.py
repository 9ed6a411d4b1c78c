"""DTensor (FSDP2 / TP-sharded tensor) recognition without importing torch.distributed where a build lacks it."""

from __future__ import annotations

import torch


def is_dtensor(obj) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (False on a torch built without distributed support)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(obj, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    return t._local_tensor if is_dtensor(t) else t
