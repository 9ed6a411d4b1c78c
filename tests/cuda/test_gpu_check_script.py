""".ci/gpu_check.sh fits one lease of the device tool: its step timeouts add up to <= 540 s (--quick <= 240 s), and
on a machine without a GPU it stops cleanly at the first step that needs one (exit 3, "no GPU", no traceback), with
what it wrote in $OUT within the tool's limits (<= 8 files, <= 2 folders deep). Runs without a GPU (CI)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci/gpu_check.sh"


def test_dry_run_lists_steps_within_the_budget():
    p = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    rows = {m.group(1): (int(m.group(2)), m.group(3)) for m in
            re.finditer(r"^(\S+)\s+(\d+)\s+(\d+|-)\s+(?:yes|no)$", p.stdout, re.M)}
    for step in ("env", "gpu", "build", "test:test_cuda_dense.py", "test:test_cuda_realistic.py", "sanitize:memcheck",
                 "sanitize:racecheck", "bench", "mma:test_cuda_linear_mma.py"):
        assert step in rows, p.stdout
    full = sum(t for t, _ in rows.values())
    quick = sum(int(q) for _, q in rows.values() if q != "-")
    assert full <= 540 and quick <= 240, (full, quick)
    assert rows["build"][0] <= 240
    assert re.search(rf"total \(timeouts\)\s+{full}\s+{quick}", p.stdout)
    # --build-only: one device command (<= 600 s) for the build alone; the next call reuses it
    m = re.search(r"^--build-only: build\s+(\d+)$", p.stdout, re.M)
    assert m and 240 < int(m.group(1)) <= 540, p.stdout


def test_bad_flag_is_refused():
    p = subprocess.run(["bash", str(SCRIPT), "--fast"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "unknown argument '--fast'" in p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("mode", ["--quick", "--build-only"])
def test_stops_cleanly_without_a_gpu(tmp_path, mode):
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    p = subprocess.run(["bash", str(SCRIPT), mode], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "no GPU" in p.stdout and "Traceback" not in p.stdout + p.stderr
    files = [f for f in (tmp_path / "out").rglob("*") if f.is_file()]
    assert len(files) <= 8 and all(len(f.relative_to(tmp_path / "out").parts) <= 3 for f in files)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| gpu | no GPU |" in summary and "| build |" not in summary  # nothing ran past the GPU check
