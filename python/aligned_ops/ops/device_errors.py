"""The in-kernel value checks of the GPU ops, read back outside the hot path.

On a GPU the ops never read device data on the host (no sync on the decode path, CUDA-graph safe): a bad value
(position, token id, temperature) makes that row NaN and sets its word in a per-device error buffer.
:func:`check_device_errors` reads the words (one host sync: call it outside the hot path, e.g. once per engine
step or batch) and raises the error the CPU glue raises at the call itself.
"""

from __future__ import annotations

import torch

from ._registry import ops
from ._registry import reg_fake as _reg_fake

# csrc/gpu/dense_api.h DeviceError, same order.
DEVICE_ERRORS = (
    "aligned::rotary_embedding: positions must lie in [0, max_position) (cos_sin_cache rows)",
    "aligned::log_softmax/logsumexp/token_logprobs: every temperature must be finite and > 0, and a normal float32 "
    "value",
    "aligned::token_logprobs: token_ids must lie in [0, vocab)",
    "aligned::attention_varlen_planned/paged_attention_planned: the attention plan does not fit the call (planned "
    "for other heads/head_dim/block_size, more rows than q or the KV, or a larger workspace/table; the outputs are "
    "NaN)",
    "aligned::moe_experts: topk_ids must lie in [0, experts) (the tokens routed to another id are NaN)",
)


@_reg_fake("_device_error_flags")
def _(like):
    return like.new_empty((len(DEVICE_ERRORS),), dtype=torch.int32)


def check_device_errors(device=None) -> None:
    """Raise ``RuntimeError`` if a GPU op met a bad input value since the last check (and clear the words).

    ``device``: a device, device string or a tensor on it; default: the current CUDA / ROCm device where torch has
    one, else the CPU. On the CPU backend every value is checked at the call (this returns at once); under
    ``aligned_ops.emulate`` (CPU tensors) it reads the emulated GPU glue's words."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, torch.Tensor):
        like = device
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"aligned_ops.check_device_errors: device must be a device, a device string or a "
                             f"tensor, got {device!r} ({e})") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"aligned_ops.check_device_errors: device {str(dev)!r} is not available (this torch "
                               "has no CUDA / ROCm device); the CPU backend checks every value at the call")
        like = torch.empty(0, device=dev)
    flags = ops._device_error_flags(like)
    seen = flags.to("cpu", copy=True)  # the one host read, outside the hot path
    if bool(seen.any()):
        flags.zero_()
        found = [msg for msg, hit in zip(DEVICE_ERRORS, seen.tolist()) if hit]
        raise RuntimeError("; ".join(found) + " -- reported by the in-kernel check (the affected rows are NaN)")
