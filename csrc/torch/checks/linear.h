// checks/linear.h — argument checks of the linear families: `fma` (linear, linear_partial, linear_backward) and
// `mma` (linear_mma, linear_mma_partial, linear_mma_backward: the same shapes, bfloat16 only).
// Written once for every backend (checks/common.h says how the checks are used).
#pragma once

#include "common.h"

namespace aligned {

// ---- linear, linear_backward: x [..., K] (M rows), weight [N, K], one dtype ------------------------------
template <class DTypeEnum>
struct LinearArgs {
  DTypeEnum dt;         // x, weight (and bias, grad_out) dtype
  int64_t M, K, N;
  at::Tensor bias;      // linear only: undefined, or [N] contiguous
};

namespace detail {

template <class DTypeEnum>
LinearArgs<DTypeEnum> check_linear_weight(const at::Tensor& x, const at::Tensor& weight, DTypeEnum dt,
                                          const char* op) {
  TORCH_CHECK(x.dim() >= 1, "aligned::", op, ": x must have at least one dimension");
  TORCH_CHECK(weight.dim() == 2, "aligned::", op, ": weight must be [out_features, in_features], got ",
              weight.sizes());
  LinearArgs<DTypeEnum> a;
  a.dt = dt;
  a.K = x.size(-1);
  a.N = weight.size(0);
  a.M = c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);  // from the leading dims: K may be 0
  return a;
}

}  // namespace detail

template <class DTypeEnum>
LinearArgs<DTypeEnum> check_linear(const at::Tensor& x, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, const char* op = "linear") {
  const DTypeEnum dt = dtype_of<DTypeEnum>(x, op, "x");
  dtype_of<DTypeEnum>(weight, op, "weight");
  auto a = detail::check_linear_weight(x, weight, dt, op);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "aligned::", op, ": weight dtype ", weight.scalar_type(),
              " must equal x dtype ", x.scalar_type());
  TORCH_CHECK(weight.size(1) == a.K, "aligned::", op, ": x has ", a.K, " input features but weight is ",
              weight.sizes());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == a.N && bias->scalar_type() == x.scalar_type(),
                "aligned::", op, ": bias must be [", a.N, "] with x's dtype, got ", bias->sizes(), " ",
                bias->scalar_type());
    a.bias = bias->contiguous();
  }
  return a;
}

// linear_partial: x, weight as for linear (no bias); lanes ∈ {1, 2, 4, 8} (contract.h, `fma` profile).
template <class DTypeEnum>
LinearArgs<DTypeEnum> check_linear_partial(const at::Tensor& x, const at::Tensor& weight, int64_t lanes) {
  TORCH_CHECK(lanes == 1 || lanes == 2 || lanes == 4 || lanes == 8,
              "aligned::linear_partial: lanes must be 1, 2, 4 or 8 (whole lanes of the 8-lane tree), got ", lanes);
  return check_linear<DTypeEnum>(x, weight, std::nullopt, "linear_partial");
}

template <class DTypeEnum>
LinearArgs<DTypeEnum> check_linear_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                            const char* op = "linear_backward") {
  const DTypeEnum dt = dtype_of<DTypeEnum>(x, op, "x");
  dtype_of<DTypeEnum>(weight, op, "weight");
  dtype_of<DTypeEnum>(grad, op, "grad_out");
  auto a = detail::check_linear_weight(x, weight, dt, op);
  TORCH_CHECK(weight.size(1) == a.K, "aligned::", op, ": x has ", a.K, " input features but weight is ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && grad.scalar_type() == x.scalar_type(),
              "aligned::", op, ": grad_out, x and weight must share one dtype, got ", grad.scalar_type(), ", ",
              x.scalar_type(), ", ", weight.scalar_type());
  auto want = x.sizes().vec();
  want.back() = a.N;
  TORCH_CHECK(grad.sizes() == at::IntArrayRef(want), "aligned::", op, ": grad_out must have shape ",
              at::IntArrayRef(want), ", got ", grad.sizes());
  return a;
}

// ---- linear_mma (the `mma` profile, csrc/common/mma.h): bfloat16 only ------------------------------------------
// The units take bf16 pairs; a float32 / float16 input would need a second rounding the model never made, so it
// is refused by name rather than converted.
namespace detail {
inline void check_mma_bf16(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, "aligned::", op, ": ", name,
              " must be bfloat16 (the mma profile's matrix units take bf16; float32 / float16 models run "
              "ALIGNED_OPS_LINEAR=fma), got ", t.scalar_type());
}
}  // namespace detail

template <class DTypeEnum>
LinearArgs<DTypeEnum> check_linear_mma(const at::Tensor& x, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias, const char* op = "linear_mma") {
  detail::check_mma_bf16(x, op, "x");
  detail::check_mma_bf16(weight, op, "weight");
  if (bias.has_value() && bias->defined()) detail::check_mma_bf16(*bias, op, "bias");
  return check_linear<DTypeEnum>(x, weight, bias, op);
}

// linear_mma_partial (and _linear_mma_reference): as linear_mma without bias; lanes ∈ {1, 2, 4, 8}.
template <class DTypeEnum>
LinearArgs<DTypeEnum> check_linear_mma_partial(const at::Tensor& x, const at::Tensor& weight, int64_t lanes,
                                               const char* op = "linear_mma_partial") {
  TORCH_CHECK(lanes == 1 || lanes == 2 || lanes == 4 || lanes == 8, "aligned::", op,
              ": lanes must be 1, 2, 4 or 8 (whole lanes of the 8-lane tree), got ", lanes);
  return check_linear_mma<DTypeEnum>(x, weight, std::nullopt, op);
}

template <class DTypeEnum>
LinearArgs<DTypeEnum> check_linear_mma_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight) {
  const char* op = "linear_mma_backward";
  detail::check_mma_bf16(grad, op, "grad_out");
  detail::check_mma_bf16(x, op, "x");
  detail::check_mma_bf16(weight, op, "weight");
  return check_linear_backward<DTypeEnum>(grad, x, weight, op);
}

}  // namespace aligned
