// checks/exact.h — argument checks of the `exact` linear family (one-shot, packed, and its TP pieces).
// Written once for every backend (checks/common.h says how the checks are used).
#pragma once

#include "common.h"
#include "../../common/exact_linear.h"
#include "linear.h"

#include <utility>

namespace aligned {

// ---- linear_exact (exact profile, exact_linear.h): weight [N, K] packed once; x [..., K] ---------------
// The packed weight is (wd int8 [Sw, Np * Kp], w_exp int32 [N + 1], w_bad uint8 [N]), Np = 16 ceil(N/16),
// Kp = 64 ceil(K/64), 1 <= Sw <= 4; w_exp[N] holds the weight's in_features K (checked against x).
template <class DTypeEnum>
DTypeEnum check_linear_exact_weight(const at::Tensor& weight, const char* op) {
  const DTypeEnum dt = dtype_of<DTypeEnum>(weight, op, "weight");
  TORCH_CHECK(weight.dim() == 2, "aligned::", op, ": weight must be [out_features, in_features], got ", weight.sizes());
  TORCH_CHECK(weight.size(1) <= exact::kMaxK, "aligned::", op, ": in_features must be <= ", exact::kMaxK,
              " (the exact profile's int64 accumulators hold sums of at most that many products), got ",
              weight.size(1));
  return dt;
}

template <class DTypeEnum>
LinearArgs<DTypeEnum> check_linear_exact_packed(const at::Tensor& x, const at::Tensor& wd, const at::Tensor& w_exp,
                                                const at::Tensor& w_bad, int64_t N,
                                                const std::optional<at::Tensor>& bias, int64_t k_parts,
                                                const char* op = "linear_exact_packed") {
  LinearArgs<DTypeEnum> a;
  a.dt = dtype_of<DTypeEnum>(x, op, "x");
  TORCH_CHECK(x.dim() >= 1, "aligned::", op, ": x must have at least one dimension");
  a.K = x.size(-1);
  a.N = N;
  a.M = c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
  TORCH_CHECK(a.K <= 131072, "aligned::", op, ": in_features must be <= 131072, got ", a.K);
  TORCH_CHECK(N >= 0, "aligned::", op, ": out_features must be >= 0");
  const int64_t Np = (N + 15) / 16 * 16, Kp = (a.K + 63) / 64 * 64;
  TORCH_CHECK(wd.scalar_type() == at::kChar && wd.dim() == 2 && wd.size(0) >= 1 && wd.size(0) <= 4 &&
                  wd.size(1) == Np * Kp && wd.is_contiguous(),
              "aligned::", op, ": weight_digits must be contiguous int8 [S, ", Np * Kp, "] (S in 1..4) for x's ", a.K,
              " input features and ", N, " outputs, got ", wd.scalar_type(), " ", wd.sizes(),
              " (pack the weight with linear_exact_pack_weight)");
  TORCH_CHECK(w_exp.scalar_type() == at::kInt && w_exp.dim() == 1 && w_exp.size(0) == N + 1 && w_exp.is_contiguous(),
              "aligned::", op, ": weight_exponents must be contiguous int32 [", N + 1, "]");
  // in_features of the packed weight: w_exp[N]. Read on the CPU only: on a device it would be a host sync per
  // call (the decode path); there the weight_digits shape check above already pins the 64-padded width, so no
  // read goes out of bounds, and a K differing only inside that padding meets zero weight digits.
  if (w_exp.device().is_cpu()) {
    const int64_t packed_k = w_exp.data_ptr<int32_t>()[N];
    TORCH_CHECK(packed_k == a.K, "aligned::", op, ": x has ", a.K, " input features but the packed weight has ",
                packed_k);
  }
  TORCH_CHECK(w_bad.scalar_type() == at::kByte && w_bad.dim() == 1 && w_bad.size(0) == N && w_bad.is_contiguous(),
              "aligned::", op, ": weight_nonfinite must be contiguous uint8 [", N, "]");
  TORCH_CHECK(k_parts >= 1, "aligned::", op, ": k_parts must be >= 1, got ", k_parts);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == x.scalar_type(),
                "aligned::", op, ": bias must be [", N, "] with x's dtype, got ", bias->sizes(), " ",
                bias->scalar_type());
    a.bias = bias->contiguous();
  }
  return a;
}

// ---- the CPU's fp64 path and exact TP (exact_linear.h): the per-row bounds and scans ----------------------
// weight_f64_bounds: int32 [N] from linear_exact_f64_bounds.
inline void check_exact_f64_bounds(const at::Tensor& wb, int64_t N, const char* op) {
  TORCH_CHECK(wb.scalar_type() == at::kInt && wb.dim() == 1 && wb.size(0) == N && wb.is_contiguous(), "aligned::", op,
              ": weight_f64_bounds must be contiguous int32 [", N, "] (from linear_exact_f64_bounds), got ",
              wb.scalar_type(), " ", wb.sizes());
}

// A row scan: int32 [R, 3] (linear_exact_row_scan of the rows' slices, MAX-merged over the ranks).
inline void check_exact_scan(const at::Tensor& s, int64_t R, const char* op, const char* name) {
  const int64_t kScanInts = exact::kScanInts;  // (emax, -lmin, bad)
  TORCH_CHECK(s.scalar_type() == at::kInt && s.dim() == 2 && s.size(0) == R && s.size(1) == kScanInts &&
                  s.is_contiguous(),
              "aligned::", op, ": ", name, " must be contiguous int32 [", R, ", ", kScanInts,
              "] (linear_exact_row_scan of the rows' slices, merged over the ranks by an elementwise MAX), got ",
              s.scalar_type(), " ", s.sizes());
}

// linear_exact_finish: partial int64 [..., N, 2] (the ranks' linear_exact_partial summed), its x_scan, the
// packed weight's exponents / flags, an optional bias [N] in `dtype`. Returns (M, N).
inline std::pair<int64_t, int64_t> check_linear_exact_finish(const at::Tensor& partial, const at::Tensor& x_scan,
                                                             const at::Tensor& w_exp, const at::Tensor& w_bad,
                                                             const std::optional<at::Tensor>& bias,
                                                             at::ScalarType dtype, const char* op) {
  TORCH_CHECK(partial.scalar_type() == at::kLong && partial.dim() >= 2 && partial.size(-1) == 2, "aligned::", op,
              ": partial must be int64 [..., out_features, 2] (the sum of the ranks' linear_exact_partial), got ",
              partial.scalar_type(), " ", partial.sizes());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "aligned::", op,
              ": dtype must be float32, bfloat16 or float16, got ", dtype);
  const int64_t N = partial.size(-2);
  const int64_t M = c10::multiply_integers(partial.sizes().begin(), partial.sizes().end() - 2);
  check_exact_scan(x_scan, M, op, "x_scan");
  TORCH_CHECK(w_exp.scalar_type() == at::kInt && w_exp.dim() == 1 && w_exp.size(0) == N + 1 && w_exp.is_contiguous(),
              "aligned::", op, ": weight_exponents must be contiguous int32 [", N + 1,
              "] (from linear_exact_pack_weight_scanned), got ", w_exp.scalar_type(), " ", w_exp.sizes());
  TORCH_CHECK(w_bad.scalar_type() == at::kByte && w_bad.dim() == 1 && w_bad.size(0) == N && w_bad.is_contiguous(),
              "aligned::", op, ": weight_nonfinite must be contiguous uint8 [", N, "], got ", w_bad.scalar_type(), " ",
              w_bad.sizes());
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == dtype, "aligned::", op,
                ": bias must be [", N, "] in dtype ", dtype, ", got ", bias->scalar_type(), " ", bias->sizes());
  return {M, N};
}

}  // namespace aligned
