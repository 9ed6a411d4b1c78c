"""The main jobs: `aligned-ops verify` and `aligned-ops demo`, end to end with real vLLM.

Small settings keep each run around a minute on 2 cores; the assertions are the claims the tables make:
aligned kernels give 100 % bitwise-equal log-probs, standard kernels do not (negative control)."""

import json
import os
import subprocess
import sys

import pytest
from _background import OUT_DIR

pytest.importorskip("vllm")


def cli_job(*argv, timeout=600):
    """The CLI run as a process: argv, environment and timeout (a test runs it, or tests/_background.py does)."""
    return dict(argv=[sys.executable, "-m", "aligned_ops.apps.cli", *argv], env=dict(os.environ, PYTHONUNBUFFERED="1"),
                timeout=timeout)


def run_cli(*argv, timeout=600):
    job = cli_job(*argv, timeout=timeout)
    proc = subprocess.run(job["argv"], env=job["env"], capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


# The verify run needs nothing from the test process: tests/_background.py starts it at the beginning of the run
# (one job at a time, beside the in-process tests).
VERIFY_ARGV = ("verify", "--num-prompts", "4", "--max-tokens", "8")


# The demo run too (four train runs, each a learner process and a rollout-engine process: ~90 CPU s, one chain of
# processes): it writes only to its own --out, the job's folder under pytest's basetemp (kept, as tmp_path was).
DEMO_ARGV = ("demo", "--steps", "3", "--prompts", "4", "--samples", "2", "--hidden", "64", "--layers", "1",
             "--sft-steps", "2", "--lr-warmup", "0", "--out", OUT_DIR)


def BACKGROUND_JOBS(tiny_checkpoint):
    return {"cli_verify": dict(cli_job(*VERIFY_ARGV, timeout=1200),  # generous: it runs beside the suite
                               for_test="test_verify_standard_mismatches_aligned_is_bitwise"),
            "cli_demo": dict(cli_job(*DEMO_ARGV, timeout=1800),
                             for_test="test_demo_runs_four_configurations_and_prints_one_table")}


def background_cli(background, key):
    res = background.result(key)
    return res.returncode, res.stdout + res.stderr


def table_row(output: str, metric: str) -> list[str]:
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == metric:
            return cells[1:]
    raise AssertionError(f"no row {metric!r} in:\n{output[-3000:]}")


@pytest.mark.slow  # two vLLM engines (standard, aligned) in a fresh process
def test_verify_standard_mismatches_aligned_is_bitwise(background):
    code, out = background_cli(background, "cli_verify")
    assert code == 0, out[-4000:]
    standard, aligned = table_row(out, "bitwise equal (%)")
    assert float(aligned) == 100.0
    assert float(standard) < 100.0  # negative control: stock kernels disagree somewhere
    assert float(table_row(out, "max abs Δlogp")[1]) == 0.0
    assert float(table_row(out, "max abs Δlogp")[0]) > 0.0


@pytest.mark.slow  # four train runs, each with a vLLM engine in its own process
def test_demo_runs_four_configurations_and_prints_one_table(background):
    # Structure and the claims that hold at any size (the README's numbers come from the default run): four train
    # runs of one tiny MoE; aligned kernels are bitwise at every step (sync: no lag, so D3 is exactly 0 and the IS
    # ratio exactly 1); stock kernels are not (negative control); one table, the headline lines, a PNG.
    code, out = background_cli(background, "cli_demo")
    _check_demo(code, out, background.out_dir("cli_demo"))


def _check_demo(code, out, out_dir):
    assert code == 0, out[-4000:]
    cols = table_row(out, "metric")
    assert cols == ["standard async", "aligned async", "standard sync", "aligned sync"]
    bitwise = [float(v) for v in table_row(out, "kernel-only bitwise equal (min % over steps)")]
    assert bitwise[1] == 100.0 and bitwise[3] == 100.0 and bitwise[0] < 100.0 and bitwise[2] < 100.0
    assert float(table_row(out, "D3 peak")[3]) == 0.0  # aligned sync: π = μ bit for bit
    assert float(table_row(out, "max IS ratio π/μ (any token)")[3]) == 1.0
    assert float(table_row(out, "D3 peak")[2]) > 0.0  # standard sync: the kernel mismatch alone is not 0
    for line in ("D3 peak-to-median (async, lag 1): standard", "throughput async / sync: aligned",
                 "aligned kernels: kernel-only mismatch 0 and bitwise at every step: yes", "columns: standard = stock"):
        assert line in out
    for run in ("standard_async", "aligned_async", "standard_sync", "aligned_sync"):
        summary = json.loads((out_dir / "runs" / run / "summary.json").read_text())
        assert summary["updates"] == 3 and summary["steps_in_file"]
    assert (out_dir / "demo.png").stat().st_size > 0
    assert set(json.loads((out_dir / "demo_summary.json").read_text())) == {
        "standard_async", "aligned_async", "standard_sync", "aligned_sync"}


def test_cli_rejects_unknown_command():
    code, out = run_cli("nope")
    assert code != 0 and "invalid choice" in out
