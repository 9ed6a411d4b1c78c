"""Entry point of one run: prepare the model, then run the learner with plain-process or Ray rollout workers."""

from __future__ import annotations

import os

from .config import RunConfig
from .loop import ProcessLauncher, learner_main


def run(cfg: RunConfig, callbacks=()) -> dict:
    """Run one RL configuration end to end (model preparation, workers, learner); returns the summary."""
    cfg.validate()
    model_dir = cfg.model
    if model_dir is None:
        from .models import prepare_tiny_model

        model_dir = prepare_tiny_model(cfg, os.path.join(cfg.out, "model"))
    if cfg.backend == "ray":
        from .ray_backend import run_with_ray  # Ray is imported only when asked for

        return run_with_ray(cfg, model_dir)
    return learner_main(cfg, model_dir, ProcessLauncher(cfg), callbacks)
