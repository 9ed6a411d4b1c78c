// register_cpu.cpp — the CPU dispatch key: one line per op family (csrc/torch/registration.h).
//
// A family with GPU kernels lists the emulated GPUs after Cpu: under aligned_ops.emulate(arch) its ops run the
// same glue bodies instantiated for the Emulated backend of the arch's vendor (the csrc/gpu source on the SIMT
// runtime, on CPU tensors); otherwise, and for the families without GPU kernels, the CPU kernels run. The
// instantiations live beside the Cpu run functions (backends/cpu_*.cpp).
#include "registration.h"

TORCH_LIBRARY_IMPL(aligned, CPU, m) {
  using namespace aligned::glue;
  register_family<Dense, Cpu, EmulatedCuda, EmulatedHip>(m);
  register_family<Logits, Cpu, EmulatedCuda, EmulatedHip>(m);
  register_family<LmHeadPieces, Cpu>(m);
  register_family<Linear, Cpu, EmulatedCuda, EmulatedHip>(m);
  register_family<LinearReference, Cpu>(m);
  register_family<LinearMma, Cpu, EmulatedCuda, EmulatedHip>(m);
  register_family<LinearMmaPacked, Cpu>(m);  // the amx_bf16 unit's packed weights (refused on any other unit)
  register_family<LinearMmaReference, Cpu, EmulatedCuda, EmulatedHip>(m);  // emulated: the arch's unit model
  register_family<Hooks, Cpu, EmulatedCuda, EmulatedHip>(m);
  register_family<ExactLinear, Cpu, EmulatedCuda, EmulatedHip>(m);
  register_family<ExactF64, Cpu>(m);
  register_family<ExactTp, Cpu>(m);
  register_family<ExactReference, Cpu>(m);
  register_family<Attention, Cpu, EmulatedCuda, EmulatedHip>(m);
  register_family<AttentionSizes, Cpu>(m);
  register_family<Moe, Cpu, EmulatedCuda, EmulatedHip>(m);
  register_family<MoeReference, Cpu>(m);
  register_family<AttentionMmaReference, Cpu, EmulatedCuda, EmulatedHip>(m);  // emulated: the arch's unit model
}
