// register_cuda.cpp — the CUDA dispatch key (a CUDA torch, and a ROCm torch: HIP kernels register under the CUDA
// key): one line per op family with GPU kernels (csrc/torch/registration.h). The instantiations live beside the
// device's functions (backends/cuda.cpp). Families not listed have no GPU kernels: a device call fails naming
// the op.
#include "registration.h"

TORCH_LIBRARY_IMPL(aligned, CUDA, m) {
  using namespace aligned::glue;
  register_family<Dense, Cuda>(m);
  register_family<Logits, Cuda>(m);
  register_family<Linear, Cuda>(m);
  register_family<LinearMma, Cuda>(m);
  register_family<LinearMmaReference, Cuda>(m);  // refuses: the unit's model is the emulator's
  register_family<Hooks, Cuda>(m);
  register_family<ExactLinear, Cuda>(m);
  register_family<Attention, Cuda>(m);
  register_family<Moe, Cuda>(m);
  register_family<AttentionMmaReference, Cuda>(m);  // refuses: the unit's model is the emulator's
}
