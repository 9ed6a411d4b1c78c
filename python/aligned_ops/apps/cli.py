"""``aligned-ops``: the main job.

    aligned-ops verify [--model DIR] [--dtype bfloat16]   rollout vs trainer mismatch, standard vs aligned kernels
    aligned-ops demo   [--steps N] [--seed S] ...           the RL runner, standard vs aligned kernels, async vs sync
    aligned-ops train  [--mode async] [--kernels aligned] ...  one RL run of the runner (aligned_ops.runner)

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


# The head sizes vLLM-CPU's attention backend takes (vllm/v1/attention/backends/cpu_attn.py,
# CPUAttentionBackend.get_supported_head_sizes, vLLM 0.32; the standard kernel set runs it). Written here so the
# check costs no vLLM import; tests/test_cli_validation.py compares it with the installed vLLM's.
from ..choices import VLLM_CPU_ATTENTION_HEAD_SIZES  # noqa: E402  (torch-free)


def _at_least(args, name: str, lo: int) -> None:
    value = getattr(args, name.lstrip("-").replace("-", "_"))
    if value is not None and value < lo:
        raise UsageError(f"{name} must be >= {lo}, got {value}")


def check_model_dir(path: str) -> None:
    """The model folder exists, holds a config.json, names an architecture both sides support and a head size
    vLLM-CPU's attention takes: checked from the JSON alone (no engine), so a wrong folder fails in well under a
    second. The same check as ``aligned-ops train`` / ``demo`` (runner.config.read_model_config)."""
    from ..runner.config import ConfigError, read_model_config

    try:
        read_model_config(path)
    except ConfigError as e:
        raise UsageError(str(e)) from None


def check_temperature_flag(value: float) -> None:
    """``verify --temperature``: a temperature vLLM samples from (> 0: greedy decoding samples no distribution
    to compare) and accepts — its rule for the installed release (aligned_ops.sampling.check_temperature)."""
    if not (0.0 < value < float("inf")):
        raise UsageError(f"--temperature must be a finite number > 0, got {value} (greedy decoding samples no "
                         "distribution to compare; use e.g. 1.0)")
    from ..sampling_rules import check_temperature

    try:
        check_temperature(value, "--temperature")
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_linear_profile(args) -> None:
    """--linear (or ALIGNED_OPS_LINEAR) names a registered profile that can run this model here (the mma profile:
    --dtype bfloat16 and the CPU's unit) — refused now, not when both engines have started. A profile that runs
    every model (unset: fma; exact) needs no torch import for it."""
    # torch-free: a bad name fails before torch loads
    from ..choices import MODEL_REFUSING_PROFILES, PROFILE_ENV_VAR, profile_name

    env = os.environ.get(PROFILE_ENV_VAR, "").strip()
    if args.linear is None and not env:
        return
    where = "--linear" if args.linear is not None else PROFILE_ENV_VAR
    try:
        name = profile_name(args.linear if args.linear is not None else env, where)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.linear is not None:
        args.linear = name
    if name not in MODEL_REFUSING_PROFILES:
        return
    from .. import profiles

    profile = profiles.get(name, where)
    bad = profile.model_refusals(args.dtype)
    if bad:
        raise UsageError(f"{where} {profile.name}: " + "; ".join(bad))


def validate_args(args) -> None:
    """Every flag checked up front (the runs take minutes; a bad value must not surface at the end)."""
    if args.command == "train":
        from ..runner.config import ConfigError
        from .train import config_from_args

        try:
            args.config = config_from_args(args)
        except ConfigError as e:
            raise UsageError(str(e)) from None
        return
    if args.command == "demo":
        from ..runner.config import ConfigError
        from .demo import configs_from_args

        try:
            args.configs = configs_from_args(args)
        except ConfigError as e:
            raise UsageError(str(e)) from None
        return
    _at_least(args, "--threads", 1)
    _at_least(args, "--seed", 0)
    if args.command == "verify":
        _check_linear_profile(args)
        _at_least(args, "--num-prompts", 1)
        _at_least(args, "--max-tokens", 1)
        check_temperature_flag(args.temperature)
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

    from . import demo, train

    demo.add_parser(sub)
    train.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        validate_args(args)
    except UsageError as e:
        print(f"aligned-ops {args.command}: error: {e}", file=sys.stderr)
        return 2
    if args.command in ("demo", "train"):
        pin_reproducible_env()
    import aligned_ops

    aligned_ops.load()  # deferred in this process until the flags were checked (aligned_ops/__init__.py)

    if args.command == "train":
        from . import train

        return train.main(args, args.config)
    if args.command == "demo":
        from . import demo

        return demo.main(args, args.configs)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from . import verify as job
    if args.kernels:  # a child started by run_child: one kernel set, result as JSON
        with open(args.result, "w") as f:
            json.dump(job.child(args), f)
        return 0
    return job.main(args)


if __name__ == "__main__":
    sys.exit(main())
