// checks/logits.h — argument checks of the log-prob family (logsumexp, log_softmax, token_logprobs +
// backwards, the fused LM head's pieces).
// Written once for every backend (checks/common.h says how the checks are used).
#pragma once

#include "common.h"

namespace aligned {

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

}  // namespace aligned
