// ieee_env.h — the IEEE floating-point environment every CPU op of this library runs in, on the calling thread
// and on every worker thread: no flush-to-zero, no denormals-are-zero, round to nearest even (the caller's
// environment restored after). contract.h's profiles keep subnormals and promise no dependence on the thread
// count; a caller's FTZ / DAZ (torch.set_flush_denormal(True)) lives in the calling thread's MXCSR (x86) or
// FPCR (aarch64) only, and OpenMP workers keep their own, so without this an op's rows would flush on some
// threads and not on others. Backends/cpu.h's Call holds one for the whole op (glue, serial paths, inline
// tasks); ieee_parallel_for is the only way the CPU glue forks (tests/test_structure.py bans bare
// at::parallel_for in csrc/torch/backends and csrc/cpu).
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace aligned::cpu {

class IeeeFpEnv {
 public:
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
  // MXCSR: FTZ (bit 15) | DAZ (bit 6), rounding control (bits 13-14) cleared; every exception masked (bits 7-12:
  // a caller's feenableexcept must not turn a kernel's legitimate inf / NaN into SIGFPE).
  IeeeFpEnv() : saved_(_mm_getcsr()) { _mm_setcsr((saved_ & ~(0x8040u | 0x6000u)) | 0x1f80u); }
  ~IeeeFpEnv() { _mm_setcsr(saved_); }
#elif defined(__aarch64__)
  // FPCR: FZ (bit 24), FZ16 (bit 19), RMode (bits 22-23) cleared (AH / FIZ of FEAT_AFP, bits 1 and 0, too).
  IeeeFpEnv() {
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t ieee = saved_ & ~((1ull << 24) | (1ull << 19) | (3ull << 22) | 3ull);
    __asm__ __volatile__("msr fpcr, %0" : : "r"(ieee));
  }
  ~IeeeFpEnv() { __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_)); }
#else
  // Other architectures: the default environment (IEEE) is assumed; nothing to save.
  IeeeFpEnv() = default;
#endif
  IeeeFpEnv(const IeeeFpEnv&) = delete;
  IeeeFpEnv& operator=(const IeeeFpEnv&) = delete;

 private:
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
  unsigned saved_;
#elif defined(__aarch64__)
  uint64_t saved_;
#endif
};

// at::parallel_for with every task under IeeeFpEnv (the one place the CPU glue forks).
template <typename F>
void ieee_parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    IeeeFpEnv fenv;
    f(b, e);
  });
}

}  // namespace aligned::cpu
