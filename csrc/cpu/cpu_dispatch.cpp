// cpu_dispatch.cpp — the one place a CPU ISA level is chosen (cpu_backend.h), and the family accessors that
// read their table from it.
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <stdexcept>
#include <string>

#include "cpu_backend.h"

namespace aligned::cpu {

// Each ISA namespace's tables, gathered with designated initializers (same names in every namespace).
#define ALIGNED_DECLARE_LEVEL(ns)                   \
  namespace ns {                                    \
  extern const KernelTable kTable;                  \
  extern const DenseSplitKernels kDenseSplit;       \
  extern const AttentionTable kAttentionTable;      \
  extern const MoeKernels kMoe;                     \
  extern const ExactKernels kExact;                 \
  }
#define ALIGNED_LEVEL(name, ns, amx)                                                                          \
  CpuBackend {                                                                                              \
    .level = name, .amx_int8 = amx, .dense = &ns::kTable, .dense_split = &ns::kDenseSplit,                  \
    .attention = &ns::kAttentionTable, .moe = &ns::kMoe, .exact = &ns::kExact, .mma = nullptr               \
  }

ALIGNED_DECLARE_LEVEL(generic)
#if defined(__x86_64__)
ALIGNED_DECLARE_LEVEL(avx2)
ALIGNED_DECLARE_LEVEL(avx512)
#endif
#if defined(ALIGNED_HAS_MMA_AVX512BF16)
namespace avx512bf16 {
extern const MmaKernels kMma;     // gemm_mma_kernels.cpp, the one level that has the mma unit (CMakeLists.txt)
extern const MmaKernels kMmaAmx;  // gemm_amx_mma_kernels.cpp (same level; AMX functions targeted per function)
}
#endif

static bool amx_bf16_usable();

// The mma unit of a backend whose level runs AVX-512 (cpu_backend.h), where the CPU has avx512_bf16: the `amx`
// level's is AMX-BF16 tdpbf16ps where the CPU has amx_bf16 (the fast unit; its own bits), the `avx512` level's
// vdpbf16ps (the bits every avx512_bf16 CPU shares: ALIGNED_CPU_ISA=avx512 picks it on an AMX CPU).
static CpuBackend with_mma_unit(CpuBackend b) {
#if defined(ALIGNED_HAS_MMA_AVX512BF16) && defined(__x86_64__)
  if (__builtin_cpu_supports("avx512bf16"))
    b.mma = b.amx_int8 && amx_bf16_usable() ? &avx512bf16::kMmaAmx : &avx512bf16::kMma;
#endif
  return b;
}

bool amx_int8_usable() {
  static const bool ok = []() {
#if defined(__x86_64__)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, int8 = (d >> 25) & 1;
    if (!tile || !int8) return false;
    // Linux grants the AMX tile state (XFEATURE_XTILEDATA = 18) per process on request.
    constexpr long kArchReqXcompPerm = 0x1023;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, 18) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

static bool amx_bf16_usable() {
#if defined(__x86_64__)
  unsigned a, b, c, d;
  // CPUID.(7, 0).EDX[22] = AMX-BF16; the tile state is the one amx_int8_usable() has been granted
  return amx_int8_usable() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1);
#else
  return false;
#endif
}

static CpuBackend select_backend() {
  const char* forced = getenv("ALIGNED_CPU_ISA");
  if (forced && *forced == '\0') forced = nullptr;  // set but empty: no preference
  auto is = [&](const char* name) { return forced && strcmp(forced, name) == 0; };
  if (forced && !is("generic") && !is("avx2") && !is("avx512") && !is("amx"))
    throw std::runtime_error(std::string("aligned_ops: ALIGNED_CPU_ISA='") + forced +
                             "' is not a kernel level; use generic, avx2, avx512 or amx (or unset it)");
  if (is("generic")) return ALIGNED_LEVEL("generic", generic, false);
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool has_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (is("avx2")) {
    if (!has_avx2) throw std::runtime_error("aligned_ops: ALIGNED_CPU_ISA=avx2 but this CPU lacks AVX2/FMA");
    return ALIGNED_LEVEL("avx2", avx2, false);
  }
  if (is("avx512") || is("amx")) {
    if (!has_avx512) throw std::runtime_error(std::string("aligned_ops: ALIGNED_CPU_ISA=") + forced +
                                              " but this CPU lacks AVX-512 F/BW/VL/DQ");
    if (is("avx512")) return with_mma_unit(ALIGNED_LEVEL("avx512", avx512, false));
    if (!amx_int8_usable())
      throw std::runtime_error("aligned_ops: ALIGNED_CPU_ISA=amx but this CPU (or kernel) grants no AMX-INT8 tiles");
    return with_mma_unit(ALIGNED_LEVEL("amx", avx512, true));
  }
  if (has_avx512)
    return with_mma_unit(amx_int8_usable() ? ALIGNED_LEVEL("amx", avx512, true) : ALIGNED_LEVEL("avx512", avx512, false));
  if (has_avx2) return ALIGNED_LEVEL("avx2", avx2, false);
#else
  if (forced) throw std::runtime_error(std::string("aligned_ops: ALIGNED_CPU_ISA=") + forced + " is not available on this CPU");
#endif
  return ALIGNED_LEVEL("generic", generic, false);
}

const CpuBackend& cpu_backend() {
  static const CpuBackend backend = select_backend();
  return backend;
}

const KernelTable& cpu_kernels() { return *cpu_backend().dense; }
const DenseSplitKernels& dense_split_kernels() { return *cpu_backend().dense_split; }
const AttentionTable& attention_kernels() { return *cpu_backend().attention; }
const MoeKernels& moe_kernels() { return *cpu_backend().moe; }
const ExactKernels& exact_kernels() { return *cpu_backend().exact; }

}  // namespace aligned::cpu
