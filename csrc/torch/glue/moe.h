// glue/moe.h — the moe family's glue bodies (csrc/common/moe.h): moe_routing(+_backward),
// moe_grouped_routing(+_backward), moe_experts and its per-token scalar reference. The four steps: glue/dense.h.
// Two families: Moe (the routing ops and moe_experts) has GPU kernels (backends/gpu.h, csrc/gpu/moe_kernels.cuh) and
// runs them on a CUDA / ROCm device and under aligned_ops.emulate; MoeReference (_moe_experts_reference, the plain
// per-token reference the tests hold the kernels to) has CPU kernels only.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "../checks/moe.h"
#include "../make_params.h"
#include "../registration.h"
#include "../run_args.h"

namespace aligned::glue {

namespace moe_detail {

// The two top-k routing ops (moe_routing, moe_grouped_routing) share everything but their scoring rule: the
// tensors below, the params base (MoeTopkParams) and, per backward, the checks of the gradients.

// Forward: the logits read contiguous, the outputs allocated (scores fp32 [T, E], weights fp32 [T, k], ids int64
// [T, k]); the op's checks have passed.
inline MoeRoutingTensors routing_outputs(const at::Tensor& logits, int64_t top_k) {
  const int64_t T = logits.size(0), E = logits.size(1);
  MoeRoutingTensors t;
  t.z = logits.contiguous();
  auto f32 = t.z.options().dtype(at::kFloat);
  t.scores = at::empty({T, E}, f32);
  t.w = at::empty({T, top_k}, f32);
  t.ids = at::empty({T, top_k}, t.z.options().dtype(at::kLong));
  return t;
}

// Backward: devices, the router logits (their dtype is returned), ids in [0, E) as int64, the gradients as fp32
// (grad_scores may be absent), dz allocated in the logits dtype.
template <class B>
std::pair<DType, MoeRoutingTensors> routing_backward_tensors(const typename B::Call& call, const at::Tensor& grad_w,
                                                             const std::optional<at::Tensor>& grad_scores,
                                                             const at::Tensor& logits, const at::Tensor& ids) {
  call.on_device(ids, "topk_ids");
  call.on_device(grad_w, "grad_weights");
  call.on_device(grad_scores, "grad_scores");
  const DType dt = check_router_logits<DType>(logits, call.op);
  const int64_t T = logits.size(0), E = logits.size(1);
  MoeRoutingTensors t;
  t.ids = check_topk_ids(ids, T, E, call.op, B::kValueChecks);
  t.gw = check_moe_grad_weights(grad_w, T, t.ids.size(1), call.op);
  t.gs = check_moe_grad_scores(grad_scores, logits, call.op);
  t.z = logits.contiguous();
  t.dz = at::empty_like(t.z);
  return {dt, t};
}

}  // namespace moe_detail

// moe_routing (moe.h "routing"): (weights fp32 [T, k], ids int64 [T, k], scores fp32 [T, E]).
template <class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_routing(const at::Tensor& logits, int64_t top_k,
                                                           c10::string_view scoring, bool renormalize) {
  const char* op = "moe_routing";
  const typename B::Call call(op, logits, "router_logits");
  const DType dt = check_moe_routing<DType>(logits, top_k, op);
  const MoeScoring sc = check_moe_scoring(std::string(scoring), op);
  const auto t = moe_detail::routing_outputs(logits, top_k);
  B::moe_routing(call, make_moe_routing_params(dt, t, top_k, sc, renormalize));
  return {t.w, t.ids, t.scores};
}

template <class B>
at::Tensor moe_routing_backward(const at::Tensor& grad_w, const std::optional<at::Tensor>& grad_scores,
                                const at::Tensor& logits, const at::Tensor& ids, c10::string_view scoring,
                                bool renormalize) {
  const char* op = "moe_routing_backward";
  const typename B::Call call(op, logits, "router_logits");
  const auto [dt, t] = moe_detail::routing_backward_tensors<B>(call, grad_w, grad_scores, logits, ids);
  const MoeScoring sc = check_moe_scoring(std::string(scoring), op);
  B::moe_routing_backward(call, make_moe_routing_params(dt, t, t.ids.size(1), sc, renormalize));
  return t.dz;
}

// moe_grouped_routing (moe.h "grouped sigmoid routing"): (weights fp32 [T, k], ids int64 [T, k], scores fp32 [T, E]).
template <class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_grouped_routing(const at::Tensor& logits,
                                                                   const std::optional<at::Tensor>& bias,
                                                                   int64_t top_k, int64_t n_group, int64_t topk_group,
                                                                   bool renormalize, double scale) {
  const char* op = "moe_grouped_routing";
  const typename B::Call call(op, logits, "router_logits");
  call.on_device(bias, "correction_bias");
  const DType dt = check_moe_grouped_routing<DType>(logits, bias, top_k, n_group, topk_group, scale, op);
  const auto t = moe_detail::routing_outputs(logits, top_k);
  auto b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  B::moe_grouped_routing(call, make_moe_grouped_routing_params(dt, t, b, top_k, n_group, topk_group, renormalize,
                                                               scale));
  return {t.w, t.ids, t.scores};
}

// The backward needs no groups and no bias: the selection is given (ids); n_group = topk_group = 1 (moe.h).
template <class B>
at::Tensor moe_grouped_routing_backward(const at::Tensor& grad_w, const std::optional<at::Tensor>& grad_scores,
                                        const at::Tensor& logits, const at::Tensor& ids, bool renormalize,
                                        double scale) {
  const char* op = "moe_grouped_routing_backward";
  const typename B::Call call(op, logits, "router_logits");
  const auto [dt, t] = moe_detail::routing_backward_tensors<B>(call, grad_w, grad_scores, logits, ids);
  check_routed_scaling_factor(scale, op);
  B::moe_grouped_routing_backward(call, make_moe_grouped_routing_params(dt, t, {}, t.ids.size(1), 1, 1, renormalize,
                                                                        scale));
  return t.dz;
}

namespace moe_detail {

template <class B>
MoeExpertsArgs<DType> experts_args(const typename B::Call& call, const at::Tensor& x, const at::Tensor& tw,
                                   const at::Tensor& ids, const at::Tensor& w13, const at::Tensor& w2,
                                   const std::optional<at::Tensor>& sw13, const std::optional<at::Tensor>& sw2,
                                   const std::optional<at::Tensor>& sgate) {
  call.on_device(tw, "topk_weights");
  call.on_device(ids, "topk_ids");
  call.on_device(w13, "w13");
  call.on_device(w2, "w2");
  call.on_device(sw13, "shared_w13");
  call.on_device(sw2, "shared_w2");
  call.on_device(sgate, "shared_gate");
  return check_moe_experts<DType>(x, tw, ids, w13, w2, sw13, sw2, sgate, call.op, B::kValueChecks);
}

}  // namespace moe_detail

template <class B>
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& tw, const at::Tensor& ids, const at::Tensor& w13,
                       const at::Tensor& w2, const std::optional<at::Tensor>& sw13,
                       const std::optional<at::Tensor>& sw2, const std::optional<at::Tensor>& sgate,
                       c10::string_view linear_profile) {
  const typename B::Call call("moe_experts", x, "x");
  MoeExpertsRun r;
  r.a = moe_detail::experts_args<B>(call, x, tw, ids, w13, w2, sw13, sw2, sgate);
  r.linear = check_experts_linear_profile<DType>(linear_profile, r.a.dt, call.op);
  r.out = at::empty({r.a.T, r.a.H}, r.a.x.options());
  if (r.a.T > 0) B::moe_experts(call, r);
  return r.out;
}

template <class B>
at::Tensor moe_experts_reference(const at::Tensor& x, const at::Tensor& tw, const at::Tensor& ids,
                                 const at::Tensor& w13, const at::Tensor& w2, const std::optional<at::Tensor>& sw13,
                                 const std::optional<at::Tensor>& sw2, const std::optional<at::Tensor>& sgate) {
  const typename B::Call call("_moe_experts_reference", x, "x");
  const auto a = moe_detail::experts_args<B>(call, x, tw, ids, w13, w2, sw13, sw2, sgate);
  auto out = at::empty({a.T, a.H}, a.x.options());
  B::moe_experts_reference(call, make_moe_experts_params(a.dt, a.x, a.w, a.ids, a.w13, a.w2, a.sw13, a.sw2,
                                                         a.sgate, out));
  return out;
}

struct Moe {
  template <class B>
  static constexpr std::tuple ops{
      Op{"moe_routing", &moe_routing<B>},
      Op{"moe_routing_backward", &moe_routing_backward<B>},
      Op{"moe_experts", &moe_experts<B>},
      Op{"moe_grouped_routing", &moe_grouped_routing<B>},
      Op{"moe_grouped_routing_backward", &moe_grouped_routing_backward<B>},
  };
};

struct MoeReference {
  template <class B>
  static constexpr std::tuple ops{
      Op{"_moe_experts_reference", &moe_experts_reference<B>},
  };
};

}  // namespace aligned::glue
