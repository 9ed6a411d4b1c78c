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

from .common import KERNEL_SETS, one_line_errors, pin_reproducible_env

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


def _at_most(args, name: str, hi: int) -> None:
    value = getattr(args, name.lstrip("-").replace("-", "_"))
    if value is not None and value > hi:
        raise UsageError(f"{name} must be <= {hi}, got {value}")


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
    """``verify --temperature``: the rule of every command (runner.config.check_temperature_flag, also train's and
    demo's), as a UsageError."""
    from ..runner.config import ConfigError, check_temperature_flag as check

    try:
        check(value)
    except ConfigError as e:
        raise UsageError(str(e)) from None


def _check_linear_profile(args) -> None:
    """--linear (or ALIGNED_OPS_LINEAR) names a registered profile that can run this model here (the mma profile:
    --dtype bfloat16 and the CPU's unit) — refused now, not when both engines have started. A profile that runs
    every model (unset: fma; exact) needs no torch import for it."""
    # torch-free: a bad name fails before torch loads
    from ..choices import PROFILE_ENV_VAR, profile_name

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
    from ..runner.config import ConfigError, check_profile_runs_here  # train's and demo's check (RunConfig.validate)

    try:
        check_profile_runs_here(name, args.dtype, where)
    except ConfigError as e:
        raise UsageError(str(e)) from None


def _check_prompts_fit(num_prompts: int) -> None:
    """``verify --num-prompts``: the prompts' token ids (int64; apps.verify.PROMPT_LENGTHS in turn) fit in memory, a
    floor of what the job holds (vLLM and the trainer hold them again): --num-prompts 99999999999 looped drawing
    prompts until memory ran out, after the model build."""
    from ..runner.config import approx, physical_memory_bytes
    from .verify import PROMPT_LENGTHS

    memory = physical_memory_bytes()
    cycles, rest = divmod(num_prompts, len(PROMPT_LENGTHS))
    need = 8 * (cycles * sum(PROMPT_LENGTHS) + sum(PROMPT_LENGTHS[:rest]))
    if memory is not None and need > memory:
        raise UsageError(f"--num-prompts {num_prompts}: the prompts' token ids alone take {approx(need, 2**30)} "
                         f"GiB, more than this machine's {approx(memory, 2**30)} GiB of memory")


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
    from ..runner.config import MAX_SEED, MAX_THREADS  # train's and demo's bounds too (RunConfig.validate)

    _at_least(args, "--threads", 1)
    _at_most(args, "--threads", MAX_THREADS)
    _at_least(args, "--seed", 0)
    _at_most(args, "--seed", MAX_SEED)
    if args.command == "verify":
        # the hidden pair a child run gets from its parent (common.run_child: --model, --kernels K --result PATH)
        if args.kernels is not None and (args.result is None or args.model is None):
            raise UsageError("--kernels is the internal child run's flag: it needs --model and --result (run "
                             "`aligned-ops verify` without it for both kernel sets)")
        if args.result is not None and args.kernels is None:
            raise UsageError("--result is the internal child run's flag: it needs --kernels")
        _check_linear_profile(args)
        _at_least(args, "--num-prompts", 1)
        _check_prompts_fit(args.num_prompts)
        _at_least(args, "--max-tokens", 1)
        check_temperature_flag(args.temperature)
    if args.model is not None:
        check_model_dir(args.model)


def build_parser() -> argparse.ArgumentParser:
    from ..runner.config import MAX_SEED, MAX_THREADS  # torch-free

    # every parser: allow_abbrev=False (`demo --mode` must not mean --model) and one-line errors (common.py)
    p = argparse.ArgumentParser(prog="aligned-ops", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    one_line_errors(p, "aligned-ops")
    sub = p.add_subparsers(dest="command", required=True, metavar="{verify,demo,train}")

    v = sub.add_parser("verify", allow_abbrev=False,
                       help="rollout (vLLM) vs trainer log-prob mismatch, standard vs aligned kernels")
    one_line_errors(v, "aligned-ops verify")
    v.add_argument("--model", default=None, help="a local Qwen2/Qwen3/Llama checkpoint (default: build a tiny one)")
    v.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    v.add_argument("--num-prompts", type=int, default=8)
    v.add_argument("--max-tokens", type=int, default=48)
    v.add_argument("--temperature", type=float, default=1.0)
    v.add_argument("--seed", type=int, default=0, help=f"0 to {MAX_SEED} (2**32 - 1: vLLM seeds numpy with it)")
    v.add_argument("--threads", type=int, default=None,
                   help=f"torch threads in the children, 1 to {MAX_THREADS} (default: all cores)")
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
    args, unknown = p.parse_known_args(argv)
    if unknown:  # said by the command they were given to, in one line (argparse: the top-level usage, then this)
        print(f"aligned-ops {args.command}: error: unrecognized arguments: {' '.join(unknown)}", file=sys.stderr)
        return 2
    from .._extension import ExtensionLoadError  # torch-free until called
    from ..runner.config import missing_folders, remove_empty_folders

    out = getattr(args, "out", None)  # train / demo: validation creates it (its last check)
    made = missing_folders(out) if out else []
    try:
        validate_args(args)
        if args.command in ("demo", "train"):
            pin_reproducible_env()
        import aligned_ops

        aligned_ops.load()  # deferred in this process until the flags were checked (aligned_ops/__init__.py)
    except UsageError as e:
        print(f"aligned-ops {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ExtensionLoadError as e:  # the extension's own one-line reasons (a bad ALIGNED_CPU_ISA), after the
        remove_empty_folders(made)   # flags passed: the --out folder validation made goes again
        print(f"aligned-ops {args.command}: error: {e}", file=sys.stderr)
        return 2

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
