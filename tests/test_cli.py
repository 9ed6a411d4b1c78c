"""The main job (README command 1): `aligned-ops verify` and `aligned-ops demo`, end to end with real vLLM.

Small settings keep each run around a minute on 2 cores; the assertions are the claims the tables make:
aligned kernels give 100 % bitwise-equal log-probs, standard kernels do not (negative control)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")


def run_cli(*argv, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "aligned_ops.apps.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def table_row(output: str, metric: str) -> list[str]:
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == metric:
            return cells[1:]
    raise AssertionError(f"no row {metric!r} in:\n{output[-3000:]}")


def test_verify_standard_mismatches_aligned_is_bitwise():
    code, out = run_cli("verify", "--num-prompts", "4", "--max-tokens", "8")
    assert code == 0, out[-4000:]
    standard, aligned = table_row(out, "bitwise equal (%)")
    assert float(aligned) == 100.0
    assert float(standard) < 100.0  # negative control: stock kernels disagree somewhere
    assert float(table_row(out, "max abs Δlogp")[1]) == 0.0
    assert float(table_row(out, "max abs Δlogp")[0]) > 0.0


def test_demo_runs_and_records_every_step(tmp_path):
    code, out = run_cli("demo", "--steps", "3", "--sft-steps", "3", "--prompts", "4", "--samples", "2",
                        "--hidden", "128", "--layers", "1", "--out", str(tmp_path))
    assert code == 0, out[-4000:]
    assert (tmp_path / "demo.png").stat().st_size > 0
    for kernels in ("standard", "aligned"):
        res = json.loads((tmp_path / f"demo_{kernels}.json").read_text())
        assert [r["step"] for r in res["steps"]] == [0, 1, 2]
        assert all(0.0 <= r["reward"] <= 1.0 for r in res["steps"])
    aligned = json.loads((tmp_path / "demo_aligned.json").read_text())
    assert all(r["kernel_frac_bitwise_equal"] == 1.0 and r["kernel_abs_diff_max"] == 0.0 for r in aligned["steps"])
    assert "D3 peak-to-median" in out


@pytest.mark.slow
def test_moe_demo_prints_both_kernel_sets_d3_and_routing_flips(tmp_path):
    # Structure only (a tiny config; the README's numbers come from the default run): the table names each
    # column's D3 peak-to-median and the routing flips; with aligned kernels no route flips and no bit differs.
    code, out = run_cli("demo", "--moe", "--steps", "2", "--rl-warmup", "1", "--sft-steps", "2", "--prompts", "2",
                        "--samples", "2", "--layers", "1", "--out", str(tmp_path))
    assert code == 0, out[-4000:]
    assert "tiny Qwen3-MoE" in out and "2 logged steps after 1 unlogged" in out
    assert "trains the head (after the last router)" in out  # the --moe default --train-scope
    assert "of a+b (a < 1000)" in out  # the --moe default --a-range
    for row in ("D3 peak-to-median", "kernel-made routing flips (token·layer, all steps)",
                "lag-made routing flips (token·layer, all steps)", "kernel max abs Δlogp (any token)"):
        assert len(table_row(out, row)) == 2
    assert table_row(out, "kernel-made routing flips (token·layer, all steps)")[1] == "0"
    # Training only the weights after the last router, a lag step cannot change a route, for either kernel set.
    assert table_row(out, "lag-made routing flips (token·layer, all steps)") == ["0", "0"]
    assert "D3 peak-to-median: standard" in out and "columns: standard = stock vLLM" in out
    aligned = json.loads((tmp_path / "demo_aligned.json").read_text())
    assert aligned["moe"] and [r["step"] for r in aligned["steps"]] == [0, 1]
    assert all(r["routing_flips"] == 0 and r["kernel_abs_diff_max"] == 0.0 for r in aligned["steps"])
    assert all(r["lag_routing_flips"] == 0 for r in aligned["steps"])
    assert (tmp_path / "demo.png").stat().st_size > 0


def test_cli_rejects_unknown_command():
    code, out = run_cli("nope")
    assert code != 0 and "invalid choice" in out
