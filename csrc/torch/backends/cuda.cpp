// cuda.cpp — the CUDA (and ROCm) torch's device functions (backends/cuda.h) and the CUDA key's registrations of
// every family with GPU kernels (register_cuda.cpp), instantiated here. Compiled into _C only in a CUDA or ROCm
// build; in a CPU build the GPU compile check syntax-checks it against the CPU wheel's c10/cuda headers
// (cmake/gpu_compile_check.cmake, -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <mutex>

#if defined(ALIGNED_ROCM)
#include <c10/hip/HIPStream.h>
#else
#include <c10/cuda/CUDAStream.h>
#endif

#include "../glue/attention.h"
#include "../glue/dense.h"
#include "../glue/exact.h"
#include "../glue/hooks.h"
#include "../glue/linear.h"
#include "../glue/linear_mma.h"
#include "../glue/logits.h"
#include "../glue/moe.h"
#include "../registration_impl.h"
#include "cuda.h"
#include "gpu.h"

namespace aligned::glue {

void* CudaDevice::stream(const at::Tensor& first) {
#if defined(ALIGNED_ROCM)
  return (void*)c10::hip::getCurrentHIPStream(first.device().index()).stream();
#else
  return (void*)c10::cuda::getCurrentCUDAStream(first.device().index()).stream();
#endif
}

int32_t* CudaDevice::error_flags(const at::Tensor& first) {
  static std::mutex mu;
  static at::Tensor* flags[64] = {};
  const int idx = first.device().index();
  TORCH_CHECK(idx >= 0 && idx < 64, "aligned: device index ", idx, " out of range for the error flags");
  std::lock_guard<std::mutex> lock(mu);
  if (!flags[idx]) flags[idx] = new at::Tensor(at::zeros({gpu::kNumDeviceErrors}, first.options().dtype(at::kInt)));
  return flags[idx]->data_ptr<int32_t>();
}

at::Tensor CudaDevice::error_flags_tensor(const at::Tensor& first) {
  return at::from_blob(error_flags(first), {gpu::kNumDeviceErrors}, first.options().dtype(at::kInt));
}

// ---- the CUDA key's registrations (register_cuda.cpp) -------------------------------------------------------
template void register_family<Dense, Cuda>(torch::Library&);
template void register_family<Logits, Cuda>(torch::Library&);
template void register_family<Linear, Cuda>(torch::Library&);
template void register_family<LinearMma, Cuda>(torch::Library&);
template void register_family<LinearMmaReference, Cuda>(torch::Library&);
template void register_family<Hooks, Cuda>(torch::Library&);
template void register_family<ExactLinear, Cuda>(torch::Library&);
template void register_family<Attention, Cuda>(torch::Library&);
template void register_family<Moe, Cuda>(torch::Library&);
template void register_family<AttentionMmaReference, Cuda>(torch::Library&);

}  // namespace aligned::glue
