#!/usr/bin/env bash
# gpu_compile_check.sh — CI check of the GPU backends on a machine without a GPU.
#
# Configures a separate build dir with -DALIGNED_GPU_COMPILE_CHECK=ON and builds the gpu_compile_check
# target (cmake/gpu_compile_check.cmake): every csrc/cuda/*.cu with nvcc 13 for the extension's CUDA targets
# (CMakeLists.txt: sm_80, sm_90, sm_100, sm_120 cubins + compute_80 PTX, listed back from each object's fatbin),
# every csrc/hip/*.hip with clang++-22 for gfx942 and gfx950 (and its host half), the emitted PTX / AMDGPU asm /
# device IR checked by cmake/gpu_isa_check.py (no vendor exp/log, no flush-to-zero, no contraction in f32 or f64),
# and the CUDA key's torch glue (csrc/torch/backends/cuda.cpp, register_cuda.cpp) syntax-checked against the
# installed torch's headers. Then negative controls prove the checker can fail: a kernel that calls __expf, and an
# f64 TwoSum built with --fmad=true, must be rejected.
#
# Usage: .ci/gpu_compile_check.sh [build-dir]   (default build/gpu-check). A few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD="${1:-build/gpu-check}"
PY="${PYTHON:-$(command -v python3)}"
start=$(date +%s)
mkdir -p "$BUILD"

cmake -S . -B "$BUILD" -G Ninja -DPython_EXECUTABLE="$PY" -DALIGNED_GPU_COMPILE_CHECK=ON >"$BUILD/configure.log" 2>&1 \
  || { cat "$BUILD/configure.log"; exit 1; }
grep -E "GPU compile check" "$BUILD/configure.log" || true
cmake --build "$BUILD" --target gpu_compile_check

# Negative control: the PTX/asm checker must reject a vendor exp and a flushing build.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/bad.cu" <<'CU'
__global__ void vendor_exp(float* x) { x[threadIdx.x] = __expf(x[threadIdx.x]); }
CU
NVCC="${NVCC:-/usr/local/bin/nvcc}"
control_ok=1
if [ -x "$NVCC" ]; then
  "$NVCC" -arch=sm_90a -ptx "$tmp/bad.cu" -o "$tmp/bad.ptx"
  if "$PY" cmake/gpu_isa_check.py ptx "$tmp/bad.ptx" "$tmp/bad.ok" 2>/dev/null; then
    echo "NEGATIVE CONTROL FAILED: the PTX checker accepted __expf"; control_ok=0
  fi
  # the exact epilogue's TwoSum (csrc/common/exact_linear.h sum_round_odd) is correct only unfused: nvcc's default
  # --fmad=true contracts its f64 arithmetic, and the scan must say so; --fmad=false (the extension's flag) passes
  cat >"$tmp/twosum.cu" <<'CU'
__global__ void two_sum(const double* a, const double* b, double* out) {
  const int i = threadIdx.x;
  const double s = a[i] + b[i], bb = s - a[i];
  out[i] = (a[i] - (s - bb)) + (b[i] - bb) + a[i] * b[i] * 0.5;
}
CU
  "$NVCC" -arch=sm_90 -ptx "$tmp/twosum.cu" -o "$tmp/twosum_fmad.ptx"
  if "$PY" cmake/gpu_isa_check.py ptx "$tmp/twosum_fmad.ptx" "$tmp/tw.ok" 2>/dev/null; then
    echo "NEGATIVE CONTROL FAILED: the PTX checker accepted contracted f64 arithmetic (--fmad=true)"; control_ok=0
  fi
  "$NVCC" -arch=sm_90 --fmad=false -ptx "$tmp/twosum.cu" -o "$tmp/twosum_exact.ptx"
  "$PY" cmake/gpu_isa_check.py ptx "$tmp/twosum_exact.ptx" "$tmp/tw.ok" \
    || { echo "POSITIVE CONTROL FAILED: the PTX checker rejected an unfused f64 TwoSum"; control_ok=0; }
  # the mma linear's PTX must contain its bf16 mma.sync (gpu_isa_check.py REQUIRED): a clean file without it fails
  cp "$tmp/twosum_exact.ptx" "$tmp/linear_mma.compute_90.ptx"
  if "$PY" cmake/gpu_isa_check.py ptx "$tmp/linear_mma.compute_90.ptx" "$tmp/lm.ok" 2>/dev/null; then
    echo "NEGATIVE CONTROL FAILED: the PTX checker accepted a linear_mma PTX without mma.sync m16n8k16 bf16"; control_ok=0
  fi
  cp "$tmp/twosum_exact.ptx" "$tmp/attention.compute_90.ptx"
  if "$PY" cmake/gpu_isa_check.py ptx "$tmp/attention.compute_90.ptx" "$tmp/at.ok" 2>/dev/null; then
    echo "NEGATIVE CONTROL FAILED: the PTX checker accepted an attention PTX without mma.sync m16n8k16 bf16"; control_ok=0
  fi
fi
if command -v clang++-22 >/dev/null; then
  cat >"$tmp/bad.hip" <<'HIP'
#include <hip/hip_runtime.h>
__global__ void vendor_exp(float* x) { x[threadIdx.x] = __expf(x[threadIdx.x]); }
HIP
  clang++-22 -x hip -std=c++20 --offload-arch=gfx942 -nogpulib --rocm-path=/usr -D__AMDGCN_WAVEFRONT_SIZE=64 -O3 \
    --offload-device-only -S "$tmp/bad.hip" -o "$tmp/bad.s" 2>/dev/null
  if "$PY" cmake/gpu_isa_check.py s "$tmp/bad.s" "$tmp/bad.ok" 2>/dev/null; then
    echo "NEGATIVE CONTROL FAILED: the AMDGPU asm checker accepted __expf"; control_ok=0
  fi
fi
[ "$control_ok" = 1 ] || exit 1

echo
echo "== GPU compile check summary ($(( $(date +%s) - start )) s) =="
m="$BUILD/gpu_check/manifest.txt"
cuda_files=$(grep -c '^cuda ' "$m" || true)
hip_files=$(grep -c '^hip ' "$m" || true)
echo "CUDA: $(grep '^cuda ' "$m" | awk '{print $3}' | sort -u | wc -l) file(s) x targets {$(grep '^cuda ' "$m" | awk '{print $2}' | sort -uV | paste -sd, -)} = $cuda_files images + PTX checked"
for f in "$BUILD"/gpu_check/cuda_*.fatbin.txt; do
  [ -f "$f" ] && echo "  $(basename "$f" .fatbin.txt).o embeds: $(cat "$f")  (cubins;PTX, read from its .nv_fatbin)"
done
echo "HIP:  $(grep '^hip ' "$m" | awk '{print $3}' | sort -u | wc -l) file(s) x archs {$(grep '^hip ' "$m" | awk '{print $2}' | sort -u | paste -sd, -)} = $hip_files compiled + asm/IR checked"
grep '^glue ' "$m" | sed 's/^/GLUE: /' || true
if grep '^SKIPPED' "$m"; then
  echo "WARNING: some GPU targets were SKIPPED (see above)"
fi
echo "negative controls: checker rejects __expf (PTX$(command -v clang++-22 >/dev/null && echo ', AMDGPU asm')) and f64 contracted by --fmad=true"
# Register spills per kernel image (ptxas -v, cuda_<file>.resources.txt): the kernels a GPU user pays local-memory
# traffic for, listed in every CI log (not a failure: a spill costs speed, not bits).
"$PY" - "$BUILD"/gpu_check/cuda_*.resources.txt <<'PY'
import os, re, sys
rows, cur = [], None
for path in sys.argv[1:]:
    if not os.path.exists(path):  # no nvcc (the manifest says SKIPPED cuda): the unmatched glob itself
        continue
    for line in open(path):
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\w+)'", line)
        if m:
            cur = m.groups()
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and cur:
            rows.append((int(m.group(1)), cur[0], cur[1]))
            cur = None
spilling = sorted((r for r in rows if r[0] > 0), reverse=True)
print(f"ptxas spills: {len(spilling)} of {len(rows)} kernel images store spills" + ("; largest:" if spilling else ""))
for n, name, arch in spilling[:5]:
    print(f"  {n:6d} B  {arch}  {name}")
PY
