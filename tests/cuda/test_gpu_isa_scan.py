"""The GPU numerics scan (cmake/gpu_isa_check.py) fails on every flag that breaks the contract.

A probe kernel built on csrc/gpu/compat.cuh — a plain division, a plain sqrt, a multiply-add, the contract's
exp — is compiled with the extension's own exact-numerics flags (parsed from CMakeLists.txt, the one place
they are written) and must pass the scan (positive control); then each bad flag is planted in place of its
good counterpart (or added) and the compile or the scan must fail, naming the problem. Needs nvcc / clang-22
(present in CI); skipped where they are missing. Plus unit tests of each scan pattern on text.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECK = ROOT / "cmake/gpu_isa_check.py"
NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if pathlib.Path("/usr/local/bin/nvcc").exists() else None)
HIP_CLANG = shutil.which("clang++-22")

PROBE = f"""#include "{ROOT}/csrc/gpu/compat.cuh"
__global__ void probe(const float* a, const float* b, float* o, int n) {{
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float q = a[i] / b[i];                 // what a careless kernel writes: plain '/'
  float r = sqrtf(a[i]);                 // and plain sqrt
  o[i] = q * r + aligned::exp_f32(b[i]) * a[i];
}}
"""


def cmake_list(name: str) -> list[str]:
    text = (ROOT / "CMakeLists.txt").read_text()
    m = re.search(rf"set\({name}\s+([^)]*)\)", text)
    assert m, f"{name} is not defined in CMakeLists.txt"
    return m.group(1).split()


def test_flags_written_once_and_used_by_the_real_build_and_the_check():
    cmake = (ROOT / "CMakeLists.txt").read_text()
    check = (ROOT / "cmake/gpu_compile_check.cmake").read_text()
    assert cmake_list("ALIGNED_CUDA_EXACT_FLAGS") == ["--fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true"]
    hip = cmake_list("ALIGNED_HIP_EXACT_FLAGS")
    assert {"-ffp-contract=off", "-fno-fast-math", "-fno-gpu-flush-denormals-to-zero",
            "-fhip-fp32-correctly-rounded-divide-sqrt"} <= set(hip)
    # the extension's CUDA/HIP sources compile with these lists ...
    assert "$<$<COMPILE_LANGUAGE:CUDA>:${ALIGNED_CUDA_EXACT_FLAGS}" in cmake
    assert "$<$<COMPILE_LANGUAGE:HIP>:-O3 ${ALIGNED_HIP_EXACT_FLAGS}>" in cmake
    # ... the check compiles with the same lists plus the user's flags of the real build ...
    assert "${ALIGNED_CUDA_EXACT_FLAGS}" in check and "${ALIGNED_HIP_EXACT_FLAGS}" in check
    assert "CMAKE_CUDA_FLAGS" in check and "CUDAFLAGS" in check and "CMAKE_HIP_FLAGS" in check and "HIPFLAGS" in check
    # ... and a CUDA / ROCm build runs the check before linking _C
    assert "add_dependencies(_C gpu_compile_check)" in cmake


def run_scan(kind: str, path: pathlib.Path) -> tuple[int, str]:
    p = subprocess.run([sys.executable, str(CHECK), kind, str(path), str(path) + ".ok"], capture_output=True, text=True)
    return p.returncode, p.stderr


def replace_flag(flags: list[str], bad: str) -> list[str]:
    """flags with bad's counterpart (same option name) removed, then bad added."""
    key = re.split(r"[=]", bad)[0].replace("-fno-", "-f")
    keep = [f for f in flags if re.split(r"[=]", f)[0].replace("-fno-", "-f") != key]
    return keep + [bad]


# ---- CUDA -----------------------------------------------------------------------------------------------------

CUDA_PLANTS = {
    # flag planted: what the failure must mention
    "-prec-div=false": "approximate division",
    "-prec-sqrt=false": "approximate rcp/sqrt",
    "-ftz=true": "flush-to-zero",
    "--fmad=true": "without .rn",
    "--use_fast_math": "flush-to-zero|approximate|fast_math",
}


def nvcc_scan(tmp_path, flags) -> tuple[int, str]:
    src = tmp_path / "probe.cu"
    src.write_text(PROBE)
    ptx = tmp_path / "probe.ptx"
    p = subprocess.run([NVCC, "-std=c++17", "-O3", *flags, "-Xcompiler", "-ffp-contract=off", "-arch=sm_90a", "-ptx",
                        str(src), "-o", str(ptx)], capture_output=True, text=True)
    if p.returncode != 0:
        return p.returncode, p.stderr
    return run_scan("ptx", ptx)


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_cuda_probe_passes_with_the_extension_flags(tmp_path):
    rc, err = nvcc_scan(tmp_path, cmake_list("ALIGNED_CUDA_EXACT_FLAGS"))
    assert rc == 0, err


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
@pytest.mark.parametrize("bad", sorted(CUDA_PLANTS))
def test_cuda_scan_fails_on_planted_flag(tmp_path, bad):
    # --use_fast_math only expands to -ftz=true -prec-div=false -prec-sqrt=false --fmad=true, and nvcc lets the
    # extension's explicit flags win over it (measured, nvcc 13.0), so it is planted as a build that lost them.
    flags = [bad] if bad == "--use_fast_math" else replace_flag(cmake_list("ALIGNED_CUDA_EXACT_FLAGS"), bad)
    rc, err = nvcc_scan(tmp_path, flags)
    assert rc != 0, f"{bad}: the PTX scan accepted it"
    assert re.search(CUDA_PLANTS[bad], err), err


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_cuda_explicit_flags_override_use_fast_math(tmp_path):
    rc, err = nvcc_scan(tmp_path, cmake_list("ALIGNED_CUDA_EXACT_FLAGS") + ["--use_fast_math"])
    assert rc == 0, err


# ---- HIP ------------------------------------------------------------------------------------------------------

HIP_PLANTS = {
    "-fno-hip-fp32-correctly-rounded-divide-sqrt": ("ll", "approximate divide/sqrt"),
    "-ffast-math": ("compile", "must not be compiled with -ffast-math"),
    "-fgpu-approx-transcendentals": ("compile", "approximate transcendentals"),
    "-fgpu-flush-denormals-to-zero": ("s", "flushes f32 denormals"),
    "-ffp-contract=fast": ("ll", "fmuladd|fast-math flag"),
}


HIP_BASE = ["-x", "hip", "-std=c++20", "-O3", "-nogpulib", "--rocm-path=/usr", "-D__AMDGCN_WAVEFRONT_SIZE=64"]


def hip_module(src: pathlib.Path, flags: list[str], out_dir: pathlib.Path, arch: str = "gfx942"
               ) -> tuple[int, str, pathlib.Path]:
    """The compile check's first HIP step (cmake/gpu_compile_check.cmake): front end + optimiser once, the optimised
    device module as bitcode (use-list order kept)."""
    bc = out_dir / f"{src.stem}.{arch}.bc"
    p = subprocess.run([HIP_CLANG, *HIP_BASE, *flags, f"--offload-arch={arch}", "--offload-device-only", "-emit-llvm",
                        "-c", "-Xclang", "-emit-llvm-uselists", str(src), "-o", str(bc)], capture_output=True, text=True)
    return p.returncode, p.stderr, bc


def hip_from_module(bc: pathlib.Path, kind: str, arch: str = "gfx942") -> pathlib.Path:
    """Its second step: the module's code generation alone (kind s) or its text (kind ll), no optimiser."""
    out = bc.with_suffix(f".{kind}")
    subprocess.run([HIP_CLANG, "-target", "amdgcn-amd-amdhsa", f"-mcpu={arch}", "-nogpulib", "-O3", "-x", "ir", str(bc),
                    "-Xclang", "-disable-llvm-passes", "-S", *(["-emit-llvm"] if kind == "ll" else []), "-o", str(out)],
                   check=True)
    return out


def hip_scan(tmp_path, flags, kind) -> tuple[int, str]:
    src = tmp_path / "probe.hip"
    src.write_text(PROBE)
    rc, err, bc = hip_module(src, flags, tmp_path)
    if rc != 0:
        return rc, err
    return run_scan(kind, hip_from_module(bc, kind))


@pytest.fixture(scope="module")
def hip_probe_module(tmp_path_factory):
    """The probe's module under the extension's flags, built once for both scans (as the compile check does)."""
    d = tmp_path_factory.mktemp("hip_probe")
    src = d / "probe.hip"
    src.write_text(PROBE)
    rc, err, bc = hip_module(src, cmake_list("ALIGNED_HIP_EXACT_FLAGS"), d)
    assert rc == 0, err
    return bc


@pytest.mark.skipif(HIP_CLANG is None, reason="needs clang++-22")
@pytest.mark.parametrize("kind", ["s", "ll"])
def test_hip_probe_passes_with_the_extension_flags(hip_probe_module, kind):
    rc, err = run_scan(kind, hip_from_module(hip_probe_module, kind))
    assert rc == 0, err


@pytest.mark.skipif(HIP_CLANG is None, reason="needs clang++-22")
@pytest.mark.parametrize("bad", sorted(HIP_PLANTS))
def test_hip_scan_fails_on_planted_flag(tmp_path, bad):
    kind, what = HIP_PLANTS[bad]
    rc, err = hip_scan(tmp_path, replace_flag(cmake_list("ALIGNED_HIP_EXACT_FLAGS"), bad), "s" if kind == "compile" else kind)
    assert rc != 0, f"{bad}: accepted"
    assert re.search(what, err), err


def asm_code(text: str) -> list[str]:
    """An AMDGPU asm file's instructions, labels and directives: comments (';'), blank lines and the per-compile
    random __hip_cuid_ suffix dropped."""
    lines = (re.sub(r"__hip_cuid_[0-9a-f]+", "__hip_cuid_", ln.split(";", 1)[0]).rstrip() for ln in text.splitlines())
    return [ln for ln in lines if ln.strip()]


@pytest.mark.skipif(HIP_CLANG is None, reason="needs clang++-22")
def test_hip_asm_from_the_module_is_the_one_step_asm(tmp_path):
    """The compile check scans asm generated from the optimised module (so the front end runs once per file and arch
    for the asm and the IR): on a real kernel file (the mma linear's: matrix instructions, loops, the correctly rounded
    divide) its instructions, labels and directives (.amdhsa_float_denorm_mode_32 included) are exactly those of a
    one-step `-S` from the source."""
    src = ROOT / "csrc/hip/linear_mma.hip"
    flags = cmake_list("ALIGNED_HIP_EXACT_FLAGS")
    direct = tmp_path / "direct.s"
    subprocess.run([HIP_CLANG, *HIP_BASE, *flags, "--offload-arch=gfx942", "--offload-device-only", "-S", str(src),
                    "-o", str(direct)], check=True)
    rc, err, bc = hip_module(src, flags, tmp_path)
    assert rc == 0, err
    one, two = asm_code(direct.read_text()), asm_code(hip_from_module(bc, "s").read_text())
    assert len(one) > 500 and any("v_mfma_f32_16x16x16" in ln for ln in one)
    assert any(".amdhsa_float_denorm_mode_32 3" in ln for ln in one)
    assert one == two
    # negative control: the comparison sees a single changed instruction
    i = next(k for k, ln in enumerate(two) if "v_mfma_f32_16x16x16" in ln)
    assert two[:i] + [two[i].replace("v_mfma", "v_mfmb")] + two[i + 1:] != one


# ---- the patterns themselves ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,line", [
    ("ptx", "div.full.f32 %f3, %f1, %f2;"), ("ptx", "div.approx.f32 %f3, %f1, %f2;"),
    ("ptx", "div.approx.ftz.f32 %f3, %f1, %f2;"), ("ptx", "rcp.approx.f32 %f2, %f1;"),
    ("ptx", "rcp.approx.ftz.f64 %fd2, %fd1;"), ("ptx", "sqrt.approx.f32 %f2, %f1;"),
    ("ptx", "rsqrt.approx.f32 %f2, %f1;"), ("ptx", "sin.approx.f32 %f2, %f1;"), ("ptx", "cos.approx.f32 %f2, %f1;"),
    ("ptx", "ex2.approx.f32 %f2, %f1;"), ("ptx", "lg2.approx.f32 %f2, %f1;"), ("ptx", "tanh.approx.f32 %f2, %f1;"),
    ("ptx", "add.ftz.f32 %f3, %f1, %f2;"),
    ("s", "v_exp_f32_e32 v1, v0"), ("s", "v_log_f32_e32 v1, v0"), ("s", "v_rsq_f32_e32 v1, v0"),
    ("ll", "%3 = fdiv float %1, %2, !fpmath !7"), ("ll", "%3 = call float @llvm.sqrt.f32(float %1), !fpmath !8"),
    ("ll", "%3 = call float @llvm.amdgcn.rcp.f32(float %1)"), ("ll", "%3 = call float @llvm.amdgcn.sqrt.f32(float %1)"),
    ("ll", "%3 = call float @__ocml_native_sqrt_f32(float %1)"), ("ll", "%3 = fdiv arcp float %1, %2"),
    # f64: the exact epilogue's TwoSum is correct only unfused (csrc/common/exact_linear.h sum_round_odd)
    ("ptx", "add.f64 %fd3, %fd1, %fd2;"), ("ptx", "sub.f64 %fd3, %fd1, %fd2;"), ("ptx", "mul.f64 %fd3, %fd1, %fd2;"),
    ("ptx", "fma.rn.f64 %fd4, %fd1, %fd2, %fd3;"), ("ptx", "mad.rn.f64 %fd4, %fd1, %fd2, %fd3;"),
    ("ll", "%4 = call double @llvm.fmuladd.f64(double %1, double %2, double %3)"),
    ("ll", "%4 = call double @llvm.fma.f64(double %1, double %2, double %3)"),
    ("s", "v_fma_f64 v[0:1], v[2:3], v[4:5], v[6:7]"), ("s", "v_fmac_f64_e32 v[0:1], v[2:3], v[4:5]"),
])
def test_scan_pattern_fires(tmp_path, kind, line):
    f = tmp_path / f"x.{kind}"
    denorm = "\n.amdhsa_float_denorm_mode_32 3\n" if kind == "s" else "\n"
    f.write_text(line + denorm)
    rc, err = run_scan(kind, f)
    assert rc == 1, f"{line!r} passed the {kind} scan"


@pytest.mark.parametrize("kind,line", [
    ("ptx", "div.rn.f32 %f3, %f1, %f2;"), ("ptx", "sqrt.rn.f32 %f2, %f1;"), ("ptx", "rcp.rn.f32 %f2, %f1;"),
    ("ptx", "div.s64 %rd3, %rd1, %rd2;"), ("ptx", "fma.rn.f32 %f4, %f1, %f2, %f3;"),
    ("ptx", "add.rn.f64 %fd3, %fd1, %fd2;"), ("ptx", "mul.rn.f64 %fd3, %fd1, %fd2;"), ("ll", "%3 = fadd double %1, %2"),
    ("ll", "%3 = fdiv float %1, %2"), ("ll", "%3 = call float @llvm.sqrt.f32(float %1)"),
    ("s", "v_div_fixup_f32 v1, v2, v3, v4\nv_rcp_f32_e32 v5, v6"),
])
def test_scan_pattern_accepts_correctly_rounded(tmp_path, kind, line):
    f = tmp_path / f"x.{kind}"
    f.write_text(line + ("\n.amdhsa_float_denorm_mode_32 3\n" if kind == "s" else "\n"))
    rc, err = run_scan(kind, f)
    assert rc == 0, err


# ---- f64: the TwoSum of the exact epilogue --------------------------------------------------------------------

TWOSUM = """__global__ void two_sum(const double* a, const double* b, double* out) {
  const int i = threadIdx.x;
  const double s = a[i] + b[i], bb = s - a[i];
  out[i] = (a[i] - (s - bb)) + (b[i] - bb) + a[i] * b[i] * 0.5;
}
"""


def nvcc_ptx(tmp_path, source: str, flags: list[str]) -> tuple[int, str]:
    src = tmp_path / "k.cu"
    src.write_text(source)
    ptx = tmp_path / "k.ptx"
    subprocess.run([NVCC, "-std=c++17", "-O3", *flags, "-arch=sm_90", "-ptx", str(src), "-o", str(ptx)], check=True)
    return run_scan("ptx", ptx)


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_f64_twosum_unfused_with_the_extension_flags_and_caught_when_contracted(tmp_path):
    rc, err = nvcc_ptx(tmp_path, TWOSUM, cmake_list("ALIGNED_CUDA_EXACT_FLAGS"))
    assert rc == 0, err
    # negative control: nvcc's default --fmad=true fuses the f64 products and sums; the scan names it
    rc, err = nvcc_ptx(tmp_path, TWOSUM, replace_flag(cmake_list("ALIGNED_CUDA_EXACT_FLAGS"), "--fmad=true"))
    assert rc != 0 and "f64" in err, err


# ---- the target list: written once, built, listed back from the objects ------------------------------------------


def test_cuda_and_hip_targets_written_once():
    cmake = (ROOT / "CMakeLists.txt").read_text()
    check = (ROOT / "cmake/gpu_compile_check.cmake").read_text()
    m = re.search(r'set\(ALIGNED_CUDA_ARCHS_DEFAULT "([^"]*)"\)', cmake)
    assert m and m.group(1) == "80-real;90-real;100-real;120-real;80-virtual"
    m = re.search(r'set\(ALIGNED_HIP_ARCHS_DEFAULT "([^"]*)"\)', cmake)
    assert m and m.group(1) == "gfx942;gfx950"
    assert "90a-real" not in cmake and "100a-real" not in cmake  # no arch-specific target without a kernel needing it
    assert "set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)" in cmake
    assert '"${ALIGNED_CUDA_ARCHS}"' in check and "${ALIGNED_HIP_ARCHS}" in check
    # the extension and the check both compile with aligned_cuda_gencode_flags' -gencode list (one front end per
    # NVVM generation), not with CMake's per-arch CUDA_ARCHITECTURES
    assert 'aligned_cuda_gencode_flags(ALIGNED_CUDA_GENCODE "${ALIGNED_CUDA_ARCHS}")' in cmake
    assert "set_target_properties(_C PROPERTIES CUDA_ARCHITECTURES OFF)" in cmake
    assert '"$<$<COMPILE_LANGUAGE:CUDA>:${ALIGNED_CUDA_GENCODE}>"' in cmake
    assert 'aligned_cuda_gencode_flags(_gencode "${ALIGNED_CUDA_CHECK_ARCHS}")' in check


CMAKE = shutil.which("cmake")


@pytest.mark.skipif(CMAKE is None, reason="needs cmake")
@pytest.mark.parametrize("torch_list,expected", [
    ("9.0", "90-real"), ("8.0 9.0 10.0 12.0+PTX", "80-real;90-real;100-real;120-real;120-virtual"),
    ("9.0a;10.0a", "90a-real;100a-real"),
])
def test_torch_cuda_arch_list_translation(tmp_path, torch_list, expected):
    script = tmp_path / "t.cmake"
    script.write_text(f'include("{ROOT}/cmake/gpu_archs.cmake")\n'
                      f'aligned_torch_arch_to_cmake(r "{torch_list}")\nmessage("RESULT=${{r}}")\n'
                      'set(f "-O3 -gencode arch=compute_90,code=sm_90 -gencode=arch=compute_80,code=[sm_80,compute_80] -g")\n'
                      'aligned_strip_gencode_flags(f)\nmessage("STRIPPED=${f}")\n')
    p = subprocess.run([CMAKE, "-P", str(script)], capture_output=True, text=True)
    assert f"RESULT={expected}" in p.stderr, p.stderr
    assert "STRIPPED=-O3 -g" in p.stderr, p.stderr


DEFAULT_GENCODE = ["-gencode=arch=compute_80,code=[sm_80,sm_90,compute_80]", "-gencode=arch=compute_100,code=[sm_100,sm_120]"]


def gencode_flags(archs: str) -> list[str]:
    with tempfile.TemporaryDirectory() as d:
        script = pathlib.Path(d) / "gencode.cmake"
        script.write_text(f'include("{ROOT}/cmake/gpu_archs.cmake")\naligned_cuda_gencode_flags(f "{archs}")\n'
                          'message("FLAGS=${f}")\n')
        p = subprocess.run([CMAKE, "-P", str(script)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return re.search(r"FLAGS=(.*)", p.stderr).group(1).split(";")


@pytest.mark.skipif(CMAKE is None, reason="needs cmake")
@pytest.mark.parametrize("archs,expected", [
    # the default list: two front ends (NVVM 7: compute_80 for sm_80 + sm_90 and the PTX; NVVM 20: compute_100)
    ("80-real;90-real;100-real;120-real;80-virtual", DEFAULT_GENCODE),
    # a build for one GPU (the lease build, TORCH_CUDA_ARCH_LIST=9.0 / 12.0): its cubin from the PTX the wheel's
    # comes from
    ("90-real", ["-gencode=arch=compute_80,code=[sm_90]"]),
    ("120-real", ["-gencode=arch=compute_100,code=[sm_120]"]),
    ("120-real;100-real;90-real", ["-gencode=arch=compute_80,code=[sm_90]", "-gencode=arch=compute_100,code=[sm_100,sm_120]"]),
    ("86-real;80-real;89-real", ["-gencode=arch=compute_80,code=[sm_80,sm_86,sm_89]"]),
    # PTX asked for another virtual arch: its own front end
    ("80-real;90-real;100-real;120-real;120-virtual", [  # TORCH_CUDA_ARCH_LIST="8.0 9.0 10.0 12.0+PTX"
        "-gencode=arch=compute_80,code=[sm_80,sm_90]", "-gencode=arch=compute_100,code=[sm_100,sm_120]",
        "-gencode=arch=compute_120,code=compute_120"]),
    ("90;100", ["-gencode=arch=compute_80,code=[sm_90]", "-gencode=arch=compute_100,code=[sm_100,compute_100]",
                "-gencode=arch=compute_90,code=compute_90"]),
    # arch-specific targets keep their own PTX (their features exist nowhere else)
    ("90-real;90a-real;100a-real", ["-gencode=arch=compute_80,code=[sm_90]", "-gencode=arch=compute_90a,code=sm_90a",
                                    "-gencode=arch=compute_100a,code=sm_100a"]),
])
def test_gencode_one_front_end_per_nvvm_generation(archs, expected):
    assert gencode_flags(archs) == expected


@pytest.mark.skipif(NVCC is None or CMAKE is None, reason="needs nvcc and cmake")
def test_default_gencode_builds_every_target_from_two_front_ends(tmp_path):
    sys.path.insert(0, str(ROOT / "cmake"))
    import gpu_isa_check

    cmake = (ROOT / "CMakeLists.txt").read_text()
    default = re.search(r'set\(ALIGNED_CUDA_ARCHS_DEFAULT "([^"]*)"\)', cmake).group(1)
    flags = gencode_flags(default)
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k(float* x) { x[threadIdx.x] += 1.0f; }\n")
    obj = tmp_path / "k.o"
    dry = subprocess.run([NVCC, *flags, "--dryrun", "-c", str(src), "-o", str(obj)], capture_output=True, text=True)
    front_ends = re.findall(r"cicc\b.* -arch (compute_\d+)", dry.stderr)
    ptxas = re.findall(r"ptxas\b.* -arch=(sm_\d+)", dry.stderr)
    assert front_ends == ["compute_80", "compute_100"], dry.stderr
    assert sorted(ptxas) == ["sm_100", "sm_120", "sm_80", "sm_90"], dry.stderr
    subprocess.run([NVCC, *flags, "-c", str(src), "-o", str(obj)], check=True)
    # the object holds what CMakeLists.txt's list names: four cubins and compute_80 PTX for later GPUs
    assert sorted(gpu_isa_check.fatbin_entries(str(obj))) == [("elf", 80), ("elf", 90), ("elf", 100), ("elf", 120),
                                                               ("ptx", 80)]


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_fatbin_listing_matches_the_gencode(tmp_path):
    sys.path.insert(0, str(ROOT / "cmake"))
    import gpu_isa_check

    src = tmp_path / "k.cu"
    src.write_text("__global__ void k(float* x) { x[threadIdx.x] += 1.0f; }\n")
    obj = tmp_path / "k.o"
    subprocess.run([NVCC, "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
                    "-gencode=arch=compute_80,code=compute_80", "-c", str(src), "-o", str(obj)], check=True)
    assert sorted(gpu_isa_check.fatbin_entries(str(obj))) == [("elf", 80), ("elf", 90), ("ptx", 80)]
    stamp = tmp_path / "s"
    assert gpu_isa_check.check_fatbin(str(obj), "sm_80,sm_90+compute_80", str(stamp)) == 0
    assert gpu_isa_check.check_fatbin(str(obj), "sm_80,sm_90,sm_100+compute_80", str(stamp)) == 1  # control


@pytest.mark.parametrize("kind,name,present", [
    ("ptx", "linear_mma.compute_90.ptx",
     "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1,%f2,%f3,%f4}, {%r1,%r2,%r3,%r4}, {%r5,%r6}, {%f1,%f2,%f3,%f4};"),
    ("s", "hip_linear_mma.gfx942.s", "v_mfma_f32_16x16x16_bf16 a[0:3], v[0:1], v[2:3], a[0:3]"),
])
def test_scan_requires_the_mma_linears_matrix_instruction(tmp_path, kind, name, present):
    """The mma linear's files must contain its bf16 matrix instruction (gpu_isa_check.py REQUIRED); a file
    without it fails naming the instruction (negative control), other files are not held to it."""
    tail = "\n.amdhsa_float_denorm_mode_32 3\n" if kind == "s" else "\n"
    good = tmp_path / name
    good.write_text(present + tail)
    assert run_scan(kind, good)[0] == 0
    bad = tmp_path / "missing" / name
    bad.parent.mkdir()
    bad.write_text("add.rn.f32 %f3, %f1, %f2;" + tail if kind == "ptx" else tail)
    rc, err = run_scan(kind, bad)
    assert rc == 1 and "missing matrix instruction" in err, err
    other = tmp_path / ("dense.compute_90.ptx" if kind == "ptx" else "hip_dense.gfx942.s")
    other.write_text(tail)
    assert run_scan(kind, other)[0] == 0
