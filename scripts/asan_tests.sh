#!/usr/bin/env bash
# Builds the CPU backend with AddressSanitizer + UBSan (CMake option ALIGNED_SANITIZE) into a private copy
# of the package and runs the kernel test suites under it. Any out-of-bounds access, use-after-free or
# undefined behaviour in our kernels aborts the run (-fno-sanitize-recover). Usage: scripts/asan_tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
root=build/asan
rm -rf "$root/pkg" && mkdir -p "$root/pkg"
cp -r python/aligned_ops "$root/pkg/"
rm -f "$root/pkg/aligned_ops/"_C*.so
cmake -S . -B "$root/cmake" -G Ninja -DPython_EXECUTABLE="$(command -v "$PY")" -DALIGNED_SANITIZE=ON \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DALIGNED_OUTPUT_DIR="$PWD/$root/pkg/aligned_ops" >/dev/null
cmake --build "$root/cmake"
libasan=$(g++ -print-file-name=libasan.so)
libubsan=$(g++ -print-file-name=libubsan.so)
# Python and torch allocate for the life of the process: leak checking would only report those.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:alloc_dealloc_mismatch=0:detect_odr_violation=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# tests/emulated: the GPU kernel source under the fiber SIMT runtime (ASan follows every fiber switch).
tests=${*:-tests/ops tests/common tests/emulated}
# torch.compile under ASan only re-tests inductor (slow); eager, opcheck and autograd tests run.
LD_PRELOAD="$libasan $libubsan" PYTHONPATH="$PWD/$root/pkg" ALIGNED_ASAN=1 "$PY" -m pytest -q -p no:cacheprovider -k "not compile" $tests
