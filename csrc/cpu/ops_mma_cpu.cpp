// ops_mma_cpu.cpp — torch glue of the `mma` linear profile on the CPU (csrc/common/mma.h): device checks, the
// shared argument checks (../op_checks.h: bf16 only), output allocation, the params struct (../op_params.h) and
// the tile split (gemm_tiles.h) over the unit's kernel (mma_kernels.h, vdpbf16ps). No arithmetic here.
// Laid out as linear / linear_partial / linear_backward are in ops_cpu.cpp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>

#include "../common/mma.h"
#include "../op_params.h"
#include "cpu_backend.h"
#include "emulation_hook.h"
#include "gemm_tiles.h"
#include "glue_checks.h"

namespace aligned::cpu {

namespace {

// The unit's kernels, or the one-line refusal (a CPU without avx512_bf16, or a process forced to a level below
// AVX-512 with ALIGNED_CPU_ISA).
const MmaKernels& mma_unit(const char* op) {
  const CpuBackend& b = cpu_backend();
  TORCH_CHECK(b.mma != nullptr, "aligned::", op, ": mma needs avx512_bf16; use ALIGNED_OPS_LINEAR=fma (this CPU ",
              "backend runs the '", b.level, "' level without the bf16 dot-product unit)");
  return *b.mma;
}

void check_operands(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                    const char* op) {
  check_cpu(x, op, "x");
  check_cpu(weight, op, "weight");
  if (bias.has_value() && bias->defined()) check_cpu(*bias, op, "bias");
}

// The kernel reads pairs along contiguous rows: the weight's rows must have unit stride (a copy otherwise).
at::Tensor row_major(const at::Tensor& w) { return w.stride(1) == 1 ? w : w.contiguous(); }

at::Tensor linear_mma(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const char* op = "linear_mma";
  check_operands(x, weight, bias, op);
  const auto a = check_linear_mma<DType>(x, weight, bias);
  const auto& unit = mma_unit(op);
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto wc = row_major(weight);
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  auto out = at::empty({a.M, a.N}, x.options());
  run_gemm_tiles(make_linear_params(a, xc, wc, out, a.dt, kLinearLanes), unit.gemm);
  return out.view(sizes);
}

// linear_mma_partial: the sub-tree over `lanes` lanes of the local K, fp32, no bias (mma.h; TP row-parallel).
at::Tensor linear_mma_partial(const at::Tensor& x, const at::Tensor& weight, int64_t lanes) {
  const char* op = "linear_mma_partial";
  check_operands(x, weight, std::nullopt, op);
  const auto a = check_linear_mma_partial<DType>(x, weight, lanes);
  const auto& unit = mma_unit(op);
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto wc = row_major(weight);
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  auto out = at::empty({a.M, a.N}, x.options().dtype(at::kFloat));
  run_gemm_tiles(make_linear_params(a, xc, wc, out, DType::F32, (int)lanes), unit.gemm);
  return out.view(sizes);
}

// dx and dw on the unit (the profile's linear over N and over the M tokens), db the fp32 column chains (mma.h).
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_mma_backward(const at::Tensor& grad, const at::Tensor& x,
                                                                   const at::Tensor& weight, bool needs_x,
                                                                   bool needs_w, bool needs_b) {
  const char* op = "linear_mma_backward";
  check_cpu(grad, op, "grad_out");
  check_operands(x, weight, std::nullopt, op);
  const auto a = check_linear_mma_backward<DType>(grad, x, weight);
  const auto& unit = mma_unit(op);
  const int64_t M = a.M, K = a.K, N = a.N;
  auto g = grad.reshape({M, N}).contiguous();
  at::Tensor dx, dw, db;
  if (needs_x) {
    dx = at::empty({M, K}, x.options());
    run_gemm_tiles(make_linear_mma_dx_params(a, g, weight.contiguous(), dx), unit.gemm);
    dx = dx.view(x.sizes());
  }
  if (needs_w) {
    dw = at::empty({N, K}, weight.options());
    run_gemm_tiles(make_linear_mma_dw_params(a, g.t().contiguous(), x.reshape({M, K}).contiguous(), dw), unit.gemm);
  }
  if (needs_b) {
    db = at::empty({N}, x.options());
    const auto p = make_column_sum_params(a, g, db);
    const auto& k = cpu_kernels();
    at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) { k.column_sum(p, b, e); });
  }
  return {dx, dw, db};
}

// _linear_mma_reference: mma.h's scalar model of the CPU unit (linear_mma_partial_dot), one call per output — the
// conformance reference every kernel path is held to (llm.c style). Needs no unit: it runs on any CPU. Slow.
at::Tensor linear_mma_reference(const at::Tensor& x, const at::Tensor& weight, int64_t lanes) {
  const char* op = "_linear_mma_reference";
  check_operands(x, weight, std::nullopt, op);
  const auto a = check_linear_mma_partial<DType>(x, weight, lanes, op);
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty({a.M, a.N}, x.options().dtype(at::kFloat));
  const auto* xp = (const bf16_t*)xc.data_ptr();
  const auto* wp = (const bf16_t*)wc.data_ptr();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, a.M, 1, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      for (int64_t n = 0; n < a.N; ++n)
        o[m * a.N + n] = linear_mma_partial_dot(xp + m * a.K, 1, wp + n * a.K, 1, a.K, (int)lanes);
  });
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  return out.view(sizes);
}

}  // namespace

// The CPU's mma unit ("avx512_bf16"), or "" where it has none: how Python refuses the profile at start-up
// (aligned_ops.mma_unit) before any layer runs. No tensor arguments: a catch-all kernel.
std::string cpu_mma_unit() {
  const MmaKernels* k = cpu_backend().mma;
  return k ? k->unit : "";
}

TORCH_LIBRARY_IMPL(aligned, CatchAll, m) { m.impl("_cpu_mma_unit", &cpu_mma_unit); }

TORCH_LIBRARY_IMPL(aligned, CPU, lib) {
  EmulationAwareLibrary m(lib);  // a GPU mma glue registered in ops_cuda.cpp would take over under emulate(arch)
  m.impl("linear_mma", &linear_mma);
  m.impl("linear_mma_partial", &linear_mma_partial);
  m.impl("linear_mma_backward", &linear_mma_backward);
  m.impl("_linear_mma_reference", &linear_mma_reference);
}

}  // namespace aligned::cpu
