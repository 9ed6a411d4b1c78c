// cpu_dispatch.cpp — picks the kernel table for the widest ISA the running CPU supports. All tables
// compute identical bits; ALIGNED_CPU_ISA=generic|avx2|avx512 forces one (used by the tests that prove it).
// A value that names no level, or a level this CPU cannot run, fails loudly (std::runtime_error, which the
// dispatcher reports as a RuntimeError on the first op call) instead of silently running another level.
#include <stdlib.h>
#include <string.h>

#include <stdexcept>
#include <string>

#include "cpu_kernels.h"

namespace aligned::cpu {
namespace generic { extern const KernelTable kTable; }
#if defined(__x86_64__)
namespace avx2 { extern const KernelTable kTable; }
namespace avx512 { extern const KernelTable kTable; }
#endif

static const KernelTable& select_table() {
  const char* forced = getenv("ALIGNED_CPU_ISA");
  if (forced && *forced == '\0') forced = nullptr;  // set but empty: no preference
  if (forced && strcmp(forced, "generic") != 0 && strcmp(forced, "avx2") != 0 && strcmp(forced, "avx512") != 0)
    throw std::runtime_error(std::string("aligned_ops: ALIGNED_CPU_ISA='") + forced +
                             "' is not a kernel level; use generic, avx2 or avx512 (or unset it)");
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool has_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (forced && strcmp(forced, "generic") == 0) return generic::kTable;
  if (forced && strcmp(forced, "avx2") == 0) {
    if (!has_avx2) throw std::runtime_error("aligned_ops: ALIGNED_CPU_ISA=avx2 but this CPU lacks AVX2/FMA");
    return avx2::kTable;
  }
  if (forced && strcmp(forced, "avx512") == 0) {
    if (!has_avx512) throw std::runtime_error("aligned_ops: ALIGNED_CPU_ISA=avx512 but this CPU lacks AVX-512 F/BW/VL/DQ");
    return avx512::kTable;
  }
  if (has_avx512) return avx512::kTable;
  if (has_avx2) return avx2::kTable;
#else
  if (forced && strcmp(forced, "generic") != 0)
    throw std::runtime_error(std::string("aligned_ops: ALIGNED_CPU_ISA=") + forced + " is not available on this CPU");
#endif
  return generic::kTable;
}

const KernelTable& cpu_kernels() {
  static const KernelTable& table = select_table();
  return table;
}

}  // namespace aligned::cpu
