#!/usr/bin/env bash
# gpu_check.sh — the one prepared script for a lent GPU machine: sized to finish inside one command of the
# device tool (≤ 600 s) with room to spare, build included.
#
#   OUT=/some/dir bash .ci/gpu_check.sh [--quick | --build-only] [--dry-run]     (the device tool sets OUT)
#
#   --dry-run     lists the steps and their timeouts (full and quick) and their sums, runs nothing
#   --quick       the steps marked quick, with their quick timeouts (≤ 240 s in all)
#   --build-only  env, gpu and the build alone, the build with BUILD_ONLY_TIMEOUT (≤ 540 s). The build lands in
#                 build/gpu-site (inside the checkout: the device tool keeps ignored build outputs between calls
#                 on a warm machine) with a stamp of the sources it was built from; the next call (full or quick)
#                 reuses it when the sources are the same, so its whole budget goes to the tests. The lease plan:
#                 call 1 `--build-only`, call 2 right after it (the machine goes back when idle ~30 s) without.
#
# NVIDIA (CUDA torch, nvcc) or AMD (ROCm torch, hipcc / ROCm clang): the backend follows the installed torch.
# Steps (the table STEPS below; every step runs under its own timeout, and the timeouts add up to ≤ 540 s):
#   env       the machine, torch, compilers (no GPU needed)
#   gpu       is there a GPU torch can use? If not: "no GPU", exit 3, nothing else runs
#   build     the wheel (pip wheel --no-build-isolation) for THIS GPU's arch only (TORCH_CUDA_ARCH_LIST /
#             PYTORCH_ROCM_ARCH), installed into a private folder; if it fails, the CMake dev build (what is
#             left of the step's time); the ISA scan of the real flags runs inside either build
#   test:*    one pytest process per GPU test file (a hang loses one file, not all), each with its own timeout
#   sanitize:*  compute-sanitizer memcheck and racecheck over tests/cuda/sanitizer_probe.py (NVIDIA only)
#   bench     bench/bench_gpu.py: the ceilings of this run (1 GiB device copy, 8192^3 bf16 matmul) and every
#             op's achieved GB/s or TFLOP/s, its fraction of the ceiling and of the roofline, vs torch
#   mma:*     the `mma` profile's hardware checks: the bf16 instruction vs the emulator's model, the kernel vs
#             the emulated kernel, batch invariance (tests/cuda/test_cuda_linear_mma.py); its speed against
#             cuBLAS and the fma linear in the same run (bench/bench_gpu_mma.py)
#
# $OUT receives (≤ 8 files, flat — the device tool returns at most 8 files, 2 folders deep):
#   summary.md   one table: step, status, seconds, detail (pytest counts, sanitizer verdicts); then the bench table
#   env.txt  build.log  tests.log  sanitizer.log  bench.log  bench.json
# Exit status: 0 all steps ok, 1 a step failed or timed out, 3 no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=full
DRY=0
for a in "$@"; do
  case "$a" in
    --quick) MODE=quick ;;
    --build-only) MODE=build-only ;;
    --dry-run) DRY=1 ;;
    -h | --help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$a' (use --quick, --dry-run)" >&2; exit 2 ;;
  esac
done

BUDGET_FULL=540
BUDGET_QUICK=240
BUILD_ONLY_TIMEOUT=540  # --build-only: the build step's timeout (one device command is ≤ 600 s)

# ---- the steps ----------------------------------------------------------------------------------------------
# name | full timeout (s) | quick timeout (s, 0 = not in --quick) | needs a GPU | function and arguments
STEPS=(
  "env|10|10|no|step_env"
  "gpu|15|15|yes|step_gpu"
  "build|225|130|yes|step_build"
  "test:test_cuda_dense.py|55|20|yes|step_pytest tests/cuda/test_cuda_dense.py"
  "test:test_cuda_realistic.py|25|0|yes|step_pytest tests/cuda/test_cuda_realistic.py"
  "test:test_cuda_attention.py|25|0|yes|step_pytest tests/cuda/test_cuda_attention.py"
  "test:test_cuda_exact_linear.py|20|0|yes|step_pytest tests/cuda/test_cuda_exact_linear.py"
  "test:test_cuda_trainer.py|20|0|yes|step_pytest tests/cuda/test_cuda_trainer.py"
  "sanitize:memcheck|25|0|yes|step_sanitize memcheck"
  "sanitize:racecheck|25|0|yes|step_sanitize racecheck"
  "bench|25|20|yes|step_bench"
  # ---- mma profile: hardware checks (tests/cuda/test_cuda_linear_mma.py) -----------------------------------
  # The bf16 instruction vs the emulator's MMA-Sim model of this arch (agreement printed in tests.log), the
  # kernel vs the emulated kernel, batch invariance on the hardware; then its speed against cuBLAS and the fma
  # linear in the same run (bench/bench_gpu_mma.py).
  "mma:test_cuda_linear_mma.py|25|25|yes|step_pytest tests/cuda/test_cuda_linear_mma.py"
  "mma:bench|20|20|yes|step_bench_mma"
  # ---- MoE on the GPU (both profiles): device vs CPU / emulated kernel, a token alone vs batches, graph replay ----
  "test:test_cuda_moe.py|25|0|yes|step_pytest tests/cuda/test_cuda_moe.py"
)
# The GPU test files of tests/cuda. The others there (test_gpu_isa_scan.py, test_gpu_sources.py,
# test_no_host_sync.py) need no GPU and run in CI.

OUT="${OUT:-$PWD/out}"
PY="${PYTHON:-python3}"
JOBS="$(nproc 2>/dev/null || echo 8)"
export PYTHONUNBUFFERED=1
START=$(date +%s)
SCRATCH=$(mktemp -d)  # per-step scratch: $OUT holds only the files listed above
trap 'rm -rf "$SCRATCH"' EXIT
SITE=$PWD/build/gpu-site      # the wheel's install (kept between the device tool's calls: ignored, in the checkout)
STAMP=$SITE/.sources-stamp    # what it was built from: source_stamp below
TEST_PATH=""
VENDOR=""
GPU_ARCH=""

field() { echo "$1" | cut -d'|' -f"$2"; }
timeout_of() {
  case "$MODE" in
    quick) field "$1" 3 ;;
    build-only) case "$(field "$1" 1)" in build) echo "$BUILD_ONLY_TIMEOUT" ;; env | gpu) field "$1" 2 ;; *) echo 0 ;; esac ;;
    *) field "$1" 2 ;;
  esac
}
# The build's inputs (no .git is needed: the device tool's copy of the tree may have none) plus the GPU and torch.
source_stamp() {
  { find csrc cmake python/aligned_ops -type f \( -name '*.h' -o -name '*.cuh' -o -name '*.cu' -o -name '*.hip' \
      -o -name '*.cpp' -o -name '*.cmake' -o -name '*.py' -o -name '*.in' -o -name '*.yaml' \) -print0 | sort -z |
      xargs -0 sha256sum; sha256sum CMakeLists.txt pyproject.toml; echo "$VENDOR $GPU_ARCH"
    "$PY" -c "import torch; print(torch.__version__)"; } 2>/dev/null | sha256sum | cut -c1-16
}

if [ "$DRY" = 1 ]; then
  printf '%-32s %8s %8s  %s\n' "step" "full(s)" "quick(s)" "needs GPU"
  tf=0; tq=0
  for s in "${STEPS[@]}"; do
    f=$(field "$s" 2); q=$(field "$s" 3)
    printf '%-32s %8s %8s  %s\n' "$(field "$s" 1)" "$f" "$([ "$q" = 0 ] && echo '-' || echo "$q")" "$(field "$s" 4)"
    tf=$((tf + f)); tq=$((tq + q))
  done
  printf '%-32s %8s %8s\n' "total (timeouts)" "$tf" "$tq"
  printf '%-32s %8s %8s\n' "budget" "$BUDGET_FULL" "$BUDGET_QUICK"
  printf '%-32s %8s\n' "--build-only: build" "$BUILD_ONLY_TIMEOUT"
  if [ "$tf" -gt "$BUDGET_FULL" ] || [ "$tq" -gt "$BUDGET_QUICK" ] || [ "$BUILD_ONLY_TIMEOUT" -gt 540 ]; then
    echo "gpu_check.sh: the step timeouts exceed the budget" >&2; exit 1
  fi
  exit 0
fi

mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"
printf '# gpu_check (%s mode) — %s\n\n| step | status | seconds | timeout | detail |\n|---|---|---:|---:|---|\n' \
  "$MODE" "$(git log --oneline -1 2>/dev/null || echo '?')" >"$SUMMARY"
DETAIL=""

# ---- steps ---------------------------------------------------------------------------------------------------
step_env() {  # stdout goes to env.txt (the driver)
  {
    echo "date: $(date -u)"
    echo "host: $(uname -a)"
    echo "cpus: $JOBS"
    command -v nvidia-smi >/dev/null && timeout 5 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    command -v rocm-smi >/dev/null && rocm-smi --showproductname 2>&1 | head -20
    timeout 8 "$PY" -c "import torch, sys; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'hip', torch.version.hip)" 2>&1
    command -v nvcc >/dev/null && nvcc --version 2>&1 | tail -1
    command -v hipcc >/dev/null && hipcc --version 2>&1 | head -2
    command -v compute-sanitizer >/dev/null && compute-sanitizer --version 2>&1 | tail -1
    cmake --version 2>&1 | head -1
    "$PY" -c "import scikit_build_core; print('scikit-build-core', scikit_build_core.__version__)" 2>&1 | tail -1
    git log --oneline -1 2>&1
  } 2>&1
  return 0
}

step_gpu() {
  local info
  info=$(timeout 12 "$PY" - <<'PY' 2>&1
import torch
if not torch.cuda.is_available():
    print("NOGPU")
else:
    p = torch.cuda.get_device_properties(0)
    if torch.version.hip:
        print("hip", p.gcnArchName.split(":")[0], torch.cuda.get_device_name(0).replace(" ", "_"))
    else:
        print("cuda", f"{p.major}.{p.minor}", torch.cuda.get_device_name(0).replace(" ", "_"))
PY
)
  echo "$info"
  case "$info" in
    cuda\ * | hip\ *) ;;
    *) return 3 ;;
  esac
  read -r VENDOR GPU_ARCH _ <<<"$(echo "$info" | tail -1)"
  DETAIL="$VENDOR $GPU_ARCH $(echo "$info" | tail -1 | awk '{print $3}')"
}

step_build() {
  local limit=$1 t0 rc left
  t0=$(date +%s)
  if [ "$VENDOR" = cuda ]; then
    # this GPU only (CMakeLists.txt / cmake/gpu_archs.cmake), compiled as the wheel compiles it: from its NVVM
    # generation's PTX (compute_80 for sm_90, compute_100 for sm_120), one ptxas
    export TORCH_CUDA_ARCH_LIST="$GPU_ARCH"
  else
    export PYTORCH_ROCM_ARCH="$GPU_ARCH"
  fi
  export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS
  local stamp
  stamp=$(source_stamp)
  if [ "$MODE" != build-only ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$stamp" ] && [ -d "$SITE/aligned_ops" ]; then
    echo "== reusing the build of an earlier --build-only call (sources stamp $stamp)"
    TEST_PATH=$SITE; DETAIL="prebuilt by --build-only (stamp $stamp)"; return 0
  fi
  if [ "$MODE" != build-only ] && [ -f build/gpu-device/.sources-stamp ] && [ "$(cat build/gpu-device/.sources-stamp)" = "$stamp" ] \
      && ls python/aligned_ops/_C*.so >/dev/null 2>&1; then
    echo "== reusing the CMake dev build of an earlier --build-only call (sources stamp $stamp)"
    TEST_PATH=$PWD/python; DETAIL="prebuilt dev build (stamp $stamp)"; return 0
  fi
  if "$PY" -c "import scikit_build_core" >/dev/null 2>&1; then
    echo "== wheel build for $VENDOR $GPU_ARCH (timeout $((limit - 5))s)"
    rm -rf "$SITE" build/gpu-wheel-dist
    timeout --kill-after=5 $((limit - 5)) bash -c \
      "$PY -m pip wheel -q --no-build-isolation --no-deps -w build/gpu-wheel-dist . && $PY -m pip install -q --no-deps --target $SITE build/gpu-wheel-dist/aligned_ops-*.whl && ls build/gpu-wheel-dist"
    rc=$?
    if [ $rc = 0 ]; then
      echo "$stamp" >"$STAMP"
      TEST_PATH=$SITE; DETAIL="wheel $(ls build/gpu-wheel-dist | head -1), $(($(date +%s) - t0)) s"; return 0
    fi
    echo "== wheel build failed (rc=$rc): falling back to the CMake dev build"
  else
    echo "== scikit-build-core absent: the CMake dev build"
  fi
  left=$((limit - ($(date +%s) - t0) - 5))
  if [ "$left" -lt 20 ]; then
    echo "== no time left for the CMake build ($left s)"; return 124
  fi
  timeout --kill-after=5 "$left" bash -c \
    "cmake -S . -B build/gpu-device -G Ninja -DPython_EXECUTABLE=\"\$(command -v $PY)\" -DCMAKE_BUILD_TYPE=Release && cmake --build build/gpu-device -j $JOBS"
  rc=$?
  [ $rc = 0 ] && { echo "$stamp" >build/gpu-device/.sources-stamp; TEST_PATH=$PWD/python; DETAIL="CMake dev build (wheel failed or absent)"; }
  return $rc
}

step_pytest() {
  local limit=$1 file=$2 rc last
  echo "== $file"
  timeout --kill-after=5 $((limit - 3)) env PYTHONPATH="$TEST_PATH" "$PY" -m pytest "$file" -q -rfEs -p no:cacheprovider \
    --durations=5 --maxfail=10 2>&1 | tee "$SCRATCH/pytest_last"
  rc=${PIPESTATUS[0]}
  last=$(grep -E "[0-9]+ (passed|failed|error|skipped)" "$SCRATCH/pytest_last" | tail -1)
  DETAIL="${last:-no pytest summary}"
  return $rc
}

step_sanitize() {
  local limit=$1 tool=$2 rc extra=""
  if [ "$VENDOR" != cuda ]; then DETAIL="n/a on ROCm"; return 0; fi
  if ! command -v compute-sanitizer >/dev/null; then DETAIL="compute-sanitizer not found"; return 1; fi
  [ "$tool" = racecheck ] && extra="--racecheck-report hazard"
  echo "== compute-sanitizer --tool $tool"
  # memcheck: no caching allocator, so an out-of-bounds access cannot land in a neighbouring cached block
  timeout --kill-after=5 $((limit - 3)) env PYTHONPATH="$TEST_PATH" PYTORCH_NO_CUDA_MEMORY_CACHING=$([ "$tool" = memcheck ] && echo 1 || echo 0) \
    compute-sanitizer --tool "$tool" $extra --error-exitcode 9 --print-limit 50 --target-processes all \
    "$PY" tests/cuda/sanitizer_probe.py 2>&1 | tee "$SCRATCH/san_last"
  rc=${PIPESTATUS[0]}
  DETAIL="$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$SCRATCH/san_last" | tail -1)"
  return $rc
}

step_bench() {
  local limit=$1 rc
  timeout --kill-after=5 $((limit - 3)) env PYTHONPATH="$TEST_PATH" "$PY" bench/bench_gpu.py $([ "$MODE" = quick ] && echo --quick) \
    --out "$SCRATCH/bench.md" --json "$OUT/bench.json"
  rc=$?
  DETAIL="$(grep -c '^| [a-z]' "$SCRATCH/bench.md" 2>/dev/null || echo 0) rows"
  return $rc
}

step_bench_mma() {  # the mma linear vs cuBLAS and the fma linear, same run (bench/bench_gpu_mma.py)
  local limit=$1 rc
  timeout --kill-after=5 $((limit - 3)) env PYTHONPATH="$TEST_PATH" "$PY" bench/bench_gpu_mma.py \
    $([ "$MODE" = quick ] && echo --quick) --out "$SCRATCH/bench.md"
  rc=$?
  DETAIL="$(grep -c '^| [0-9]' "$SCRATCH/bench.md" 2>/dev/null || echo 0) mma rows"
  return $rc
}


# ---- the driver ------------------------------------------------------------------------------------------------
log_of() {
  case "$1" in
    env | gpu) echo "$OUT/env.txt" ;;
    build) echo "$OUT/build.log" ;;
    test:*) echo "$OUT/tests.log" ;;
    sanitize:*) echo "$OUT/sanitizer.log" ;;
    *) echo "$OUT/bench.log" ;;
  esac
}

failed=0
for s in "${STEPS[@]}"; do
  name=$(field "$s" 1)
  limit=$(timeout_of "$s")
  needs_gpu=$(field "$s" 4)
  read -r fn args <<<"$(field "$s" 5)"
  if [ "$limit" = 0 ]; then continue; fi
  if [ "$name" != env ] && [ "$name" != gpu ] && [ -z "$TEST_PATH" ] && [ "$name" != build ]; then
    echo "| $name | skipped (no build) | 0 | $limit | |" >>"$SUMMARY"; continue
  fi
  log=$(log_of "$name")
  DETAIL=""
  t0=$(date +%s)
  echo "== [$((t0 - START))s] $name (timeout ${limit}s)" | tee -a "$log"
  # a step runs in this shell (it sets TEST_PATH, VENDOR, GPU_ARCH, DETAIL), each of its commands under `timeout`
  $fn "$limit" $args >>"$log" 2>&1
  rc=$?
  secs=$(($(date +%s) - t0))
  case $rc in
    0) status=ok ;;
    3) status="no GPU" ;;
    124 | 137) status=TIMEOUT ;;
    *) status="FAILED (rc=$rc)" ;;
  esac
  echo "| $name | $status | $secs | $limit | ${DETAIL//|/\/} |" >>"$SUMMARY"
  echo "   -> $status ($secs s) $DETAIL"
  if [ $rc = 3 ]; then
    echo "gpu_check.sh: no GPU: torch sees no CUDA/ROCm device here; stopping before the first step that needs one."
    cat "$SUMMARY"
    exit 3
  fi
  [ $rc = 0 ] || failed=1
  if [ "$name" = build ] && [ $rc != 0 ]; then tail -40 "$log"; fi
done

{
  echo
  echo "total: $(($(date +%s) - START)) s ($MODE mode, budget $(case $MODE in quick) echo $BUDGET_QUICK ;; build-only) echo $BUILD_ONLY_TIMEOUT ;; *) echo $BUDGET_FULL ;; esac) s)"
  if [ -f "$SCRATCH/bench.md" ]; then echo; cat "$SCRATCH/bench.md"; fi
} >>"$SUMMARY"
echo
cat "$SUMMARY"
exit $failed
