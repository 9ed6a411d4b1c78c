"""C++ conformance of the contract's templated formulas (csrc/common/contract.h) on every arithmetic type a
backend instantiates them for: float (the scalar CPU code and the GPU kernels' instantiation) and the CPU
vector types of csrc/cpu/simd.h (F32x1; F32x8 on AVX2; F32x16 on AVX-512), each held bit for bit to a plain
scalar reference (tests/common/simd_conformance.cpp). The program is compiled once per ISA level with the
extension's numerics flags (CMakeLists.txt) and run where the CPU has the level. Negative controls (a
reciprocal silu, an fma the contract does not write) must show mismatches through the same comparison.
The GPU kernels themselves are held to the CPU backend by tests/emulated."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "common" / "simd_conformance.cpp"
EXACT_FLAGS = ["-ffp-contract=off", "-fno-fast-math", "-fno-unsafe-math-optimizations", "-fno-finite-math-only",
               "-fno-associative-math", "-fno-reciprocal-math"]
LEVELS = {  # CMakeLists.txt ALIGNED_ISA_FLAGS_<level>, and the /proc/cpuinfo flags a level needs
    "generic": ([], set()),
    "avx2": (["-mavx2", "-mfma", "-mf16c"], {"avx2", "fma", "f16c"}),
    "avx512": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
               {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
}
TYPES = {"generic": {"float", "F32x1"}, "avx2": {"float", "F32x1", "F32x8"},
         "avx512": {"float", "F32x1", "F32x8", "F32x16"}}


def cpu_flags() -> set[str]:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("conformance")
    have = cpu_flags()
    procs = {}
    for level, (flags, needs) in LEVELS.items():
        if not needs <= have:
            continue
        exe = out / f"conformance_{level}"
        cmd = [cxx, "-std=c++20", "-O2", *EXACT_FLAGS, *flags, f"-DALIGNED_ISA={level}", f"-I{ROOT}", str(SOURCE),
               "-o", str(exe)]
        procs[level] = (exe, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True))
    runs = {}
    for level, (exe, proc) in procs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{level}: compile failed\n{err}"
        run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
        rows = {}
        for line in run.stdout.splitlines():
            check, vtype, checked, bad = line.split()
            rows[(check, vtype)] = (int(checked), int(bad))
        runs[level] = (run.returncode, rows)
    return runs


@pytest.mark.parametrize("level", list(LEVELS))
def test_every_formula_matches_the_scalar_reference(results, level):
    if level not in results:
        pytest.skip(f"this CPU cannot run the {level} level")
    rc, rows = results[level]
    assert {t for _, t in rows} == TYPES[level]
    checks = {c for c, _ in rows}
    for name in ["silu_mul", "silu_mul_backward", "rotate_pair", "rotate_pair_inverse", "rms_sq_step", "rms_scale",
                 "rms_grad_dot_step", "rms_grad_dx", "rms_grad_dw_step", "logit_scale", "lse_sum_step", "exp_f32",
                 "exp_f32_not_nan", "attn_tile_prob", "attn_tile_probs"]:
        assert name in checks
    bad = {k: v for k, v in rows.items() if not k[0].startswith("negative_") and v[1] != 0}
    assert bad == {}
    assert all(v[0] > 60000 for k, v in rows.items() if not k[0].startswith(("load_store", "exp_f32_sweep")))
    vector_types = TYPES[level] - {"float"}
    for t in vector_types:  # exp on a stride of all 2^32 bit patterns, loads/stores for every tail length
        assert rows[("exp_f32_sweep", t)][0] > 17_000_000
        for st in ("f32", "bf16", "f16"):
            assert rows[(f"load_store_{st}", t)][0] > 0
        for st in ("bf16", "f16"):  # every 16-bit pattern widened, compared as bits (NaN payloads included)
            assert rows[(f"widen_all_{st}", t)] == (65536, 0)
    assert rc == 0


@pytest.mark.parametrize("level", list(LEVELS))
def test_negative_controls_differ(results, level):
    if level not in results:
        pytest.skip(f"this CPU cannot run the {level} level")
    _, rows = results[level]
    for t in TYPES[level]:
        for name in ("negative_silu_reciprocal", "negative_rms_grad_dx_fma", "negative_attn_prob_split_exp",
                     "negative_attn_tile_probs_unmasked"):
            checked, bad = rows[(name, t)]
            assert bad > checked // 100, (name, t, bad)
    for t in TYPES[level] - {"float"}:  # a widening that keeps f16 signalling NaNs signalling: 2 x 511 of them
        assert rows[("negative_widen_all_f16_signalling_kept", t)] == (65536, 1022)
    if "F32x16" in TYPES[level]:  # the AVX-512 attention's tile maximum (simd.h TileMax32)
        assert rows[("attn_tile_max", "F32x16")] [1] == 0
        checked, bad = rows[("negative_attn_tile_max_no_fallback", "F32x16")]
        assert bad > checked // 100, bad
