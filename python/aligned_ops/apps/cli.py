"""``aligned-ops``: the main job.

    aligned-ops verify [--model DIR] [--dtype bfloat16]   rollout vs trainer mismatch, standard vs aligned kernels
    aligned-ops demo   [--steps N] [--lag K] ...            small async RL run (REINFORCE Zero), both kernel sets

Each kernel set runs in its own child process (apps/common.py): the vLLM plugin patches vLLM's layers process-wide, so
"standard" and "aligned" must not share an interpreter. The parent collects the children's JSON and prints
the side-by-side tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .common import KERNEL_SETS, pin_reproducible_env

class UsageError(Exception):
    """A bad flag or model folder: reported as one line, exit status 2, before any engine starts."""


def _at_least(args, name: str, lo: int) -> None:
    value = getattr(args, name.lstrip("-").replace("-", "_"))
    if value is not None and value < lo:
        raise UsageError(f"{name} must be >= {lo}, got {value}")


def _positive_float(args, name: str) -> None:
    value = getattr(args, name.lstrip("-").replace("-", "_"))
    if not (0.0 < value < float("inf")):
        raise UsageError(f"{name} must be a finite number > 0, got {value}")


def check_model_dir(path: str) -> None:
    """The model folder exists, holds a config.json, and names an architecture both sides support: checked
    from the JSON alone (no torch, no transformers, no engine), so a wrong folder fails in well under a second."""
    from types import SimpleNamespace

    from ..integrations import check_hf_config

    if not os.path.isdir(path):
        raise UsageError(f"--model {path}: no such directory (pass a local checkpoint folder)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise UsageError(f"--model {path}: no config.json in that folder (not a Hugging Face checkpoint)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model {path}: cannot read config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"--model {path}: config.json is not a JSON object")
    try:
        check_hf_config(SimpleNamespace(**cfg), "--model")
    except ValueError as e:
        raise UsageError(f"{e} (folder {path})") from None


DEMO_DEFAULTS = dict(steps=60, sft_steps=150, rl_warmup=0, lag=2, prompts=16, samples=4, lr=5e-4, sft_lr=3e-3,
                     router_scale=0.08, freeze_router=False, train_scope="all", a_range=100)
# --moe: what makes D3 show the mechanism (README "The MoE demo"): RL trains only the weights after the last router
# (--train-scope head), so a weight-lag step cannot flip a route and the aligned D3 carries the smooth lag only; a
# warmed-up policy (20 unlogged RL steps: Adam's first updates are its largest, and its first moment averages over
# ~10 steps), a small steady learning rate at lag 1; routers frozen near ties (bf16 kernel differences flip routes
# under stock kernels); 32x4 rollouts per step (fewer tokens make the per-step mean of the lag's k3 noisy: aligned
# peak-to-median 7.2 at 16x4, 1.6 at 32x4); 10,000 distinct prompts (--a-range 1000): with 1000 the model's few
# near-tie routing contexts recur, so a run's kernel-made flips were a handful of repeated draws of the flip effect
# (seed 2: every flip moved its token by <= 0.13 nats; standard peak-to-median 2.1) instead of many independent ones.
DEMO_MOE_DEFAULTS = dict(DEMO_DEFAULTS, steps=40, sft_steps=60, rl_warmup=20, lag=1, lr=3e-5, prompts=32,
                         router_scale=0.08, freeze_router=True, train_scope="head", a_range=1000)


def resolve_demo_defaults(args) -> None:
    """Fill the demo flags left unset from the dense or the --moe defaults (idempotent)."""
    table = DEMO_MOE_DEFAULTS if getattr(args, "moe", False) else DEMO_DEFAULTS
    for key, value in table.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def _check_linear_profile(args) -> None:
    """--linear (or ALIGNED_OPS_LINEAR) names a registered profile that can run this model here (the mma profile:
    --dtype bfloat16 and the CPU's unit) — refused now, not when both engines have started. Unset: fma, which
    runs everywhere (no torch import for it)."""
    env = os.environ.get("ALIGNED_OPS_LINEAR", "").strip()
    if args.linear is None and not env:
        return
    from .. import profiles

    where = "--linear" if args.linear is not None else "ALIGNED_OPS_LINEAR"
    try:
        profile = profiles.get(args.linear if args.linear is not None else env, where)
    except ValueError as e:
        raise UsageError(str(e)) from None
    bad = profile.model_refusals(args.dtype)
    if bad:
        raise UsageError(f"{where} {profile.name}: " + "; ".join(bad))


def validate_args(args) -> None:
    """Every flag checked up front (the runs take minutes; a bad value must not surface at the end)."""
    if args.command == "demo":
        resolve_demo_defaults(args)
    _at_least(args, "--threads", 1)
    _at_least(args, "--seed", 0)
    if args.command == "verify":
        _check_linear_profile(args)
        _at_least(args, "--num-prompts", 1)
        _at_least(args, "--max-tokens", 1)
        if not (0.0 < args.temperature < float("inf")):
            raise UsageError(f"--temperature must be a finite number > 0, got {args.temperature} (greedy decoding "
                             "samples no distribution to compare; use e.g. 1.0)")
    else:
        _at_least(args, "--steps", 1)
        _at_least(args, "--sft-steps", 0)
        _at_least(args, "--rl-warmup", 0)
        _positive_float(args, "--router-scale")
        _at_least(args, "--lag", 0)
        _at_least(args, "--prompts", 1)
        _at_least(args, "--samples", 1)
        _at_least(args, "--layers", 1)
        _at_least(args, "--a-range", 1)
        _positive_float(args, "--lr")
        _positive_float(args, "--sft-lr")
        if args.hidden < 8 or args.hidden % 8:
            raise UsageError(f"--hidden must be a positive multiple of 8 (4 heads of an even head_dim), got {args.hidden}")
        if args.train_scope == "head" and args.kernels is None and not args.moe:
            raise UsageError("--train-scope head needs --moe (it trains the weights after the last MoE router)")
        if args.kernels is None and os.path.exists(args.out) and not os.path.isdir(args.out):
            raise UsageError(f"--out {args.out}: exists and is not a folder")
    if args.model is not None:
        check_model_dir(args.model)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aligned-ops", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", help="rollout (vLLM) vs trainer log-prob mismatch, standard vs aligned kernels")
    v.add_argument("--model", default=None, help="a local Qwen2/Qwen3/Llama checkpoint (default: build a tiny one)")
    v.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    v.add_argument("--num-prompts", type=int, default=8)
    v.add_argument("--max-tokens", type=int, default=48)
    v.add_argument("--temperature", type=float, default=1.0)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--threads", type=int, default=None, help="torch threads in the children (default: all cores)")
    v.add_argument("--moe", action="store_true",
                   help="build a tiny mixture-of-experts model (Qwen3-MoE) instead of a dense one; with --model, "
                        "MoE checkpoints are detected from their config (routing flips are reported either way)")

    v.add_argument("--linear", default=None, metavar="PROFILE",
                   help="linear numerics profile of the aligned side, a name from aligned_ops.profiles (fma, exact, mma; "
                        "default: ALIGNED_OPS_LINEAR, else fma)")
    v.add_argument("--kernels", choices=KERNEL_SETS, default=None, help=argparse.SUPPRESS)
    v.add_argument("--result", default=None, help=argparse.SUPPRESS)

    d = sub.add_parser("demo", help="small async RL run with REINFORCE Zero, standard vs aligned kernels")
    # Defaults: None here, filled from DEMO_DEFAULTS (dense) or DEMO_MOE_DEFAULTS (--moe) by resolve_demo_defaults.
    d.add_argument("--steps", type=int, default=None, help="logged RL steps")
    d.add_argument("--sft-steps", type=int, default=None, help="supervised warm-up steps before RL")
    d.add_argument("--rl-warmup", type=int, default=None,
                   help="RL steps trained before logging starts (Adam's first, largest updates; dense 0)")
    d.add_argument("--lag", type=int, default=None, help="rollout weights lag the trainer by this many steps")
    d.add_argument("--prompts", type=int, default=None, help="prompts per RL step")
    d.add_argument("--samples", type=int, default=None, help="samples per prompt (group size)")
    d.add_argument("--lr", type=float, default=None, help="RL learning rate (AdamW on fp32 master weights)")
    d.add_argument("--sft-lr", type=float, default=None, help="supervised warm-up learning rate")
    d.add_argument("--router-scale", type=float, default=None,
                   help="--moe: std of the random router weights (small: close expert scores, routes that flip)")
    d.add_argument("--freeze-router", action=argparse.BooleanOptionalAction, default=None,
                   help="--moe: keep the router weights fixed in warm-up and RL (routing stays close to ties)")
    d.add_argument("--train-scope", choices=["all", "head"], default=None,
                   help="--moe: what RL trains: 'head' = only the weights after the last router (last layer's "
                        "experts, final norm, untied LM head), so a weight-lag step cannot flip a route; 'all'")
    d.add_argument("--a-range", type=int, default=None,
                   help="task prompts a+b= with a < A (b < 10): the number of distinct prompts is 10*A (dense 100; "
                        "--moe 1000, so the model's few near-tie routing contexts do not recur every step)")
    d.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    d.add_argument("--hidden", type=int, default=128, help="tiny model width")
    d.add_argument("--layers", type=int, default=2)
    d.add_argument("--moe", action="store_true",
                   help="a tiny Qwen3-MoE (8 experts, top-2) instead of the dense Qwen2: routing flips under "
                        "standard kernels")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--threads", type=int, default=None)
    d.add_argument("--out", default="demo_out", help="folder for the plot and JSON results")
    d.add_argument("--kernels", choices=KERNEL_SETS, default=None, help=argparse.SUPPRESS)
    d.add_argument("--result", default=None, help=argparse.SUPPRESS)
    d.add_argument("--model", default=None, help=argparse.SUPPRESS)

    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        validate_args(args)
    except UsageError as e:
        print(f"aligned-ops {args.command}: error: {e}", file=sys.stderr)
        return 2
    if args.command == "demo":
        pin_reproducible_env()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.command == "verify":
        from . import verify as job
    else:
        from . import demo as job
    if args.kernels:  # a child started by run_child: one kernel set, result as JSON
        with open(args.result, "w") as f:
            json.dump(job.child(args), f)
        return 0
    return job.main(args)


if __name__ == "__main__":
    sys.exit(main())
