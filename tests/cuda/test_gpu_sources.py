"""Static rules on the GPU kernel sources (runs everywhere, no GPU or compiler needed).

The compile check (.ci/gpu_compile_check.sh) proves the rules on the emitted PTX/ISA; these cheap scans catch
a violation at review time: no atomics (reductions have a fixed order), no vendor exp/log or fast
intrinsics, and the exact-numerics compiler flags present in every build description.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
GPU_SOURCES = sorted(
    p for d in ("csrc/gpu", "csrc/cuda", "csrc/hip") for p in (ROOT / d).glob("*") if p.suffix in {".cuh", ".cu", ".hip", ".h"}
)

FORBIDDEN = {
    "atomic operation": re.compile(r"\batomic\w*\s*\("),
    "vendor exp/log": re.compile(r"\b(__expf|__logf|__exp10f|__powf|expf|logf|exp2f|log2f|__builtin_expf|__builtin_logf)\s*\("),
    "fast/unrounded intrinsic": re.compile(r"\b(__fdividef|__frcp_r[zud]|__fmaf_r[zud]|__fadd_r[zud]|__fmul_r[zud])\s*\("),
    "tensor-core / matrix instruction": re.compile(r"\b(wmma|mma\.sync|wgmma|__builtin_amdgcn_mfma\w*)\b"),
}


def _code(text: str) -> str:
    """Source without // and /* */ comments (comments may name forbidden things to explain why)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def violations(text: str) -> list[str]:
    code = _code(text)
    return [what for what, rx in FORBIDDEN.items() if rx.search(code)]


def test_sources_exist():
    names = {p.name for p in GPU_SOURCES}
    assert {"compat.cuh", "dense_kernels.cuh", "gemm_fp32.cuh", "dense.cu", "dense.hip"} <= names


def test_no_forbidden_constructs():
    bad = {str(p.relative_to(ROOT)): v for p in GPU_SOURCES if (v := violations(p.read_text()))}
    assert not bad, bad


def test_scanner_detects_violations():
    # negative control: the scanner must fire on each kind of forbidden code, and ignore comments
    assert violations("x = atomicAdd(p, v);") == ["atomic operation"]
    assert violations("y = __expf(x);") == ["vendor exp/log"]
    assert violations("y = __fmul_rz(a, b);") == ["fast/unrounded intrinsic"]
    assert violations("// atomicAdd( is forbidden\n/* __expf( */ y = exp_f32(x);") == []


def test_exact_numerics_flags_everywhere():
    cmake = (ROOT / "CMakeLists.txt").read_text()
    check = (ROOT / "cmake/gpu_compile_check.cmake").read_text()
    for f in ("--fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true", "-ffp-contract=off",
              "-fhip-fp32-correctly-rounded-divide-sqrt"):
        assert f in cmake, f
    # the check compiles with the extension's own lists (tests/cuda/test_gpu_isa_scan.py plants bad flags)
    assert "${ALIGNED_CUDA_EXACT_FLAGS}" in check and "${ALIGNED_HIP_EXACT_FLAGS}" in check
    for text in (cmake, check, (ROOT / ".ci/gpu_check.sh").read_text()):
        code = re.sub(r"#[^\n]*", "", text)  # comments may say what never to add
        assert "use_fast_math" not in code and "-ffast-math" not in code
