"""``aligned-ops train``: one RL run of :mod:`aligned_ops.runner` from the command line.

    aligned-ops train --mode async --max-lag 1 --kernels aligned --steps 60 --out runs/a
    aligned-ops train --mode sync --kernels standard --model ./my-qwen3 --out runs/b

Writes OUT/metrics.jsonl (one JSON object per learner step), OUT/summary.json, OUT/checkpoint/ (``--resume``
continues a killed run) and OUT/logs/ (the rollout engines' output). Every flag is checked before anything starts.
"""

from __future__ import annotations

import argparse
import json

from ..runner.config import (BACKENDS, KERNEL_SETS, MAX_SEED, MAX_THREADS, MODES, REWARDS, TINY_MODELS,
                             TRAIN_SCOPES, RunConfig)

# flag -> RunConfig field (same name with "-" for "_"); help texts
FLAGS = [
    ("--mode", dict(choices=MODES, help="sync: rollout and training take turns (lag 0); async: they overlap, "
                                        "rollouts lag the learner by up to --max-lag versions")),
    ("--max-lag", dict(type=int, metavar="K", help="maximum staleness k (async default 1; sync is 0)")),
    ("--kernels", dict(choices=KERNEL_SETS, help="aligned: vLLM with the aligned_ops plugin + the patched trainer; "
                                                 "standard: stock vLLM + stock Hugging Face trainer")),
    ("--model", dict(metavar="DIR", help="a local Qwen2/Qwen3/Llama (or Qwen2/Qwen3-MoE) checkpoint; default: the "
                                         "built-in tiny model (--tiny), taught the task by --sft-steps first")),
    ("--linear", dict(metavar="PROFILE", help="aligned kernels: the linear numerics profile of both sides, a name "
                                              "from aligned_ops.profiles (fma, exact, mma; default: ALIGNED_OPS_LINEAR, "
                                              "else fma)")),
    ("--tiny", dict(choices=TINY_MODELS, help="built-in tiny model: a Qwen3-MoE (8 experts, top-2) or a dense Qwen2")),
    ("--dtype", dict(choices=["bfloat16", "float32", "float16"])),
    ("--steps", dict(type=int, help="learner updates")),
    ("--prompts", dict(type=int, help="prompts per batch")),
    ("--samples", dict(type=int, help="samples per prompt (the advantage group, >= 2)")),
    ("--lr", dict(type=float, help="learning rate (AdamW on fp32 master weights)")),
    ("--lr-warmup", dict(type=int, help="linear learning-rate warm-up steps")),
    ("--loss", dict(help="policy loss: reinforce_zero (untruncated token IS, default), tis, mis, icepop, seq_tis, "
                         "seq_mis, ppo_clip (aligned_ops.rl.policy_loss)")),
    ("--clip-c", dict(type=float, help="truncation C of tis / seq_tis / ppo_clip")),
    ("--advantage", dict(choices=["grpo", "rloo", "group_mean"])),
    ("--temperature", dict(type=float, help="sampling (and scoring) temperature")),
    ("--train-scope", dict(choices=TRAIN_SCOPES, help="MoE: 'head' (default) trains only the weights after the "
                                                      "last router, so a lag step cannot flip a route; 'all'")),
    ("--freeze-router", dict(action=argparse.BooleanOptionalAction, help="MoE: keep the routers fixed (default on)")),
    ("--a-range", dict(type=int, help="task prompts a+b= with a < A, b < 10")),
    ("--reward", dict(choices=list(REWARDS), help="exact: 1 for the whole answer, else 0; digits: the "
                                                        "fraction of answer tokens right")),
    ("--seed", dict(type=int, help=f"0 to {MAX_SEED} (2**32 - 1: vLLM seeds numpy with it)")),
    ("--d3-from", dict(type=int, help="first step of the D3 summary (default: --lr-warmup)")),
    ("--checkpoint-every", dict(type=int, help="checkpoint every N steps (and at the end)")),
    ("--resume", dict(action="store_true", help="continue the run in --out from its checkpoint")),
    ("--backend", dict(choices=BACKENDS, help="processes (default) or ray (actors; --ray-address or a local head)")),
    ("--rollout-workers", dict(type=int, help="rollout engines feeding the learner")),
    ("--ray-address", dict(help="an existing Ray cluster (default: start a local head on loopback)")),
    ("--threads", dict(type=int, help=f"torch threads per process, 1 to {MAX_THREADS} (default 1: one core each)")),
    ("--pin-cores", dict(action=argparse.BooleanOptionalAction, help="pin learner and workers to one core each "
                                                                     "(default: when there are enough cores)")),
    ("--hidden", dict(type=int, help="tiny model width")),
    ("--layers", dict(type=int, help="tiny model layers")),
    ("--router-scale", dict(type=float, help="tiny MoE: std of the router weights (small: near-tie routes)")),
    ("--logit-scale", dict(type=float, help="tiny model: multiply the final norm's weight (every logit) by this")),
    ("--sft-steps", dict(type=int, help="tiny model: supervised warm-up steps on the task")),
    ("--sft-lr", dict(type=float)),
    ("--out", dict(help="output folder")),
]


def add_arguments(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """The train flags on ``p``; every default is RunConfig's (or ``defaults``), shown in --help."""
    base = RunConfig()
    for flag, kw in FLAGS:
        name = flag[2:].replace("-", "_")
        default = (defaults or {}).get(name, getattr(base, name))
        kw = dict(kw, default=default)
        if kw.get("action") != "store_true" and default is not None and "help" in kw:
            kw["help"] += f" (default {default})"
        p.add_argument(flag, **kw)
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def add_parser(sub) -> argparse.ArgumentParser:
    from .common import one_line_errors

    t = sub.add_parser("train", allow_abbrev=False, help="one RL run (async or sync, aligned or standard kernels): metrics.jsonl, "
                                     "summary.json", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(t)
    one_line_errors(t, "aligned-ops train")
    return t


def config_from_args(args) -> RunConfig:
    """The RunConfig of parsed flags, validated (raises runner.ConfigError naming the flag)."""
    fields = {f[2:].replace("-", "_") for f, _ in FLAGS} | {"progress"}
    return RunConfig(**{k: getattr(args, k) for k in fields}).validate()


def main(args, cfg: RunConfig) -> int:
    from ..runner import run

    summary = run(cfg)
    keys = ("mode", "kernels", "max_lag", "updates", "tokens_per_s", "kernel_bitwise_min", "d3_median", "d3_peak",
            "d3_peak_to_median", "is_ratio_max", "reward_first", "reward_last", "sync_s_mean")
    print(json.dumps({k: summary[k] for k in keys}, indent=1))
    print(f"wrote {cfg.out}/metrics.jsonl, {cfg.out}/summary.json")
    return 0
