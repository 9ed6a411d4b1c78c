// checks/dense.h — argument checks of the dense family: rms_norm, fused_add_rms_norm, silu_and_mul,
// rotary_embedding (+ backwards), and the elementwise test hooks (_exp_f32, _log_f32).
// Written once for every backend (checks/common.h says how the checks are used).
#pragma once

#include "common.h"

namespace aligned {

// ---- rms_norm, fused_add_rms_norm, rms_norm_backward ---------------------------------------------------
template <class DTypeEnum>
struct NormArgs {
  DTypeEnum dt, wdt;  // x dtype; weight dtype (== dt or F32)
  int64_t H, rows;    // x viewed as [rows, H]
};

namespace detail {

template <class DTypeEnum>
NormArgs<DTypeEnum> check_norm_weight(const at::Tensor& x, const at::Tensor& weight, DTypeEnum dt, DTypeEnum wdt,
                                      const char* op) {
  TORCH_CHECK(x.dim() >= 1, "aligned::", op, ": x must have at least one dimension");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "aligned::", op, ": weight must have shape [", H, "], got ",
              weight.sizes());
  TORCH_CHECK(wdt == dt || wdt == DTypeEnum::F32, "aligned::", op, ": weight dtype must equal x dtype or be float32");
  return {dt, wdt, H, H == 0 ? 0 : x.numel() / H};
}

inline void check_matches_x(const at::Tensor& t, const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == x.scalar_type() && t.sizes() == x.sizes(), "aligned::", op, ": ", name,
              " must match x in shape and dtype, got ", t.sizes(), " ", t.scalar_type(), " vs ", x.sizes(), " ",
              x.scalar_type());
}

// eps is added in fp32 (contract.h rms_inv): it must be >= 0 (a negative or NaN eps turns rows into NaN) and
// finite once rounded to fp32 (1e39 would become inf and every output 0).
inline void check_eps(double eps, const char* op) {
  TORCH_CHECK(eps >= 0 && std::isfinite((float)eps), "aligned::", op,
              ": eps must be >= 0 and finite in float32, got ", eps);
}

}  // namespace detail

template <class DTypeEnum>
NormArgs<DTypeEnum> check_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const char* op = "rms_norm";
  const DTypeEnum dt = dtype_of<DTypeEnum>(x, op, "x"), wdt = dtype_of<DTypeEnum>(weight, op, "weight");
  auto a = detail::check_norm_weight(x, weight, dt, wdt, op);
  detail::check_eps(eps, op);
  return a;
}

template <class DTypeEnum>
NormArgs<DTypeEnum> check_fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                             const at::Tensor& weight, double eps) {
  const char* op = "fused_add_rms_norm";
  const DTypeEnum dt = dtype_of<DTypeEnum>(x, op, "x"), wdt = dtype_of<DTypeEnum>(weight, op, "weight");
  detail::check_matches_x(residual, x, op, "residual");
  auto a = detail::check_norm_weight(x, weight, dt, wdt, op);
  detail::check_eps(eps, op);
  return a;
}

template <class DTypeEnum>
NormArgs<DTypeEnum> check_rms_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                            double eps) {
  const char* op = "rms_norm_backward";
  const DTypeEnum dt = dtype_of<DTypeEnum>(x, op, "x"), wdt = dtype_of<DTypeEnum>(weight, op, "weight");
  detail::check_matches_x(grad, x, op, "grad_out");
  auto a = detail::check_norm_weight(x, weight, dt, wdt, op);
  detail::check_eps(eps, op);
  return a;
}

// ---- silu_and_mul, silu_and_mul_backward ---------------------------------------------------------------
template <class DTypeEnum>
struct SiluMulArgs {
  DTypeEnum dt;
  int64_t d, rows;  // x viewed as [rows, 2*d], the output as [rows, d]
};

template <class DTypeEnum>
SiluMulArgs<DTypeEnum> check_silu_and_mul(const at::Tensor& x, const char* op = "silu_and_mul") {
  const DTypeEnum dt = dtype_of<DTypeEnum>(x, op, "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "aligned::", op, ": last dimension of x must be even (2*d), got ",
              x.sizes());
  const int64_t d = x.size(-1) / 2;
  return {dt, d, d == 0 ? 0 : x.numel() / (2 * d)};
}

template <class DTypeEnum>
SiluMulArgs<DTypeEnum> check_silu_and_mul_backward(const at::Tensor& grad, const at::Tensor& x) {
  const char* op = "silu_and_mul_backward";
  auto a = check_silu_and_mul<DTypeEnum>(x, op);
  auto expected = x.sizes().vec();
  expected.back() = a.d;
  TORCH_CHECK(grad.scalar_type() == x.scalar_type() && grad.sizes() == at::IntArrayRef(expected), "aligned::", op,
              ": grad_out must be x's dtype with half its last dimension, got ", grad.sizes(), " ", grad.scalar_type(),
              " for x ", x.sizes(), " ", x.scalar_type());
  return a;
}


// ---- rotary_embedding, rotary_embedding_backward -------------------------------------------------------
template <class DTypeEnum>
struct RotaryArgs {
  DTypeEnum dt;
  int64_t T, heads, head_dim;
  at::Tensor positions;  // int64, contiguous, every entry in [0, max_position)
};

// ValueChecks::kHost reads positions (min/max) on the host: the CPU backend, where that is free (device
// checks first). ValueChecks::kInKernel (the GPU glue) reads no tensor data here: the kernel checks each value
// and reports through its error flags (csrc/gpu/dense_api.h), so the op never synchronises with the host.

template <class DTypeEnum>
RotaryArgs<DTypeEnum> check_rotary(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cache,
                                   int64_t rot, const char* op, ValueChecks values = ValueChecks::kHost) {
  const DTypeEnum dt = dtype_of<DTypeEnum>(x, op, "x");
  TORCH_CHECK(x.dim() == 3, "aligned::", op, ": x must be [tokens, heads, head_dim], got ", x.sizes());
  const int64_t T = x.size(0), heads = x.size(1), head_dim = x.size(2);
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T, "aligned::", op, ": positions must be [", T, "], got ",
              positions.sizes());
  TORCH_CHECK(positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt, "aligned::", op,
              ": positions must be int64 or int32");
  TORCH_CHECK(rot > 0 && rot % 2 == 0 && rot <= head_dim, "aligned::", op,
              ": rotary_dim must be even and in (0, head_dim], got ", rot, " with head_dim ", head_dim);
  TORCH_CHECK(cache.scalar_type() == at::kFloat && cache.dim() == 2 && cache.size(1) == rot, "aligned::", op,
              ": cos_sin_cache must be float32 [max_position, rotary_dim=", rot, "], got ", cache.scalar_type(), " ",
              cache.sizes());
  auto pos = positions.to(at::kLong).contiguous();
  const int64_t max_pos = cache.size(0);
  if (T > 0 && values == ValueChecks::kHost) {
    const int64_t lo = pos.min().item<int64_t>(), hi = pos.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < max_pos, "aligned::", op, ": positions must lie in [0, ", max_pos, "), got [", lo,
                ", ", hi, "]");
  }
  return {dt, T, heads, head_dim, pos};
}

// ---- _exp_f32, _log_f32 (numerics test hooks) ----------------------------------------------------------
inline void check_elementwise_f32(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "aligned::", op, ": x must be float32");
}

}  // namespace aligned
