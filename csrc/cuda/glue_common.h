// glue_common.h — what every GPU torch glue file needs around its launches, written once: the current stream
// as the launchers' opaque pointer, the launch-error check, and the device check of a tensor argument. Used by
// ops_cuda.cpp (dense, logits, linear, moe, exact families) and ops_attention_cuda.cpp (attention).
//
// Three builds, chosen by the including TU's macros (as in ops_cuda.cpp): CUDA torch, ROCm torch
// (ALIGNED_ROCM: HIP streams; ROCm torch reports HIP devices as "cuda"), and the emulation target
// (ALIGNED_EMULATED_GLUE: CPU tensors, synchronous emulated launches, no stream). Internal linkage (an
// unnamed namespace): an emulated and a real GPU glue TU in one library each keep their own definition.
#pragma once

#include <ATen/ATen.h>

#if defined(ALIGNED_EMULATED_GLUE)
#include "../emu/emulation.h"
#elif defined(ALIGNED_ROCM)
#include <c10/hip/HIPStream.h>
#else
#include <c10/cuda/CUDAStream.h>
#endif

namespace aligned::cuda_glue {
namespace {

// The stream the op's launches go to: the current stream of t's device (nullptr under emulation).
inline void* current_stream(const at::Tensor& t) {
#if defined(ALIGNED_EMULATED_GLUE)
  (void)t;
  return nullptr;  // emulated launches are synchronous
#elif defined(ALIGNED_ROCM)
  return (void*)c10::hip::getCurrentHIPStream(t.device().index()).stream();
#else
  return (void*)c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#endif
}

// A launcher's result (nullptr or the runtime's error string) as the op's error.
inline void check_launch(const char* err, const char* op) {
  TORCH_CHECK(err == nullptr, "aligned::", op, ": kernel launch failed: ", err ? err : "");
}

// t must live on the same GPU device as ref (ref itself a GPU tensor); a CPU tensor under emulation.
inline void check_cuda(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name) {
#if defined(ALIGNED_EMULATED_GLUE)
  TORCH_CHECK(t.device().is_cpu(), "aligned::", op, ": ", name,
              " must be a CPU tensor under aligned_ops.emulate, got device ", t.device());
  (void)ref;
#else
  TORCH_CHECK(t.device().is_cuda(), "aligned::", op, ": ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == ref.device(), "aligned::", op, ": ", name, " is on ", t.device(), " but the inputs are on ",
              ref.device(), " (all tensors must be on the same device)");
#endif
}

}  // namespace
}  // namespace aligned::cuda_glue
