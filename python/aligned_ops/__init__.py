"""aligned_ops: batch-invariant kernels that make rollout and trainer log-probs bitwise identical.

Importing the package loads the compiled extension, which registers ``torch.ops.aligned.*``; the Python
side adds fake (meta) implementations for torch.compile and autograd formulas.
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (registers the ops)
from . import _dense  # noqa: F401  (fake impls + autograd of the dense ops)
from ._dense import (
    fused_add_rms_norm,
    linear,
    log_softmax,
    logsumexp,
    rms_norm,
    rotary_embedding,
    rotary_cos_sin_cache,
    silu_and_mul,
    token_logprobs,
)

try:  # attention lives in its own module (issue: attention and KV cache)
    from . import _attention  # noqa: F401
    from ._attention import attention_varlen, paged_attention, reshape_and_cache  # noqa: F401
except ImportError:  # pragma: no cover - only while attention is not built
    pass

__version__ = "0.1.0"
BUILT_WITH_TORCH = torch.__version__

__all__ = [
    "linear",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "rotary_embedding",
    "rotary_cos_sin_cache",
    "log_softmax",
    "logsumexp",
    "token_logprobs",
]
