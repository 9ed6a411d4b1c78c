// ops_exact_cpu.cpp — torch glue of the `exact` linear on the CPU: weight packing (once per weight version;
// the Python wrapper caches it), activation packing, the split of row blocks x 64-column groups across threads,
// and the choice of integer unit. The numbers are defined in csrc/common/exact_linear.h; the arithmetic is
// in gemm_exact_kernels.cpp. Threads only pick which tiles they compute; every output is an exact integer
// rounded once, so neither threads nor the unit can change a bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <stdlib.h>
#include <string.h>

#include <vector>

#include "cpu_backend.h"
#include "emulation_hook.h"
#include "glue_checks.h"

namespace aligned::cpu {

namespace {

DType dtype_enum(const at::Tensor& t, const char* op, const char* name) { return dtype_of<DType>(t, op, name); }

// AMX-INT8 tiles where the chosen level grants them (cpu_backend.h: level "amx").
bool use_amx() { return cpu_backend().amx_int8; }

constexpr int64_t ceil_to(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_exact_pack_weight(const at::Tensor& weight) {
  const char* op = "linear_exact_pack_weight";
  check_cpu(weight, op, "weight");
  const DType dt = check_linear_exact_weight<DType>(weight, op);
  auto wc = weight.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), Np = ceil_to(N, 16), Kp = ceil_to(K, 64);
  const auto& k = exact_kernels();
  std::vector<exact::RowForm> forms((size_t)std::max<int64_t>(N, 1));
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) { k.w_forms(dt, wc.data_ptr(), K, forms.data(), b, e); });
  int sw = 1;
  for (int64_t n = 0; n < N; ++n) sw = std::max(sw, forms[n].S);
  auto opts = weight.options();
  auto wd = at::zeros({sw, Np * Kp}, opts.dtype(at::kChar));
  auto we = at::zeros({N + 1}, opts.dtype(at::kInt));
  we.data_ptr<int32_t>()[N] = (int32_t)K;  // the packed form's in_features
  auto wb = at::zeros({N}, opts.dtype(at::kByte));
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    k.pack_w(dt, wc.data_ptr(), K, Kp, Np * Kp, sw, forms.data(), wd.data_ptr<int8_t>(), we.data_ptr<int32_t>(),
             wb.data_ptr<uint8_t>(), b, e);
  });
  return {wd, we, wb};
}

at::Tensor linear_exact_packed(const at::Tensor& x, const at::Tensor& wd, const at::Tensor& w_exp,
                               const at::Tensor& w_bad, int64_t N, const std::optional<at::Tensor>& bias,
                               int64_t k_parts) {
  const char* op = "linear_exact_packed";
  check_cpu(x, op, "x");
  check_cpu(wd, op, "weight_digits");
  if (bias.has_value() && bias->defined()) check_cpu(*bias, op, "bias");
  const auto a = check_linear_exact_packed<DType>(x, wd, w_exp, w_bad, N, bias, k_parts);
  const int64_t M = a.M, K = a.K, Mp = ceil_to(M, 16), Kp = ceil_to(K, 64);
  auto xc = x.reshape({M, K}).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out.view(sizes);
  const auto& k = exact_kernels();
  const int maxd = exact::kMaxDigits;
  auto opts = x.options();
  auto xd = at::empty({maxd, Mp, Kp}, opts.dtype(at::kChar));
  auto xe = at::zeros({Mp}, opts.dtype(at::kInt));
  auto xs = at::zeros({Mp}, opts.dtype(at::kChar));
  auto xb = at::zeros({Mp}, opts.dtype(at::kByte));
  if (Mp > M) {  // padding rows of the last tile: zero digits
    for (int t = 0; t < maxd; ++t) memset(xd.data_ptr<int8_t>() + (t * Mp + M) * Kp, 0, (size_t)((Mp - M) * Kp));
  }
  at::parallel_for(0, M, 4, [&](int64_t b, int64_t e) {
    k.pack_x(a.dt, xc.data_ptr(), K, Kp, Mp * Kp, maxd, xd.data_ptr<int8_t>(), xe.data_ptr<int32_t>(),
             xs.data_ptr<int8_t>(), xb.data_ptr<uint8_t>(), b, e);
  });
  ExactGemmParams p{};
  p.xd = xd.data_ptr<int8_t>();
  p.x_plane = Mp * Kp;
  p.x_exp = xe.data_ptr<int32_t>();
  p.x_digits = xs.data_ptr<int8_t>();
  p.x_bad = xb.data_ptr<uint8_t>();
  p.wd = wd.data_ptr<int8_t>();
  p.w_plane = wd.size(1);
  p.w_exp = w_exp.data_ptr<int32_t>();
  p.w_bad = w_bad.data_ptr<uint8_t>();
  p.w_digits = (int)wd.size(0);
  p.bias = a.bias.defined() ? a.bias.data_ptr() : nullptr;
  p.dt = a.dt;
  p.out = out.data_ptr();
  p.M = M;
  p.N = N;
  p.K = K;
  p.Kp = Kp;
  p.k_parts = (int)std::min<int64_t>(k_parts, 1 << 20);
  p.use_amx = use_amx();
  // Tasks: blocks of rows x groups of 64 columns, column group outermost, so a thread's consecutive tasks
  // share the group's weight digits (the kernel keeps each 16-column panel in cache while its row tiles
  // pass). AMX takes up to 256 rows per task (its tile configuration is loaded once per task); the vector
  // levels 16.
  constexpr int64_t kCols = 64;
  const int64_t rows_per_task = p.use_amx ? 256 : 16;
  const int64_t mt = (M + rows_per_task - 1) / rows_per_task, ng = (N + kCols - 1) / kCols;
  at::parallel_for(0, mt * ng, 1, [&](int64_t b, int64_t e) {
    for (int64_t task = b; task < e; ++task) {
      ExactGemmParams q = p;
      const int64_t g = task / mt, i = task % mt;
      q.m0 = i * rows_per_task;
      q.m1 = std::min(M, q.m0 + rows_per_task);
      q.n0 = g * kCols;
      q.n1 = std::min(N, q.n0 + kCols);
      k.gemm(q);
    }
  });
  return out.view(sizes);
}

at::Tensor linear_exact(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const char* op = "linear_exact";
  check_cpu(x, op, "x");
  check_cpu(weight, op, "weight");
  const DType dt = check_linear_exact_weight<DType>(weight, op);
  TORCH_CHECK(dtype_enum(x, op, "x") == dt, "aligned::linear_exact: weight dtype ", weight.scalar_type(),
              " must equal x dtype ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "aligned::linear_exact: x has ",
              x.dim() >= 1 ? x.size(-1) : 0, " input features but weight is ", weight.sizes());
  auto [wd, we, wb] = linear_exact_pack_weight(weight);
  return linear_exact_packed(x, wd, we, wb, weight.size(0), bias, 1);
}

// The scalar definition (exact_linear.h: canonical integers, one int128 sum, one rounding): for tests.
at::Tensor linear_exact_reference(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const char* op = "_linear_exact_reference";
  check_cpu(x, op, "x");
  check_cpu(weight, op, "weight");
  check_linear_exact_weight<DType>(weight, op);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "aligned::", op, ": x must be float32, bfloat16 or float16");
  const int64_t K = weight.size(1), N = weight.size(0);
  auto x2 = x.reshape({-1, K}).to(at::kFloat).contiguous();
  auto w2 = weight.to(at::kFloat).contiguous();
  const int64_t M = x2.size(0);
  const float* xp = x2.data_ptr<float>();
  const float* wp = w2.data_ptr<float>();
  std::vector<exact::RowForm> wf(N);
  int sw = 1;
  for (int64_t n = 0; n < N; ++n) {
    wf[n] = exact::row_form(wp + n * K, K);
    sw = std::max(sw, wf[n].S);
  }
  std::vector<int32_t> W((size_t)(N * K)), X((size_t)K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const float v = wp[n * K + k];
      W[n * K + k] = exact::is_finite_bits(v) ? exact::quantize(v, sw, wf[n].E) : 0;
    }
  auto out32 = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* o = out32.data_ptr<float>();
  std::optional<at::Tensor> b32;
  if (bias.has_value() && bias->defined()) b32 = bias->to(at::kFloat).contiguous();
  for (int64_t m = 0; m < M; ++m) {
    const exact::RowForm f = exact::row_form(xp + m * K, K);
    for (int64_t k = 0; k < K; ++k) {
      const float v = xp[m * K + k];
      X[k] = exact::is_finite_bits(v) ? exact::quantize(v, f.S, f.E) : 0;
    }
    for (int64_t n = 0; n < N; ++n) {
      float y;
      if (f.bad || wf[n].bad) {
        y = float_of(0x7fc00000u);
      } else {
        const __int128 s = exact::exact_dot_ref(X.data(), W.data() + n * K, K);
        y = exact::round_i128_f32(s, (f.E + 3 - 8 * f.S) + (wf[n].E + 3 - 8 * sw));
      }
      if (b32) y = y + b32->data_ptr<float>()[n];
      o[m * N + n] = y;
    }
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return out32.to(x.scalar_type()).view(sizes);
}

std::string exact_unit() { return exact_kernels().unit(use_amx()); }

}  // namespace

TORCH_LIBRARY_IMPL(aligned, CPU, lib) {
  EmulationAwareLibrary m(lib);  // under aligned_ops.emulate(arch): the GPU source runs (emulation_hook.h)
  m.impl("linear_exact", &linear_exact);
  m.impl("linear_exact_pack_weight", &linear_exact_pack_weight);
  m.impl("linear_exact_packed", &linear_exact_packed);
  lib.impl("_linear_exact_reference", &linear_exact_reference);
}

// No tensor arguments: a catch-all kernel (schema in torch_bindings.cpp).
TORCH_LIBRARY_IMPL(aligned, CatchAll, m) { m.impl("_exact_unit", &exact_unit); }

}  // namespace aligned::cpu
