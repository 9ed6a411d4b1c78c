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
// nothing is silently dropped. A row of log_softmax that holds a NaN or +inf yields NaN for the row.
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

// ---- log_softmax / token_logprobs ------------------------------------------------------------------------
// s_v = z_v / tau (IEEE division; tau > 0), m = max_v s_v (exact, order-free),
// sum = lane_sum over v of exp(s_v - m), lse = m + log(sum), logp_v = s_v - lse.
// token_logprobs(z, id) is logp_id of the same expression, so it equals log_softmax(z)[id] bit for bit.
// Backward: dz_v = round_T(((v == id ? 1 : 0) - exp(s_v - lse)) * g / tau)   [(. * g) then / tau]
// NaN or +inf anywhere in the row -> lse = NaN (so every output of the row is NaN).
template <typename T>
ALIGNED_HD float logsumexp_row(const T* z, int64_t V, float tau) {
  float m = -float_of(0x7f800000u);
  bool bad = false;
  for (int64_t v = 0; v < V; ++v) {
    float s = div_f32(to_f32(z[v]), tau);
    bad = bad || is_nan_f32(s) || s == float_of(0x7f800000u);
    m = max_f32(m, s);
  }
  if (bad) return float_of(0x7fc00000u);
  if (m == -float_of(0x7f800000u)) return m;  // every logit -inf: lse = -inf, logp = NaN (documented)
  float lanes[kReduceLanes];
  for (int j = 0; j < kReduceLanes; ++j) lanes[j] = 0.0f;
  int64_t v0 = 0;
  for (; v0 + kReduceLanes <= V; v0 += kReduceLanes) {
    for (int j = 0; j < kReduceLanes; ++j) lanes[j] = lanes[j] + exp_f32(div_f32(to_f32(z[v0 + j]), tau) - m);
  }
  for (int j = 0; v0 + j < V; ++j) lanes[j] = lanes[j] + exp_f32(div_f32(to_f32(z[v0 + j]), tau) - m);
  return m + log_f32(fold_lanes(lanes));
}

}  // namespace aligned
