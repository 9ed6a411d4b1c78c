// glue/linear_mma.h — the `mma` linear family's glue bodies (csrc/common/mma.h: the matrix unit's bf16
// instruction in the `fma` profile's 8 lanes and tree, + bias once, one rounding): linear_mma,
// linear_mma_partial, linear_mma_backward (family LinearMma), and the scalar model of the unit the kernels are
// held to, _linear_mma_reference (family LinearMmaReference: a test hook). The four steps: glue/dense.h.
//
// The backend supplies mma_gemm(call, params) — its unit's GEMM over its own tiling (which never changes a bit:
// every output is one lane tree over all of K), refusing by the op's name where the machine has no unit —,
// column_sum (db: the fp32 column chains, as linear_backward's) and linear_mma_reference.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "../checks/linear.h"
#include "../make_params.h"
#include "../registration.h"

namespace aligned::glue {

namespace mma_detail {
// The unit's kernels read pairs along contiguous rows of A and B: a weight whose rows do not have unit stride
// is copied (a view with unit k-stride is read in place).
inline at::Tensor row_major(const at::Tensor& w) { return w.stride(1) == 1 ? w : w.contiguous(); }
}  // namespace mma_detail

template <class B>
at::Tensor linear_mma(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const typename B::Call call("linear_mma", x, "x");
  call.on_device(weight, "weight");
  call.on_device(bias, "bias");
  const auto a = check_linear_mma<DType>(x, weight, bias);
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto wc = mma_detail::row_major(weight);
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  auto out = at::empty({a.M, a.N}, x.options());
  B::mma_gemm(call, make_linear_params(a, xc, wc, out, a.dt, kLinearLanes));
  return out.view(sizes);
}

// linear_mma_partial: the sub-tree over `lanes` lanes of the local K, fp32, no bias (mma.h; TP row-parallel,
// finished by aligned_ops.tree_all_reduce as linear_partial is).
template <class B>
at::Tensor linear_mma_partial(const at::Tensor& x, const at::Tensor& weight, int64_t lanes) {
  const typename B::Call call("linear_mma_partial", x, "x");
  call.on_device(weight, "weight");
  const auto a = check_linear_mma_partial<DType>(x, weight, lanes);
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto wc = mma_detail::row_major(weight);
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  auto out = at::empty({a.M, a.N}, x.options().dtype(at::kFloat));
  B::mma_gemm(call, make_linear_params(a, xc, wc, out, DType::F32, (int)lanes));
  return out.view(sizes);
}

// dx and dw on the unit (the profile's 8-lane linear over N, and over the M tokens in order), db the fp32 column
// chains (mma.h). w and x are read in place as column-major B operands; g^T is one contiguous copy (A is read
// along its rows).
template <class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_mma_backward(const at::Tensor& grad, const at::Tensor& x,
                                                                   const at::Tensor& weight, bool needs_x,
                                                                   bool needs_w, bool needs_b) {
  const typename B::Call call("linear_mma_backward", grad, "grad_out");
  call.on_device(x, "x");
  call.on_device(weight, "weight");
  const auto a = check_linear_mma_backward<DType>(grad, x, weight);
  const int64_t M = a.M, K = a.K, N = a.N;
  auto g = grad.reshape({M, N}).contiguous();
  at::Tensor dx, dw, db;
  if (needs_x) {
    dx = at::empty({M, K}, x.options());
    B::mma_gemm(call, make_linear_mma_dx_params(a, g, weight.contiguous(), dx));
    dx = dx.view(x.sizes());
  }
  if (needs_w) {
    dw = at::empty({N, K}, weight.options());
    B::mma_gemm(call, make_linear_mma_dw_params(a, g.t().contiguous(), x.reshape({M, K}).contiguous(), dw));
  }
  if (needs_b) {
    db = at::empty({N}, x.options());
    B::column_sum(call, make_column_sum_params(a, g, db));
  }
  return {dx, dw, db};
}

// _linear_mma_reference: mma.h's scalar model of the unit (linear_mma_partial_dot), one call per output — the
// conformance reference every kernel path is held to (llm.c style). Needs no unit: it runs on any CPU. Slow.
template <class B>
at::Tensor linear_mma_reference(const at::Tensor& x, const at::Tensor& weight, int64_t lanes) {
  const typename B::Call call("_linear_mma_reference", x, "x");
  call.on_device(weight, "weight");
  const auto a = check_linear_mma_partial<DType>(x, weight, lanes, "_linear_mma_reference");
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty({a.M, a.N}, x.options().dtype(at::kFloat));
  B::linear_mma_reference(call, make_linear_params(a, xc, wc, out, DType::F32, (int)lanes));
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  return out.view(sizes);
}

struct LinearMma {
  template <class B>
  static constexpr std::tuple ops{
      Op{"linear_mma", &linear_mma<B>},
      Op{"linear_mma_partial", &linear_mma_partial<B>},
      Op{"linear_mma_backward", &linear_mma_backward<B>},
  };
};

struct LinearMmaReference {
  template <class B>
  static constexpr std::tuple ops{Op{"_linear_mma_reference", &linear_mma_reference<B>}};
};

}  // namespace aligned::glue
