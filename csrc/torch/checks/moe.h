// checks/moe.h — argument checks of the moe family (moe_routing(_backward), moe_experts and its plain
// reference), written once for every backend's glue body (csrc/torch/glue/moe.h; checks/common.h says how).
// They return what the body needs to allocate and fill the params (csrc/torch/make_params.h).
//
// Device-independent (ATen only). The one data-value check (top-k ids in [0, E)) reads the ids on the host
// only under ValueChecks::kHost, like the other families'.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>

#include "../../common/moe.h"
#include "common.h"

namespace aligned {

inline MoeScoring check_moe_scoring(const std::string& s, const char* op) {
  if (s == "softmax") return MoeScoring::Softmax;
  if (s == "sigmoid") return MoeScoring::Sigmoid;
  TORCH_CHECK(false, "aligned::", op, ": scoring must be 'softmax' or 'sigmoid', got '", s, "'");
}

// router_logits [T, E], any float dtype; returns its dtype.
template <class DTypeEnum>
DTypeEnum check_router_logits(const at::Tensor& z, const char* op) {
  TORCH_CHECK(z.dim() == 2, "aligned::", op, ": router_logits must be 2-D [tokens, experts], got ", z.sizes());
  return dtype_of<DTypeEnum>(z, op, "router_logits");
}

// moe_routing: top_k in [1, E].
template <class DTypeEnum>
DTypeEnum check_moe_routing(const at::Tensor& z, int64_t top_k, const char* op) {
  const DTypeEnum dt = check_router_logits<DTypeEnum>(z, op);
  const int64_t E = z.size(1);
  TORCH_CHECK(E >= 1, "aligned::", op, ": router_logits must have at least one expert column");
  TORCH_CHECK(top_k >= 1 && top_k <= E, "aligned::", op, ": top_k must be in [1, ", E, "], got ", top_k);
  return dt;
}

// topk_ids [T, k], int64 or int32, every id in [0, E) (read under ValueChecks::kHost). Returns int64, contiguous.
inline at::Tensor check_topk_ids(const at::Tensor& ids, int64_t T, int64_t E, const char* op,
                                 ValueChecks values = ValueChecks::kHost) {
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T, "aligned::", op, ": topk_ids must be [", T, ", k], got ",
              ids.sizes());
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, "aligned::", op,
              ": topk_ids must be int64 or int32, got ", ids.scalar_type());
  auto idc = ids.to(at::kLong).contiguous();
  if (idc.numel() > 0 && values == ValueChecks::kHost) {
    const int64_t lo = idc.min().item<int64_t>(), hi = idc.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < E, "aligned::", op, ": topk_ids must lie in [0, ", E, "), got range [", lo, ", ", hi,
                "]");
  }
  return idc;
}

// moe_routing_backward's gradients: grad_weights [T, k] and grad_scores [T, E] (optional), as fp32 contiguous.
inline at::Tensor check_moe_grad_weights(const at::Tensor& grad_w, int64_t T, int64_t k, const char* op) {
  TORCH_CHECK(grad_w.dim() == 2 && grad_w.size(0) == T && grad_w.size(1) == k, "aligned::", op,
              ": grad_weights must be [", T, ", ", k, "], got ", grad_w.sizes());
  return grad_w.to(at::kFloat).contiguous();
}
inline at::Tensor check_moe_grad_scores(const std::optional<at::Tensor>& grad_scores, const at::Tensor& z,
                                        const char* op) {
  if (!grad_scores.has_value() || !grad_scores->defined()) return at::Tensor();
  TORCH_CHECK(grad_scores->sizes() == z.sizes(), "aligned::", op, ": grad_scores must be [", z.size(0), ", ",
              z.size(1), "], got ", grad_scores->sizes());
  return grad_scores->to(at::kFloat).contiguous();
}

// moe_experts (and its reference): x [T, H], topk_weights fp32 [T, k], topk_ids [T, k], w13 [E, 2I, H],
// w2 [E, H, I], an optional shared expert (shared_w13 [2Is, H], shared_w2 [H, Is]) and its optional gate [1, H].
template <class DTypeEnum>
struct MoeExpertsArgs {
  DTypeEnum dt;
  int64_t T, H, k, E, I, Is;                 // Is = 0 without a shared expert
  at::Tensor x, w, ids, w13, w2, sw13, sw2, sgate;  // contiguous; ids int64; the shared ones may be undefined
};

template <class DTypeEnum>
MoeExpertsArgs<DTypeEnum> check_moe_experts(const at::Tensor& x, const at::Tensor& tw, const at::Tensor& ids,
                                            const at::Tensor& w13, const at::Tensor& w2,
                                            const std::optional<at::Tensor>& sw13,
                                            const std::optional<at::Tensor>& sw2,
                                            const std::optional<at::Tensor>& sgate, const char* op,
                                            ValueChecks values = ValueChecks::kHost) {
  MoeExpertsArgs<DTypeEnum> a;
  TORCH_CHECK(x.dim() == 2, "aligned::", op, ": x must be 2-D [tokens, hidden], got ", x.sizes());
  a.dt = dtype_of<DTypeEnum>(x, op, "x");
  a.T = x.size(0);
  a.H = x.size(1);
  TORCH_CHECK(w13.dim() == 3 && w13.size(2) == a.H && w13.size(1) % 2 == 0, "aligned::", op,
              ": w13 must be [experts, 2 * intermediate, ", a.H, "], got ", w13.sizes());
  a.E = w13.size(0);
  a.I = w13.size(1) / 2;
  TORCH_CHECK(w2.dim() == 3 && w2.size(0) == a.E && w2.size(1) == a.H && w2.size(2) == a.I, "aligned::", op,
              ": w2 must be [", a.E, ", ", a.H, ", ", a.I, "], got ", w2.sizes());
  TORCH_CHECK(w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(), "aligned::", op,
              ": w13 and w2 must have x's dtype ", x.scalar_type(), ", got ", w13.scalar_type(), " and ",
              w2.scalar_type());
  a.ids = check_topk_ids(ids, a.T, a.E, op, values);
  a.k = a.ids.size(1);
  TORCH_CHECK(tw.dim() == 2 && tw.size(0) == a.T && tw.size(1) == a.k && tw.scalar_type() == at::kFloat,
              "aligned::", op, ": topk_weights must be float32 [", a.T, ", ", a.k, "], got ", tw.scalar_type(), " ",
              tw.sizes());
  a.x = x.contiguous();
  a.w = tw.contiguous();
  a.w13 = w13.contiguous();
  a.w2 = w2.contiguous();
  a.Is = 0;
  const bool has13 = sw13.has_value() && sw13->defined(), has2 = sw2.has_value() && sw2->defined();
  TORCH_CHECK(has13 == has2, "aligned::", op, ": shared_w13 and shared_w2 must be given together");
  if (has13) {
    TORCH_CHECK(sw13->dim() == 2 && sw13->size(1) == a.H && sw13->size(0) % 2 == 0, "aligned::", op,
                ": shared_w13 must be [2 * shared_intermediate, ", a.H, "], got ", sw13->sizes());
    a.Is = sw13->size(0) / 2;
    TORCH_CHECK(sw2->dim() == 2 && sw2->size(0) == a.H && sw2->size(1) == a.Is, "aligned::", op,
                ": shared_w2 must be [", a.H, ", ", a.Is, "], got ", sw2->sizes());
    TORCH_CHECK(sw13->scalar_type() == x.scalar_type() && sw2->scalar_type() == x.scalar_type(), "aligned::", op,
                ": shared_w13 and shared_w2 must have x's dtype");
    a.sw13 = sw13->contiguous();
    a.sw2 = sw2->contiguous();
  }
  if (sgate.has_value() && sgate->defined()) {
    TORCH_CHECK(has13, "aligned::", op, ": shared_gate needs a shared expert (shared_w13, shared_w2)");
    // [1, H] exactly (nn.Linear(H, 1).weight, vLLM's and HF's gate): another shape with H elements is a caller's
    // mistake (e.g. [H, 1] or a gate of another layer), not a layout to reinterpret.
    TORCH_CHECK(sgate->dim() == 2 && sgate->size(0) == 1 && sgate->size(1) == a.H &&
                    sgate->scalar_type() == x.scalar_type(), "aligned::", op,
                ": shared_gate must be [1, ", a.H, "] with x's dtype, got ", sgate->sizes(), " ", sgate->scalar_type());
    a.sgate = sgate->reshape({1, a.H}).contiguous();
  }
  return a;
}

// moe_experts' linear_profile: the experts' projections under `fma` (contract.h) or `mma` (mma.h: bfloat16 only,
// the machine's matrix unit; the backend's run refuses where it has none).
enum class ExpertsLinear { kFma, kMma };

template <class DTypeEnum>
ExpertsLinear check_experts_linear_profile(c10::string_view profile, DTypeEnum dt, const char* op) {
  if (profile == "fma") return ExpertsLinear::kFma;
  TORCH_CHECK(profile == "mma", "aligned::", op, ": linear_profile must be 'fma' or 'mma', got '",
              std::string(profile), "'");
  TORCH_CHECK(dt == DTypeEnum::BF16, "aligned::", op, ": the mma profile's experts take bfloat16 (float32 / "
              "float16 models run ALIGNED_OPS_LINEAR=fma)");
  return ExpertsLinear::kMma;
}

// routed_scaling_factor of moe_grouped_routing and its backward. The kernels multiply by its fp32 rounding: 1e39
// would become inf, 1e-50 zero (every weight inf / 0, silently), so what fp32 cannot hold as a positive normal
// number is refused.
inline void check_routed_scaling_factor(double scale, const char* op) {
  TORCH_CHECK(std::isfinite(scale) && scale > 0 && std::isnormal(static_cast<float>(scale)), "aligned::", op,
              ": routed_scaling_factor must be > 0 and a normal float32 value (the weights are scaled in fp32: [",
              std::numeric_limits<float>::min(), ", ", std::numeric_limits<float>::max(), "]), got ", scale);
}

// moe_grouped_routing: router_logits [T, E] (any float dtype), correction_bias fp32 [E] (optional),
// E % n_group == 0, topk_group in [1, n_group], top_k in [1, topk_group * E / n_group] (the experts of the kept
// groups), a routed_scaling_factor > 0 that fp32 holds as a normal number. Returns router_logits' dtype.
template <class DTypeEnum>
DTypeEnum check_moe_grouped_routing(const at::Tensor& z, const std::optional<at::Tensor>& bias, int64_t top_k,
                                    int64_t n_group, int64_t topk_group, double scale, const char* op) {
  const DTypeEnum dt = check_router_logits<DTypeEnum>(z, op);
  const int64_t E = z.size(1);
  TORCH_CHECK(E >= 1, "aligned::", op, ": router_logits must have at least one expert column");
  TORCH_CHECK(n_group >= 1 && E % n_group == 0, "aligned::", op, ": n_group must divide the number of experts ", E,
              " (router_logits' columns), got n_group ", n_group);
  TORCH_CHECK(topk_group >= 1 && topk_group <= n_group, "aligned::", op, ": topk_group must be in [1, n_group = ",
              n_group, "], got ", topk_group);
  const int64_t avail = topk_group * (E / n_group);
  TORCH_CHECK(top_k >= 1 && top_k <= avail, "aligned::", op, ": top_k must be in [1, ", avail,
              "] (the experts in the kept groups: topk_group ", topk_group, " x ", E / n_group,
              " experts per group), got ", top_k);
  check_routed_scaling_factor(scale, op);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat, "aligned::", op,
                ": correction_bias must be float32 (a rounded bias changes the routing), got ", bias->scalar_type());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == E, "aligned::", op, ": correction_bias must be [", E,
                "] (one per expert), got ", bias->sizes());
  }
  return dt;
}

}  // namespace aligned
