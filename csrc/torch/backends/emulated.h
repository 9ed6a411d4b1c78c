// backends/emulated.h — the emulation target as a Device of Gpu<Device> (backends/gpu.h): the csrc/gpu source
// compiled for the host in one vendor spelling (csrc/emu/model_cuda.h: 32-lane warps; model_hip.h: wave64) and
// run by the SIMT runtime (csrc/emu), on CPU tensors. EmulatedCuda / EmulatedHip (families.h) stand in for the
// Cpu backend on the CPU dispatch key while aligned_ops.emulate(arch) selects their vendor (register_cpu.cpp), so
// an op runs the GPU glue body — the same checks, params and launchers as on a GPU — on CPU tensors.
//
// What differs from a real device: tensors are CPU tensors, launches are synchronous (no stream), an "upload" is
// a memcpy that is recorded beside the launches (emulation.h record_host_copy: the proof that a run form of
// attention copies nothing), and the error words of the in-kernel value checks are one host buffer per vendor.
#pragma once

#include <ATen/ATen.h>
#include <string.h>

#include "../../cpu/ieee_env.h"
#include "../../emu/emulation.h"
#include "../../gpu/launchers.h"
#include "../families.h"
#include "../run_args.h"

namespace aligned::glue {

template <emu::Vendor V>
struct EmulatedDevice {
  static bool selected() {
    const emu::Arch* arch = emu::active_arch();
    return arch != nullptr && arch->vendor == V;
  }
  static void check_device(const at::Tensor& t, const at::Tensor& first, const char* op, const char* name) {
    (void)first;
    TORCH_CHECK(t.device().is_cpu(), "aligned::", op, ": ", name,
                " must be a CPU tensor under aligned_ops.emulate, got device ", t.device());
  }
  // The emulated kernels pin their own FP environment (the runtime's run_blocks); the glue's host arithmetic and the
  // scalar references (_linear_mma_reference, _attention_mma_reference, ...) run on the calling thread: under the
  // CPU's IEEE environment too, so a caller's FTZ / DAZ changes no bit the kernels are held to (csrc/cpu/ieee_env.h).
  struct Guard {
    explicit Guard(const at::Tensor&) {}
    cpu::IeeeFpEnv fenv;
  };
  static void* stream(const at::Tensor&) { return nullptr; }  // emulated launches are synchronous

  // The persistent error words (dense_api.h DeviceError) of this vendor's emulated kernels (emulated.cpp).
  static int32_t* error_flags(const at::Tensor& first);
  static at::Tensor error_flags_tensor(const at::Tensor& first);

  // The host buffer is the device buffer: a recorded memcpy.
  static at::Tensor upload(const void* data, int64_t n, at::ScalarType st, const at::Tensor& first) {
    (void)first;
    const int64_t bytes = n * (int64_t)c10::elementSize(st);
    emu::record_host_copy((size_t)bytes);
    auto h = at::empty({n}, at::TensorOptions().dtype(st));
    if (n > 0) memcpy(h.data_ptr(), data, (size_t)bytes);
    return h;
  }
  template <class E>
  static void copy_into(const at::Tensor& dst, int64_t offset, const E* src, int64_t n) {
    if (n == 0) return;
    emu::record_host_copy((size_t)n * sizeof(E));
    memcpy(dst.view({-1}).narrow(0, offset, n).data_ptr(), src, (size_t)n * sizeof(E));
  }

  static const gpu::DenseLaunchers& dense() {
    if constexpr (V == emu::Vendor::kHip) return gpu::emulated_hip::kDenseLaunchers;
    else return gpu::emulated_cuda::kDenseLaunchers;
  }
  static const gpu::AttentionLaunchers& attention() {
    if constexpr (V == emu::Vendor::kHip) return gpu::emulated_hip::kAttentionLaunchers;
    else return gpu::emulated_cuda::kAttentionLaunchers;
  }
  static const gpu::ExactLaunchers& exact() {
    if constexpr (V == emu::Vendor::kHip) return gpu::emulated_hip::kExactLaunchers;
    else return gpu::emulated_cuda::kExactLaunchers;
  }
  static const gpu::MmaLaunchers& mma() {
    if constexpr (V == emu::Vendor::kHip) return gpu::emulated_hip::kMmaLaunchers;
    else return gpu::emulated_cuda::kMmaLaunchers;
  }
  static const gpu::MoeLaunchers& moe() {
    if constexpr (V == emu::Vendor::kHip) return gpu::emulated_hip::kMoeLaunchers;
    else return gpu::emulated_cuda::kMoeLaunchers;
  }
  // _linear_mma_reference under emulation: mma.h's mma_block_chain with the active arch's bf16 unit under the
  // scope's model (csrc/emu/bf16_mma_models.h), one output at a time on the host — what the kernels are held to
  // (emulated.cpp).
  static void mma_reference(const char* op, const GemmParams& p);
  // _attention_mma_reference under emulation: attention_mma.h's attn_mma_row_reference per (row, head) of a
  // packed varlen batch with the same unit model (emulated.cpp).
  static void attention_mma_reference(const char* op, const AttnProblem& problem, const int32_t* cu_q,
                                      const int32_t* cu_k, int64_t n_seqs, void* out, float* lse);
  static void attention_mma_backward_reference(const char* op, const AttnBackwardRun& r, const int32_t* cu_q,
                                               const int32_t* cu_k, int64_t n_seqs);
};

}  // namespace aligned::glue
