"""``aligned-ops``: the main job.

    aligned-ops verify [--model DIR] [--dtype bfloat16]   rollout vs trainer mismatch, standard vs aligned kernels
    aligned-ops demo   [--steps N] [--lag K] ...            small async RL run (REINFORCE Zero), both kernel sets

Each kernel set runs in its own child process: the vLLM plugin patches vLLM's layers process-wide, so
"standard" and "aligned" must not share an interpreter. The parent collects the children's JSON and prints
the side-by-side tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

KERNEL_SETS = ("standard", "aligned")


def child_env(kernels: str) -> dict:
    env = dict(os.environ)
    env["ALIGNED_OPS_VLLM"] = "1" if kernels == "aligned" else "0"
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    return env


def run_child(kernels: str, argv: list[str], result_path: str) -> dict:
    """Run ``python -m aligned_ops.cli <argv> --kernels K --result PATH`` and load its JSON result."""
    cmd = [sys.executable, "-m", "aligned_ops.cli", *argv, "--kernels", kernels, "--result", result_path]
    proc = subprocess.run(cmd, env=child_env(kernels))
    if proc.returncode != 0:
        raise SystemExit(f"aligned-ops: the {kernels!r} run failed (exit {proc.returncode}); its output is above")
    with open(result_path) as f:
        return json.load(f)


def _fmt(v, spec=".3g"):
    if isinstance(v, str):
        return v
    if v != v:
        return "nan"
    return format(v, spec)


def print_table(title: str, columns: list[str], rows: list[tuple[str, list]]) -> str:
    """A plain-text table (also valid Markdown), printed and returned."""
    head = ["metric", *columns]
    body = [[name, *[_fmt(v) for v in vals]] for name, vals in rows]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    out = [f"\n{title}\n", line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)]
    text = "\n".join(out)
    print(text, flush=True)
    return text


def main(argv: list[str] | None = None) -> int:
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
    v.add_argument("--kernels", choices=KERNEL_SETS, default=None, help=argparse.SUPPRESS)
    v.add_argument("--result", default=None, help=argparse.SUPPRESS)

    d = sub.add_parser("demo", help="small async RL run with REINFORCE Zero, standard vs aligned kernels")
    d.add_argument("--steps", type=int, default=60, help="RL steps")
    d.add_argument("--sft-steps", type=int, default=150, help="supervised warm-up steps before RL")
    d.add_argument("--lag", type=int, default=2, help="rollout weights lag the trainer by this many steps")
    d.add_argument("--prompts", type=int, default=16, help="prompts per RL step")
    d.add_argument("--samples", type=int, default=4, help="samples per prompt (group size)")
    d.add_argument("--lr", type=float, default=5e-4, help="RL learning rate (AdamW on fp32 master weights)")
    d.add_argument("--sft-lr", type=float, default=3e-3, help="supervised warm-up learning rate")
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

    args = p.parse_args(argv)
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


def temp_dir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=prefix)


if __name__ == "__main__":
    sys.exit(main())
