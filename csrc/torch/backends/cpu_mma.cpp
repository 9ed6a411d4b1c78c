// cpu_mma.cpp — the CPU backend's runs of the `mma` linear family (glue/linear_mma.h): the unit's GEMM
// (AVX512-BF16 vdpbf16ps, csrc/cpu/gemm_mma_kernels.cpp, compiled once for the one level that has it) spread
// over threads by gemm_tiles.h, and mma.h's scalar model of the unit (the conformance reference). Also the CPU
// key's registration of the family (register_cpu.cpp) and the _cpu_mma_unit query.
//
// The unit is not an ISA level (csrc/cpu/cpu_backend.h): cpu_backend().mma is nullptr on a CPU without
// avx512_bf16 or under ALIGNED_CPU_ISA=generic / avx2, and every op of the family except the reference refuses
// by its own name there — the one-line refusal the Python profile (aligned_ops.profiles.MMA) also gives at
// start-up.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>

#include "../../common/mma.h"
#include "../../cpu/cpu_backend.h"
#include "../../cpu/gemm_tiles.h"
#include "../glue/linear_mma.h"
#include "../registration_impl.h"
#include "cpu.h"
#include "emulated.h"
#include "gpu.h"

namespace aligned::glue {

void Cpu::mma_gemm(const Call& call, const GemmParams& p) {
  const cpu::CpuBackend& b = cpu::cpu_backend();
  TORCH_CHECK(b.mma != nullptr, "aligned::", call.op, ": mma needs avx512_bf16; use ALIGNED_OPS_LINEAR=fma (this CPU ",
              "backend runs the '", b.level, "' level without the bf16 dot-product unit)");
  TORCH_CHECK(p.B_packed == nullptr || b.mma->pack_weight != nullptr, "aligned::", call.op, ": packed weights ",
              "are the amx_bf16 unit's; this process's mma unit is ", b.mma->unit, " (call linear_mma)");
  TORCH_CHECK(p.B_packed == nullptr || emu::active_arch() == nullptr, "aligned::", call.op, ": packed weights are ",
              "the CPU amx_bf16 unit's, not an emulated GPU's (call linear_mma under aligned_ops.emulate)");
  if (!b.mma->row_major_b || p.K <= 1 || p.b_sk == 1) return cpu::run_gemm_tiles(p, b.mma->gemm);
  // The AMX kernel reads B's rows as tiles (unit k-stride): a column-major B (the backward's w and x, read in
  // place by the vdpbf16ps kernel) is copied row-major once, so dx and dw run the forward's chain unchanged.
  const at::Tensor rows =
      at::from_blob(const_cast<void*>(p.B), {p.N, p.K}, {p.b_sn, p.b_sk}, at::TensorOptions().dtype(at::kBFloat16))
          .contiguous();
  const auto* dst = (const uint16_t*)rows.data_ptr();
  GemmParams q = p;
  q.B = dst;
  q.b_sn = p.K;
  q.b_sk = 1;
  cpu::run_gemm_tiles(q, b.mma->gemm);
}

void Cpu::mma_pack_weight(const Call& call, const at::Tensor& w, at::Tensor& out) {
  const cpu::MmaKernels* k = cpu::cpu_backend().mma;
  TORCH_CHECK(k != nullptr && k->pack_weight != nullptr, "aligned::", call.op, ": packs weights for the amx_bf16 ",
              "unit; this process's mma unit is ", k ? k->unit : "none", " (call linear_mma, which reads the weight ",
              "in place)");
  TORCH_CHECK(emu::active_arch() == nullptr, "aligned::", call.op, ": packs weights for the CPU amx_bf16 unit, not ",
              "an emulated GPU's (call linear_mma under aligned_ops.emulate)");
  const int64_t N = w.size(0), K = w.size(1);
  if (out.numel() == 0) return;
  cpu::ieee_parallel_for(0, (N + 15) / 16, 16, [&](int64_t b, int64_t e) {
    k->pack_weight((const uint16_t*)w.data_ptr(), w.stride(0), N, K, b, e, out.data_ptr());
  });
}

// The unit's plain form (mma_kernels.h reference): mma.h's scalar model on avx512_bf16 and on a CPU without the
// unit (the model needs none), the instruction on 1 x 1 tiles on amx_bf16.
void Cpu::linear_mma_reference(const Call&, const GemmParams& p) {
  const cpu::MmaKernels* k = cpu::cpu_backend().mma;
  const auto* xp = (const bf16_t*)p.A;
  const auto* wp = (const bf16_t*)p.B;
  float* o = (float*)p.C;
  cpu::ieee_parallel_for(0, p.M, 1, [&](int64_t b, int64_t e) {
    if (k != nullptr) return k->reference(p, b, e);
    for (int64_t m = b; m < e; ++m)
      for (int64_t n = 0; n < p.N; ++n)
        o[m * p.N + n] = linear_mma_partial_dot(xp + m * p.a_sm, p.a_sk, wp + n * p.b_sn, p.b_sk, p.K, p.lanes);
  });
}

// ---- the CPU key's registrations of the families (register_cpu.cpp) -----------------------------------------
template void register_family<LinearMma, Cpu, EmulatedCuda, EmulatedHip>(torch::Library&);
template void register_family<LinearMmaPacked, Cpu>(torch::Library&);
template void register_family<LinearMmaReference, Cpu, EmulatedCuda, EmulatedHip>(torch::Library&);

}  // namespace aligned::glue

// The CPU's mma unit ("avx512_bf16"), or "" where it has none: how Python refuses the profile at start-up
// (aligned_ops.mma_unit) before any layer runs. No tensor arguments: a catch-all kernel.
TORCH_LIBRARY_IMPL(aligned, CatchAll, m) {
  m.impl("_cpu_mma_unit", +[]() -> std::string {
    const aligned::cpu::MmaKernels* k = aligned::cpu::cpu_backend().mma;
    return k ? k->unit : "";
  });
}
