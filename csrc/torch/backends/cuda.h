// backends/cuda.h — a CUDA or ROCm torch's GPU as a Device of Gpu<Device> (backends/gpu.h). ROCm torch registers
// HIP kernels under the CUDA dispatch key and reports HIP devices as device type "cuda", so one Device serves
// both; only the stream accessor differs (ALIGNED_ROCM, set by CMakeLists.txt for a ROCm torch), and it lives in
// cuda.cpp, so this header needs no vendor header: the glue compiles (and is syntax-checked, cmake/
// gpu_compile_check.cmake) against the CPU torch wheel too.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <string.h>

#include "../../gpu/launchers.h"
#include "../families.h"
#include "../run_args.h"

namespace aligned::glue {

struct CudaDevice {
  static bool selected() { return true; }  // the CUDA key's only backend
  // t must live on the same GPU device as the op's first tensor (itself a GPU tensor).
  static void check_device(const at::Tensor& t, const at::Tensor& first, const char* op, const char* name) {
    TORCH_CHECK(t.device().is_cuda(), "aligned::", op, ": ", name, " must be a CUDA tensor, got ", t.device());
    TORCH_CHECK(t.device() == first.device(), "aligned::", op, ": ", name, " is on ", t.device(),
                " but the inputs are on ", first.device(), " (all tensors must be on the same device)");
  }
  struct Guard {
    explicit Guard(const at::Tensor& first) : guard(first.device()) {}
    c10::DeviceGuard guard;
  };
  // The current stream of first's device, as the launchers' opaque pointer (cuda.cpp).
  static void* stream(const at::Tensor& first);
  // The per-device error words of the in-kernel value checks (dense_api.h DeviceError), allocated once per
  // device on first use (zeros: an async memset, no sync) and never freed (cuda.cpp).
  static int32_t* error_flags(const at::Tensor& first);
  static at::Tensor error_flags_tensor(const at::Tensor& first);
  // A host buffer on first's device: one asynchronous copy from pinned memory (the caching host allocator keeps the
  // pinned block alive until the copy has run).
  static at::Tensor upload(const void* data, int64_t n, at::ScalarType st, const at::Tensor& first) {
    const int64_t bytes = n * (int64_t)c10::elementSize(st);
    auto h = at::empty({n}, at::TensorOptions().dtype(st).pinned_memory(true));
    if (n > 0) memcpy(h.data_ptr(), data, (size_t)bytes);
    return h.to(first.device(), st, /*non_blocking=*/true);
  }
  // n host values into dst's elements [offset, offset + n): one stream-ordered copy from pinned memory.
  template <class E>
  static void copy_into(const at::Tensor& dst, int64_t offset, const E* src, int64_t n) {
    if (n == 0) return;
    auto slice = dst.view({-1}).narrow(0, offset, n);
    auto h = at::empty({n}, at::TensorOptions().dtype(slice.scalar_type()).pinned_memory(true));
    memcpy(h.data_ptr(), src, (size_t)n * sizeof(E));
    slice.copy_(h, /*non_blocking=*/true);
  }
  static const gpu::DenseLaunchers& dense() { return gpu::device::kDenseLaunchers; }
  static const gpu::AttentionLaunchers& attention() { return gpu::device::kAttentionLaunchers; }
  static const gpu::ExactLaunchers& exact() { return gpu::device::kExactLaunchers; }
  static const gpu::MmaLaunchers& mma() { return gpu::device::kMmaLaunchers; }
  static const gpu::MoeLaunchers& moe() { return gpu::device::kMoeLaunchers; }
  // _linear_mma_reference: the unit's arithmetic model exists only in the emulator (csrc/emu/bf16_mma_models.h);
  // on the device the op refuses (tests/cuda/test_cuda_linear_mma.py compares the device with that model).
  static void mma_reference(const char* op, const GemmParams&) {
    TORCH_CHECK(false, "aligned::", op, ": the GPU's matrix unit has no scalar model on the device; call it on CPU "
                "tensors under aligned_ops.emulate(arch) (the emulator's model of that arch's unit)");
  }
  static void attention_mma_reference(const char* op, const AttnProblem&, const int32_t*, const int32_t*, int64_t,
                                      void*, float*) {
    mma_reference(op, GemmParams{});
  }
  static void attention_mma_backward_reference(const char* op, const AttnBackwardRun&, const int32_t*,
                                               const int32_t*, int64_t) {
    mma_reference(op, GemmParams{});
  }
};

}  // namespace aligned::glue
