// emulation_hook.h — how the CPU glue hands an op to the emulation target (csrc/emu/emulation.h).
//
// ops_cpu.cpp registers its ops through EmulationAwareLibrary instead of torch::Library directly: each op's
// CPU kernel is wrapped so that, while aligned_ops.emulate(arch) is active, the call goes to the GPU glue of
// that arch's vendor (csrc/cuda/ops_cuda.cpp compiled for emulation), which checks the same arguments
// (op_checks.h), fills the same params and calls the same run(params) launchers (csrc/gpu/dense_api.h),
// whose kernels the SIMT runtime executes. Outside emulation the cost is one atomic load per call. An op
// without GPU glue runs its CPU kernel under emulation too (no launch is recorded for it).
#pragma once

#include <torch/library.h>

#include "../emu/emulation.h"

namespace aligned::cpu {

class EmulationAwareLibrary {
 public:
  explicit EmulationAwareLibrary(torch::Library& lib) : lib_(lib) {}

  template <class R, class... A>
  EmulationAwareLibrary& impl(const char* name, R (*cpu_kernel)(A...)) {
    lib_.impl(name, [cpu_kernel, name](A... a) -> R {
      if (const emu::Arch* arch = emu::active_arch())
        if (auto* gpu_glue = emu::glue_registry(arch->vendor).find<R(A...)>(name)) return gpu_glue(a...);
      return cpu_kernel(a...);
    });
    return *this;
  }

 private:
  torch::Library& lib_;
};

}  // namespace aligned::cpu
