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

# Matrix instructions are allowed only in their wrapper headers, each only its own: the `exact` profile's integer
# MMA (int8 x int8 -> int32, exact on every unit) in int_mma.cuh, and the `mma` profile's ONE pinned bf16
# instruction per vendor (its bits are the unit's by contract, csrc/common/mma.h) in bf16_mma.cuh. Any other
# floating-point MMA (another shape, fp16, tf32, wgmma) stays forbidden everywhere, those headers included.
INTEGER_MMA_HEADER = "int_mma.cuh"
INTEGER_MMA = re.compile(r"mma\.sync\.aligned\.m\d+n\d+k\d+\.row\.col\.s32\.s8\.s8\.s32|"
                         r"__builtin_amdgcn_mfma_i32_\w+_i8\b")
BF16_MMA_HEADER = "bf16_mma.cuh"
BF16_MMA = re.compile(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32|"
                      r"__builtin_amdgcn_mfma_f32_16x16x16bf16_1k\b")
ALLOWED_MMA = {INTEGER_MMA_HEADER: INTEGER_MMA, BF16_MMA_HEADER: BF16_MMA}


def _code(text: str) -> str:
    """Source without // and /* */ comments (comments may name forbidden things to explain why)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def violations(text: str, integer_mma_allowed: bool = False, allowed_mma: re.Pattern | None = None) -> list[str]:
    code = _code(text)
    if integer_mma_allowed:
        code = INTEGER_MMA.sub("", code)
    if allowed_mma is not None:
        code = allowed_mma.sub("", code)
    return [what for what, rx in FORBIDDEN.items() if rx.search(code)]


def test_sources_exist():
    names = {p.name for p in GPU_SOURCES}
    assert {"compat.cuh", "dense_kernels.cuh", "gemm_fp32.cuh", "dense.cu", "dense.hip"} <= names


def test_no_forbidden_constructs():
    bad = {str(p.relative_to(ROOT)): v for p in GPU_SOURCES
           if (v := violations(p.read_text(), allowed_mma=ALLOWED_MMA.get(p.name)))}
    assert not bad, bad


def test_scanner_detects_violations():
    # negative control: the scanner must fire on each kind of forbidden code, and ignore comments
    assert violations("x = atomicAdd(p, v);") == ["atomic operation"]
    assert violations("y = __expf(x);") == ["vendor exp/log"]
    assert violations("y = __fmul_rz(a, b);") == ["fast/unrounded intrinsic"]
    assert violations("// atomicAdd( is forbidden\n/* __expf( */ y = exp_f32(x);") == []
    # integer MMA: refused outside its header; inside it, only the s8 forms pass, a bf16/f16 MMA still fires
    s8 = 'asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 ...");'
    assert violations(s8) == ["tensor-core / matrix instruction"]
    assert violations(s8, integer_mma_allowed=True) == []
    assert violations("acc = __builtin_amdgcn_mfma_i32_16x16x32_i8(a, b, acc, 0, 0, 0);", integer_mma_allowed=True) == []
    bf16 = 'asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 ...");'
    assert violations(bf16, integer_mma_allowed=True) == ["tensor-core / matrix instruction"]
    assert violations("c = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, c, 0, 0, 0);",
                      integer_mma_allowed=True) == ["tensor-core / matrix instruction"]
    # the mma profile's header: its one bf16 instruction per vendor passes, any other float MMA still fires
    assert violations(bf16, allowed_mma=BF16_MMA) == []
    assert violations("c = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, c, 0, 0, 0);", allowed_mma=BF16_MMA) == []
    assert violations('asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 ...");', allowed_mma=BF16_MMA) != []
    assert violations("c = __builtin_amdgcn_mfma_f32_32x32x8bf16_1k(a, b, c, 0, 0, 0);", allowed_mma=BF16_MMA) != []
    assert violations('asm("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 ...");', allowed_mma=BF16_MMA) != []
    assert violations(s8, allowed_mma=BF16_MMA) != []


# One front end per NVVM generation (cmake/gpu_archs.cmake): sm_90 compiles from compute_80's PTX and sm_120 from
# compute_100's. That gives each arch the code of its own front end only while no source asks which arch it is
# compiled for: `defined(__CUDA_ARCH__)` (device or host) is fine, its value, or an arch-feature macro, is not. A
# kernel that needs an arch's own instructions gets an arch-specific target (90a, 100a) for its file instead.
ARCH_TEST_ALLOWED = re.compile(r"defined\s*\(\s*__CUDA_ARCH__\s*\)|defined\s+__CUDA_ARCH__\b|#\s*ifn?def\s+__CUDA_ARCH__\b")
ARCH_TEST = re.compile(r"\b__CUDA_ARCH\w*|\bNV_(?:PROVIDES|IS_EXACTLY|HAS_FEATURE)_SM\w*")  # (libcu++ <nv/target>)
ALL_SOURCES = sorted(p for p in (ROOT / "csrc").rglob("*") if p.suffix in {".h", ".cuh", ".cu", ".cpp", ".hip"})


def arch_value_tests(text: str) -> list[str]:
    return ARCH_TEST.findall(ARCH_TEST_ALLOWED.sub("", _code(text)))


def test_no_source_asks_which_cuda_arch_it_is_compiled_for():
    assert len(ALL_SOURCES) > 50
    bad = {str(p.relative_to(ROOT)): v for p in ALL_SOURCES if (v := arch_value_tests(p.read_text()))}
    assert not bad, f"a source tests the CUDA arch's value; sm_90 / sm_120 compile from compute_80 / compute_100 PTX " \
                    f"(cmake/gpu_archs.cmake): {bad}"
    # negative control: each way of asking fires, the device/host tests do not
    for line in ("#if __CUDA_ARCH__ >= 900", "constexpr int arch = __CUDA_ARCH__;", "#if (__CUDA_ARCH__ == 1000)",
                 "#ifdef __CUDA_ARCH_FEAT_SM90_ALL", "#if defined(__CUDA_ARCH_SPECIFIC__)",
                 "NV_IF_TARGET(NV_PROVIDES_SM_90, (fast();), (slow();))", "NV_IF_TARGET(NV_IS_EXACTLY_SM_80, (a();))",
                 "NV_IF_TARGET(NV_HAS_FEATURE_SM_90a, (a();))"):
        assert arch_value_tests(line + "\n#endif\n"), line
    for line in ("#if defined(__CUDA_ARCH__)", "#ifdef __CUDA_ARCH__", "#ifndef __CUDA_ARCH__",
                 "#elif defined __CUDA_ARCH__", "// __CUDA_ARCH__ >= 900 is what this avoids"):
        assert arch_value_tests(line + "\n#endif\n") == [], line


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
