"""What ``aligned-ops`` and its jobs (verify, demo) share: the kernel sets, the child-process runner, tables.

Each kernel set runs in its own child process (``python -m aligned_ops.apps.cli ... --kernels K``): the vLLM
plugin patches vLLM's layers process-wide, so "standard" and "aligned" must not share an interpreter.
This module imports nothing of the jobs, so cli -> verify/demo -> common has no cycle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

KERNEL_SETS = ("standard", "aligned")

# What makes `aligned-ops demo` differ between machines of one kind (issue 8): torch's own CPU kernels
# (AdamW's lerp/addcdiv, clip_grad_norm_'s vector_norm, the stock HF trainer of the warm-up) are picked per
# CPU capability (AVX2 vs AVX-512: fma use and reduction widths differ), and the stock engine's oneDNN
# matmuls take the AMX path on CPUs that have it. The demo pins torch's level to AVX2 (an explicit setting
# in the environment wins). oneDNN is NOT pinned: ONEDNN_MAX_CPU_ISA=AVX2 crashes vLLM-CPU's bf16 engine
# (c10::Error at the first step), so the standard column still depends on AMX; the aligned ops never
# depend on the CPU. Thread count still matters
# for torch's reductions: pass --threads for the same table on machines with different core counts.
REPRODUCIBLE_ENV = {"ATEN_CPU_CAPABILITY": "avx2"}


def pin_reproducible_env() -> None:
    """Set REPRODUCIBLE_ENV (unless already set): before the first torch CPU kernel runs, since torch and
    oneDNN read these once, lazily; child processes inherit them."""
    for key, value in REPRODUCIBLE_ENV.items():
        os.environ.setdefault(key, value)


def one_line_errors(p, prog: str) -> None:
    """argparse's own errors on parser ``p`` (a bad choice, a non-integer, an unknown or missing command) as one
    line, exit 2 — not usage plus error. ``--help`` is untouched."""

    def error(message: str):
        print(f"{prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    p.error = error


def child_env(kernels: str, overrides: dict | None = None) -> dict:
    """The environment of a child process of kernel set ``kernels``; ``overrides`` (e.g. the resolved linear
    profile, ``ALIGNED_OPS_LINEAR``) are set in it, never in this process's environment."""
    env = dict(os.environ)
    env.update(overrides or {})
    env["ALIGNED_OPS_VLLM"] = "1" if kernels == "aligned" else "0"
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    return env


def run_child(kernels: str, argv: list[str], result_path: str, env: dict | None = None) -> dict:
    """Run ``python -m aligned_ops.apps.cli <argv> --kernels K --result PATH`` (``env``: variables set in the
    child only) and load its JSON result."""
    cmd = [sys.executable, "-m", "aligned_ops.apps.cli", *argv, "--kernels", kernels, "--result", result_path]
    proc = subprocess.run(cmd, env=child_env(kernels, env))
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


def temp_dir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=prefix)
