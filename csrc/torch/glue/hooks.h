// glue/hooks.h — the test hooks every backend implements (family Hooks): the contract's scalar exp / log
// elementwise (_exp_f32, _log_f32: fp32 in, fp32 out, so tests can hold each backend to float64 and to each
// other), and _device_error_flags, the backend's per-device error words of the in-kernel value checks (the CPU
// checks values at the call: always zeros). The four steps: glue/dense.h.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "../checks/dense.h"
#include "../make_params.h"
#include "../registration.h"

namespace aligned::glue {

template <class B>
at::Tensor elementwise_f32(const at::Tensor& x, bool is_log, const char* op) {
  const typename B::Call call(op, x, "x");
  check_elementwise_f32(x, op);
  auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  const auto p = make_elementwise_params(xc, out);
  if (is_log) {
    B::log_f32(call, p);
  } else {
    B::exp_f32(call, p);
  }
  return out;
}

template <class B>
at::Tensor exp_f32(const at::Tensor& x) {
  return elementwise_f32<B>(x, false, "_exp_f32");
}

template <class B>
at::Tensor log_f32(const at::Tensor& x) {
  return elementwise_f32<B>(x, true, "_log_f32");
}

// The error words of like's device (a view of the backend's persistent buffer, so the caller can read and clear
// them; aligned_ops.check_device_errors).
template <class B>
at::Tensor device_error_flags(const at::Tensor& like) {
  const typename B::Call call("_device_error_flags", like, "like");
  return B::device_error_flags(call);
}

struct Hooks {
  template <class B>
  static constexpr std::tuple ops{
      Op{"_exp_f32", &exp_f32<B>},
      Op{"_log_f32", &log_f32<B>},
      Op{"_device_error_flags", &device_error_flags<B>},
  };
};

}  // namespace aligned::glue
