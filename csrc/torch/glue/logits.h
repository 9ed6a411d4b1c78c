// glue/logits.h — the log-prob family's glue bodies (logits [T, V], a temperature per row or one scalar):
// logsumexp, log_softmax, token_logprobs and their backwards (family Logits), and the fused LM head's two
// pieces, token_logprobs_pairs and token_logprobs_backward_cols (family LmHeadPieces: CPU kernels only).
// The four steps of every body: glue/dense.h.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "../checks/logits.h"
#include "../make_params.h"
#include "../registration.h"

namespace aligned::glue {

namespace logits_detail {

// The logits (the call's first tensor) and the optional per-row temperatures, checked; values on the host or in
// the kernel (B::kValueChecks).
template <class B>
LogitsArgs<DType> logits_args(const typename B::Call& call, const at::Tensor& logits, double temperature,
                              const std::optional<at::Tensor>& temperatures) {
  call.on_device(logits, "logits");
  call.on_device(temperatures, "temperatures");
  return check_logits<DType>(logits, temperature, temperatures, call.op, B::kValueChecks);
}

template <class B>
at::Tensor token_ids(const typename B::Call& call, const at::Tensor& ids, int64_t T, int64_t V) {
  call.on_device(ids, "token_ids");
  return check_token_ids(ids, T, V, call.op, B::kValueChecks);
}

template <class B>
LogitsParams params(const typename B::Call& call, const LogitsArgs<DType>& a, const LogitsTensors& t,
                    LogitsGrad mode = LogitsGrad::kTokenLogprobs, int64_t v0 = 0) {
  return make_logits_params(a, t, mode, v0, B::error_flags(call));
}

inline at::Tensor f32(const LogitsArgs<DType>& a, at::IntArrayRef sizes) {
  return at::empty(sizes, a.z.options().dtype(at::kFloat));
}

}  // namespace logits_detail

template <class B>
at::Tensor logsumexp(const at::Tensor& logits, double temperature, const std::optional<at::Tensor>& temperatures) {
  using namespace logits_detail;
  const typename B::Call call("logsumexp", logits, "logits");
  const auto a = logits_args<B>(call, logits, temperature, temperatures);
  LogitsTensors t;
  t.lse = f32(a, {a.T});
  B::logsumexp(call, params<B>(call, a, t));
  return t.lse;
}

template <class B>
at::Tensor log_softmax(const at::Tensor& logits, double temperature, const std::optional<at::Tensor>& temperatures) {
  using namespace logits_detail;
  const typename B::Call call("log_softmax", logits, "logits");
  const auto a = logits_args<B>(call, logits, temperature, temperatures);
  LogitsTensors t;
  t.out_f32 = f32(a, {a.T, a.V});
  B::log_softmax(call, params<B>(call, a, t));
  return t.out_f32;
}

// token_logprobs, and with `pairs` the rows' (m, L) pairs [T, 2] too (token_logprobs_pairs: the fused LM head
// keeps them for its backward).
template <class B>
std::tuple<at::Tensor, at::Tensor> token_logprobs_and_pairs(const at::Tensor& logits, const at::Tensor& ids,
                                                            double temperature,
                                                            const std::optional<at::Tensor>& temperatures,
                                                            bool pairs, const char* op) {
  using namespace logits_detail;
  const typename B::Call call(op, logits, "logits");
  const auto a = logits_args<B>(call, logits, temperature, temperatures);
  LogitsTensors t;
  t.ids = token_ids<B>(call, ids, a.T, a.V);
  if (pairs) t.pairs = f32(a, {a.T, 2});
  t.out_f32 = f32(a, {a.T});
  B::token_logprobs(call, params<B>(call, a, t));
  return {t.out_f32, t.pairs};
}

template <class B>
at::Tensor token_logprobs(const at::Tensor& logits, const at::Tensor& ids, double temperature,
                          const std::optional<at::Tensor>& temperatures) {
  return std::get<0>(token_logprobs_and_pairs<B>(logits, ids, temperature, temperatures, false, "token_logprobs"));
}

template <class B>
std::tuple<at::Tensor, at::Tensor> token_logprobs_pairs(const at::Tensor& logits, const at::Tensor& ids,
                                                        double temperature,
                                                        const std::optional<at::Tensor>& temperatures) {
  return token_logprobs_and_pairs<B>(logits, ids, temperature, temperatures, true, "token_logprobs_pairs");
}

// The three backwards: dz [T, V] in the logits' dtype; grad [T, V] for log_softmax, [T] otherwise; ids for
// token_logprobs only. They differ in the mode (contract.h: which gradient) and the run function.
template <class B>
at::Tensor logits_backward(LogitsGrad mode, const char* op, const at::Tensor& grad, const at::Tensor& logits,
                           const at::Tensor* ids, double temperature, const std::optional<at::Tensor>& temperatures) {
  using namespace logits_detail;
  const typename B::Call call(op, grad, "grad");
  const auto a = logits_args<B>(call, logits, temperature, temperatures);
  LogitsTensors t;
  if (ids) t.ids = token_ids<B>(call, *ids, a.T, a.V);
  t.g = check_logits_grad(grad, a.T, a.V, mode == LogitsGrad::kLogSoftmax, op);
  t.dz = at::empty({a.T, a.V}, a.z.options());
  const LogitsParams p = params<B>(call, a, t, mode);
  switch (mode) {
    case LogitsGrad::kTokenLogprobs: B::token_logprobs_backward(call, p); break;
    case LogitsGrad::kLogsumexp: B::logsumexp_backward(call, p); break;
    case LogitsGrad::kLogSoftmax: B::log_softmax_backward(call, p); break;
  }
  return t.dz;
}

template <class B>
at::Tensor token_logprobs_backward(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& ids,
                                   double temperature, const std::optional<at::Tensor>& temperatures) {
  return logits_backward<B>(LogitsGrad::kTokenLogprobs, "token_logprobs_backward", grad, logits, &ids, temperature,
                            temperatures);
}

template <class B>
at::Tensor logsumexp_backward(const at::Tensor& grad, const at::Tensor& logits, double temperature,
                              const std::optional<at::Tensor>& temperatures) {
  return logits_backward<B>(LogitsGrad::kLogsumexp, "logsumexp_backward", grad, logits, nullptr, temperature,
                            temperatures);
}

template <class B>
at::Tensor log_softmax_backward(const at::Tensor& grad, const at::Tensor& logits, double temperature,
                                const std::optional<at::Tensor>& temperatures) {
  return logits_backward<B>(LogitsGrad::kLogSoftmax, "log_softmax_backward", grad, logits, nullptr, temperature,
                            temperatures);
}

// token_logprobs_backward on the column tile [vocab_start, vocab_start + n) of the rows (logits is that tile,
// [T, n]), given the rows' pairs from token_logprobs_pairs: the same elements token_logprobs_backward writes
// for those columns of the full [T, vocab_size] logits.
template <class B>
at::Tensor token_logprobs_backward_cols(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& ids,
                                        const at::Tensor& lse_pairs, int64_t vocab_start, int64_t vocab_size,
                                        double temperature, const std::optional<at::Tensor>& temperatures) {
  using namespace logits_detail;
  const char* op = "token_logprobs_backward_cols";
  const typename B::Call call(op, grad, "grad");
  call.on_device(lse_pairs, "lse_pairs");
  const auto a = logits_args<B>(call, logits, temperature, temperatures);
  TORCH_CHECK(vocab_start >= 0 && vocab_start + a.V <= vocab_size, "aligned::", op, ": the tile [", vocab_start,
              ", ", vocab_start + a.V, ") must lie in the vocabulary [0, ", vocab_size, ")");
  LogitsTensors t;
  t.ids = token_ids<B>(call, ids, a.T, vocab_size);
  TORCH_CHECK(lse_pairs.scalar_type() == at::kFloat && lse_pairs.dim() == 2 && lse_pairs.size(0) == a.T &&
                  lse_pairs.size(1) == 2,
              "aligned::", op, ": lse_pairs must be float32 [", a.T, ", 2], got ", lse_pairs.scalar_type(), " ",
              lse_pairs.sizes());
  t.pairs = lse_pairs.contiguous();
  t.g = check_logits_grad(grad, a.T, a.V, false, op);
  t.dz = at::empty({a.T, a.V}, a.z.options());
  B::token_logprobs_backward_cols(call, params<B>(call, a, t, LogitsGrad::kTokenLogprobs, vocab_start));
  return t.dz;
}

struct Logits {
  template <class B>
  static constexpr std::tuple ops{
      Op{"logsumexp", &logsumexp<B>},
      Op{"log_softmax", &log_softmax<B>},
      Op{"token_logprobs", &token_logprobs<B>},
      Op{"token_logprobs_backward", &token_logprobs_backward<B>},
      Op{"logsumexp_backward", &logsumexp_backward<B>},
      Op{"log_softmax_backward", &log_softmax_backward<B>},
  };
};

struct LmHeadPieces {
  template <class B>
  static constexpr std::tuple ops{
      Op{"token_logprobs_pairs", &token_logprobs_pairs<B>},
      Op{"token_logprobs_backward_cols", &token_logprobs_backward_cols<B>},
  };
};

}  // namespace aligned::glue
