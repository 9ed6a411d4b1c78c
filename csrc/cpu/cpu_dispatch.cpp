// cpu_dispatch.cpp — picks the kernel table for the widest ISA the running CPU supports. All tables
// compute identical bits; ALIGNED_CPU_ISA=generic|avx2|avx512 forces one (used by the tests that prove it).
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

namespace aligned::cpu {
namespace generic { extern const KernelTable kTable; }
#if defined(__x86_64__)
namespace avx2 { extern const KernelTable kTable; }
namespace avx512 { extern const KernelTable kTable; }
#endif

static const KernelTable& select_table() {
  const char* forced = getenv("ALIGNED_CPU_ISA");
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool has_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (forced && strcmp(forced, "generic") == 0) return generic::kTable;
  if (forced && strcmp(forced, "avx2") == 0 && has_avx2) return avx2::kTable;
  if (has_avx512 && !(forced && strcmp(forced, "avx2") == 0)) return avx512::kTable;
  if (has_avx2) return avx2::kTable;
#else
  (void)forced;
#endif
  return generic::kTable;
}

const KernelTable& cpu_kernels() {
  static const KernelTable& table = select_table();
  return table;
}

}  // namespace aligned::cpu
