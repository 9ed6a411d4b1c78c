"""The trainer side of ``aligned-ops verify`` lives in :mod:`aligned_ops.runner.trainer` (the RL runner shares it);
re-exported here for the verify job."""

from __future__ import annotations

from ..runner.trainer import (  # noqa: F401
    is_moe_model,
    pad_batch,
    routing_pair,
    stock_completion_logprobs,
    trainer_logprobs,
    trainer_model,
    trainer_routing,
)
