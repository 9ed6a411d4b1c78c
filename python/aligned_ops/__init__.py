"""aligned_ops: batch-invariant kernels that make rollout and trainer log-probs bitwise identical.

Importing the package loads the compiled extension, which registers ``torch.ops.aligned.*``; the Python
side adds fake (meta) implementations for torch.compile and autograd formulas.

One exception, so that ``aligned-ops --help`` (and a bad flag) answers in well under a second instead of after
the ~2-6 s torch import: in a process started AS the ``aligned-ops`` command (the console script, or
``python -m aligned_ops.apps.cli``), loading is deferred until the command has parsed and checked its flags
(``apps.cli.main`` calls :func:`load`), or until anything touches an attribute of the package or imports
``aligned_ops.ops``. Every other process loads at import, as always.
"""

from __future__ import annotations

import os as _os
import sys as _sys

_loaded = False

try:  # the torch the extension was built against (a generated, torch-free file; _extension.py checks it on load)
    from ._build_info import TORCH_VERSION as BUILT_WITH_TORCH
except ImportError:  # pragma: no cover - a source tree without a build (loading then says how to build)
    BUILT_WITH_TORCH = None


def _started_as_cli() -> bool:
    """Whether this interpreter was started to run the ``aligned-ops`` command (see the module docstring)."""
    argv = list(getattr(_sys, "orig_argv", ()) or ())
    if "-m" in argv:
        i = argv.index("-m")
        return i + 1 < len(argv) and argv[i + 1] == "aligned_ops.apps.cli"
    return len(argv) > 1 and _os.path.basename(argv[1]) == "aligned-ops"


def load() -> None:
    """Load the compiled extension and every op family (idempotent): what ``import aligned_ops`` does."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    try:
        _load()
    except BaseException:
        _loaded = False
        raise


def _load() -> None:
    from ._extension import load_extension

    load_extension()
    from . import ops  # noqa: F401  (every op family's fake impls + autograd; ops/__init__.py imports them in order)
    from .ops.dense import fused_add_rms_norm, rms_norm, rotary_cos_sin_cache, rotary_embedding, silu_and_mul
    from .ops.linear import linear, linear_lane_bounds, linear_partial, linear_tp_slices, tree_combine
    from .ops.logits import log_softmax, logsumexp, token_logprobs
    from .ops.collective import tree_all_reduce
    from .ops.device_errors import check_device_errors
    from .ops.linear_exact import cache_exact_weights, clear_exact_weight_cache, linear_exact
    from .ops.linear_mma import linear_mma, linear_mma_partial, mma_unit
    from .ops.attention import (
        AttentionPlan,
        attention_plan_size,
        attention_varlen,
        paged_attention,
        reshape_and_cache,
    )
    from .ops.mla import (
        mla_absorb_out,
        mla_absorb_q,
        mla_absorbed_weights,
        mla_attention_varlen,
        mla_paged_attention,
        mla_reshape_and_cache,
    )
    from .emulation import emulate
    from .ops.moe import moe_experts, moe_grouped_routing, moe_layer, moe_routing
    from .ops.lm_head import fused_token_logprobs
    from . import profiles  # noqa: F401  (the numerics profiles as objects; ALIGNED_OPS_LINEAR)
    from .profiles import linear_profile, profile_linear

    globals().update({name: value for name, value in locals().items() if name in __all__})


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
    "linear_mma",
    "linear_mma_partial",
    "mma_unit",
    "linear_profile",
    "profile_linear",
    "profiles",
    "clear_exact_weight_cache",
    "cache_exact_weights",
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
    "mla_attention_varlen",
    "mla_paged_attention",
    "mla_reshape_and_cache",
    "mla_absorbed_weights",
    "mla_absorb_q",
    "mla_absorb_out",
    "emulate",
    "check_device_errors",
    "moe_routing",
    "moe_grouped_routing",
    "moe_experts",
    "moe_layer",
]


def __getattr__(name: str):
    """Deferred mode only (module docstring): the first read of a name this package exports loads everything."""
    if not _loaded and name in __all__:
        load()
        return globals()[name]
    raise AttributeError(f"module 'aligned_ops' has no attribute {name!r}")


if not _started_as_cli():
    load()
