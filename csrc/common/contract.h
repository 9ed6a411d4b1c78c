// contract.h — the reduction order of every dense op, written down once.
//
// Each function below is the per-row (or per-element) definition of an op: the exact fp32 expression
// tree, with the order of every sum. The CPU backend calls these functions row by row (the compiler
// vectorises them without changing any element's tree: no contraction, no reassociation); the CUDA and
// HIP kernels parallelise each row across a warp/wave with the same lane assignment (reduce.h) and
// the same per-element expressions. Rows never interact, so an output row depends only on its own
// input row and the weights: batch size, row position, other rows and thread count cannot change it.
//
// Storage types T: float, bf16_t, f16_t. Inputs are widened to fp32 exactly; every result is rounded
// once to its output type (round to nearest even).
//
// NaN policy (all ops): NaN inputs propagate to the outputs that depend on them; nothing is clamped,
// nothing is silently dropped. A row of log_softmax that holds a NaN or +inf yields NaN for the row
// (logsumexp of a row with +inf and no NaN is +inf); the log-prob section below lists every special row.
#pragma once

#include "numerics.h"
#include "reduce.h"

namespace aligned {

// ---- linear ----------------------------------------------------------------------------------------
// out[m, n] = round_T(acc + bias[n]) where acc starts at +0 and runs k = 0, 1, ..., K-1 in order:
//   acc = fma(x[m, k], w[n, k], acc)
// One sequential fma chain per output element: no BLOCK_K split, no split-K, no tree. The chain does
// not depend on M, on the M/N tiling or on threads. (CPU: vectorised across n, 16 or 8 outputs per
// register; CUDA/HIP fp32 path: one chain per thread.) The bias add is one fp32 addition.
// Backward uses the same chain shape:
//   dx[m, k] = chain over n = 0..N-1 of fma(g[m, n], w[n, k], .)
//   dw[n, k] = chain over m = 0..M-1 of fma(g[m, n], x[m, k], .)   (tokens in their order in the batch)
//   db[n]    = chain over m = 0..M-1 of (. + g[m, n])
template <typename TX, typename TW>
ALIGNED_HD float linear_dot(const TX* x_row, const TW* w_row, int64_t K) {
  float acc = 0.0f;
  for (int64_t k = 0; k < K; ++k) acc = fma_f32(to_f32(x_row[k]), to_f32(w_row[k]), acc);
  return acc;
}

// ---- rms_norm ----------------------------------------------------------------------------------------
// ss = lane_sum over k of (x_k * x_k)        (product rounded, then added; reduce.h order)
// inv = 1 / sqrt(ss / H + eps)               (division, add, sqrt, division: each correctly rounded)
// out_k = round_T((x_k * inv) * w_k)
template <typename T>
ALIGNED_HD float rms_inv(const T* x, int64_t H, float eps) {
  float lanes[kReduceLanes];
  for (int j = 0; j < kReduceLanes; ++j) lanes[j] = 0.0f;
  int64_t k0 = 0;
  for (; k0 + kReduceLanes <= H; k0 += kReduceLanes) {
    for (int j = 0; j < kReduceLanes; ++j) {
      float v = to_f32(x[k0 + j]);
      lanes[j] = lanes[j] + v * v;
    }
  }
  for (int j = 0; k0 + j < H; ++j) {
    float v = to_f32(x[k0 + j]);
    lanes[j] = lanes[j] + v * v;
  }
  float ss = fold_lanes(lanes);
  return div_f32(1.0f, sqrt_f32(div_f32(ss, (float)H) + eps));
}

template <typename T, typename TW>
ALIGNED_HD void rms_norm_row(const T* x, const TW* w, T* out, int64_t H, float eps) {
  float inv = rms_inv(x, H, eps);
  for (int64_t k = 0; k < H; ++k) out[k] = from_f32<T>((to_f32(x[k]) * inv) * to_f32(w[k]));
}

// fused_add_rms_norm: r_k = round_T(x_k + res_k) is the new residual; the norm is rms_norm of the
// *rounded* r (as HF computes it: the residual stream is stored in T between layers).
template <typename T, typename TW>
ALIGNED_HD void fused_add_rms_norm_row(const T* x, const T* res, const TW* w, T* out, T* res_out, int64_t H,
                                       float eps) {
  for (int64_t k = 0; k < H; ++k) res_out[k] = from_f32<T>(to_f32(x[k]) + to_f32(res[k]));
  rms_norm_row(res_out, w, out, H, eps);
}

// rms_norm backward, per row (g = upstream gradient, y_k = x_k * inv):
//   gw_k = g_k * w_k ; dot = lane_sum(gw_k * x_k) ; c = ((dot / H) * inv) * inv
//   dx_k = round_T((gw_k - x_k * c) * inv)
// dw_k = chain over rows in order of (. + g_k * (x_k * inv)), computed by the column pass below.
template <typename T, typename TW>
ALIGNED_HD void rms_norm_backward_row(const T* g, const T* x, const TW* w, T* dx, int64_t H, float eps) {
  float inv = rms_inv(x, H, eps);
  float lanes[kReduceLanes];
  for (int j = 0; j < kReduceLanes; ++j) lanes[j] = 0.0f;
  for (int64_t k = 0; k < H; ++k) {
    float gw = to_f32(g[k]) * to_f32(w[k]);
    lanes[k % kReduceLanes] = lanes[k % kReduceLanes] + gw * to_f32(x[k]);
  }
  float dot = fold_lanes(lanes);
  float c = (div_f32(dot, (float)H) * inv) * inv;
  for (int64_t k = 0; k < H; ++k) {
    float gw = to_f32(g[k]) * to_f32(w[k]);
    dx[k] = from_f32<T>((gw - to_f32(x[k]) * c) * inv);
  }
}

// ---- silu_and_mul -------------------------------------------------------------------------------------
// x = [a | b] (last dim 2d): out_i = round_T(silu(a_i) * b_i), silu(a) = a / (1 + exp(-a)).
// Backward: s = 1 / (1 + exp(-a)); da = round_T((g * b) * (s + (a * s) * (1 - s))); db = round_T(g * silu(a)).
ALIGNED_HD float silu_mul(float a, float b) { return silu_f32(a) * b; }
ALIGNED_HD void silu_mul_backward(float g, float a, float b, float* da, float* db) {
  float s = div_f32(1.0f, 1.0f + exp_f32(-a));
  *da = (g * b) * (s + (a * s) * (1.0f - s));
  *db = g * silu_f32(a);
}

// ---- rotary_embedding -----------------------------------------------------------------------------------
// cos_sin_cache[pos] = [cos_0 .. cos_{R/2-1} | sin_0 .. sin_{R/2-1}] (fp32, R = rotary_dim).
// Pair i (i < R/2) is (i, i + R/2) for neox style, (2i, 2i+1) for gpt-j style; dims >= R pass through.
//   o1 = x1 * c - x2 * s ; o2 = x2 * c + x1 * s        (each product rounded, then one add/sub)
// Backward is the rotation by -theta: g1' = g1 * c + g2 * s ; g2' = g2 * c - g1 * s.
ALIGNED_HD void rotate_pair(float x1, float x2, float c, float s, bool inverse, float* o1, float* o2) {
  if (!inverse) {
    *o1 = x1 * c - x2 * s;
    *o2 = x2 * c + x1 * s;
  } else {
    *o1 = x1 * c + x2 * s;
    *o2 = x2 * c - x1 * s;
  }
}

// ---- log_softmax / logsumexp / token_logprobs (+ their backward) ----------------------------------------
// s_v = z_v / tau (IEEE division; tau > 0 and a normal fp32 value, checked by the glue),
// m = max_v s_v (exact, order-free), sum = lane_sum over v of exp(s_v - m), L = log(sum).
// The row is kept as the pair (m, L) — never as one lse = m + L — so that the shift stays exact:
//   logp_v  = (s_v - m) - L                  (log_softmax; token_logprobs is logp_id of the same expression,
//                                             so it equals log_softmax(z)[id] bit for bit)
//   lse     = m + L                          (logsumexp)
//   p_v     = exp(logp_v)
// Why the pair: s_v - m is exact whenever s_v is within a factor 2 of m (Sterbenz) and L is in [0, log V],
// so logp of the likely tokens keeps full fp32 relative accuracy however large the logits are. The former
// s_v - (m + L) rounded m + L to the ulp of m first: errors of 3.7e-6 at max logit 1e2, 4.6e-4 at 1e4 and
// 3e-2 at 1e6; and a fully masked row (every logit -3e38 or the bf16 minimum) gave logp = 0 for every token
// (probabilities summing to V). With the pair that row gives (s - s) - log V = -log V exactly as it should.
// Backward (g = upstream gradient; each product rounded, then the division by tau):
//   token_logprobs: dz_v = round_T(((v == id ? 1 : 0) - p_v) * g / tau)        [(. * g) then / tau]
//   logsumexp:      dz_v = round_T((p_v * g) / tau)
//   log_softmax:    G = lane_sum over v of g_v (reduce.h order), dz_v = round_T((g_v - p_v * G) / tau)
// Special rows (decided by the max pass alone; NaN policy, see also the README):
//   a NaN s_v anywhere      -> (NaN, NaN): every logp, the lse and every gradient of the row are NaN;
//   a +inf s_v (no NaN)     -> (+inf, NaN): logsumexp = +inf (as torch.logsumexp), logp and gradients NaN;
//   every s_v = -inf        -> (-inf, 0): logsumexp = -inf, logp = (-inf - -inf) - 0 = NaN (as torch);
//   some -inf, some finite  -> the -inf entries get logp = -inf and p = 0 (masked logits), others are exact.
// Note tau < 1 can turn a finite masked logit (-3e38) into s = -inf: such a row is an all -inf row.
// Accuracy limit of the exp-sum: each of the 32 lanes is a sequential fp32 chain of V/32 terms, so the
// relative error of sum (and the absolute error of L, in nats) grows like (V/32) * 2^-24 in the worst case,
// ~sqrt(V/32) * 2^-24 typically: ~1e-7 at V = 152k, but V = 2^24 (2^19 terms per lane) was off by 3e-4 nats.
struct LsePair {
  float m;  // shift: the row maximum of s (NaN / +inf / -inf for the special rows above)
  float L;  // log of the shifted exp-sum, in [0, log V] for an ordinary row
};

constexpr int32_t kRowHasNaN = 1;     // flags gathered by the max pass
constexpr int32_t kRowHasPosInf = 2;

ALIGNED_HD int32_t logit_flags(float s) {
  return (is_nan_f32(s) ? kRowHasNaN : 0) | (s == float_of(0x7f800000u) ? kRowHasPosInf : 0);
}

// The special rows: true when (m, flags) already decide the row (the exp-sum pass is skipped).
ALIGNED_HD bool lse_special_row(float m, int32_t flags, LsePair* out) {
  const float inf = float_of(0x7f800000u), nan = float_of(0x7fc00000u);
  if (flags & kRowHasNaN) {
    *out = LsePair{nan, nan};
    return true;
  }
  if (flags & kRowHasPosInf) {
    *out = LsePair{inf, nan};
    return true;
  }
  if (m == -inf) {
    *out = LsePair{-inf, 0.0f};
    return true;
  }
  return false;
}

ALIGNED_HD float lse_value(LsePair p) { return p.m == float_of(0x7f800000u) ? p.m : p.m + p.L; }
ALIGNED_HD float logp_value(float s, LsePair p) { return (s - p.m) - p.L; }
ALIGNED_HD float prob_value(float s, LsePair p) { return exp_f32(logp_value(s, p)); }

// The reference row: max pass, then the reduce.h lane sums of exp(s_v - m). Backends compute the same
// values with their own loops (cpu_kernels.cpp, dense_kernels.cuh); tests compare them.
template <typename T>
ALIGNED_HD LsePair lse_pair_row(const T* z, int64_t V, float tau) {
  float m = -float_of(0x7f800000u);
  int32_t flags = 0;
  for (int64_t v = 0; v < V; ++v) {
    float s = div_f32(to_f32(z[v]), tau);
    flags |= logit_flags(s);
    m = max_f32(m, s);
  }
  LsePair p;
  if (lse_special_row(m, flags, &p)) return p;
  float lanes[kReduceLanes];
  for (int j = 0; j < kReduceLanes; ++j) lanes[j] = 0.0f;
  for (int64_t v = 0; v < V; ++v)
    lanes[v % kReduceLanes] = lanes[v % kReduceLanes] + exp_f32(div_f32(to_f32(z[v]), tau) - m);
  return LsePair{m, log_f32(fold_lanes(lanes))};
}

ALIGNED_HD float token_logprobs_grad(float s, LsePair p, bool is_id, float g, float tau) {
  return div_f32(((is_id ? 1.0f : 0.0f) - prob_value(s, p)) * g, tau);
}
ALIGNED_HD float logsumexp_grad(float s, LsePair p, float g, float tau) { return div_f32(prob_value(s, p) * g, tau); }
ALIGNED_HD float log_softmax_grad(float s, LsePair p, float g_v, float g_sum, float tau) {
  return div_f32(g_v - prob_value(s, p) * g_sum, tau);
}

}  // namespace aligned
