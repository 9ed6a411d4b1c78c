"""numerics.h's f16 conversions (branch-free: every case computed, one picked) equal the branching form they replaced
bit for bit (tests/common/f16_conversion.cpp holds the reference): every f16 input; for f32 -> f16 every sign x
exponent x low 14 mantissa bits (a normal result's rounding bits) here, and every one of the 2^32 inputs in the slow
test; a NaN widens quiet (a signalling NaN gets the quiet bit, as IEEE 754 conversions and F16C do; a negative control
keeps it signalling); and known IEEE binary16 answers, which a build whose flags broke the rounding in both forms alike would fail. A
negative control (round-half-up) must mismatch through the same comparison. Compiled with a copy of the extension's
numerics flags (CMakeLists.txt ALIGNED_EXACT_CXX_FLAGS); the GPU kernels compile the same source (their f16 paths
are held to the CPU backend by tests/emulated)."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "common" / "f16_conversion.cpp"
EXACT_FLAGS = ["-ffp-contract=off", "-fno-fast-math", "-fno-unsafe-math-optimizations", "-fno-finite-math-only",
               "-fno-associative-math", "-fno-reciprocal-math"]


@pytest.fixture(scope="module")
def exe(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("f16_conversion") / "f16_conversion"
    subprocess.run([cxx, "-std=c++20", "-O2", *EXACT_FLAGS, f"-I{ROOT}", str(SOURCE), "-o", str(out)], check=True)
    return out


def run(exe, *args) -> dict[str, tuple[int, int]]:
    p = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=600)
    rows = {name: (int(n), int(m)) for name, n, m in (line.split() for line in p.stdout.splitlines())}
    assert p.returncode == 0, p.stdout + p.stderr
    return rows


def check(rows):
    assert rows["to_f32"] == (65536, 0)
    # 2 x 511 signalling NaNs (sign x payload without the quiet bit): the comparison sees a kept signalling NaN
    assert rows["negative_to_f32_signalling_kept"] == (65536, 1022), rows
    assert rows["from_f32"][0] > 0 and rows["from_f32"][1] == 0, rows
    assert rows["negative_from_f32_half_up"][1] > 0, rows  # the comparison sees a rounding change
    assert rows["known_answers"][0] >= 20 and rows["known_answers"][1] == 0, rows  # IEEE binary16 values


def test_f16_conversions_equal_the_branching_form(exe):
    rows = run(exe)
    assert rows["from_f32"][0] == 2 * 256 * 4 * (1 << 14)
    check(rows)


@pytest.mark.slow
def test_f16_conversions_equal_the_branching_form_on_every_f32(exe):
    rows = run(exe, "all")
    assert rows["from_f32"][0] == 1 << 32
    check(rows)
