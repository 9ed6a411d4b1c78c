// checks/linear.h — argument checks of the linear families, one per op for every profile: `fma` (linear,
// linear_partial, linear_backward) and `mma` (linear_mma, linear_mma_partial, linear_mma_backward: the same
// shapes, bfloat16 only — LinearDtypes::kBf16Only).
// Written once for every backend (checks/common.h says how the checks are used).
#pragma once

#include "common.h"

namespace aligned {

// What the linear profiles' checks differ in: the dtypes their units take. The `mma` profile's units
// (csrc/common/mma.h) take bf16 pairs; a float32 / float16 input would need a second rounding the model never
// made, so it is refused by name rather than converted.
enum class LinearDtypes { kAny, kBf16Only };

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

inline void check_profile_dtype(const at::Tensor& t, LinearDtypes dtypes, const char* op, const char* name) {
  if (dtypes != LinearDtypes::kBf16Only) return;
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, "aligned::", op, ": ", name,
              " must be bfloat16 (the mma profile's matrix units take bf16; float32 / float16 models run "
              "ALIGNED_OPS_LINEAR=fma), got ", t.scalar_type());
}

}  // namespace detail

template <class DTypeEnum>
LinearArgs<DTypeEnum> check_linear(const at::Tensor& x, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, const char* op = "linear",
                                   LinearDtypes dtypes = LinearDtypes::kAny) {
  const bool has_bias = bias.has_value() && bias->defined();
  detail::check_profile_dtype(x, dtypes, op, "x");
  detail::check_profile_dtype(weight, dtypes, op, "weight");
  if (has_bias) detail::check_profile_dtype(*bias, dtypes, op, "bias");
  const DTypeEnum dt = dtype_of<DTypeEnum>(x, op, "x");
  dtype_of<DTypeEnum>(weight, op, "weight");
  auto a = detail::check_linear_weight(x, weight, dt, op);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "aligned::", op, ": weight dtype ", weight.scalar_type(),
              " must equal x dtype ", x.scalar_type());
  TORCH_CHECK(weight.size(1) == a.K, "aligned::", op, ": x has ", a.K, " input features but weight is ",
              weight.sizes());
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == a.N && bias->scalar_type() == x.scalar_type(),
                "aligned::", op, ": bias must be [", a.N, "] with x's dtype, got ", bias->sizes(), " ",
                bias->scalar_type());
    a.bias = bias->contiguous();
  }
  return a;
}

// linear_partial (and the scalar references): x, weight as for linear (no bias); lanes ∈ {1, 2, 4, 8} (whole
// lanes of the profiles' 8-lane tree, contract.h).
template <class DTypeEnum>
LinearArgs<DTypeEnum> check_linear_partial(const at::Tensor& x, const at::Tensor& weight, int64_t lanes,
                                           const char* op = "linear_partial",
                                           LinearDtypes dtypes = LinearDtypes::kAny) {
  TORCH_CHECK(lanes == 1 || lanes == 2 || lanes == 4 || lanes == 8, "aligned::", op,
              ": lanes must be 1, 2, 4 or 8 (whole lanes of the 8-lane tree), got ", lanes);
  return check_linear<DTypeEnum>(x, weight, std::nullopt, op, dtypes);
}

template <class DTypeEnum>
LinearArgs<DTypeEnum> check_linear_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                            const char* op = "linear_backward",
                                            LinearDtypes dtypes = LinearDtypes::kAny) {
  detail::check_profile_dtype(grad, dtypes, op, "grad_out");
  detail::check_profile_dtype(x, dtypes, op, "x");
  detail::check_profile_dtype(weight, dtypes, op, "weight");
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

}  // namespace aligned
