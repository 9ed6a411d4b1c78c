// ops_cuda.cpp — torch glue of the dense ops on the GPU: argument checks, output allocation, the current
// stream, and a call to the torch-free launchers of csrc/gpu/dense_api.h (kernels: csrc/gpu/*.cuh, built by
// csrc/cuda/dense.cu with nvcc or csrc/hip/dense.hip with hip-clang).
//
// The same file serves CUDA and ROCm torch: ROCm torch registers HIP kernels under the CUDA dispatch key and
// reports HIP devices as device type "cuda", so only the stream accessor differs (ALIGNED_ROCM, set by
// CMakeLists.txt for a ROCm torch). Only c10-level headers are used (no ATen/cuda/CUDAContext.h), so this
// file also syntax-checks against the CPU torch wheel with -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE (see
// cmake/gpu_compile_check.cmake). The argument checks are csrc/op_checks.h, shared with the CPU glue (same
// rules, same messages); this file adds only the device check: every tensor must be a CUDA tensor on the
// same device as the first input.
//
// No op here reads device data on the host (no .item(), no copy to the CPU, no stream synchronisation), so
// every op is asynchronous and CUDA-graph capturable. The data-value checks the CPU glue runs on the host
// (positions in range, token ids in range, temperatures finite and > 0) run in the kernels instead
// (ValueChecks::kInKernel, csrc/gpu/dense_api.h): a bad value never causes an out-of-bounds read, the row
// comes out NaN, and a per-device error word is set that aligned_ops.check_device_errors() reads (one sync,
// outside the hot path) and turns into the error the CPU glue would raise. tests/cuda/test_no_host_sync.py
// scans this file for host reads (planted-violation negative control).
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

// Compiled a second time for the emulation target (csrc/emu/ops_emulated_*.cpp, ALIGNED_EMULATED_GLUE): CPU
// tensors, the emulated launchers, no stream, and a registry instead of the CUDA dispatch key
// (csrc/emu/emulation.h); the stream and device helpers of each build are glue_common.h.

#include <algorithm>
#include <cmath>
#include <mutex>
#include <optional>
#include <tuple>

#include "../common/contract.h"
#include "../common/exact_linear.h"
#include "../gpu/dense_api.h"
#include "../gpu/exact_api.h"
#include "../op_params.h"
#include "glue_common.h"

namespace aligned::cuda {
namespace {

using gpu::DType;
using cuda_glue::check_cuda;
using cuda_glue::check_launch;
using cuda_glue::current_stream;

// The per-device error words of the in-kernel value checks (dense_api.h DeviceError), allocated once per
// device on first use (zeros: an async memset, no sync; vLLM's eager warm-up runs before graph capture) and
// never freed (a process-lifetime buffer must outlive the caching allocator's teardown).
int32_t* device_error_flags(const at::Tensor& like) {
  static std::mutex mu;
  static at::Tensor* flags[64] = {};
  const int idx = like.device().is_cpu() ? 0 : like.device().index();
  TORCH_CHECK(idx >= 0 && idx < 64, "aligned: device index ", idx, " out of range for the error flags");
  std::lock_guard<std::mutex> lock(mu);
  if (!flags[idx]) flags[idx] = new at::Tensor(at::zeros({gpu::kNumDeviceErrors}, like.options().dtype(at::kInt)));
  return flags[idx]->data_ptr<int32_t>();
}

// _device_error_flags(like): the error words of like's device (a view of the persistent buffer, so the caller
// can read and clear them).
at::Tensor device_error_flags_tensor(const at::Tensor& like) {
  check_cuda(like, like, "_device_error_flags", "like");
  c10::DeviceGuard guard(like.device());
  int32_t* ptr = device_error_flags(like);
  return at::from_blob(ptr, {gpu::kNumDeviceErrors}, like.options().dtype(at::kInt));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const char* op = "rms_norm";
  check_cuda(x, x, op, "x");
  check_cuda(weight, x, op, "weight");
  const auto a = check_rms_norm<DType>(x, weight, eps);
  c10::DeviceGuard guard(x.device());
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  check_launch(gpu::launch_rms_norm(make_rms_norm_params(a, xc, wc, out, eps), current_stream(x)), op);
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  const char* op = "fused_add_rms_norm";
  check_cuda(x, x, op, "x");
  check_cuda(residual, x, op, "residual");
  check_cuda(weight, x, op, "weight");
  const auto a = check_fused_add_rms_norm<DType>(x, residual, weight, eps);
  c10::DeviceGuard guard(x.device());
  auto xc = x.contiguous(), rc = residual.contiguous(), wc = weight.contiguous();
  auto out = at::empty_like(xc), res_out = at::empty_like(xc);
  const auto p = make_rms_norm_params(a, xc, wc, out, eps, rc, res_out);
  check_launch(gpu::launch_fused_add_rms_norm(p, current_stream(x)), op);
  return {out, res_out};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad, const at::Tensor& x,
                                                     const at::Tensor& weight, double eps) {
  const char* op = "rms_norm_backward";
  check_cuda(x, x, op, "x");
  check_cuda(grad, x, op, "grad_out");
  check_cuda(weight, x, op, "weight");
  const auto a = check_rms_norm_backward<DType>(grad, x, weight, eps);
  c10::DeviceGuard guard(x.device());
  auto gc = grad.contiguous(), xc = x.contiguous(), wc = weight.contiguous();
  auto dx = at::empty_like(xc);
  auto inv = at::empty({a.rows}, x.options().dtype(at::kFloat));
  auto dw = at::empty({a.H}, x.options().dtype(at::kFloat));
  const auto p = make_rms_norm_backward_params(a, gc, xc, wc, dx, inv, dw, eps);
  check_launch(gpu::launch_rms_norm_backward(p, current_stream(x)), op);
  return {dx, dw.to(weight.scalar_type())};
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  const char* op = "silu_and_mul";
  check_cuda(x, x, op, "x");
  const auto a = check_silu_and_mul<DType>(x);
  c10::DeviceGuard guard(x.device());
  auto xc = x.contiguous();
  auto sizes = xc.sizes().vec();
  sizes.back() = a.d;
  auto out = at::empty(sizes, xc.options());
  check_launch(gpu::launch_silu_and_mul(make_silu_and_mul_params(a, xc, out), current_stream(x)), op);
  return out;
}

at::Tensor silu_and_mul_backward(const at::Tensor& grad, const at::Tensor& x) {
  const char* op = "silu_and_mul_backward";
  check_cuda(x, x, op, "x");
  check_cuda(grad, x, op, "grad_out");
  const auto a = check_silu_and_mul_backward<DType>(grad, x);
  c10::DeviceGuard guard(x.device());
  auto gc = grad.contiguous(), xc = x.contiguous();
  auto dx = at::empty_like(xc);
  check_launch(gpu::launch_silu_and_mul_backward(make_silu_and_mul_params(a, xc, dx, gc), current_stream(x)), op);
  return dx;
}

at::Tensor rotary_impl(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cache, int64_t rot,
                       bool is_neox, bool inverse, const char* op) {
  check_cuda(x, x, op, "x");
  check_cuda(positions, x, op, "positions");
  check_cuda(cache, x, op, "cos_sin_cache");
  c10::DeviceGuard guard(x.device());  // the positions range check below runs on x's device
  const auto a = check_rotary<DType>(positions, x, cache, rot, op, ValueChecks::kInKernel);
  auto xc = x.contiguous(), cc = cache.contiguous();
  auto out = at::empty_like(xc);
  const auto p = make_rotary_params(a, xc, cc, out, rot, is_neox, inverse, device_error_flags(x));
  check_launch(gpu::launch_rotary(p, current_stream(x)), op);
  return out;
}

at::Tensor rotary_embedding(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cache, int64_t rot,
                            bool is_neox) {
  return rotary_impl(positions, x, cache, rot, is_neox, false, "rotary_embedding");
}
at::Tensor rotary_embedding_backward(const at::Tensor& positions, const at::Tensor& grad, const at::Tensor& cache,
                                     int64_t rot, bool is_neox) {
  return rotary_impl(positions, grad, cache, rot, is_neox, true, "rotary_embedding_backward");
}

// The log-prob family: the glue's device checks, the shared checks (op_checks.h, values checked in the
// kernels), then the params (op_params.h) with this device's error words.
using LogitsArgs = aligned::LogitsArgs<DType>;

LogitsArgs check_logits(const at::Tensor& logits, double temperature, const std::optional<at::Tensor>& temperatures,
                        const char* op) {
  check_cuda(logits, logits, op, "logits");
  if (temperatures.has_value() && temperatures->defined()) check_cuda(*temperatures, logits, op, "temperatures");
  return aligned::check_logits<DType>(logits, temperature, temperatures, op, ValueChecks::kInKernel);
}

at::Tensor check_ids(const at::Tensor& ids, const LogitsArgs& a, const char* op) {
  check_cuda(ids, a.z, op, "token_ids");
  return check_token_ids(ids, a.T, a.V, op, ValueChecks::kInKernel);
}

LogitsParams logits_params(const LogitsArgs& a, const LogitsTensors& t, const at::Tensor& logits) {
  return make_logits_params(a, t, LogitsGrad::kTokenLogprobs, 0, device_error_flags(logits));
}

at::Tensor logsumexp(const at::Tensor& logits, double temperature, const std::optional<at::Tensor>& temperatures) {
  const char* op = "logsumexp";
  auto a = check_logits(logits, temperature, temperatures, op);
  c10::DeviceGuard guard(logits.device());
  LogitsTensors t;
  t.lse = at::empty({a.T}, a.z.options().dtype(at::kFloat));
  check_launch(gpu::launch_logsumexp(logits_params(a, t, logits), current_stream(logits)), op);
  return t.lse;
}

at::Tensor log_softmax(const at::Tensor& logits, double temperature, const std::optional<at::Tensor>& temperatures) {
  const char* op = "log_softmax";
  auto a = check_logits(logits, temperature, temperatures, op);
  c10::DeviceGuard guard(logits.device());
  LogitsTensors t;
  t.out_f32 = at::empty({a.T, a.V}, a.z.options().dtype(at::kFloat));
  check_launch(gpu::launch_log_softmax(logits_params(a, t, logits), current_stream(logits)), op);
  return t.out_f32;
}

at::Tensor token_logprobs(const at::Tensor& logits, const at::Tensor& ids, double temperature,
                          const std::optional<at::Tensor>& temperatures) {
  const char* op = "token_logprobs";
  auto a = check_logits(logits, temperature, temperatures, op);
  LogitsTensors t;
  t.ids = check_ids(ids, a, op);
  c10::DeviceGuard guard(logits.device());
  t.out_f32 = at::empty({a.T}, a.z.options().dtype(at::kFloat));
  check_launch(gpu::launch_token_logprobs(logits_params(a, t, logits), current_stream(logits)), op);
  return t.out_f32;
}

// The backward ops of the family: grad [T] (token_logprobs, logsumexp) or [T, V] (log_softmax).
at::Tensor logits_backward(const at::Tensor& grad, const LogitsArgs& a, LogitsTensors& t, const at::Tensor& logits,
                           bool per_logit, const char* (*launch)(const LogitsParams&, void*), const char* op) {
  check_cuda(grad, logits, op, "grad");
  c10::DeviceGuard guard(logits.device());
  t.g = check_logits_grad(grad, a.T, a.V, per_logit, op);
  t.dz = at::empty({a.T, a.V}, a.z.options());
  check_launch(launch(logits_params(a, t, logits), current_stream(logits)), op);
  return t.dz;
}

at::Tensor token_logprobs_backward(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& ids,
                                   double temperature, const std::optional<at::Tensor>& temperatures) {
  const char* op = "token_logprobs_backward";
  auto a = check_logits(logits, temperature, temperatures, op);
  LogitsTensors t;
  t.ids = check_ids(ids, a, op);
  return logits_backward(grad, a, t, logits, false, gpu::launch_token_logprobs_backward, op);
}

at::Tensor logsumexp_backward(const at::Tensor& grad, const at::Tensor& logits, double temperature,
                              const std::optional<at::Tensor>& temperatures) {
  const char* op = "logsumexp_backward";
  auto a = check_logits(logits, temperature, temperatures, op);
  LogitsTensors t;
  return logits_backward(grad, a, t, logits, false, gpu::launch_logsumexp_backward, op);
}

at::Tensor log_softmax_backward(const at::Tensor& grad, const at::Tensor& logits, double temperature,
                                const std::optional<at::Tensor>& temperatures) {
  const char* op = "log_softmax_backward";
  auto a = check_logits(logits, temperature, temperatures, op);
  LogitsTensors t;
  return logits_backward(grad, a, t, logits, true, gpu::launch_log_softmax_backward, op);
}

// ---- linear --------------------------------------------------------------------------------------------
// lanes > 1 (linear, linear_partial): the lane sums go through an fp32 workspace [lanes, ws_rows, N]
// (gemm_fp32.cuh), sized by params_linear.h's gemm_workspace_rows.
void run_gemm(GemmParams p, const at::Tensor& C, const char* op) {
  if (p.M <= 0 || p.N <= 0) return;
  at::Tensor ws;
  if (p.lanes > 1) {
    p.ws_rows = gemm_workspace_rows(p.M, p.N, p.lanes);
    ws = at::empty({p.lanes, p.ws_rows, p.N}, C.options().dtype(at::kFloat));
    p.lane_ws = ws.data_ptr<float>();
  }
  check_launch(gpu::launch_gemm(p, current_stream(C)), op);  // ws is stream-ordered by the caching allocator
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const char* op = "linear";
  check_cuda(x, x, op, "x");
  check_cuda(weight, x, op, "weight");
  if (bias.has_value() && bias->defined()) check_cuda(*bias, x, op, "bias");
  c10::DeviceGuard guard(x.device());
  const auto a = check_linear<DType>(x, weight, bias);
  // M from the leading dims: reshape({-1, 0}) is ambiguous when K == 0
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  auto out = at::empty({a.M, a.N}, x.options());
  run_gemm(make_linear_params(a, xc, weight, out, a.dt, kLinearLanes), out, op);
  return out.view(sizes);
}

at::Tensor linear_partial(const at::Tensor& x, const at::Tensor& weight, int64_t lanes) {
  const char* op = "linear_partial";
  check_cuda(x, x, op, "x");
  check_cuda(weight, x, op, "weight");
  c10::DeviceGuard guard(x.device());
  const auto a = check_linear_partial<DType>(x, weight, lanes);
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  auto out = at::empty({a.M, a.N}, x.options().dtype(at::kFloat));
  run_gemm(make_linear_params(a, xc, weight, out, DType::F32, (int)lanes), out, op);
  return out.view(sizes);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward(const at::Tensor& grad, const at::Tensor& x,
                                                               const at::Tensor& weight, bool needs_x, bool needs_w,
                                                               bool needs_b) {
  const char* op = "linear_backward";
  check_cuda(x, x, op, "x");
  check_cuda(grad, x, op, "grad_out");
  check_cuda(weight, x, op, "weight");
  const auto a = check_linear_backward<DType>(grad, x, weight);
  const int64_t M = a.M, K = a.K, N = a.N;
  c10::DeviceGuard guard(x.device());
  auto g = grad.reshape({M, N}).contiguous();
  auto xc = x.reshape({M, K}).contiguous();
  auto wc = weight.contiguous();
  at::Tensor dx, dw, db;
  if (needs_x) {  // dx[m, k] = chain over n of g[m, n] * w[n, k]
    dx = at::empty({M, K}, x.options());
    run_gemm(make_linear_dx_params(a, g, wc, dx), dx, op);
    dx = dx.view(x.sizes());
  }
  if (needs_w) {  // dw[n, k] = chain over m (token order) of g[m, n] * x[m, k]
    dw = at::empty({N, K}, weight.options());
    run_gemm(make_linear_dw_params(a, g, xc, dw), dw, op);
  }
  if (needs_b) {
    db = at::empty({N}, x.options());
    check_launch(gpu::launch_column_sum(make_column_sum_params(a, g, db), current_stream(x)), op);
  }
  return {dx, dw, db};
}

at::Tensor elementwise_f32(const at::Tensor& x, bool is_log, const char* op) {
  check_cuda(x, x, op, "x");
  check_elementwise_f32(x, op);
  c10::DeviceGuard guard(x.device());
  auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  const auto p = make_elementwise_params(xc, out);
  check_launch(is_log ? gpu::launch_log_f32(p, current_stream(x)) : gpu::launch_exp_f32(p, current_stream(x)), op);
  return out;
}
at::Tensor exp_f32(const at::Tensor& x) { return elementwise_f32(x, false, "_exp_f32"); }
at::Tensor log_f32(const at::Tensor& x) { return elementwise_f32(x, true, "_log_f32"); }

// ---- the exact linear (csrc/gpu/exact_linear_kernels.cuh; numbers: csrc/common/exact_linear.h) ------------
// Same packed form as the CPU (op_checks.h): (wd int8 [Sw, Np * Kp], w_exp int32 [N + 1] with K at [N],
// w_bad uint8 [N]), packed here by the row-forms + pack kernels. Sw = the max of the rows' digit counts is
// read back to size the buffer (one synchronisation per weight version, at pack time).
constexpr int64_t exact_ceil(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

void exact_row_forms(DType dt, const at::Tensor& v, int64_t rows, int64_t K, at::Tensor& E, at::Tensor& S,
                     at::Tensor& bad, const char* op) {
  gpu::ExactFormsParams f{};
  f.dt = dt;
  f.v = v.data_ptr();
  f.rows = rows;
  f.K = K;
  f.E = E.data_ptr<int32_t>();
  f.S = S.data_ptr<int8_t>();
  f.bad = bad.data_ptr<uint8_t>();
  check_launch(gpu::launch_exact_row_forms(f, current_stream(v)), op);
}

void exact_pack(DType dt, const at::Tensor& v, int64_t rows, int64_t K, int64_t Kp, const at::Tensor& E,
                const at::Tensor* S, int fixed_digits, at::Tensor& out, const char* op) {
  gpu::ExactPackParams p{};
  p.dt = dt;
  p.v = v.data_ptr();
  p.rows = rows;
  p.K = K;
  p.Kp = Kp;
  p.plane = out.size(1) * (out.dim() == 3 ? out.size(2) : 1);
  p.E = E.data_ptr<int32_t>();
  p.S = S ? S->data_ptr<int8_t>() : nullptr;
  p.fixed_digits = fixed_digits;
  p.weight_layout = S == nullptr;
  p.out = out.data_ptr<int8_t>();
  check_launch(gpu::launch_exact_pack_digits(p, current_stream(v)), op);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_exact_pack_weight(const at::Tensor& weight) {
  const char* op = "linear_exact_pack_weight";
  check_cuda(weight, weight, op, "weight");
  const DType dt = check_linear_exact_weight<DType>(weight, op);
  c10::DeviceGuard guard(weight.device());
  auto wc = weight.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), Np = exact_ceil(N, 16), Kp = exact_ceil(K, 64);
  auto opts = weight.options();
  auto we = at::zeros({N + 1}, opts.dtype(at::kInt));
  auto ws = at::ones({std::max<int64_t>(N, 1)}, opts.dtype(at::kChar));
  auto wb = at::zeros({N}, opts.dtype(at::kByte));
  exact_row_forms(dt, wc, N, K, we, ws, wb, op);
  const int sw = N > 0 ? (int)ws.narrow(0, 0, N).max().item<int8_t>() : 1;
  auto wd = at::zeros({sw, Np * Kp}, opts.dtype(at::kChar));
  exact_pack(dt, wc, N, K, Kp, we, nullptr, sw, wd, op);
  we.narrow(0, N, 1).fill_(K);  // the packed form's in_features
  return {wd, we, wb};
}

at::Tensor linear_exact_packed(const at::Tensor& x, const at::Tensor& wd, const at::Tensor& w_exp,
                               const at::Tensor& w_bad, int64_t N, const std::optional<at::Tensor>& bias,
                               int64_t k_parts, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& weight_f64_bounds) {
  const char* op = "linear_exact_packed";
  // The CPU's fp64 path takes these; on a device every row takes the integer-MMA path (the same bits).
  (void)weight;
  (void)weight_f64_bounds;
  check_cuda(x, x, op, "x");
  check_cuda(wd, x, op, "weight_digits");
  check_cuda(w_exp, x, op, "weight_exponents");
  check_cuda(w_bad, x, op, "weight_nonfinite");
  if (bias.has_value() && bias->defined()) check_cuda(*bias, x, op, "bias");
  c10::DeviceGuard guard(x.device());
  const auto a = check_linear_exact_packed<DType>(x, wd, w_exp, w_bad, N, bias, k_parts);
  const int64_t M = a.M, K = a.K, Mp = exact_ceil(M, 16), Kp = exact_ceil(K, 64);
  auto xc = x.reshape({M, K}).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out.view(sizes);
  auto opts = x.options();
  auto xd = at::zeros({exact::kMaxDigits, Mp, Kp}, opts.dtype(at::kChar));
  auto xe = at::empty({M}, opts.dtype(at::kInt));
  auto xs = at::empty({M}, opts.dtype(at::kChar));
  auto xb = at::empty({M}, opts.dtype(at::kByte));
  exact_row_forms(a.dt, xc, M, K, xe, xs, xb, op);
  exact_pack(a.dt, xc, M, K, Kp, xe, &xs, 0, xd, op);
  gpu::ExactGemmParams p = make_exact_gemm_params(a.dt, xd, Mp, xe, xs, xb, wd, w_exp, w_bad, a.bias, out, M, N, K, Kp);
  // k_parts cuts K into parts summed on their own (exactly combined): here it sets the k per int32 level sum.
  const int64_t part = exact_ceil((Kp + std::min<int64_t>(k_parts, Kp) - 1) / std::min<int64_t>(k_parts, Kp), 32);
  p.chunk_k = std::max<int64_t>(32, std::min<int64_t>(8192, part));
  check_launch(gpu::launch_exact_gemm(p, current_stream(x)), op);
  return out.view(sizes);
}

at::Tensor linear_exact(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const char* op = "linear_exact";
  check_cuda(x, x, op, "x");
  check_cuda(weight, x, op, "weight");
  const DType dt = check_linear_exact_weight<DType>(weight, op);
  TORCH_CHECK(dtype_of<DType>(x, op, "x") == dt, "aligned::linear_exact: weight dtype ", weight.scalar_type(),
              " must equal x dtype ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "aligned::linear_exact: x has ",
              x.dim() >= 1 ? x.size(-1) : 0, " input features but weight is ", weight.sizes());
  auto [wd, we, wb] = linear_exact_pack_weight(weight);
  return linear_exact_packed(x, wd, we, wb, weight.size(0), bias, 1, std::nullopt, std::nullopt);
}

}  // namespace

#if defined(ALIGNED_EMULATED_GLUE)
ALIGNED_EMULATED_GLUE_IMPL(m) {
#else
TORCH_LIBRARY_IMPL(aligned, CUDA, m) {
#endif
  m.impl("linear", &linear);
  m.impl("linear_backward", &linear_backward);
  m.impl("linear_partial", &linear_partial);
  m.impl("rms_norm", &rms_norm);
  m.impl("rms_norm_backward", &rms_norm_backward);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("silu_and_mul_backward", &silu_and_mul_backward);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("rotary_embedding_backward", &rotary_embedding_backward);
  m.impl("logsumexp", &logsumexp);
  m.impl("log_softmax", &log_softmax);
  m.impl("token_logprobs", &token_logprobs);
  m.impl("token_logprobs_backward", &token_logprobs_backward);
  m.impl("logsumexp_backward", &logsumexp_backward);
  m.impl("log_softmax_backward", &log_softmax_backward);
  m.impl("_exp_f32", &exp_f32);
  m.impl("_log_f32", &log_f32);
  m.impl("linear_exact", &linear_exact);
  m.impl("linear_exact_pack_weight", &linear_exact_pack_weight);
  m.impl("linear_exact_packed", &linear_exact_packed);
  m.impl("_device_error_flags", &device_error_flags_tensor);
}

}  // namespace aligned::cuda
