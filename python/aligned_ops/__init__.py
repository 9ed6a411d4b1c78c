"""aligned_ops: batch-invariant kernels that make rollout and trainer log-probs bitwise identical.

Importing the package loads the compiled extension, which registers ``torch.ops.aligned.*``; the Python
side adds fake (meta) implementations for torch.compile and autograd formulas.
"""

from __future__ import annotations

import torch

try:
    from ._build_info import TORCH_VERSION as BUILT_WITH_TORCH
except ImportError as e:  # pragma: no cover - source checkout without a build
    raise ImportError(
        "aligned_ops is not built: run `pip install --no-build-isolation .` (or the cmake dev build, see "
        "DESIGN.md) against the installed torch"
    ) from e
if BUILT_WITH_TORCH != torch.__version__:
    raise ImportError(
        f"aligned_ops was built against torch {BUILT_WITH_TORCH} but torch {torch.__version__} is installed; "
        "torch's C++ ABI changes between versions: rebuild with `pip install --no-build-isolation .`"
    )

from . import _C  # noqa: F401  (registers the ops)

# The CPU kernel level is chosen once, in C++ (csrc/cpu/cpu_backend.h); an ALIGNED_CPU_ISA that names no level
# (or one this CPU cannot run) fails here, at import, with the backend's own words, not at the first op.
try:
    torch.ops.aligned._cpu_isa()
except RuntimeError as _e:
    raise ImportError(str(_e).splitlines()[0]) from None
from . import ops  # noqa: F401  (every op family's fake impls + autograd; ops/__init__.py imports them in order)
from .ops.dense import fused_add_rms_norm, rms_norm, rotary_cos_sin_cache, rotary_embedding, silu_and_mul
from .ops.linear import linear, linear_lane_bounds, linear_partial, linear_tp_slices, tree_combine
from .ops.logits import log_softmax, logsumexp, token_logprobs
from .ops.collective import tree_all_reduce
from .ops.device_errors import check_device_errors
from .ops.linear_exact import clear_exact_weight_cache, linear_exact
from .ops.attention import (
    AttentionPlan,
    attention_plan_size,
    attention_varlen,
    paged_attention,
    reshape_and_cache,
)
from .emulation import emulate
from .ops.moe import moe_experts, moe_grouped_routing, moe_layer, moe_routing
from .ops.lm_head import fused_token_logprobs
from . import profiles  # noqa: F401  (the numerics profiles as objects; ALIGNED_OPS_LINEAR)
from .profiles import linear_profile, profile_linear

__version__ = "0.1.0"

__all__ = [
    "linear",
    "linear_partial",
    "linear_lane_bounds",
    "linear_tp_slices",
    "tree_combine",
    "tree_all_reduce",
    "fused_token_logprobs",
    "linear_exact",
    "linear_profile",
    "profile_linear",
    "profiles",
    "clear_exact_weight_cache",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "rotary_embedding",
    "rotary_cos_sin_cache",
    "log_softmax",
    "logsumexp",
    "token_logprobs",
    "AttentionPlan",
    "attention_plan_size",
    "attention_varlen",
    "paged_attention",
    "reshape_and_cache",
    "emulate",
    "check_device_errors",
    "moe_routing",
    "moe_grouped_routing",
    "moe_experts",
    "moe_layer",
]
