// glue/exact.h — the `exact` linear family's glue bodies (csrc/common/exact_linear.h: integer digits, one
// exact sum, one rounding; the weight packed once per version). Families:
//   ExactLinear     linear_exact, linear_exact_pack_weight, linear_exact_packed  (every backend)
//   ExactF64        linear_exact_f64_bounds and its test hooks: the CPU's fp64 routes
//   ExactTp         linear_exact_row_scan, _pack_weight_scanned, _partial, _finish: exact tensor parallelism
//   ExactReference  _linear_exact_reference: the scalar int128 model (a test hook)
// The four steps of every body: glue/dense.h. Packing allocates what the digits need (their count is data),
// so the exact runs take the checked tensors (run_args.h) and allocate their intermediates themselves.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "../checks/exact.h"
#include "../registration.h"
#include "../run_args.h"

namespace aligned::glue {

template <class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_exact_pack_weight(const at::Tensor& weight) {
  const char* op = "linear_exact_pack_weight";
  const typename B::Call call(op, weight, "weight");
  const DType dt = check_linear_exact_weight<DType>(weight, op);
  return B::linear_exact_pack_weight(call, dt, weight.contiguous());
}

// The packed-weight forward; `op` names the op the caller called (linear_exact runs it on the weight it packed:
// its errors, a bad bias say, must name linear_exact).
template <class B>
at::Tensor linear_exact_packed_as(const char* op, const at::Tensor& x, const at::Tensor& wd, const at::Tensor& w_exp,
                                  const at::Tensor& w_bad, int64_t N, const std::optional<at::Tensor>& bias,
                                  int64_t k_parts, const std::optional<at::Tensor>& weight,
                                  const std::optional<at::Tensor>& weight_f64_bounds) {
  const typename B::Call call(op, x, "x");
  call.on_device(wd, "weight_digits");
  call.on_device(w_exp, "weight_exponents");
  call.on_device(w_bad, "weight_nonfinite");
  call.on_device(bias, "bias");
  ExactPackedRun r;
  r.a = check_linear_exact_packed<DType>(x, wd, w_exp, w_bad, N, bias, k_parts, op);
  const int64_t M = r.a.M, K = r.a.K;
  r.x = x.reshape({M, K}).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  r.out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return r.out.view(sizes);
  // The CPU's fp64 path reads the weight itself and its row bounds (a GPU computes every row on the integer
  // path, the same bits, and ignores them): both or neither, and they must be this packed weight's.
  const bool has_w = weight.has_value() && weight->defined();
  const bool has_b = weight_f64_bounds.has_value() && weight_f64_bounds->defined();
  TORCH_CHECK(has_w == has_b, "aligned::", op, ": weight and weight_f64_bounds go together (the fp64 path)");
  if (has_w) {
    call.on_device(*weight, "weight");
    TORCH_CHECK(weight->scalar_type() == x.scalar_type() && weight->dim() == 2 && weight->size(0) == N &&
                    weight->size(1) == K,
                "aligned::", op, ": weight must be the packed weight itself, [", N, ", ", K, "] in x's dtype ",
                x.scalar_type(), ", got ", weight->scalar_type(), " ", weight->sizes());
    call.on_device(*weight_f64_bounds, "weight_f64_bounds");
    check_exact_f64_bounds(*weight_f64_bounds, N, op);
    r.weight = *weight;
    r.weight_f64_bounds = *weight_f64_bounds;
  }
  r.wd = wd;
  r.w_exp = w_exp;
  r.w_bad = w_bad;
  r.k_parts = k_parts;
  B::linear_exact_packed(call, r);
  return r.out.view(sizes);
}

template <class B>
at::Tensor linear_exact_packed(const at::Tensor& x, const at::Tensor& wd, const at::Tensor& w_exp,
                               const at::Tensor& w_bad, int64_t N, const std::optional<at::Tensor>& bias,
                               int64_t k_parts, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& weight_f64_bounds) {
  return linear_exact_packed_as<B>("linear_exact_packed", x, wd, w_exp, w_bad, N, bias, k_parts, weight,
                                   weight_f64_bounds);
}

template <class B>
at::Tensor linear_exact_f64_bounds(const at::Tensor& weight);

template <class B>
at::Tensor linear_exact(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const char* op = "linear_exact";
  const typename B::Call call(op, x, "x");
  call.on_device(weight, "weight");
  const DType dt = check_linear_exact_weight<DType>(weight, op);
  TORCH_CHECK(dtype_of<DType>(x, op, "x") == dt, "aligned::linear_exact: weight dtype ", weight.scalar_type(),
              " must equal x dtype ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "aligned::linear_exact: x must have at least one dimension (its last: in_features)");
  TORCH_CHECK(x.size(-1) == weight.size(1), "aligned::linear_exact: x has ", x.size(-1),
              " input features but weight is ", weight.sizes());
  auto [wd, we, wb] = linear_exact_pack_weight<B>(weight);
  if constexpr (B::kExactF64Path) {
    if (B::exact_f64_path_enabled()) {  // ALIGNED_EXACT_F64 (read per call): the fp64 routes may run
      const at::Tensor bounds = linear_exact_f64_bounds<B>(weight);
      return linear_exact_packed_as<B>(op, x, wd, we, wb, weight.size(0), bias, 1, weight, bounds);
    }
  }
  return linear_exact_packed_as<B>(op, x, wd, we, wb, weight.size(0), bias, 1, std::nullopt, std::nullopt);
}

// ---- the CPU's fp64 path (exact_linear.h): per weight row its bound b (int32 [N], once per weight version) ----
template <class B>
at::Tensor linear_exact_f64_bounds(const at::Tensor& weight) {
  const char* op = "linear_exact_f64_bounds";
  const typename B::Call call(op, weight, "weight");
  const DType dt = check_linear_exact_weight<DType>(weight, op);
  auto wc = weight.contiguous();
  auto out = at::empty({wc.size(0)}, weight.options().dtype(at::kInt));
  B::linear_exact_f64_bounds(call, dt, wc, out);
  return out;
}

// Test hook: per (x row, weight row) whether the pair meets the fp64 path's bound (B) (bool [M, N]; rows with
// NaN / inf: false).
template <class B>
at::Tensor linear_exact_f64_pairs(const at::Tensor& x, const at::Tensor& weight_f64_bounds) {
  const char* op = "_linear_exact_f64_pairs";
  const typename B::Call call(op, x, "x");
  const DType dt = dtype_of<DType>(x, op, "x");
  const int64_t N = weight_f64_bounds.dim() == 1 ? weight_f64_bounds.size(0) : -1;
  call.on_device(weight_f64_bounds, "weight_f64_bounds");
  check_exact_f64_bounds(weight_f64_bounds, N, op);
  auto xc = x.reshape({-1, x.size(-1)}).contiguous();
  auto out = at::empty({xc.size(0), N}, x.options().dtype(at::kBool));
  B::linear_exact_f64_pairs(call, dt, xc, weight_f64_bounds, out);
  return out;
}

// Test hook: which route computes each output of linear_exact_packed(x, ..., weight, weight_f64_bounds) under
// ALIGNED_EXACT_F64=all (int8 [M, N]: 0 the fp64 path, 1 the split route, 2 the digit path).
template <class B>
at::Tensor linear_exact_f64_routes(const at::Tensor& x, const at::Tensor& weight,
                                   const at::Tensor& weight_f64_bounds) {
  const char* op = "_linear_exact_f64_routes";
  const typename B::Call call(op, x, "x");
  call.on_device(weight, "weight");
  const DType dt = dtype_of<DType>(x, op, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 2 && x.dim() >= 1 &&
                  weight.size(1) == x.size(-1),
              "aligned::", op, ": weight must be [N, K] in x's dtype with K = x.size(-1), got ", weight.scalar_type(),
              " ", weight.sizes(), " for x ", x.scalar_type(), " ", x.sizes());
  call.on_device(weight_f64_bounds, "weight_f64_bounds");
  check_exact_f64_bounds(weight_f64_bounds, weight.size(0), op);
  auto xc = x.reshape({-1, x.size(-1)}).contiguous();
  auto out = at::empty({xc.size(0), weight.size(0)}, x.options().dtype(at::kChar));
  B::linear_exact_f64_routes(call, dt, xc, weight.contiguous(), weight_f64_bounds, out);
  return out;
}

// ---- tensor parallelism (exact_linear.h, "tensor parallelism"; docs/exact_linear.md, "TP") ----------------
// A rank holds a K slice of every row. linear_exact_row_scan gives its slice's scans; an elementwise integer
// MAX over the ranks (all-reduce MAX) gives the full rows' scans; the weight is packed against them once per
// weight version (linear_exact_pack_weight_scanned), x per call inside linear_exact_partial, which returns the
// exact integer partials (hi, lo). An int64 SUM over the ranks, then linear_exact_finish: the one rounding and
// the epilogue.
template <class B>
at::Tensor linear_exact_row_scan(const at::Tensor& v) {
  const char* op = "linear_exact_row_scan";
  const typename B::Call call(op, v, "v");
  const DType dt = dtype_of<DType>(v, op, "v");
  TORCH_CHECK(v.dim() >= 1, "aligned::", op, ": v must have at least one dimension");
  const int64_t K = v.size(-1);
  // rows from the leading sizes (reshape({-1, 0}) cannot infer them): a rank's empty slice (K_r = 0) scans
  // as rows with no element, which the MAX merge leaves unchanged
  const int64_t R = c10::multiply_integers(v.sizes().begin(), v.sizes().end() - 1);
  auto vc = v.reshape({R, K}).contiguous();
  auto out = at::empty({vc.size(0), exact::kScanInts}, v.options().dtype(at::kInt));
  B::linear_exact_row_scan(call, dt, vc, out);
  return out;
}

template <class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_exact_pack_weight_scanned(const at::Tensor& weight,
                                                                                const at::Tensor& row_scan) {
  const char* op = "linear_exact_pack_weight_scanned";
  const typename B::Call call(op, weight, "weight");
  const DType dt = check_linear_exact_weight<DType>(weight, op);
  auto wc = weight.contiguous();
  call.on_device(row_scan, "row_scan");
  check_exact_scan(row_scan, wc.size(0), op, "row_scan");
  return B::linear_exact_pack_weight_scanned(call, dt, wc, row_scan);
}

// This rank's exact integer partials (hi, lo) of x [.., K_r] against the weight slice packed by
// linear_exact_pack_weight_scanned; x_scan: the full rows' scans (MAX-merged over the ranks). int64 [.., N, 2].
template <class B>
at::Tensor linear_exact_partial(const at::Tensor& x, const at::Tensor& wd, const at::Tensor& w_exp,
                                const at::Tensor& w_bad, int64_t N, const at::Tensor& x_scan) {
  const char* op = "linear_exact_partial";
  const typename B::Call call(op, x, "x");
  call.on_device(wd, "weight_digits");
  call.on_device(w_exp, "weight_exponents");
  call.on_device(w_bad, "weight_nonfinite");
  ExactPackedRun r;
  r.a = check_linear_exact_packed<DType>(x, wd, w_exp, w_bad, N, std::nullopt, 1, op);
  const int64_t M = r.a.M, K = r.a.K;
  call.on_device(x_scan, "x_scan");
  check_exact_scan(x_scan, M, op, "x_scan");
  r.x = x.reshape({M, K}).contiguous();
  r.wd = wd;
  r.w_exp = w_exp;
  r.w_bad = w_bad;
  r.out = at::zeros({M, N, 2}, x.options().dtype(at::kLong));
  B::linear_exact_partial(call, r, x_scan);  // checks that x_scan covers x's rows, then sums
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  sizes.push_back(2);
  return r.out.view(sizes);
}

// The integer sum of every rank's partials [.., N, 2] -> the exact profile's output in `dtype`: the one
// rounding and the epilogue (exact_linear.h exact_epilogue_f32, as the single-device kernels).
template <class B>
at::Tensor linear_exact_finish(const at::Tensor& partial, const at::Tensor& x_scan, const at::Tensor& w_exp,
                               const at::Tensor& w_bad, const std::optional<at::Tensor>& bias,
                               at::ScalarType dtype) {
  const char* op = "linear_exact_finish";
  const typename B::Call call(op, partial, "partial");
  call.on_device(x_scan, "x_scan");
  call.on_device(w_exp, "weight_exponents");
  call.on_device(w_bad, "weight_nonfinite");
  call.on_device(bias, "bias");
  const auto [M, N] = check_linear_exact_finish(partial, x_scan, w_exp, w_bad, bias, dtype, op);
  auto sizes = partial.sizes().vec();
  sizes.pop_back();
  auto out = at::empty({M, N}, partial.options().dtype(dtype));
  const DType dt = dtype_of<DType>(out, op, "dtype");
  B::linear_exact_finish(call, dt, partial.reshape({M, N, 2}).contiguous(), x_scan, w_exp, w_bad,
                         bias.has_value() ? *bias : at::Tensor(), out);
  return out.view(sizes);
}

// The scalar definition (exact_linear.h: canonical integers, one int128 sum, one rounding): for tests.
template <class B>
at::Tensor linear_exact_reference(const at::Tensor& x, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias) {
  const char* op = "_linear_exact_reference";
  const typename B::Call call(op, x, "x");
  call.on_device(weight, "weight");
  check_linear_exact_weight<DType>(weight, op);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "aligned::", op, ": x must be float32, bfloat16 or float16");
  return B::linear_exact_reference(call, x, weight, bias.has_value() ? *bias : at::Tensor());
}

struct ExactLinear {
  template <class B>
  static constexpr std::tuple ops{
      Op{"linear_exact", &linear_exact<B>},
      Op{"linear_exact_pack_weight", &linear_exact_pack_weight<B>},
      Op{"linear_exact_packed", &linear_exact_packed<B>},
  };
};

struct ExactF64 {
  template <class B>
  static constexpr std::tuple ops{
      Op{"linear_exact_f64_bounds", &linear_exact_f64_bounds<B>},
      Op{"_linear_exact_f64_pairs", &linear_exact_f64_pairs<B>},
      Op{"_linear_exact_f64_routes", &linear_exact_f64_routes<B>},
  };
};

struct ExactTp {
  template <class B>
  static constexpr std::tuple ops{
      Op{"linear_exact_row_scan", &linear_exact_row_scan<B>},
      Op{"linear_exact_pack_weight_scanned", &linear_exact_pack_weight_scanned<B>},
      Op{"linear_exact_partial", &linear_exact_partial<B>},
      Op{"linear_exact_finish", &linear_exact_finish<B>},
  };
};

struct ExactReference {
  template <class B>
  static constexpr std::tuple ops{Op{"_linear_exact_reference", &linear_exact_reference<B>}};
};

}  // namespace aligned::glue
