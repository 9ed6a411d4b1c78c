"""The emulator's bf16 MMA models in integer arithmetic (csrc/emu/bf16_mma_models.h) give the bits of their fp64 /
frexp / ldexp transcription (csrc/emu/bf16_mma_models_reference.h), step by step.

Every emulated `mma` kernel's bits go through these models, and the emulated references the kernels are compared
with use them too, so a wrong model would pass every kernel test: this test holds the fast form to the first one on
1.2 M generated operand sets per step (tests/emulated/mma_model_conformance.cpp: random bits, one exponent window,
subnormals and signed zeros, the overflow edge, cancelling pairs onto zeros), for the NVIDIA fused step (K = 16,
F = 25: sm_90 / sm_100 / sm_120; K = 8, F = 24: sm_80's half step) and the AMD CDNA3 group (gfx942 / gfx950). It
also checks that each kind of result (+-0, subnormal, normal, inf, NaN) occurred. Negative controls: steps that
differ (F = 25 vs F = 24, NVIDIA vs CDNA3) show mismatches through the same comparison, and so does the integer form
built with a planted edge-case fault (ALIGNED_MMA_MODEL_MUTANT: no clamp at fp32's subnormal exponent; a truncation
where CDNA3 floors).
"""

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "emulated" / "mma_model_conformance.cpp"
# the emulator's flags (CMakeLists.txt ALIGNED_EXACT_CXX_FLAGS): no contraction, no fast-math
FLAGS = ["-std=c++20", "-O2", "-ffp-contract=off", "-fno-fast-math", "-fno-unsafe-math-optimizations",
         "-fno-finite-math-only", "-fno-associative-math", "-fno-reciprocal-math"]
STEPS = ("nv_fused_k16_f25", "nv_fused_k8_f24", "cdna3_group_k8")
CASES_PER_MODE, MODES = 200_000, 6


def build_and_run(tmp_path_factory, mutant: int, cases_per_mode: int):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("mma_model") / f"mma_model_conformance_{mutant}"
    subprocess.run([cxx, *FLAGS, f"-DALIGNED_MMA_MODEL_MUTANT={mutant}", f"-I{ROOT}", str(SOURCE), "-o", str(exe)],
                   check=True, capture_output=True, timeout=300)
    run = subprocess.run([str(exe), str(cases_per_mode), "40"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return build_and_run(tmp_path_factory, 0, CASES_PER_MODE)


def counts(report, name):
    m = re.search(rf"^{name} (\d+) (\d+)$", report.stdout, re.M)
    assert m, report.stdout
    return int(m.group(1)), int(m.group(2))


@pytest.mark.parametrize("step", STEPS)
def test_integer_model_equals_the_fp64_transcription(report, step):
    cases, mismatches = counts(report, step)
    assert cases == CASES_PER_MODE * MODES
    assert mismatches == 0, report.stderr  # (the first mismatches are printed there)
    m = re.search(rf"^kinds {step} \+0 (\d+) -0 (\d+) subnormal (\d+) normal (\d+) inf (\d+) nan (\d+)$",
                  report.stdout, re.M)
    assert m and all(int(n) > 0 for n in m.groups()), report.stdout  # every kind of result was compared


def test_the_comparison_sees_a_different_step(report):
    # negative controls: a step with one fractional bit less, and the other vendor's step, differ from the
    # reference on a share of the same operands
    for control in ("control_f25_vs_f24", "control_nvidia_vs_cdna3"):
        cases, differ = counts(report, control)
        assert differ > cases // 100, (control, differ)


@pytest.mark.parametrize("mutant,caught_by", [(1, ("nv_fused_k16_f25", "nv_fused_k8_f24")), (2, ("cdna3_group_k8",))])
def test_a_planted_edge_case_fault_is_caught(tmp_path_factory, mutant, caught_by):
    run = build_and_run(tmp_path_factory, mutant, 20_000)
    for step in STEPS:
        _, mismatches = counts(run, step)
        assert (mismatches > 0) == (step in caught_by), (mutant, step, mismatches)
