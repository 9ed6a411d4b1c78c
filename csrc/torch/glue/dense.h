// glue/dense.h — the dense family's glue bodies, one per op, for any backend B (csrc/torch/backends/):
// rms_norm, fused_add_rms_norm, rms_norm_backward, silu_and_mul(+_backward), rotary_embedding(+_backward).
//
// Every body has the same four steps: the devices (B::Call checks each tensor against the op's first one and
// holds the device guard), the family's checks (checks/dense.h, the same rule and words on every backend), the
// outputs and the params (make_params.h), then the backend's run function B::<op>(call, params), which holds
// everything that differs between backends (threads on the CPU, streams and launches on a GPU). No arithmetic
// here: the formulas are csrc/common's, the loops the kernels'.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "../checks/dense.h"
#include "../make_params.h"
#include "../registration.h"

namespace aligned::glue {

template <class B>
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const typename B::Call call("rms_norm", x, "x");
  call.on_device(weight, "weight");
  const auto a = check_rms_norm<DType>(x, weight, eps);
  auto xc = x.contiguous(), wc = weight.contiguous();
  auto out = at::empty_like(xc);
  B::rms_norm(call, make_rms_norm_params(a, xc, wc, out, eps));
  return out;
}

template <class B>
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  const typename B::Call call("fused_add_rms_norm", x, "x");
  call.on_device(residual, "residual");
  call.on_device(weight, "weight");
  const auto a = check_fused_add_rms_norm<DType>(x, residual, weight, eps);
  auto xc = x.contiguous(), rc = residual.contiguous(), wc = weight.contiguous();
  auto out = at::empty_like(xc), res_out = at::empty_like(xc);
  B::fused_add_rms_norm(call, make_rms_norm_params(a, xc, wc, out, eps, rc, res_out));
  return {out, res_out};
}

template <class B>
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad, const at::Tensor& x,
                                                     const at::Tensor& weight, double eps) {
  const typename B::Call call("rms_norm_backward", grad, "grad_out");
  call.on_device(x, "x");
  call.on_device(weight, "weight");
  const auto a = check_rms_norm_backward<DType>(grad, x, weight, eps);
  auto gc = grad.contiguous(), xc = x.contiguous(), wc = weight.contiguous();
  auto dx = at::empty_like(xc);
  auto inv = at::empty({a.rows}, x.options().dtype(at::kFloat));
  auto dw = at::empty({a.H}, x.options().dtype(at::kFloat));
  B::rms_norm_backward(call, make_rms_norm_backward_params(a, gc, xc, wc, dx, inv, dw, eps));
  return {dx, dw.to(weight.scalar_type())};
}

template <class B>
at::Tensor silu_and_mul(const at::Tensor& x) {
  const typename B::Call call("silu_and_mul", x, "x");
  const auto a = check_silu_and_mul<DType>(x);
  auto xc = x.contiguous();
  auto sizes = xc.sizes().vec();
  sizes.back() = a.d;
  auto out = at::empty(sizes, xc.options());
  B::silu_and_mul(call, make_silu_and_mul_params(a, xc, out));
  return out;
}

template <class B>
at::Tensor silu_and_mul_backward(const at::Tensor& grad, const at::Tensor& x) {
  const typename B::Call call("silu_and_mul_backward", grad, "grad_out");
  call.on_device(x, "x");
  const auto a = check_silu_and_mul_backward<DType>(grad, x);
  auto gc = grad.contiguous(), xc = x.contiguous();
  auto dx = at::empty_like(xc);
  B::silu_and_mul_backward(call, make_silu_and_mul_params(a, xc, dx, gc));
  return dx;
}

// rotary_embedding and its backward (the inverse rotation of the gradient): one body, two schemas.
template <class B>
at::Tensor rotary(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cache, int64_t rot,
                  bool is_neox, bool inverse, const char* op) {
  const typename B::Call call(op, x, "x");
  call.on_device(positions, "positions");
  call.on_device(cache, "cos_sin_cache");
  // B::kValueChecks: the positions' range is checked on the host (CPU) or in the kernel (GPU: no host sync)
  const auto a = check_rotary<DType>(positions, x, cache, rot, op, B::kValueChecks);
  auto xc = x.contiguous(), cc = cache.contiguous();
  auto out = at::empty_like(xc);
  B::rotary(call, make_rotary_params(a, xc, cc, out, rot, is_neox, inverse, B::error_flags(call)));
  return out;
}

template <class B>
at::Tensor rotary_embedding(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cache, int64_t rot,
                            bool is_neox) {
  return rotary<B>(positions, x, cache, rot, is_neox, false, "rotary_embedding");
}

template <class B>
at::Tensor rotary_embedding_backward(const at::Tensor& positions, const at::Tensor& grad, const at::Tensor& cache,
                                     int64_t rot, bool is_neox) {
  return rotary<B>(positions, grad, cache, rot, is_neox, true, "rotary_embedding_backward");
}

struct Dense {
  template <class B>
  static constexpr std::tuple ops{
      Op{"rms_norm", &rms_norm<B>},
      Op{"fused_add_rms_norm", &fused_add_rms_norm<B>},
      Op{"rms_norm_backward", &rms_norm_backward<B>},
      Op{"silu_and_mul", &silu_and_mul<B>},
      Op{"silu_and_mul_backward", &silu_and_mul_backward<B>},
      Op{"rotary_embedding", &rotary_embedding<B>},
      Op{"rotary_embedding_backward", &rotary_embedding_backward<B>},
  };
};

}  // namespace aligned::glue
