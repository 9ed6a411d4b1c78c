"""The built-in tiny models of ``aligned-ops train`` / ``demo`` and their supervised warm-up on the task.

A random-weight model never answers "a+b=" correctly, so every reward is 0 and RL has no signal; the warm-up
teaches the task briefly by teacher-forced cross-entropy (stock trainer, shared by every run that uses the model),
then RL takes over. The one import of the tiny-model builders is here.
"""

from __future__ import annotations

import json
import os

from .learner import Policy, is_router
from .task import AdditionTask


def build_tiny(kind: str, path: str, dtype: str, seed: int, hidden: int, layers: int, router_scale: float,
               logit_scale: float = 1.0) -> str:
    """The built-in tiny model; ``logit_scale`` multiplies the final norm's weight (so every logit) before training."""
    import torch

    from ..models.tiny import build_tiny_moe, build_tiny_qwen2

    if kind == "moe":
        path = build_tiny_moe(path, dtype=getattr(torch, dtype), seed=seed, hidden_size=hidden,
                              moe_intermediate_size=hidden // 2, num_hidden_layers=layers, router_scale=router_scale)
    else:
        path = build_tiny_qwen2(path, dtype=getattr(torch, dtype), seed=seed, hidden_size=hidden,
                                intermediate_size=2 * hidden, num_hidden_layers=layers)
    if logit_scale != 1.0:
        from safetensors.torch import load_file, save_file

        f = os.path.join(path, "model.safetensors")
        weights = load_file(f)
        weights["model.norm.weight"] = (weights["model.norm.weight"].float() * logit_scale).to(
            weights["model.norm.weight"].dtype)
        save_file(weights, f, metadata={"format": "pt"})
    return path


def supervised_warmup(model_dir: str, out_dir: str, dtype: str, steps: int, lr: float, seed: int,
                      freeze=lambda name: False, a_range: int = 100) -> str:
    """Teach the task briefly (teacher-forced cross-entropy on the answers), save the checkpoint to ``out_dir``."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    task = AdditionTask(tok, a_range=a_range)
    trainer = Policy(model_dir, dtype, aligned=False, lr=lr, freeze=freeze)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        batch = task.sample(gen, 64)
        lp, comp, _ = trainer.logprobs([p + a for p, a in batch], [len(p) for p, _ in batch], tok.eos_token_id)
        trainer.step(-(lp * comp).sum() / comp.sum())
    trainer.model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    src = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(src):
        with open(src) as fi, open(os.path.join(out_dir, "generation_config.json"), "w") as fo:
            fo.write(fi.read())
    return out_dir


def prepare_tiny_model(cfg, root: str) -> str:
    """Build the built-in tiny model (``cfg.tiny``) and warm it up into ``root``; reused when already there
    (a resumed run, or the demo's runs sharing one model). Returns the warmed-up checkpoint folder."""
    warm = os.path.join(root, "warm")
    stamp = os.path.join(root, "built.json")
    spec = dict(tiny=cfg.tiny, dtype=cfg.dtype, seed=cfg.seed, hidden=cfg.hidden, layers=cfg.layers,
                router_scale=cfg.router_scale, sft_steps=cfg.sft_steps, sft_lr=cfg.sft_lr, a_range=cfg.a_range)
    if cfg.logit_scale != 1.0:
        spec["logit_scale"] = cfg.logit_scale
    if os.path.isfile(stamp):
        with open(stamp) as f:
            if json.load(f) == spec:
                return warm
    base = build_tiny(cfg.tiny, os.path.join(root, "base"), cfg.dtype, cfg.seed, cfg.hidden, cfg.layers,
                      cfg.router_scale, cfg.logit_scale)
    freeze = is_router if cfg.tiny == "moe" else (lambda name: False)  # routers stay near ties (flippable)
    supervised_warmup(base, warm, cfg.dtype, cfg.sft_steps, cfg.sft_lr, cfg.seed, freeze, cfg.a_range)
    with open(stamp, "w") as f:
        json.dump(spec, f)
    return warm
