#!/usr/bin/env bash
# Builds the CPU backend with AddressSanitizer + UBSan (CMake option ALIGNED_SANITIZE) into a private copy
# of the package and runs the kernel test suites under it. Any out-of-bounds access, use-after-free or
# undefined behaviour in our kernels aborts the run (-fno-sanitize-recover).
# Usage: scripts/asan_tests.sh [--build-only | --no-build] [pytest args]   (ALIGNED_ASAN_JOBS=1: one pytest process)
#   --build-only  build (and refresh the package copy) only; CI runs it next to the README tests
#   --no-build    run the tests against the build made before (CI: after --build-only)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
root=build/asan
step=all
case "${1:-}" in
  --build-only) step=build; shift ;;
  --no-build) step=test; shift ;;
esac
if [ "$step" != test ]; then
  rm -rf "$root/pkg" && mkdir -p "$root/pkg"
  cp -r python/aligned_ops "$root/pkg/"
  rm -f "$root/pkg/aligned_ops/"_C*.so
  # -g1 (function names + line tables, what ASan/UBSan reports print) instead of RelWithDebInfo's -g: the full
  # debug info of the torch headers made each glue TU ~1.7x and each kernel TU ~1.25x as expensive to compile
  # (measured per TU: 64.7 vs 38.4 CPU-s for csrc/torch/backends/cpu_attention.cpp), for nothing a report shows.
  # (no precompiled header: every glue TU compiles from its own includes here, so a missing one fails CI)
  cmake -S . -B "$root/cmake" -G Ninja -DPython_EXECUTABLE="$(command -v "$PY")" -DALIGNED_SANITIZE=ON \
    -DCMAKE_DISABLE_PRECOMPILE_HEADERS=ON \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
    -DALIGNED_OUTPUT_DIR="$PWD/$root/pkg/aligned_ops" >/dev/null
  cmake --build "$root/cmake"
fi
if [ "$step" = build ]; then exit 0; fi
if ! ls "$root/pkg/aligned_ops/"_C*.so >/dev/null 2>&1; then
  echo "asan_tests.sh --no-build: no ASan build in $root/pkg (run scripts/asan_tests.sh --build-only first)" >&2
  exit 1
fi
libasan=$(g++ -print-file-name=libasan.so)
libubsan=$(g++ -print-file-name=libubsan.so)
# Python and torch allocate for the life of the process: leak checking would only report those.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:alloc_dealloc_mismatch=0:detect_odr_violation=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# The emulated kernels' TLS (their __shared__ arrays) is initial-exec in this build (CMakeLists.txt, ALIGNED_SANITIZE):
# a dlopen'ed library's initial-exec TLS must fit in glibc's static TLS surplus, raised here to the module's TLS size
# plus 64 KiB for what other libraries put there (without it the import fails: "cannot allocate memory in static
# TLS block"). Every process the tests start inherits it, as it inherits LD_PRELOAD.
tls_size=$(readelf -lW "$root"/pkg/aligned_ops/_C*.so | awk '$1 == "TLS" {print $6}')
export GLIBC_TUNABLES="${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.rtld.optional_static_tls=$(( ${tls_size:-0} + 65536 ))"
# tests/emulated: the GPU kernel source under the fiber SIMT runtime (ASan follows every fiber switch).
tests=${*:-tests/ops tests/common tests/emulated}
# torch.compile under ASan only re-tests inductor (slow); eager, opcheck and autograd tests run.
# Not run here (the README run runs them; here they would only repeat it or measure ASan itself):
# - test_simd_conformance.py, test_f16_conversion.py and test_mma_model_conformance.py compile their own programs
#   with plain g++ (nothing in them is sanitized: the preloaded runtime only slows the compilers down) and run the
#   same binaries the README run runs (the f16 one over all 2^32 f32 inputs: ~17 s);
# - the lm-head peak-memory test measures glibc's heap (its mmap threshold) in a fresh process: under ASan the
#   allocator is ASan's (quarantine, redzones), so the number says nothing about the user's process. The fused
#   lm-head kernels themselves run under ASan in test_lm_head.py's other tests (several tiles and token chunks);
# - the fork-while-another-thread-launches test: this libasan (GCC 12's, compiler-rt before its fork handlers) does
#   not hold its allocator's locks across fork(), so a fork that lands while another thread is inside malloc gives a
#   child that waits on that lock forever. Seen in CI (stop 46: 1 child of 20 ended by its SIGALRM) and reproduced
#   without aligned_ops at all — Python forking while a ctypes thread mallocs hung 1 child in 30, 100 and 150 under
#   LD_PRELOAD=libasan.so, 0 of 400 without. Our fork handlers still run under ASan in the chain-of-forks test
#   (test_a_forked_child_frees_the_dead_threads_fiber_stacks); the concurrent one runs in the README run.
asan_skip=(--deselect tests/common/test_simd_conformance.py --deselect tests/common/test_f16_conversion.py
           --deselect tests/emulated/test_mma_model_conformance.py
           --deselect tests/ops/test_lm_head.py::test_fused_forward_peak_resident_memory_is_tiles_not_logits
           --deselect tests/emulated/test_emulation_runtime.py::test_a_fork_while_another_thread_launches_gives_a_child_that_launches)
run_pytest() {
  LD_PRELOAD="$libasan $libubsan" PYTHONPATH="$PWD/$root/pkg" ALIGNED_ASAN=1 "$PY" -m pytest -q -p no:cacheprovider \
    -k "not compile" "${asan_skip[@]}" "$@"
}
# Two pytest processes side by side (ALIGNED_ASAN_JOBS=2, the default): the `slow` tests (subprocess matrices: one
# interpreter per ISA level / thread count, FSDP2 ranks) and the rest. One pytest process keeps about one core busy
# (Python between small kernels); the halves together run every test the single run ran, once. Their logs are
# printed one after the other when both are done. ALIGNED_ASAN_JOBS=1: one process, as before.
if [ "${ALIGNED_ASAN_JOBS:-2}" = 1 ]; then
  run_pytest $tests
  exit
fi
logdir=$(mktemp -d)
run_pytest -m slow $tests >"$logdir/slow.log" 2>&1 &
slow_pid=$!
rc_rest=0
run_pytest -m "not slow" $tests >"$logdir/rest.log" 2>&1 || rc_rest=$?
rc_slow=0
wait "$slow_pid" || rc_slow=$?
echo "== ASan + UBSan, tests not marked slow (rc $rc_rest)"
cat "$logdir/rest.log"
echo "== ASan + UBSan, tests marked slow (rc $rc_slow)"
cat "$logdir/slow.log"
rm -rf "$logdir"
# pytest's exit 5 (no test selected) in one half is fine when the other half ran tests
if [ "$rc_rest" = 5 ] && [ "$rc_slow" = 0 ]; then rc_rest=0; fi
if [ "$rc_slow" = 5 ] && [ "$rc_rest" = 0 ]; then rc_slow=0; fi
[ "$rc_rest" = 0 ] && [ "$rc_slow" = 0 ]
