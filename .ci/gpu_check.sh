#!/usr/bin/env bash
# gpu_check.sh — the one prepared script for a lent GPU machine (NVIDIA H200, CUDA torch preinstalled).
#
#   1. records the machine (nvidia-smi, torch, nvcc);
#   2. builds the CUDA vendor wheel against the machine's torch (pip wheel --no-build-isolation; the CMake
#      dev build when scikit-build-core is absent) and installs it into a private folder the tests use;
#   3. runs tests/cuda (CPU == CUDA bit for bit, GPU batch invariance, opcheck, torch.compile, errors);
#   4. runs bench/bench_dense.py and bench/bench_linear.py with --device cuda, where they exist;
#   5. writes $OUT/summary.md (one Markdown table: step, status, seconds) and the logs.
# Every step has a timeout; the whole script is sized to finish in about 8 minutes. Usage, from the
# repository root:  OUT=/some/dir bash .ci/gpu_check.sh   (the device tool sets OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
JOBS="$(nproc 2>/dev/null || echo 8)"
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.md"
printf '| step | status | seconds |\n|---|---|---:|\n' >"$SUMMARY"

# step NAME TIMEOUT LOG COMMAND...: runs the command under `timeout`, appends a summary row, returns its status.
step() {
  local name="$1" limit="$2" log="$3"
  shift 3
  local t0 rc status
  t0=$(date +%s)
  echo "== $name (timeout ${limit}s) ==" | tee -a "$log"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  case $rc in
    0) status="ok" ;;
    124 | 137) status="TIMEOUT" ;;
    *) status="FAILED (rc=$rc)" ;;
  esac
  echo "| $name | $status | $(($(date +%s) - t0)) |" >>"$SUMMARY"
  echo "   -> $status" | tee -a "$log"
  return $rc
}

# 1. the machine
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'hip', torch.version.hip); print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NONE')" 2>&1
  nvcc --version 2>&1 | tail -1
  cmake --version 2>&1 | head -1
  git log --oneline -1 2>&1
} >"$OUT/env.txt"
cat "$OUT/env.txt"

# 2. build: the CUDA vendor wheel (docs/wheels.md), installed into a private folder the tests import from.
# Needs scikit-build-core (carry its wheel: docs/wheels.md); without it, the CMake dev build (.so into python/).
SITE=/tmp/aligned_site
if "$PY" -c "import scikit_build_core" >/dev/null 2>&1; then
  if step "build CUDA wheel (pip wheel --no-build-isolation)" 360 "$OUT/build.log" \
    bash -c "rm -rf dist $SITE && CMAKE_BUILD_PARALLEL_LEVEL=$JOBS $PY -m pip wheel -q --no-build-isolation --no-deps -w dist . && $PY -m pip install -q --no-deps --target $SITE dist/aligned_ops-*.whl && ls dist"; then
    built=1; TEST_PATH=$SITE
    ls dist >>"$SUMMARY.tail"
  else
    built=0; tail -40 "$OUT/build.log"
  fi
else
  BUILD_DIR=build/gpu-device
  echo "| CUDA wheel | skipped: scikit-build-core absent, CMake dev build instead | 0 |" >>"$SUMMARY"
  if step "build (cmake, CUDA torch)" 330 "$OUT/build.log" \
    bash -c "cmake -S . -B $BUILD_DIR -G Ninja -DPython_EXECUTABLE=\"\$(command -v $PY)\" -DCMAKE_BUILD_TYPE=Release && cmake --build $BUILD_DIR -j $JOBS"; then
    built=1; TEST_PATH=python
  else
    built=0; tail -40 "$OUT/build.log"
  fi
fi

# 3. the GPU tests
if [ "$built" = 1 ]; then
  step "pytest tests/cuda" 240 "$OUT/pytest_cuda.log" \
    env PYTHONPATH=$TEST_PATH "$PY" -m pytest tests/cuda -q -rs -p no:cacheprovider --durations=8
  tail -25 "$OUT/pytest_cuda.log"
  grep -E "passed|failed|error" "$OUT/pytest_cuda.log" | tail -1 | sed 's/^/pytest: /' >>"$SUMMARY.tail" || true

  # 4. benchmarks (present on other branches; --quick keeps each under a minute)
  for b in bench/bench_dense.py bench/bench_linear.py bench/bench_attention_gpu.py; do
    if [ -f "$b" ]; then
      step "$(basename "$b") --device cuda" 90 "$OUT/bench.log" \
        env PYTHONPATH=$TEST_PATH "$PY" "$b" --device cuda --quick --out "$OUT/bench.md"
    else
      echo "| $(basename "$b") | not present | 0 |" >>"$SUMMARY"
    fi
  done
fi

if [ -f "$SUMMARY.tail" ]; then
  echo >>"$SUMMARY"
  cat "$SUMMARY.tail" >>"$SUMMARY"
  rm -f "$SUMMARY.tail"
fi
echo
cat "$SUMMARY"
[ -f "$OUT/bench.md" ] && cat "$OUT/bench.md"
exit 0
