// moe.h — the mixture-of-experts contract: routing and the expert combine, written down once.
//
// Both ops are per token: a token's routing and its expert output depend only on its own row and the
// weights — never on which other tokens are in the batch or which of them share its experts. Backends may
// group tokens by expert for speed (the CPU glue does); the per-token expression trees below do not change.
//
// ---- routing (aligned::moe_routing) -------------------------------------------------------------------------
// Input: one row of router logits z[0..E) (any storage type, widened exactly to fp32).
//   softmax:  m = max_i z_i (exact), e_i = exp_f32(z_i - m), S = lane_sum_i e_i (reduce.h order), p_i = e_i / S
//   sigmoid:  p_i = 1 / (1 + exp_f32(-z_i))                                     (DeepSeek-V3 style scores)
// Top-k: rank r = 0..k-1 picks the not-yet-picked expert with the largest p; equal scores -> the LOWER expert id
// wins (strict '>' scan in increasing id). Output ids[r], and
//   renormalize:  s = +0; s = s + p_{ids[r]} for r = 0..k-1 (rank order); w_r = p_{ids[r]} / s
//   otherwise:    w_r = p_{ids[r]}
// Weights are fp32 (never rounded to the model dtype); the full score row p is returned too (fp32), for
// auxiliary (load-balancing) losses computed from the same numbers.
// NaN policy: a NaN logit gives NaN scores for the row (softmax) or that expert (sigmoid); selection still
// follows the scan rule above, so ids stay in range and deterministic.
//
// Backward (aligned::moe_routing_backward), given gw[r] (grad of w) and gs[i] (grad of the score row, may be 0):
//   gp_i = gs_i, then for r in rank order:  renormalize: dot = +0; dot = dot + gw_r * w_r (rank order);
//                                                        gp_{ids[r]} = gp_{ids[r]} + (gw_r - dot) / s
//                                           otherwise:   gp_{ids[r]} = gp_{ids[r]} + gw_r
//   softmax: q = lane_sum_i (p_i * gp_i); dz_i = p_i * (gp_i - q)          sigmoid: dz_i = gp_i * (p_i * (1 - p_i))
//
// ---- experts (aligned::moe_experts) -------------------------------------------------------------------------
// For token x (storage type T), selected experts ids[0..k) with fp32 weights w[0..k):
//   for each rank r, e = ids[r]:
//     h   = round_T(linear(x, w13[e]))            [2I]  (the op's linear profile: `fma`, contract.h linear_dot per
//                                                         output, or `mma`, mma.h — bf16, the matrix unit)
//     a   = round_T(silu_mul(h[0..I), h[I..2I)))  [I]   (contract.h silu_and_mul)
//     y_r = linear(a, w2[e])                      [H]   fp32, NOT rounded
//   shared expert (optional, Qwen2-MoE style), same three steps with shared_w13 / shared_w2 -> y_s (fp32),
//     gate g = 1 / (1 + exp_f32(-linear(x, shared_gate))) (fp32 logit, not rounded), or g = 1 without a gate
//   acc = +0; acc = acc + w_r * y_r[n] for r = 0..k-1 (rank order; product rounded, then added);
//   with a shared expert: acc = acc + g * y_s[n];  out[n] = round_T(acc)
// The combine is in fp32 and rounds once. (HF transformers rounds every expert's output to the model dtype
// before an index_add; this contract does not — both sides call this op, so they agree.)
#pragma once

#include "contract.h"

namespace aligned {

enum class MoeScoring : int { Softmax = 0, Sigmoid = 1 };

// Scores p[0..E) of one row of router logits.
template <typename T>
ALIGNED_HD void moe_scores_row(const T* z, int64_t E, MoeScoring scoring, float* p) {
  if (scoring == MoeScoring::Sigmoid) {
    for (int64_t i = 0; i < E; ++i) p[i] = div_f32(1.0f, 1.0f + exp_f32(-to_f32(z[i])));
    return;
  }
  bool nan = false;
  float m = -float_of(0x7f800000u);
  for (int64_t i = 0; i < E; ++i) {
    const float v = to_f32(z[i]);
    nan = nan || is_nan_f32(v);
    m = max_f32(m, v);
  }
  if (nan) {
    for (int64_t i = 0; i < E; ++i) p[i] = float_of(0x7fc00000u);
    return;
  }
  for (int64_t i = 0; i < E; ++i) p[i] = exp_f32(to_f32(z[i]) - m);
  const float S = lane_sum(E, [&](int64_t i) { return p[i]; });
  for (int64_t i = 0; i < E; ++i) p[i] = div_f32(p[i], S);
}

// Top-k of p (ties: lower id), weights (renormalised in rank order or not). `taken` is E bytes of scratch.
ALIGNED_HD void moe_topk_row(const float* p, int64_t E, int64_t k, bool renormalize, unsigned char* taken,
                             int64_t* ids, float* w) {
  for (int64_t i = 0; i < E; ++i) taken[i] = 0;
  for (int64_t r = 0; r < k; ++r) {
    int64_t best = -1;
    for (int64_t i = 0; i < E; ++i) {
      if (taken[i]) continue;
      if (best < 0 || p[i] > p[best]) best = i;
    }
    taken[best] = 1;
    ids[r] = best;
    w[r] = p[best];
  }
  if (!renormalize) return;
  float s = 0.0f;
  for (int64_t r = 0; r < k; ++r) s = s + w[r];
  for (int64_t r = 0; r < k; ++r) w[r] = div_f32(w[r], s);
}

// Gradient of the router logits of one row. gs may be nullptr (no score gradient). gp: E floats of scratch.
template <typename T>
ALIGNED_HD void moe_routing_backward_row(const float* gw, const float* gs, const T* z, const int64_t* ids, int64_t E,
                                         int64_t k, MoeScoring scoring, bool renormalize, float* p, float* gp,
                                         float* dz) {
  moe_scores_row(z, E, scoring, p);
  for (int64_t i = 0; i < E; ++i) gp[i] = gs ? gs[i] : 0.0f;
  if (renormalize) {
    float s = 0.0f;
    for (int64_t r = 0; r < k; ++r) s = s + p[ids[r]];
    float dot = 0.0f;
    for (int64_t r = 0; r < k; ++r) dot = dot + gw[r] * div_f32(p[ids[r]], s);
    for (int64_t r = 0; r < k; ++r) gp[ids[r]] = gp[ids[r]] + div_f32(gw[r] - dot, s);
  } else {
    for (int64_t r = 0; r < k; ++r) gp[ids[r]] = gp[ids[r]] + gw[r];
  }
  if (scoring == MoeScoring::Sigmoid) {
    for (int64_t i = 0; i < E; ++i) dz[i] = gp[i] * (p[i] * (1.0f - p[i]));
    return;
  }
  const float q = lane_sum(E, [&](int64_t i) { return p[i] * gp[i]; });
  for (int64_t i = 0; i < E; ++i) dz[i] = p[i] * (gp[i] - q);
}

// sigmoid of the shared-expert gate logit (fp32).
ALIGNED_HD float moe_shared_gate(float logit) { return div_f32(1.0f, 1.0f + exp_f32(-logit)); }

// The combine of one token over the H outputs: acc = sum_r w_r * y_r (rank order) [+ g * y_s], rounded once.
// y[r] points at the fp32 output row of rank r; ys is nullptr without a shared expert.
template <typename T>
ALIGNED_HD void moe_combine_row(const float* const* y, const float* w, int64_t k, const float* ys, float g, T* out,
                                int64_t H) {
  for (int64_t n = 0; n < H; ++n) {
    float acc = 0.0f;
    for (int64_t r = 0; r < k; ++r) acc = acc + w[r] * y[r][n];
    if (ys) acc = acc + g * ys[n];
    out[n] = from_f32<T>(acc);
  }
}

// The plain reference of one expert MLP on one token, straight from the contract (linear_dot per output):
// y[H] (fp32) = linear(round_T(silu_mul(round_T(linear(x, w13)))), w2). h: 2I, a: I scratch of type T.
template <typename T, typename TW>
ALIGNED_HD void moe_expert_row_reference(const T* x, const TW* w13, const TW* w2, int64_t H, int64_t I, T* h, T* a,
                                         float* y) {
  for (int64_t n = 0; n < 2 * I; ++n) h[n] = from_f32<T>(linear_dot(x, w13 + n * H, H));
  for (int64_t i = 0; i < I; ++i) a[i] = from_f32<T>(silu_mul(to_f32(h[i]), to_f32(h[I + i])));
  for (int64_t n = 0; n < H; ++n) y[n] = linear_dot(a, w2 + n * I, I);
}

}  // namespace aligned
