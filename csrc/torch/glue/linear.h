// glue/linear.h — the linear families' glue bodies, one per op for every numerics profile: linear,
// linear_partial, linear_backward and the scalar reference the GEMM kernels are held to, each a template over
// the profile P and the backend B. This file also holds the `fma` profile (contract.h: 8 lanes, one tree, one
// rounding) and its families Linear and LinearReference (CPU only, a test hook); the `mma` profile and its
// families are glue/linear_mma.h. The four steps: glue/dense.h. The backend's GEMM run decides the tiling (CPU:
// 32-column panels over threads; GPU: a lane workspace), which never changes a bit (every output is one lane
// tree over all of K).
//
// A profile P says only what its ops differ in:
//   kOps                      the schema names (every error names the op)
//   kDtypes                   the dtypes its unit takes (checks/linear.h)
//   weight_operand(w)         the weight as its GEMM reads it
//   gemm<B>, reference<B>     the backend's run functions: the profile's GEMM, the scalar model of its dot
//   dx_params, dw_grad_operand, dw_params   the backward GEMMs (how many lanes, how g^T is read)
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "../checks/linear.h"
#include "../make_params.h"
#include "../registration.h"

namespace aligned::glue {

// The schema names of one profile's four linear ops.
struct LinearOpNames {
  const char* linear;
  const char* partial;
  const char* backward;
  const char* reference;
};

template <class P, class B>
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const char* op = P::kOps.linear;
  const typename B::Call call(op, x, "x");
  call.on_device(weight, "weight");
  call.on_device(bias, "bias");
  const auto a = check_linear<DType>(x, weight, bias, op, P::kDtypes);
  // M from the leading dims: reshape({-1, 0}) is ambiguous when K == 0
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto wc = P::weight_operand(weight);
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  auto out = at::empty({a.M, a.N}, x.options());
  P::template gemm<B>(call, make_linear_params(a, xc, wc, out, a.dt, kLinearLanes));
  return out.view(sizes);
}

// linear_partial: the sub-tree over `lanes` lanes of the local K, fp32, no bias (contract.h; TP row-parallel,
// finished by aligned_ops.tree_all_reduce).
template <class P, class B>
at::Tensor linear_partial(const at::Tensor& x, const at::Tensor& weight, int64_t lanes) {
  const char* op = P::kOps.partial;
  const typename B::Call call(op, x, "x");
  call.on_device(weight, "weight");
  const auto a = check_linear_partial<DType>(x, weight, lanes, op, P::kDtypes);
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto wc = P::weight_operand(weight);
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  auto out = at::empty({a.M, a.N}, x.options().dtype(at::kFloat));
  P::template gemm<B>(call, make_linear_params(a, xc, wc, out, DType::F32, (int)lanes));
  return out.view(sizes);
}

// dx [M, K] = g . w over N, dw [N, K] = g^T . x over the M tokens (in their order), db the fp32 column chains of g;
// the profile fixes the GEMMs' lanes (fma: one chain per element; mma: its 8-lane linear).
template <class P, class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward(const at::Tensor& grad, const at::Tensor& x,
                                                               const at::Tensor& weight, bool needs_x, bool needs_w,
                                                               bool needs_b) {
  const char* op = P::kOps.backward;
  const typename B::Call call(op, grad, "grad_out");
  call.on_device(x, "x");
  call.on_device(weight, "weight");
  const auto a = check_linear_backward<DType>(grad, x, weight, op, P::kDtypes);
  const int64_t M = a.M, K = a.K, N = a.N;  // K or N may be 0
  auto g = grad.reshape({M, N}).contiguous();
  at::Tensor dx, dw, db;
  if (needs_x) {
    auto wc = weight.contiguous();
    dx = at::empty({M, K}, x.options());
    P::template gemm<B>(call, P::dx_params(a, g, wc, dx));
    dx = dx.view(x.sizes());
  }
  if (needs_w) {
    auto gt = P::dw_grad_operand(g);
    auto xc = x.reshape({M, K}).contiguous();
    dw = at::empty({N, K}, weight.options());
    P::template gemm<B>(call, P::dw_params(a, gt, xc, dw));
  }
  if (needs_b) {
    db = at::empty({N}, x.options());
    B::column_sum(call, make_column_sum_params(a, g, db));
  }
  return {dx, dw, db};
}

// The scalar model of the profile's dot (contract.h's linear_partial_dot, mma.h's linear_mma_partial_dot), one
// call per output: the conformance reference every kernel path (every ISA level) is held to, llm.c style. Needs
// no unit; slow by design; test hook only.
template <class P, class B>
at::Tensor linear_reference(const at::Tensor& x, const at::Tensor& weight, int64_t lanes) {
  const char* op = P::kOps.reference;
  const typename B::Call call(op, x, "x");
  call.on_device(weight, "weight");
  const auto a = check_linear_partial<DType>(x, weight, lanes, op, P::kDtypes);
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty({a.M, a.N}, x.options().dtype(at::kFloat));
  P::template reference<B>(call, make_linear_params(a, xc, wc, out, DType::F32, (int)lanes));
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  return out.view(sizes);
}

// The `fma` profile (contract.h): fp32 fma chains on every backend.
struct FmaLinear {
  static constexpr LinearOpNames kOps{"linear", "linear_partial", "linear_backward", "_linear_partial_reference"};
  static constexpr LinearDtypes kDtypes = LinearDtypes::kAny;
  // The chains read the weight in place, any strides.
  static const at::Tensor& weight_operand(const at::Tensor& w) { return w; }
  template <class B>
  static void gemm(const typename B::Call& call, const GemmParams& p) {
    B::gemm(call, p);
  }
  template <class B>
  static void reference(const typename B::Call& call, const GemmParams& p) {
    B::linear_partial_reference(call, p);
  }
  // Backward: one chain per element; g^T is g read in place.
  static GemmParams dx_params(const LinearArgs<DType>& a, const at::Tensor& g, const at::Tensor& w,
                              const at::Tensor& dx) {
    return make_linear_dx_params(a, g, w, dx);
  }
  static const at::Tensor& dw_grad_operand(const at::Tensor& g) { return g; }
  static GemmParams dw_params(const LinearArgs<DType>& a, const at::Tensor& g, const at::Tensor& x,
                              const at::Tensor& dw) {
    return make_linear_dw_params(a, g, x, dw);
  }
};

struct Linear {
  template <class B>
  static constexpr std::tuple ops{
      Op{"linear", &linear<FmaLinear, B>},
      Op{"linear_partial", &linear_partial<FmaLinear, B>},
      Op{"linear_backward", &linear_backward<FmaLinear, B>},
  };
};

struct LinearReference {
  template <class B>
  static constexpr std::tuple ops{Op{"_linear_partial_reference", &linear_reference<FmaLinear, B>}};
};

}  // namespace aligned::glue
