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

// The quiet NaN every MoE kernel writes (a NaN router row's scores,
// a token with a bad expert id: its output / dz row).
ALIGNED_HD float moe_nan_f32() { return float_of(0x7fc00000u); }

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
    for (int64_t i = 0; i < E; ++i) p[i] = moe_nan_f32();
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

// Floats of one routing thread's scratch on the GPU (gpu/moe_kernels.cuh moe_route_scratch, sized by
// gpu/moe_api.h moe_routing_scratch_floats): p / key [E], gp [E], d [E], u [k], gscore [n_group], and the byte
// flags taken [E] / kept [n_group] packed into the rest.
ALIGNED_HD int64_t moe_route_scratch_floats(int64_t E, int64_t k, int64_t n_group) {
  return 3 * E + k + 2 * n_group + 2;
}

// sigmoid of the shared-expert gate logit (fp32).
ALIGNED_HD float moe_shared_gate(float logit) { return div_f32(1.0f, 1.0f + exp_f32(-logit)); }

// One step of the combine (the contract above): acc + w * v, the product rounded to fp32, then added — never a
// fused multiply-add. Every backend's combine is a chain of these from acc = +0 (the ranks in rank order, then the
// shared expert with w = g): moe_combine_row, the CPU kernel (cpu/moe_kernels.cpp), the GPU kernel
// (gpu/moe_kernels.cuh).
ALIGNED_HD float moe_combine_step(float acc, float w, float v) {
  const float prod = w * v;
  return acc + prod;
}

// The combine of one token over the H outputs: acc = sum_r w_r * y_r (rank order) [+ g * y_s], rounded once.
// y[r] points at the fp32 output row of rank r; ys is nullptr without a shared expert.
template <typename T>
ALIGNED_HD void moe_combine_row(const float* const* y, const float* w, int64_t k, const float* ys, float g, T* out,
                                int64_t H) {
  for (int64_t n = 0; n < H; ++n) {
    float acc = 0.0f;
    for (int64_t r = 0; r < k; ++r) acc = moe_combine_step(acc, w[r], y[r][n]);
    if (ys) acc = moe_combine_step(acc, g, ys[n]);
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

// ---- grouped sigmoid routing (aligned::moe_grouped_routing) -------------------------------------------------
// DeepSeek-V3's "noaux_tc" routing (also Kimi-K2 with n_group = 1, GLM-4.5-MoE). Per token, from one row of
// router logits z[0..E) (any storage type, widened exactly to fp32 — the models compute them in fp32), the fp32
// correction bias b[0..E) (absent: b_i = +0), top_k, n_group, topk_group, renormalize and the routed scaling
// factor c (rounded to fp32 once, on the host):
//   scores:    p_i = sigmoid_score(z_i) = 1 / (1 + exp_f32(-z_i)), or exp_f32(z_i) where exp_f32(-z_i) overflows
//              (z below about -88.72: there 1 + exp(z) rounds to 1, so this IS the fp32 sigmoid, without the
//              1/inf = 0 underflow of the plain form); p(+inf) = 1, p(-inf) = 0, and p = 1 exactly from
//              z ≈ 16.6 up ("saturated": equal scores, decided by the bias and then by the tie rule).
//   keys:      key_i = p_i + b_i (one fp32 add).
//   order:     x beats y  <=>  key_x > key_y, or key_x == key_y and x < y (ties -> the LOWER index), where a NaN
//              key ranks below every number (-inf included) and NaN keys are equal; -0 == +0. The same order
//              ranks groups by their scores (ties -> the lower group index).
//   groups:    G = E / n_group experts per group, contiguous: group g = experts [g*G, (g+1)*G).
//              group score gs_g = k1 + k2 (fp32), the best and second-best key of the group by the order above
//              (DeepSeek-V3's topk(2).sum()); G == 1: gs_g = k1.
//   kept:      the topk_group best groups (n_group == 1, Kimi-K2, or topk_group == n_group: every group).
//   selection: rank r = 0..top_k-1 picks, among the not-yet-picked experts of KEPT groups, the one that beats all
//              the others: ids[r]. Experts of dropped groups are never picked (vLLM and HF 5.19 mask them with
//              -inf; a 0.0 mask, as older references write it, picks a dropped expert when every kept key is
//              below 0 — not this contract). top_k <= topk_group * G (checked), so every rank finds an expert.
//   weights:   u_r = p_{ids[r]} (the UNBIASED score; the bias only selects);
//              renormalize: s = +0; s = s + u_r (rank order); u_r = u_r / s — except when s < 2^-24 (every
//                chosen logit below about -16.6, where sigmoid(z) = exp(z) to within fp32 rounding and u/s loses
//                bits or is 0/0): the same ratios from the logits, m = max_r z_{ids[r]} (exact),
//                e_r = 1 if z_{ids[r]} == m else exp_f32(z_{ids[r]} - m), S = +0; S = S + e_r (rank order),
//                u_r = e_r / S  (all chosen logits -inf: u_r = 1/k). No epsilon (HF adds 1e-20, vLLM none).
//              w_r = u_r * c (fp32, after the renormalisation; vLLM scales the combined output instead).
//   outputs:   w [top_k] fp32 (never rounded to the model dtype), ids [top_k] (rank order = the order above,
//              which is moe_experts' combine order), the score row p [E] fp32 (unbiased, for diagnostics).
// NaN policy: a NaN logit makes every p of its token NaN (as moe_routing's sigmoid: the token's output is NaN
// at every expert it routes to, never silently finite); then every key ties (NaN) and the lower index wins:
// groups 0..topk_group-1 are kept and ids = 0..top_k-1. A NaN bias entry makes that expert's key NaN: it ranks
// below every number (as does its group's score whenever the key is one of the group's two best).
//
// Backward (aligned::moe_grouped_routing_backward), given gw[r] (grad of w) and gs[i] (grad of p, or 0):
//   gu_r = gw_r * c;  gp_i = gs_i; then, with the forward's u_r and s (recomputed from z and ids):
//     renormalize, ratio form:  dot = +0; dot = dot + gu_r * u_r (rank order);
//                               gp_{ids[r]} = gp_{ids[r]} + (gu_r - dot) / s     (r in rank order)
//     not renormalize:          gp_{ids[r]} = gp_{ids[r]} + gu_r
//   dz_i = gp_i * (p_i * (1 - p_i));
//     renormalize, logit form (s < 2^-24; there d u_r / d z_j = u_r (delta_rj - u_j) to within one rounding):
//                               dz_i = gs_i * (p_i * (1 - p_i)), then dz_{ids[r]} = dz_{ids[r]} + u_r * (gu_r - dot)
//   The bias gets no gradient: it only chooses experts, so the weights are piecewise constant in it (derivative
//   0 wherever it exists); DeepSeek updates it outside the gradient (aux-loss-free balancing).

// The order of the grouped routing: does (key a, index ia) beat (key b, index ib)? NaN below every number.
ALIGNED_HD bool moe_grouped_beats(float a, int64_t ia, float b, int64_t ib) {
  const bool na = is_nan_f32(a), nb = is_nan_f32(b);
  if (na || nb) return na == nb ? ia < ib : nb;
  if (a != b) return a > b;
  return ia < ib;
}

// Whether the renormalised weights take the logit form (the chosen scores sum below 2^-24).
ALIGNED_HD bool moe_grouped_logit_form(float s) { return !is_nan_f32(s) && s < float_of(0x33800000u); }

// The unscaled weights u[0..k) of the chosen experts (renormalised or not) and s (their rank-order sum; the
// caller reads the form from it). p: the score row.
template <typename T>
ALIGNED_HD float moe_grouped_unscaled_weights(const T* z, const float* p, const int64_t* ids, int64_t k,
                                              bool renormalize, float* u) {
  float s = 0.0f;
  for (int64_t r = 0; r < k; ++r) {
    u[r] = p[ids[r]];
    s = s + u[r];
  }
  if (!renormalize) return s;
  if (moe_grouped_logit_form(s)) {
    float m = to_f32(z[ids[0]]);
    for (int64_t r = 1; r < k; ++r) m = max_f32(m, to_f32(z[ids[r]]));
    float S = 0.0f;
    for (int64_t r = 0; r < k; ++r) {
      const float zr = to_f32(z[ids[r]]);
      u[r] = zr == m ? 1.0f : exp_f32(zr - m);
      S = S + u[r];
    }
    for (int64_t r = 0; r < k; ++r) u[r] = div_f32(u[r], S);
    return s;
  }
  for (int64_t r = 0; r < k; ++r) u[r] = div_f32(u[r], s);
  return s;
}

// One token of the grouped routing. bias: E fp32 or nullptr. Scratch: key [E], gscore [n_group], taken [E],
// kept [n_group]. Writes p [E], ids [k], w [k].
template <typename T>
ALIGNED_HD void moe_grouped_routing_row(const T* z, const float* bias, int64_t E, int64_t k, int64_t n_group,
                                        int64_t topk_group, bool renormalize, float scale, float* key, float* gscore,
                                        unsigned char* taken, unsigned char* kept, float* p, int64_t* ids, float* w) {
  bool nan = false;
  for (int64_t i = 0; i < E; ++i) nan = nan || is_nan_f32(to_f32(z[i]));
  for (int64_t i = 0; i < E; ++i) p[i] = nan ? moe_nan_f32() : moe_sigmoid_score(to_f32(z[i]));
  for (int64_t i = 0; i < E; ++i) key[i] = bias ? p[i] + bias[i] : p[i];
  const int64_t G = E / n_group;
  for (int64_t g = 0; g < n_group; ++g) {
    int64_t b1 = -1, b2 = -1;
    for (int64_t i = g * G; i < (g + 1) * G; ++i) {
      if (b1 < 0 || moe_grouped_beats(key[i], i, key[b1], b1)) {
        b2 = b1;
        b1 = i;
      } else if (b2 < 0 || moe_grouped_beats(key[i], i, key[b2], b2)) {
        b2 = i;
      }
    }
    gscore[g] = b2 < 0 ? key[b1] : key[b1] + key[b2];
    kept[g] = 0;
  }
  for (int64_t r = 0; r < topk_group; ++r) {
    int64_t best = -1;
    for (int64_t g = 0; g < n_group; ++g)
      if (!kept[g] && (best < 0 || moe_grouped_beats(gscore[g], g, gscore[best], best))) best = g;
    kept[best] = 1;
  }
  for (int64_t i = 0; i < E; ++i) taken[i] = kept[i / G] ? 0 : 1;  // dropped groups: never eligible
  for (int64_t r = 0; r < k; ++r) {
    int64_t best = -1;
    for (int64_t i = 0; i < E; ++i)
      if (!taken[i] && (best < 0 || moe_grouped_beats(key[i], i, key[best], best))) best = i;
    taken[best] = 1;
    ids[r] = best;
  }
  moe_grouped_unscaled_weights(z, p, ids, k, renormalize, w);
  for (int64_t r = 0; r < k; ++r) w[r] = w[r] * scale;
}

// Gradient of one token's router logits (the backward above). gs may be nullptr. Scratch: p [E], gp [E], u [k].
template <typename T>
ALIGNED_HD void moe_grouped_routing_backward_row(const float* gw, const float* gs, const T* z, const int64_t* ids,
                                                 int64_t E, int64_t k, bool renormalize, float scale, float* p,
                                                 float* gp, float* u, float* dz) {
  bool nan = false;
  for (int64_t i = 0; i < E; ++i) nan = nan || is_nan_f32(to_f32(z[i]));
  for (int64_t i = 0; i < E; ++i) p[i] = nan ? moe_nan_f32() : moe_sigmoid_score(to_f32(z[i]));
  for (int64_t i = 0; i < E; ++i) gp[i] = gs ? gs[i] : 0.0f;
  const float s = moe_grouped_unscaled_weights(z, p, ids, k, renormalize, u);
  if (!renormalize) {
    for (int64_t r = 0; r < k; ++r) gp[ids[r]] = gp[ids[r]] + gw[r] * scale;
    for (int64_t i = 0; i < E; ++i) dz[i] = gp[i] * (p[i] * (1.0f - p[i]));
    return;
  }
  float dot = 0.0f;
  for (int64_t r = 0; r < k; ++r) dot = dot + (gw[r] * scale) * u[r];
  if (moe_grouped_logit_form(s)) {
    for (int64_t i = 0; i < E; ++i) dz[i] = gp[i] * (p[i] * (1.0f - p[i]));
    for (int64_t r = 0; r < k; ++r) dz[ids[r]] = dz[ids[r]] + u[r] * (gw[r] * scale - dot);
    return;
  }
  for (int64_t r = 0; r < k; ++r) gp[ids[r]] = gp[ids[r]] + div_f32(gw[r] * scale - dot, s);
  for (int64_t i = 0; i < E; ++i) dz[i] = gp[i] * (p[i] * (1.0f - p[i]));
}

}  // namespace aligned
