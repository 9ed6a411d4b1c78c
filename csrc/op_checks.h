// op_checks.h — argument validation of the dense ops, written once for every backend's torch glue
// (csrc/cpu/ops_cpu.cpp, csrc/cuda/ops_cuda.cpp), so a bad input is rejected by the same rule with the same
// words on every device: "aligned::<op>: <argument> must ...".
//
// Device-independent (ATen only). Each glue checks every tensor's device itself first (check_cpu /
// check_cuda), then calls check_<op> here, which returns what the glue needs to allocate and launch
// (dtypes as the backend's DType enum, dims, and the few tensors it had to convert). The range checks of
// positions, token ids and temperatures read tensor data (one min/max each), which is why the device
// checks must come first.
//
// DTypeEnum is the backend's kernel dtype enum (aligned::cpu::DType, aligned::gpu::DType): any enum with
// the enumerators F32, BF16 and F16.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <optional>

namespace aligned {

template <class DTypeEnum>
DTypeEnum dtype_of(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DTypeEnum::F32;
    case at::kBFloat16: return DTypeEnum::BF16;
    case at::kHalf: return DTypeEnum::F16;
    default:
      TORCH_CHECK(false, "aligned::", op, ": ", name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

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
enum class ValueChecks { kHost, kInKernel };

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

// ---- logsumexp, log_softmax, token_logprobs(+_backward): logits [T, V], temperature scalar or per row ----
template <class DTypeEnum>
struct LogitsArgs {
  at::Tensor z;      // logits, contiguous
  at::Tensor temps;  // undefined, or fp32 [T] contiguous, every entry finite and > 0
  DTypeEnum dt;
  int64_t T, V;
  float tau;
  const float* temps_ptr() const { return temps.defined() ? temps.data_ptr<float>() : nullptr; }
};

// ValueChecks::kHost reads temperatures (all finite and > 0): device checks first. kInKernel: see check_rotary.
template <class DTypeEnum>
LogitsArgs<DTypeEnum> check_logits(const at::Tensor& logits, double temperature,
                                   const std::optional<at::Tensor>& temperatures, const char* op,
                                   ValueChecks values = ValueChecks::kHost) {
  LogitsArgs<DTypeEnum> a;
  a.dt = dtype_of<DTypeEnum>(logits, op, "logits");
  TORCH_CHECK(logits.dim() == 2, "aligned::", op, ": logits must be [tokens, vocab], got ", logits.sizes());
  a.T = logits.size(0);
  a.V = logits.size(1);
  TORCH_CHECK(a.V > 0 || a.T == 0, "aligned::", op, ": vocab size must be > 0");
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0, "aligned::", op,
              ": temperature must be finite and > 0, got ", temperature,
              " (greedy decoding: pass 1.0 to score the raw distribution)");
  // The kernels divide by the fp32 rounding of temperature: 1e-50 would become 0 (every row NaN), 1e39 inf
  // (every row uniform). Refuse what fp32 cannot hold as a normal number.
  a.tau = (float)temperature;
  TORCH_CHECK(std::isnormal(a.tau), "aligned::", op, ": temperature ", temperature,
              " is not representable in float32 (the op divides by it in fp32): it must lie in [",
              std::numeric_limits<float>::min(), ", ", std::numeric_limits<float>::max(), "]");
  if (temperatures.has_value() && temperatures->defined()) {
    const auto& t = *temperatures;
    TORCH_CHECK(t.dim() == 1 && t.size(0) == a.T, "aligned::", op, ": temperatures must be [", a.T, "], got ",
                t.sizes());
    at::Tensor temps = t.to(at::kFloat).contiguous();
    if (a.T > 0 && values == ValueChecks::kHost) {
      TORCH_CHECK(temps.ge(std::numeric_limits<float>::min()).all().item<bool>() &&
                      temps.isfinite().all().item<bool>(),
                  "aligned::", op,
                  ": every temperature must be finite and > 0, and a normal float32 value (>= ",
                  std::numeric_limits<float>::min(), ") after conversion to float32");
    }
    a.temps = temps;
  }
  a.z = logits.contiguous();
  return a;
}

// token_ids [T], int64 or int32, every id in [0, V). Returns them as int64, contiguous. Reads the ids
// (min/max) under ValueChecks::kHost: device checks first. kInKernel: see check_rotary.
inline at::Tensor check_token_ids(const at::Tensor& ids, int64_t T, int64_t V, const char* op,
                                  ValueChecks values = ValueChecks::kHost) {
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, "aligned::", op,
              ": token_ids must be int64 or int32, got ", ids.scalar_type());
  TORCH_CHECK(ids.dim() == 1 && ids.size(0) == T, "aligned::", op, ": token_ids must be [", T, "], got ",
              ids.sizes());
  auto idc = ids.to(at::kLong).contiguous();
  if (T > 0 && values == ValueChecks::kHost) {
    const int64_t lo = idc.min().item<int64_t>(), hi = idc.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < V, "aligned::", op, ": token_ids must lie in [0, ", V, "), got [", lo, ", ", hi, "]");
  }
  return idc;
}

// The incoming gradient of a log-prob backward op: [T] (token_logprobs, logsumexp: one value per row) or
// [T, V] (log_softmax), any float dtype; returned as fp32, contiguous.
inline at::Tensor check_logits_grad(const at::Tensor& grad, int64_t T, int64_t V, bool per_logit, const char* op) {
  if (per_logit) {
    TORCH_CHECK(grad.dim() == 2 && grad.size(0) == T && grad.size(1) == V, "aligned::", op, ": grad must be [", T,
                ", ", V, "], got ", grad.sizes());
  } else {
    TORCH_CHECK(grad.dim() == 1 && grad.size(0) == T, "aligned::", op, ": grad must be [", T, "], got ",
                grad.sizes());
  }
  TORCH_CHECK(grad.is_floating_point(), "aligned::", op, ": grad must be a float tensor, got ", grad.scalar_type());
  return grad.to(at::kFloat).contiguous();
}

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

// linear_mma_partial: as linear_mma without bias; lanes ∈ {1, 2, 4, 8} (whole lanes of the 8-lane tree).
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

// ---- _exp_f32, _log_f32 (numerics test hooks) ----------------------------------------------------------
inline void check_elementwise_f32(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "aligned::", op, ": x must be float32");
}

// ---- linear_exact (exact profile, exact_linear.h): weight [N, K] packed once; x [..., K] ---------------
// The packed weight is (wd int8 [Sw, Np * Kp], w_exp int32 [N + 1], w_bad uint8 [N]), Np = 16 ceil(N/16),
// Kp = 64 ceil(K/64), 1 <= Sw <= 4; w_exp[N] holds the weight's in_features K (checked against x).
template <class DTypeEnum>
DTypeEnum check_linear_exact_weight(const at::Tensor& weight, const char* op) {
  const DTypeEnum dt = dtype_of<DTypeEnum>(weight, op, "weight");
  TORCH_CHECK(weight.dim() == 2, "aligned::", op, ": weight must be [out_features, in_features], got ", weight.sizes());
  TORCH_CHECK(weight.size(1) <= 131072, "aligned::", op, ": in_features must be <= 131072 (int32 digit sums), got ",
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

}  // namespace aligned
