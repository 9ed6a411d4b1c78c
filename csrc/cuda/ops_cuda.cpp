// ops_cuda.cpp — torch glue of the dense ops on the GPU: argument checks, output allocation, the current
// stream, and a call to the torch-free launchers of csrc/gpu/dense_api.h (kernels: csrc/gpu/*.cuh, built by
// csrc/cuda/dense.cu with nvcc or csrc/hip/dense.hip with hip-clang).
//
// The same file serves CUDA and ROCm torch: ROCm torch registers HIP kernels under the CUDA dispatch key and
// reports HIP devices as device type "cuda", so only the stream accessor differs (ALIGNED_ROCM, set by
// CMakeLists.txt for a ROCm torch). Only c10-level headers are used (no ATen/cuda/CUDAContext.h), so this
// file also syntax-checks against the CPU torch wheel with -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE (see
// cmake/gpu_compile_check.cmake). Checks mirror csrc/cpu/ops_cpu.cpp (same messages), plus: every tensor
// must be a CUDA tensor on the same device as the first input.
//
// Range checks of positions / token ids read the min/max back to the host (one synchronisation), exactly
// like the CPU glue: out-of-range indices must be an error, never an out-of-bounds read.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#if defined(ALIGNED_ROCM)
#include <c10/hip/HIPStream.h>
#else
#include <c10/cuda/CUDAStream.h>
#endif

#include <cmath>
#include <optional>
#include <tuple>

#include "../gpu/dense_api.h"

namespace aligned::cuda {
namespace {

using gpu::DType;

void* current_stream(const at::Tensor& t) {
#if defined(ALIGNED_ROCM)
  return (void*)c10::hip::getCurrentHIPStream(t.device().index()).stream();
#else
  return (void*)c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#endif
}

void check_launch(const char* err, const char* op) {
  TORCH_CHECK(err == nullptr, "aligned::", op, ": kernel launch failed: ", err ? err : "");
}

DType dtype_of(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    default:
      TORCH_CHECK(false, "aligned::", op, ": ", name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

// t must live on the same CUDA device as ref (ref itself must be a CUDA tensor).
void check_cuda(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cuda(), "aligned::", op, ": ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == ref.device(), "aligned::", op, ": ", name, " is on ", t.device(), " but the inputs are on ",
              ref.device(), " (all tensors must be on the same device)");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const char* op = "rms_norm";
  check_cuda(x, x, op, "x");
  check_cuda(weight, x, op, "weight");
  DType dt = dtype_of(x, op, "x"), wdt = dtype_of(weight, op, "weight");
  TORCH_CHECK(x.dim() >= 1, "aligned::rms_norm: x must have at least one dimension");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "aligned::rms_norm: weight must have shape [", H,
              "], got ", weight.sizes());
  TORCH_CHECK(wdt == dt || wdt == DType::F32, "aligned::rms_norm: weight dtype must equal x dtype or be float32");
  TORCH_CHECK(eps >= 0, "aligned::rms_norm: eps must be >= 0");
  c10::DeviceGuard guard(x.device());
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  gpu::RmsNormParams p{};
  p.dt = dt;
  p.wdt = wdt;
  p.x = xc.data_ptr();
  p.w = wc.data_ptr();
  p.out = out.data_ptr();
  p.H = H;
  p.rows = H == 0 ? 0 : xc.numel() / H;
  p.eps = (float)eps;
  check_launch(gpu::launch_rms_norm(p, current_stream(x)), op);
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  const char* op = "fused_add_rms_norm";
  check_cuda(x, x, op, "x");
  check_cuda(residual, x, op, "residual");
  check_cuda(weight, x, op, "weight");
  DType dt = dtype_of(x, op, "x"), wdt = dtype_of(weight, op, "weight");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && residual.sizes() == x.sizes(),
              "aligned::fused_add_rms_norm: residual must match x in shape and dtype, got ", residual.sizes(), " ",
              residual.scalar_type(), " vs ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "aligned::fused_add_rms_norm: x must have at least one dimension");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "aligned::fused_add_rms_norm: weight must have shape [", H,
              "], got ", weight.sizes());
  TORCH_CHECK(wdt == dt || wdt == DType::F32,
              "aligned::fused_add_rms_norm: weight dtype must equal x dtype or be float32");
  c10::DeviceGuard guard(x.device());
  auto xc = x.contiguous(), rc = residual.contiguous(), wc = weight.contiguous();
  auto out = at::empty_like(xc), res_out = at::empty_like(xc);
  gpu::RmsNormParams p{};
  p.dt = dt;
  p.wdt = wdt;
  p.x = xc.data_ptr();
  p.residual = rc.data_ptr();
  p.w = wc.data_ptr();
  p.out = out.data_ptr();
  p.residual_out = res_out.data_ptr();
  p.H = H;
  p.rows = H == 0 ? 0 : xc.numel() / H;
  p.eps = (float)eps;
  check_launch(gpu::launch_fused_add_rms_norm(p, current_stream(x)), op);
  return {out, res_out};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad, const at::Tensor& x,
                                                     const at::Tensor& weight, double eps) {
  const char* op = "rms_norm_backward";
  check_cuda(x, x, op, "x");
  check_cuda(grad, x, op, "grad_out");
  check_cuda(weight, x, op, "weight");
  DType dt = dtype_of(x, op, "x"), wdt = dtype_of(weight, op, "weight");
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type(),
              "aligned::rms_norm_backward: grad_out must match x in shape and dtype");
  TORCH_CHECK(x.dim() >= 1, "aligned::rms_norm_backward: x must have at least one dimension");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "aligned::rms_norm_backward: weight must have shape [", H,
              "], got ", weight.sizes());
  TORCH_CHECK(wdt == dt || wdt == DType::F32,
              "aligned::rms_norm_backward: weight dtype must equal x dtype or be float32");
  c10::DeviceGuard guard(x.device());
  auto gc = grad.contiguous(), xc = x.contiguous(), wc = weight.contiguous();
  const int64_t rows = H == 0 ? 0 : xc.numel() / H;
  auto dx = at::empty_like(xc);
  auto inv = at::empty({rows}, x.options().dtype(at::kFloat));
  auto dw = at::empty({H}, x.options().dtype(at::kFloat));
  gpu::RmsNormBackwardParams p{};
  p.dt = dt;
  p.wdt = wdt;
  p.g = gc.data_ptr();
  p.x = xc.data_ptr();
  p.w = wc.data_ptr();
  p.dx = dx.data_ptr();
  p.inv = inv.data_ptr<float>();
  p.dw = dw.data_ptr<float>();
  p.rows = rows;
  p.H = H;
  p.eps = (float)eps;
  check_launch(gpu::launch_rms_norm_backward(p, current_stream(x)), op);
  return {dx, dw.to(weight.scalar_type())};
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  const char* op = "silu_and_mul";
  check_cuda(x, x, op, "x");
  DType dt = dtype_of(x, op, "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "aligned::silu_and_mul: last dimension of x must be even (2*d), got ",
              x.sizes());
  c10::DeviceGuard guard(x.device());
  const int64_t d = x.size(-1) / 2;
  auto xc = x.contiguous();
  auto sizes = xc.sizes().vec();
  sizes.back() = d;
  auto out = at::empty(sizes, xc.options());
  gpu::SiluMulParams p{};
  p.dt = dt;
  p.x = xc.data_ptr();
  p.out = out.data_ptr();
  p.d = d;
  p.rows = d == 0 ? 0 : xc.numel() / (2 * d);
  check_launch(gpu::launch_silu_and_mul(p, current_stream(x)), op);
  return out;
}

at::Tensor silu_and_mul_backward(const at::Tensor& grad, const at::Tensor& x) {
  const char* op = "silu_and_mul_backward";
  check_cuda(x, x, op, "x");
  check_cuda(grad, x, op, "grad_out");
  DType dt = dtype_of(x, op, "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0,
              "aligned::silu_and_mul_backward: last dimension of x must be even (2*d), got ", x.sizes());
  const int64_t d = x.size(-1) / 2;
  TORCH_CHECK(grad.scalar_type() == x.scalar_type() && grad.numel() * 2 == x.numel(),
              "aligned::silu_and_mul_backward: grad_out must be x's dtype with half its last dimension");
  c10::DeviceGuard guard(x.device());
  auto gc = grad.contiguous(), xc = x.contiguous();
  auto dx = at::empty_like(xc);
  gpu::SiluMulParams p{};
  p.dt = dt;
  p.g = gc.data_ptr();
  p.x = xc.data_ptr();
  p.out = dx.data_ptr();
  p.d = d;
  p.rows = d == 0 ? 0 : xc.numel() / (2 * d);
  check_launch(gpu::launch_silu_and_mul_backward(p, current_stream(x)), op);
  return dx;
}

at::Tensor rotary_impl(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cache, int64_t rot,
                       bool is_neox, bool inverse, const char* op) {
  check_cuda(x, x, op, "x");
  check_cuda(positions, x, op, "positions");
  check_cuda(cache, x, op, "cos_sin_cache");
  DType dt = dtype_of(x, op, "x");
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
  c10::DeviceGuard guard(x.device());
  auto pos = positions.to(at::kLong).contiguous();
  const int64_t max_pos = cache.size(0);
  if (T > 0) {
    const int64_t lo = pos.min().item<int64_t>(), hi = pos.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < max_pos, "aligned::", op, ": positions must lie in [0, ", max_pos, "), got [", lo,
                ", ", hi, "]");
  }
  auto xc = x.contiguous(), cc = cache.contiguous();
  auto out = at::empty_like(xc);
  gpu::RotaryParams p{};
  p.dt = dt;
  p.positions = pos.data_ptr<int64_t>();
  p.x = xc.data_ptr();
  p.out = out.data_ptr();
  p.cache = cc.data_ptr<float>();
  p.T = T;
  p.heads = heads;
  p.head_dim = head_dim;
  p.rot = rot;
  p.is_neox = is_neox;
  p.inverse = inverse;
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

// Shared validation for the log-prob family (mirrors ops_cpu.cpp check_logits / check_ids).
struct LogitsArgs {
  at::Tensor z, temps, ids;
  gpu::LogitsParams p{};
};

LogitsArgs check_logits(const at::Tensor& logits, double temperature, const std::optional<at::Tensor>& temperatures,
                        const char* op) {
  check_cuda(logits, logits, op, "logits");
  LogitsArgs a;
  a.p.dt = dtype_of(logits, op, "logits");
  TORCH_CHECK(logits.dim() == 2, "aligned::", op, ": logits must be [tokens, vocab], got ", logits.sizes());
  a.p.T = logits.size(0);
  a.p.V = logits.size(1);
  TORCH_CHECK(a.p.V > 0 || a.p.T == 0, "aligned::", op, ": vocab size must be > 0");
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0, "aligned::", op,
              ": temperature must be finite and > 0, got ", temperature,
              " (greedy decoding: pass 1.0 to score the raw distribution)");
  a.p.tau = (float)temperature;
  if (temperatures.has_value() && temperatures->defined()) {
    const auto& t = *temperatures;
    check_cuda(t, logits, op, "temperatures");
    TORCH_CHECK(t.dim() == 1 && t.size(0) == a.p.T, "aligned::", op, ": temperatures must be [", a.p.T, "], got ",
                t.sizes());
    a.temps = t.to(at::kFloat).contiguous();
    if (a.p.T > 0) {
      TORCH_CHECK(a.temps.gt(0).all().item<bool>() && a.temps.isfinite().all().item<bool>(), "aligned::", op,
                  ": every temperature must be finite and > 0");
    }
    a.p.temps = a.temps.data_ptr<float>();
  }
  a.z = logits.contiguous();
  a.p.z = a.z.data_ptr();
  return a;
}

void check_ids(const at::Tensor& ids, LogitsArgs& a, const char* op) {
  check_cuda(ids, a.z, op, "token_ids");
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, "aligned::", op,
              ": token_ids must be int64 or int32, got ", ids.scalar_type());
  TORCH_CHECK(ids.dim() == 1 && ids.size(0) == a.p.T, "aligned::", op, ": token_ids must be [", a.p.T, "], got ",
              ids.sizes());
  a.ids = ids.to(at::kLong).contiguous();
  if (a.p.T > 0) {
    const int64_t lo = a.ids.min().item<int64_t>(), hi = a.ids.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < a.p.V, "aligned::", op, ": token_ids must lie in [0, ", a.p.V, "), got [", lo, ", ",
                hi, "]");
  }
  a.p.ids = a.ids.data_ptr<int64_t>();
}

at::Tensor logsumexp(const at::Tensor& logits, double temperature, const std::optional<at::Tensor>& temperatures) {
  const char* op = "logsumexp";
  auto a = check_logits(logits, temperature, temperatures, op);
  c10::DeviceGuard guard(logits.device());
  auto lse = at::empty({a.p.T}, a.z.options().dtype(at::kFloat));
  a.p.lse = lse.data_ptr<float>();
  check_launch(gpu::launch_logsumexp(a.p, current_stream(logits)), op);
  return lse;
}

at::Tensor log_softmax(const at::Tensor& logits, double temperature, const std::optional<at::Tensor>& temperatures) {
  const char* op = "log_softmax";
  auto a = check_logits(logits, temperature, temperatures, op);
  c10::DeviceGuard guard(logits.device());
  auto out = at::empty({a.p.T, a.p.V}, a.z.options().dtype(at::kFloat));
  a.p.out_f32 = out.data_ptr<float>();
  check_launch(gpu::launch_log_softmax(a.p, current_stream(logits)), op);
  return out;
}

at::Tensor token_logprobs(const at::Tensor& logits, const at::Tensor& ids, double temperature,
                          const std::optional<at::Tensor>& temperatures) {
  const char* op = "token_logprobs";
  auto a = check_logits(logits, temperature, temperatures, op);
  check_ids(ids, a, op);
  c10::DeviceGuard guard(logits.device());
  auto out = at::empty({a.p.T}, a.z.options().dtype(at::kFloat));
  a.p.out_f32 = out.data_ptr<float>();
  check_launch(gpu::launch_token_logprobs(a.p, current_stream(logits)), op);
  return out;
}

at::Tensor token_logprobs_backward(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& ids,
                                   double temperature, const std::optional<at::Tensor>& temperatures) {
  const char* op = "token_logprobs_backward";
  auto a = check_logits(logits, temperature, temperatures, op);
  check_ids(ids, a, op);
  check_cuda(grad, logits, op, "grad");
  TORCH_CHECK(grad.dim() == 1 && grad.size(0) == a.p.T, "aligned::token_logprobs_backward: grad must be [", a.p.T,
              "]");
  c10::DeviceGuard guard(logits.device());
  auto g = grad.to(at::kFloat).contiguous();
  auto dz = at::empty({a.p.T, a.p.V}, a.z.options());
  a.p.g = g.data_ptr<float>();
  a.p.dz = dz.data_ptr();
  check_launch(gpu::launch_token_logprobs_backward(a.p, current_stream(logits)), op);
  return dz;
}

// ---- linear --------------------------------------------------------------------------------------------
void run_gemm(DType dt, const at::Tensor& A, int64_t a_sm, int64_t a_sk, const at::Tensor& B, int64_t b_sn,
              int64_t b_sk, const at::Tensor* bias, at::Tensor& C, int64_t M, int64_t N, int64_t K, const char* op) {
  gpu::GemmParams p{};
  p.adt = p.bdt = p.cdt = dt;
  p.A = A.data_ptr();
  p.a_sm = a_sm;
  p.a_sk = a_sk;
  p.B = B.data_ptr();
  p.b_sn = b_sn;
  p.b_sk = b_sk;
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.C = C.data_ptr();
  p.c_sm = N;
  p.M = M;
  p.N = N;
  p.K = K;
  check_launch(gpu::launch_gemm(p, current_stream(C)), op);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const char* op = "linear";
  check_cuda(x, x, op, "x");
  check_cuda(weight, x, op, "weight");
  DType dt = dtype_of(x, op, "x");
  dtype_of(weight, op, "weight");
  TORCH_CHECK(x.dim() >= 1, "aligned::linear: x must have at least one dimension");
  TORCH_CHECK(weight.dim() == 2, "aligned::linear: weight must be [out_features, in_features], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "aligned::linear: weight dtype ", weight.scalar_type(),
              " must equal x dtype ", x.scalar_type());
  const int64_t K = x.size(-1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "aligned::linear: x has ", K, " input features but weight is ", weight.sizes());
  c10::DeviceGuard guard(x.device());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    check_cuda(*bias, x, op, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == x.scalar_type(),
                "aligned::linear: bias must be [", N, "] with x's dtype, got ", bias->sizes(), " ", bias->scalar_type());
    b = bias->contiguous();
  }
  // M from the leading dims (reshape({-1, 0}) is ambiguous when K == 0).
  const int64_t M = c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
  auto xc = x.reshape({M, K}).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto out = at::empty({M, N}, x.options());
  if (M > 0 && N > 0)
    run_gemm(dt, xc, K, 1, weight, weight.stride(0), weight.stride(1), b.defined() ? &b : nullptr, out, M, N, K, op);
  return out.view(sizes);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward(const at::Tensor& grad, const at::Tensor& x,
                                                               const at::Tensor& weight, bool needs_x, bool needs_w,
                                                               bool needs_b) {
  const char* op = "linear_backward";
  check_cuda(x, x, op, "x");
  check_cuda(grad, x, op, "grad_out");
  check_cuda(weight, x, op, "weight");
  DType dt = dtype_of(x, op, "x");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2 && weight.size(1) == x.size(-1) &&
                  weight.scalar_type() == x.scalar_type(),
              "aligned::linear_backward: weight must be [out_features, ", x.size(-1), "] with x's dtype, got ",
              weight.sizes(), " ", weight.scalar_type());
  const int64_t K = x.size(-1), N = weight.size(0);
  TORCH_CHECK(grad.dim() >= 1 && grad.size(-1) == N && grad.scalar_type() == x.scalar_type() &&
                  grad.sizes().slice(0, grad.dim() - 1) == x.sizes().slice(0, x.dim() - 1),
              "aligned::linear_backward: grad_out must be [..., ", N, "] with x's dtype");
  c10::DeviceGuard guard(x.device());
  const int64_t M = c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
  auto g = grad.reshape({M, N}).contiguous();
  auto xc = x.reshape({M, K}).contiguous();
  auto wc = weight.contiguous();
  at::Tensor dx, dw, db;
  if (needs_x) {
    // dx[m, k] = chain over n of g[m, n] * w[n, k]
    dx = at::empty({M, K}, x.options());
    if (M > 0 && K > 0) run_gemm(dt, g, N, 1, wc, 1, K, nullptr, dx, M, K, N, op);
    dx = dx.view(x.sizes());
  }
  if (needs_w) {
    // dw[n, k] = chain over m (token order) of g[m, n] * x[m, k]
    dw = at::empty({N, K}, weight.options());
    if (N > 0 && K > 0) run_gemm(dt, g, 1, N, xc, 1, K, nullptr, dw, N, K, M, op);
  }
  if (needs_b) {
    db = at::empty({N}, x.options());
    gpu::ColumnSumParams p{};
    p.dt = p.out_dt = dt;
    p.g = g.data_ptr();
    p.out = db.data_ptr();
    p.rows = M;
    p.cols = N;
    check_launch(gpu::launch_column_sum(p, current_stream(x)), op);
  }
  return {dx, dw, db};
}

at::Tensor elementwise_f32(const at::Tensor& x, bool is_log, const char* op) {
  check_cuda(x, x, op, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "aligned::", op, ": x must be float32");
  c10::DeviceGuard guard(x.device());
  auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  gpu::ElementwiseParams p{xc.data_ptr<float>(), out.data_ptr<float>(), xc.numel()};
  check_launch(is_log ? gpu::launch_log_f32(p, current_stream(x)) : gpu::launch_exp_f32(p, current_stream(x)), op);
  return out;
}
at::Tensor exp_f32(const at::Tensor& x) { return elementwise_f32(x, false, "_exp_f32"); }
at::Tensor log_f32(const at::Tensor& x) { return elementwise_f32(x, true, "_log_f32"); }

}  // namespace

TORCH_LIBRARY_IMPL(aligned, CUDA, m) {
  m.impl("linear", &linear);
  m.impl("linear_backward", &linear_backward);
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
  m.impl("_exp_f32", &exp_f32);
  m.impl("_log_f32", &log_f32);
}

}  // namespace aligned::cuda
