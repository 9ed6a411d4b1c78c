// glue/linear.h — the `fma` linear family's glue bodies (contract.h: 8 lanes, one tree, one rounding): linear,
// linear_partial, linear_backward (family Linear), and the scalar reference of the GEMM kernels,
// _linear_partial_reference (family LinearReference: CPU only, a test hook). The four steps: glue/dense.h. The
// backend's gemm run decides the tiling (CPU: 32-column panels over threads; GPU: a lane workspace), which
// never changes a bit (contract.h, `fma` profile).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "../checks/linear.h"
#include "../make_params.h"
#include "../registration.h"

namespace aligned::glue {

template <class B>
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const typename B::Call call("linear", x, "x");
  call.on_device(weight, "weight");
  call.on_device(bias, "bias");
  const auto a = check_linear<DType>(x, weight, bias);
  // M from the leading dims: reshape({-1, 0}) is ambiguous when K == 0
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  auto out = at::empty({a.M, a.N}, x.options());
  B::gemm(call, make_linear_params(a, xc, weight, out, a.dt, kLinearLanes));
  return out.view(sizes);
}

// linear_partial: the sub-tree over `lanes` lanes of the local K, fp32, no bias (contract.h).
template <class B>
at::Tensor linear_partial(const at::Tensor& x, const at::Tensor& weight, int64_t lanes) {
  const typename B::Call call("linear_partial", x, "x");
  call.on_device(weight, "weight");
  const auto a = check_linear_partial<DType>(x, weight, lanes);
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  auto out = at::empty({a.M, a.N}, x.options().dtype(at::kFloat));
  B::gemm(call, make_linear_params(a, xc, weight, out, DType::F32, (int)lanes));
  return out.view(sizes);
}

template <class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward(const at::Tensor& grad, const at::Tensor& x,
                                                               const at::Tensor& weight, bool needs_x, bool needs_w,
                                                               bool needs_b) {
  const typename B::Call call("linear_backward", grad, "grad_out");
  call.on_device(x, "x");
  call.on_device(weight, "weight");
  const auto a = check_linear_backward<DType>(grad, x, weight);
  const int64_t M = a.M, K = a.K, N = a.N;  // K or N may be 0
  auto g = grad.reshape({M, N}).contiguous();
  auto xc = x.reshape({M, K}).contiguous();
  auto wc = weight.contiguous();
  at::Tensor dx, dw, db;
  if (needs_x) {  // dx[m, k] = chain over n of g[m, n] * w[n, k]
    dx = at::empty({M, K}, x.options());
    B::gemm(call, make_linear_dx_params(a, g, wc, dx));
    dx = dx.view(x.sizes());
  }
  if (needs_w) {  // dw[n, k] = chain over m (token order) of g[m, n] * x[m, k]
    dw = at::empty({N, K}, weight.options());
    B::gemm(call, make_linear_dw_params(a, g, xc, dw));
  }
  if (needs_b) {
    db = at::empty({N}, x.options());
    B::column_sum(call, make_column_sum_params(a, g, db));
  }
  return {dx, dw, db};
}

// _linear_partial_reference: contract.h's scalar linear_partial_dot, one call per output, for the conformance
// test that holds the GEMM kernels (every ISA level) to the helper itself. Slow by design; test hook only.
template <class B>
at::Tensor linear_partial_reference(const at::Tensor& x, const at::Tensor& weight, int64_t lanes) {
  const typename B::Call call("_linear_partial_reference", x, "x");
  call.on_device(weight, "weight");
  const auto a = check_linear_partial<DType>(x, weight, lanes);
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty({a.M, a.N}, x.options().dtype(at::kFloat));
  B::linear_partial_reference(call, make_linear_params(a, xc, wc, out, DType::F32, (int)lanes));
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  return out.view(sizes);
}

struct Linear {
  template <class B>
  static constexpr std::tuple ops{
      Op{"linear", &linear<B>},
      Op{"linear_partial", &linear_partial<B>},
      Op{"linear_backward", &linear_backward<B>},
  };
};

struct LinearReference {
  template <class B>
  static constexpr std::tuple ops{Op{"_linear_partial_reference", &linear_partial_reference<B>}};
};

}  // namespace aligned::glue
