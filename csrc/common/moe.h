// moe.h — the mixture-of-experts contract: routing and the expert combine, written down once.
//
// Both ops are per token: a token's routing and its expert output depend only on its own row and the
// weights — never on which other tokens are in the batch or which of them share its experts. Backends may
// group tokens by expert for speed (the CPU glue does); the per-token expression trees below do not change.
//
// ---- routing (aligned::moe_routing) -------------------------------------------------------------------------
// Input: one row of router logits z[0..E) (any storage type, widened exactly to fp32).
//   softmax:  m = max_i z_i (exact), e_i = exp_f32(z_i - m), S = lane_sum_i e_i (reduce.h order), p_i = e_i / S
//   sigmoid:  p_i = sigmoid_score(z_i)                                          (DeepSeek-V3 style scores)
//             sigmoid_score(z) = 1 / (1 + exp_f32(-z))  where exp_f32(-z) is finite (z >= about -88.72);
//                              = exp_f32(z)             where it overflows (there 1 + exp(z) rounds to 1 in fp32,
//                                so this IS the fp32 sigmoid; the plain form gave 1/inf = 0 from -88.72 down)
//             sigmoid_score(+inf) = 1, sigmoid_score(-inf) = 0; below about -103.97 exp(z) underflows to 0.
// Top-k: rank r = 0..k-1 picks the not-yet-picked expert with the largest key; equal keys -> the LOWER expert id
// wins (strict '>' scan in increasing id). The key is p (softmax) or the logit z itself (sigmoid: sigmoid is
// increasing, so this is the order of the exact sigmoids, kept where fp32 scores round to equal values or
// underflow to 0; -0 and +0 are equal logits). Output ids[r], and
//   renormalize:  s = +0; s = s + p_{ids[r]} for r = 0..k-1 (rank order); w_r = p_{ids[r]} / s
//                 sigmoid only, when s < 2^-24 (then every chosen p < 2^-24, i.e. every chosen logit is below
//                 about -16.6, where 1 + exp(z) rounds to 1 and sigmoid(z) = exp(z) to within fp32 rounding;
//                 p/s would be 0/0 once the scores underflow (below about -103.97) and loses bits as soon as
//                 they are subnormal (below about -87.3)): the same ratios from the logits, m = z_{ids[0]}
//                 (the largest chosen):
//                   e_r = 1 if z_{ids[r]} == m else exp_f32(z_{ids[r]} - m);  S = +0; S = S + e_r (rank order);
//                   w_r = e_r / S          (S >= 1; all chosen logits -inf: equal logits, w_r = 1/k)
//   otherwise:    w_r = p_{ids[r]}
// Weights are fp32 (never rounded to the model dtype); the full score row p is returned too (fp32), for
// auxiliary (load-balancing) losses computed from the same numbers.
// NaN policy: a NaN logit makes every score of its row NaN (softmax and sigmoid alike) and so every weight of
// that token NaN: the token's output is NaN at every expert it routes to, never silently finite. The keys of
// a NaN row are all NaN, so the scan picks ids 0..k-1: in range and deterministic.
//
// Backward (aligned::moe_routing_backward), given gw[r] (grad of w) and gs[i] (grad of the score row, may be 0):
//   gp_i = gs_i, then for r in rank order:  renormalize: dot = +0; dot = dot + gw_r * w_r (rank order);
//                                                        gp_{ids[r]} = gp_{ids[r]} + (gw_r - dot) / s
//                                           otherwise:   gp_{ids[r]} = gp_{ids[r]} + gw_r
//   softmax: q = lane_sum_i (p_i * gp_i); dz_i = p_i * (gp_i - q)          sigmoid: dz_i = gp_i * (p_i * (1 - p_i))
//   sigmoid with the logit form of the weights above (s < 2^-24): there d w_r / d z_j = w_r (delta_rj - w_j)
//   (the exact factor 1 - p_j is within one fp32 rounding of 1), so  dz_i = gs_i * (p_i * (1 - p_i)), then
//   dz_{ids[r]} = dz_{ids[r]} + w_r * (gw_r - dot) for r in rank order (w_r of the forward, dot as above).
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
//
// Backward (aligned::moe_experts_backward; the CPU kernel is ops/moe.py's, built from aligned ops), per token
// and rank r, with go the fp32 gradient of out:
//   routing weight:         gw_r = row_sum_n fp32(go[n] * y_r[n])
//   shared gate (if any):   dlogit = row_sum_n fp32(go[n] * y_s[n]) * (g * (1 - g))
// where row_sum is the linear contract's sum (contract.h linear_dot of the fp32 product row against ones: 8 lanes
// of fma chains, tree-combined): row-local, so a token's gradient does not depend on the batch, on which tokens
// share its experts, or on threads. The expert weights' and x's gradients are linear_backward /
// silu_and_mul_backward chains, experts in increasing id, tokens in batch order.
#pragma once

#include "contract.h"

namespace aligned {

enum class MoeScoring : int { Softmax = 0, Sigmoid = 1 };

// sigmoid_score of the contract above (fp32 sigmoid without the 1/inf underflow below about -88.72).
ALIGNED_HD float moe_sigmoid_score(float z) {
  const float e = exp_f32(-z);
  if (e == float_of(0x7f800000u)) return exp_f32(z);  // z < about -88.72 (finite or -inf): 1 + exp(z) == 1
  return div_f32(1.0f, 1.0f + e);
}

// Scores p[0..E) of one row of router logits.
template <typename T>
ALIGNED_HD void moe_scores_row(const T* z, int64_t E, MoeScoring scoring, float* p) {
  bool nan = false;
  float m = -float_of(0x7f800000u);
  for (int64_t i = 0; i < E; ++i) {
    const float v = to_f32(z[i]);
    nan = nan || is_nan_f32(v);
    m = max_f32(m, v);
  }
  if (nan) {  // NaN policy: the whole row (both scorings)
    for (int64_t i = 0; i < E; ++i) p[i] = float_of(0x7fc00000u);
    return;
  }
  if (scoring == MoeScoring::Sigmoid) {
    for (int64_t i = 0; i < E; ++i) p[i] = moe_sigmoid_score(to_f32(z[i]));
    return;
  }
  for (int64_t i = 0; i < E; ++i) p[i] = exp_f32(to_f32(z[i]) - m);
  const float S = lane_sum(E, [&](int64_t i) { return p[i]; });
  for (int64_t i = 0; i < E; ++i) p[i] = div_f32(p[i], S);
}

// The selection key of expert i (moe.h "Top-k"): p_i (softmax), the logit (sigmoid; NaN for a NaN row, whose
// scores are all NaN).
template <typename T>
ALIGNED_HD float moe_select_key(const T* z, const float* p, int64_t i, MoeScoring scoring) {
  if (scoring == MoeScoring::Sigmoid && !is_nan_f32(p[i])) return to_f32(z[i]);
  return p[i];
}

// Whether the sigmoid weights take the logit form (moe.h: the chosen scores sum below 2^-24).
ALIGNED_HD bool moe_sigmoid_logit_form(float s) { return !is_nan_f32(s) && s < float_of(0x33800000u); }

// Top-k of one row (ties: lower id), weights (renormalised in rank order or not). `taken` is E bytes of scratch.
template <typename T>
ALIGNED_HD void moe_topk_row(const T* z, const float* p, int64_t E, int64_t k, MoeScoring scoring, bool renormalize,
                             unsigned char* taken, int64_t* ids, float* w) {
  for (int64_t i = 0; i < E; ++i) taken[i] = 0;
  for (int64_t r = 0; r < k; ++r) {
    int64_t best = -1;
    float best_key = 0.0f;
    for (int64_t i = 0; i < E; ++i) {
      if (taken[i]) continue;
      const float key = moe_select_key(z, p, i, scoring);
      if (best < 0 || key > best_key) {
        best = i;
        best_key = key;
      }
    }
    taken[best] = 1;
    ids[r] = best;
    w[r] = p[best];
  }
  if (!renormalize) return;
  float s = 0.0f;
  for (int64_t r = 0; r < k; ++r) s = s + w[r];
  if (scoring == MoeScoring::Sigmoid && moe_sigmoid_logit_form(s)) {
    const float m = to_f32(z[ids[0]]);
    float S = 0.0f;
    for (int64_t r = 0; r < k; ++r) {
      const float zr = to_f32(z[ids[r]]);
      w[r] = zr == m ? 1.0f : exp_f32(zr - m);
      S = S + w[r];
    }
    for (int64_t r = 0; r < k; ++r) w[r] = div_f32(w[r], S);
    return;
  }
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
    if (scoring == MoeScoring::Sigmoid && moe_sigmoid_logit_form(s)) {
      // The logit form of the weights (moe.h), recomputed as the forward computes it; gp[r] holds w_r.
      const float m = to_f32(z[ids[0]]);
      float S = 0.0f;
      for (int64_t r = 0; r < k; ++r) {
        const float zr = to_f32(z[ids[r]]);
        gp[r] = zr == m ? 1.0f : exp_f32(zr - m);
        S = S + gp[r];
      }
      float dot = 0.0f;
      for (int64_t r = 0; r < k; ++r) {
        gp[r] = div_f32(gp[r], S);
        dot = dot + gw[r] * gp[r];
      }
      for (int64_t i = 0; i < E; ++i) dz[i] = (gs ? gs[i] : 0.0f) * (p[i] * (1.0f - p[i]));
      for (int64_t r = 0; r < k; ++r) dz[ids[r]] = dz[ids[r]] + gp[r] * (gw[r] - dot);
      return;
    }
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
