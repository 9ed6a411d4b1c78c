// cpu_kernels.cpp — CPU backend kernels, compiled once per ISA level (see CMakeLists.txt: this file is
// built with -DALIGNED_ISA=generic / avx2 / avx512 and the matching -m flags). Every body evaluates the
// per-element expression trees and the reduce.h lane order of csrc/common/contract.h, so every ISA level
// computes the same bits (tests/cpu/test_isa_levels.py runs each level in its own process and compares):
//   * most loops are the contract's own per-row functions, shaped so the compiler vectorises the 32
//     independent lanes (contraction is off, so it cannot fuse or reorder anything);
//   * where gcc's vectorised code is slow (exp inside the log-prob lane chains and silu_and_mul), the kernel
//     calls the contract's formula (silu_mul, lse_sum_step) instantiated for this level's vector type
//     (simd.h: F32x16 on AVX-512, F32x8 on AVX2, lane by lane the same IEEE operations as the float helper);
//   * log-prob rows take two passes: s = z / tau once (into the output row or a per-thread scratch row) with
//     lane maxima, then the lane chains of exp(s - m) — the contract's (m, L) pair without a second division;
//   * dense_split_kernels.h: pieces that let threads share one row (decode batches) without splitting a
//     reduction chain.
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <memory>

#include "../common/contract.h"
#include "cpu_kernels.h"
#include "dense_split_kernels.h"
#include "simd.h"

#ifndef ALIGNED_ISA
#error "ALIGNED_ISA must name the ISA level this translation unit is compiled for"
#endif

namespace aligned::cpu::ALIGNED_ISA {

using aligned::bf16_t;
using aligned::f16_t;

namespace simd = aligned::cpu::ALIGNED_ISA::simd;
using simd::VecF32;  // this level's fp32 vector (simd.h): F32x16, F32x8 or F32x1

static void rms_norm(const RmsNormParams& p, int64_t r0, int64_t r1) {
  const DType dt = p.dt, wdt = p.wdt;
  const void *x = p.x, *w = p.w;
  void* out = p.out;
  const int64_t H = p.H;
  const float eps = p.eps;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    with_type(wdt, [&](auto* wp) {
      using TW = std::remove_pointer_t<decltype(wp)>;
      for (int64_t r = r0; r < r1; ++r)
        rms_norm_row((const T*)x + r * H, (const TW*)w, (T*)out + r * H, H, eps);
    });
  });
}

static void fused_add_rms_norm(const RmsNormParams& p, int64_t r0, int64_t r1) {
  const DType dt = p.dt, wdt = p.wdt;
  const void *x = p.x, *res = p.residual, *w = p.w;
  void *out = p.out, *res_out = p.residual_out;
  const int64_t H = p.H;
  const float eps = p.eps;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    with_type(wdt, [&](auto* wp) {
      using TW = std::remove_pointer_t<decltype(wp)>;
      for (int64_t r = r0; r < r1; ++r)
        fused_add_rms_norm_row((const T*)x + r * H, (const T*)res + r * H, (const TW*)w, (T*)out + r * H,
                               (T*)res_out + r * H, H, eps);
    });
  });
}

static void rms_norm_backward_dx(const RmsNormBackwardParams& p, int64_t r0, int64_t r1) {
  const DType dt = p.dt, wdt = p.wdt;
  const void *g = p.g, *x = p.x, *w = p.w;
  void* dx = p.dx;
  const int64_t H = p.H;
  const float eps = p.eps;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    with_type(wdt, [&](auto* wp) {
      using TW = std::remove_pointer_t<decltype(wp)>;
      for (int64_t r = r0; r < r1; ++r)
        rms_norm_backward_row((const T*)g + r * H, (const T*)x + r * H, (const TW*)w, (T*)dx + r * H, H, eps);
    });
  });
}

static void rms_inv_rows(const RmsNormBackwardParams& p, int64_t r0, int64_t r1) {
  const DType dt = p.dt;
  const void* x = p.x;
  float* inv = p.inv;
  const int64_t H = p.H;
  const float eps = p.eps;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = r0; r < r1; ++r) inv[r] = rms_inv((const T*)x + r * H, H, eps);
  });
}

// dw[k] = chain over rows r = 0..rows-1 of (. + g[r,k] * (x[r,k] * inv[r])), columns [c0, c1).
static void rms_norm_backward_dw(const RmsNormBackwardParams& p, int64_t c0, int64_t c1) {
  const DType dt = p.dt;
  const void *g = p.g, *x = p.x;
  float* dw = p.dw;
  const float* inv = p.inv;
  const int64_t rows = p.rows, H = p.H;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    const T* gt = (const T*)g;
    const T* xt = (const T*)x;
    for (int64_t k = c0; k < c1; ++k) dw[k] = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      const T* gr = gt + r * H;
      const T* xr = xt + r * H;
      float iv = inv[r];
      for (int64_t k = c0; k < c1; ++k) dw[k] = rms_grad_dw_step(dw[k], to_f32(gr[k]), to_f32(xr[k]), iv);
    }
  });
}

// out[i] = round_T(silu(a[i]) * b[i]) for i in [c0, c1): contract.h silu_mul, on this level's vectors
// (the scalar loop: f16 stores, and the generic level).
template <typename T>
static void silu_mul_range(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ o, int64_t c0, int64_t c1) {
  int64_t i = c0;
  if constexpr (VecF32::kLanes > 1 && simd::kVectorStore<VecF32, T>) {
    for (; i < c1; i += VecF32::kLanes) {
      const int n = (int)std::min<int64_t>(VecF32::kLanes, c1 - i);
      simd::store(o + i, silu_mul(simd::load<VecF32>(a + i, n), simd::load<VecF32>(b + i, n)), n);
    }
  }
  for (; i < c1; ++i) o[i] = from_f32<T>(silu_mul(to_f32(a[i]), to_f32(b[i])));
}

static void silu_and_mul(const SiluMulParams& p, int64_t r0, int64_t r1) {
  const DType dt = p.dt;
  const void* x = p.x;
  void* out = p.out;
  const int64_t d = p.d;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = r0; r < r1; ++r) {
      const T* a = (const T*)x + r * 2 * d;
      silu_mul_range(a, a + d, (T*)out + r * d, 0, d);
    }
  });
}

static void silu_and_mul_backward(const SiluMulParams& p, int64_t r0, int64_t r1) {
  const DType dt = p.dt;
  const void *g = p.g, *x = p.x;
  void* dx = p.out;
  const int64_t d = p.d;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = r0; r < r1; ++r) {
      const T* gr = (const T*)g + r * d;
      const T* a = (const T*)x + r * 2 * d;
      const T* b = a + d;
      T* da = (T*)dx + r * 2 * d;
      T* db = da + d;
      for (int64_t i = 0; i < d; ++i) {
        float fa, fb;
        silu_mul_backward(to_f32(gr[i]), to_f32(a[i]), to_f32(b[i]), &fa, &fb);
        da[i] = from_f32<T>(fa);
        db[i] = from_f32<T>(fb);
      }
    }
  });
}

// Rotary: one instantiation per (pairing, direction), so the inner loop has no per-element index choice and
// vectorises (neox: two contiguous half-rows; gpt-j: even/odd lanes, de-interleaved by the compiler).
template <typename T, bool kNeox, bool kInverse>
static void rotary_rows(const int64_t* positions, const T* x, T* out, const float* cache, int64_t heads,
                        int64_t head_dim, int64_t rot, int64_t r0, int64_t r1) {
  const int64_t half = rot / 2;
  for (int64_t t = r0; t < r1; ++t) {
    const float* cs = cache + positions[t] * rot;
    for (int64_t h = 0; h < heads; ++h) {
      const T* __restrict__ xr = x + (t * heads + h) * head_dim;
      T* __restrict__ o = out + (t * heads + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t i1 = kNeox ? i : 2 * i;
        const int64_t i2 = kNeox ? i + half : 2 * i + 1;
        float o1, o2;
        rotate_pair(to_f32(xr[i1]), to_f32(xr[i2]), cs[i], cs[half + i], kInverse, &o1, &o2);
        o[i1] = from_f32<T>(o1);
        o[i2] = from_f32<T>(o2);
      }
      if (head_dim > rot) memcpy(o + rot, xr + rot, (size_t)(head_dim - rot) * sizeof(T));
    }
  }
}

static void rotary(const RotaryParams& p, int64_t r0, int64_t r1) {
  const DType dt = p.dt;
  const int64_t* positions = p.positions;
  const void* x = p.x;
  void* out = p.out;
  const float* cache = p.cache;
  const int64_t heads = p.heads, head_dim = p.head_dim, rot = p.rot;
  const bool is_neox = p.is_neox, inverse = p.inverse;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    const T* xt = (const T*)x;
    T* ot = (T*)out;
    if (is_neox && !inverse) rotary_rows<T, true, false>(positions, xt, ot, cache, heads, head_dim, rot, r0, r1);
    if (is_neox && inverse) rotary_rows<T, true, true>(positions, xt, ot, cache, heads, head_dim, rot, r0, r1);
    if (!is_neox && !inverse) rotary_rows<T, false, false>(positions, xt, ot, cache, heads, head_dim, rot, r0, r1);
    if (!is_neox && inverse) rotary_rows<T, false, true>(positions, xt, ot, cache, heads, head_dim, rot, r0, r1);
  });
}

// ---- log-prob family -----------------------------------------------------------------------------------
// lse_pair_row of contract.h, evaluated in two vectorisable passes over the row:
//   pass 1: s_v = z_v / tau, written to `s` (fp32, the row's scratch or the log_softmax output row), with
//           32 lane maxima and 32 lane flags (logit_flags: NaN seen, +inf seen);
//   pass 2: the contract's 32 lane sums of exp(s_v - m), reading s back instead of dividing again.
// The lane maxima folded in any order give the same m as the contract's sequential max, the sign of a zero
// maximum included: every step is the total order's max (max_total_f32, as lse_max_merge). Division by tau == 1 is
// skipped: it is exact, so the bits are the same.
template <typename T, bool kUnit>
static void scale_row(const T* __restrict__ z, float* __restrict__ s, int64_t V, float tau, float* mx, int32_t* flags) {
  int64_t v0 = 0;
  for (; v0 + kReduceLanes <= V; v0 += kReduceLanes) {
    for (int j = 0; j < kReduceLanes; ++j) {
      const float sv = kUnit ? to_f32(z[v0 + j]) : div_f32(to_f32(z[v0 + j]), tau);
      s[v0 + j] = sv;
      mx[j] = max_total_f32(sv, mx[j]);
      flags[j] |= logit_flags(sv);
    }
  }
  for (int j = 0; v0 + j < V; ++j) {
    const float sv = kUnit ? to_f32(z[v0 + j]) : div_f32(to_f32(z[v0 + j]), tau);
    s[v0 + j] = sv;
    mx[j] = max_total_f32(sv, mx[j]);
    flags[j] |= logit_flags(sv);
  }
}

// The reduce.h lane chains for lanes [j0, j0 + kW) of exp(s[v] - m): lane j0+i adds v = j0+i, j0+i+32, ...
// in order (kW = 32: the whole row; 16 or 8: one lane group of an intra-row split).
template <int kW>
static void lane_exp_sums_w(const float* __restrict__ s, int64_t V, float m, int j0, float* __restrict__ lanes) {
  if constexpr (VecF32::kLanes > 1 && kW % VecF32::kLanes == 0) {  // contract.h lse_sum_step on vectors
    constexpr int kVecs = kW / VecF32::kLanes;
    VecF32 acc[kVecs];
    for (int q = 0; q < kVecs; ++q) acc[q] = VecF32::zero();
    const VecF32 mv(m);
    int64_t v0 = 0;
    for (; v0 + kReduceLanes <= V; v0 += kReduceLanes)
      for (int q = 0; q < kVecs; ++q)
        acc[q] = lse_sum_step(acc[q], simd::load<VecF32>(s + v0 + j0 + VecF32::kLanes * q), mv);
    for (int q = 0; q < kVecs; ++q) {  // last, partial chunk: missing elements add nothing
      const int64_t first = v0 + j0 + VecF32::kLanes * q;
      const int64_t n = V - first;
      if (n <= 0) continue;
      const int nl = (int)std::min<int64_t>(n, VecF32::kLanes);
      acc[q] = select_first(nl, lse_sum_step(acc[q], simd::load<VecF32>(s + first, nl), mv), acc[q]);
    }
    for (int q = 0; q < kVecs; ++q) simd::store(lanes + j0 + VecF32::kLanes * q, acc[q], VecF32::kLanes);
    return;
  }
  float acc[kW];
  for (int j = 0; j < kW; ++j) acc[j] = 0.0f;
  int64_t v0 = 0;
  for (; v0 + kReduceLanes <= V; v0 += kReduceLanes)
    for (int j = 0; j < kW; ++j) acc[j] = lse_sum_step(acc[j], s[v0 + j0 + j], m);
  for (int j = 0; j < kW && v0 + j0 + j < V; ++j) acc[j] = lse_sum_step(acc[j], s[v0 + j0 + j], m);
  for (int j = 0; j < kW; ++j) lanes[j0 + j] = acc[j];
}

// The one fold of partial maxima and flags (lse_max_merge over n parts, in part order; the total order's max, so
// the order does not matter, see above): the 32 lane maxima of a row here, the per-thread maxima of a shared row in
// the split kernels.
static void merge_maxima(const float* mx, const int32_t* fl, int64_t n, float* max, int32_t* flags) {
  float m = -float_of(0x7f800000u);
  int32_t any = 0;
  for (int64_t j = 0; j < n; ++j) lse_max_merge(mx[j], fl[j], &m, &any);
  *max = m;
  *flags = any;
}

// s_v = z_v / tau for v < n (written to s), the row maximum of s (order-free) and the OR of logit_flags
// over the row. The one scale-and-max pass of the log-prob ops, for a whole row or a shared row's v range.
template <typename T>
static void scale_and_max(const T* z, float* s, int64_t n, float tau, float* max, int32_t* flags) {
  const float inf = float_of(0x7f800000u);
  float mx[kReduceLanes];
  int32_t fl[kReduceLanes];
  for (int j = 0; j < kReduceLanes; ++j) {
    mx[j] = -inf;
    fl[j] = 0;
  }
  if (tau == 1.0f)
    scale_row<T, true>(z, s, n, tau, mx, fl);
  else
    scale_row<T, false>(z, s, n, tau, mx, fl);
  merge_maxima(mx, fl, kReduceLanes, max, flags);
}

// The row's (m, L) pair; leaves s = z / tau in `s`.
template <typename T>
static LsePair row_lse_pair(const T* z, float* s, int64_t V, float tau) {
  float m;
  int32_t flags;
  scale_and_max(z, s, V, tau, &m, &flags);
  LsePair p;
  if (lse_special_row(m, flags, &p)) return p;
  float lanes[kReduceLanes];
  lane_exp_sums_w<kReduceLanes>(s, V, m, 0, lanes);
  return lse_pair_of_sum(m, fold_lanes(lanes));
}

// Per-thread fp32 scratch row for s (kept between calls: a fresh vocab-sized allocation per call would
// page-fault on every decode step).
static float* scratch_row(int64_t V) {
  static thread_local std::unique_ptr<float[]> buf;
  static thread_local int64_t cap = 0;
  if (V > cap) {
    buf.reset(new float[(size_t)V]);
    cap = V;
  }
  return buf.get();
}

// Row r's pair into pairs[2r..2r+1], and its logsumexp m + L into lse[r] when the op asks for it.
static void store_pair(const LogitsParams& p, int64_t r, LsePair pair) {
  p.pairs[2 * r] = pair.m;
  p.pairs[2 * r + 1] = pair.L;
  if (p.lse) p.lse[r] = lse_value(pair);
}

static void logsumexp_pairs(const LogitsParams& prm, int64_t r0, int64_t r1) {
  const DType dt = prm.dt;
  const void* z = prm.z;
  const int64_t V = prm.V;
  const float tau = prm.tau;
  const float* temps = prm.temps;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    float* s = scratch_row(V);
    for (int64_t r = r0; r < r1; ++r) store_pair(prm, r, row_lse_pair((const T*)z + r * V, s, V, temps ? temps[r] : tau));
  });
}

// log_softmax: logp_v = (s_v - m) - L. With pairs == nullptr the row's pair is computed here, with s written
// straight into the output row (one read of the logits, no second division); otherwise pairs[2r..2r+1].
static void log_softmax(const LogitsParams& prm, int64_t r0, int64_t r1) {
  const DType dt = prm.dt;
  const void* z = prm.z;
  const float* pairs = prm.pairs;
  float* out = prm.out_f32;
  const int64_t V = prm.V;
  const float tau = prm.tau;
  const float* temps = prm.temps;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = r0; r < r1; ++r) {
      const T* zr = (const T*)z + r * V;
      const float t = temps ? temps[r] : tau;
      float* __restrict__ o = out + r * V;
      if (pairs == nullptr) {
        const LsePair p = row_lse_pair(zr, o, V, t);
        for (int64_t v = 0; v < V; ++v) o[v] = logp_value(o[v], p);
      } else {
        const LsePair p{pairs[2 * r], pairs[2 * r + 1]};
        for (int64_t v = 0; v < V; ++v) o[v] = logp_value(div_f32(to_f32(zr[v]), t), p);
      }
    }
  });
}

// token_logprobs from known pairs: logp_id = logp_value(z_id / tau, pair), the expression log_softmax evaluates
// for that one column (division by tau == 1 is exact either way).
static void token_logprobs(const LogitsParams& prm, int64_t r0, int64_t r1) {
  with_type(prm.dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = r0; r < r1; ++r) {
      const float t = prm.temps ? prm.temps[r] : prm.tau;
      const LsePair p{prm.pairs[2 * r], prm.pairs[2 * r + 1]};
      prm.out_f32[r] = logp_value(div_f32(to_f32(((const T*)prm.z)[r * prm.V + prm.ids[r]]), t), p);
    }
  });
}

// The backward ops of the family (contract.h), one pass per row after the row's pair:
//   kTokenLogprobs: dz_v = round_T(((v == id) - p_v) * g / tau)         g [rows]
//   kLogsumexp:     dz_v = round_T((p_v * g) / tau)                     g [rows]
//   kLogSoftmax:    dz_v = round_T((g_v - p_v * G) / tau), G = lane_sum g_v   g [rows, V]
// With pairs == nullptr the pair is computed here (s kept in the scratch row, so the logits are read once
// and divided once).
template <typename T, LogitsGrad kMode>
static void logits_backward_rows(const float* g, const T* z, const int64_t* ids, const float* pairs, T* dz, int64_t V,
                                 float tau, const float* temps, int64_t r0, int64_t r1) {
  float* __restrict__ s = scratch_row(V);
  for (int64_t r = r0; r < r1; ++r) {
    const T* zr = z + r * V;
    T* __restrict__ o = dz + r * V;
    const float t = temps ? temps[r] : tau;
    LsePair p;
    if (pairs == nullptr) {
      p = row_lse_pair(zr, s, V, t);
    } else {
      p = LsePair{pairs[2 * r], pairs[2 * r + 1]};
      for (int64_t v = 0; v < V; ++v) s[v] = div_f32(to_f32(zr[v]), t);
    }
    if constexpr (kMode == LogitsGrad::kTokenLogprobs) {
      const float gr = g[r];
      const int64_t id = ids[r];
      for (int64_t v = 0; v < V; ++v) o[v] = from_f32<T>(token_logprobs_grad(s[v], p, false, gr, t));
      o[id] = from_f32<T>(token_logprobs_grad(s[id], p, true, gr, t));
    } else if constexpr (kMode == LogitsGrad::kLogsumexp) {
      const float gr = g[r];
      for (int64_t v = 0; v < V; ++v) o[v] = from_f32<T>(logsumexp_grad(s[v], p, gr, t));
    } else {
      const float* __restrict__ gr = g + r * V;
      float lanes[kReduceLanes];
      for (int j = 0; j < kReduceLanes; ++j) lanes[j] = 0.0f;
      int64_t v0 = 0;
      for (; v0 + kReduceLanes <= V; v0 += kReduceLanes)
        for (int j = 0; j < kReduceLanes; ++j) lanes[j] = lanes[j] + gr[v0 + j];
      for (int j = 0; v0 + j < V; ++j) lanes[j] = lanes[j] + gr[v0 + j];
      const float gsum = fold_lanes(lanes);
      for (int64_t v = 0; v < V; ++v) o[v] = from_f32<T>(log_softmax_grad(s[v], p, gr[v], gsum, t));
    }
  }
}

static void logits_backward(const LogitsParams& prm, int64_t r0, int64_t r1) {
  const LogitsGrad mode = prm.mode;
  const DType dt = prm.dt;
  const float* g = prm.g;
  const void* z = prm.z;
  const int64_t* ids = prm.ids;
  const float* pairs = prm.pairs;
  void* dz = prm.dz;
  const int64_t V = prm.V;
  const float tau = prm.tau;
  const float* temps = prm.temps;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    const T* zt = (const T*)z;
    T* dzt = (T*)dz;
    switch (mode) {
      case LogitsGrad::kTokenLogprobs:
        logits_backward_rows<T, LogitsGrad::kTokenLogprobs>(g, zt, ids, pairs, dzt, V, tau, temps, r0, r1);
        break;
      case LogitsGrad::kLogsumexp:
        logits_backward_rows<T, LogitsGrad::kLogsumexp>(g, zt, ids, pairs, dzt, V, tau, temps, r0, r1);
        break;
      case LogitsGrad::kLogSoftmax:
        logits_backward_rows<T, LogitsGrad::kLogSoftmax>(g, zt, ids, pairs, dzt, V, tau, temps, r0, r1);
        break;
    }
  });
}

// token_logprobs backward on a column tile (cpu_kernels.h): the expression logits_backward_rows evaluates
// with given pairs (s = z / tau, then contract.h's token_logprobs_grad), for columns v0 .. v0 + n - 1 only.
static void token_logprobs_backward_cols(const LogitsParams& prm, int64_t r0, int64_t r1) {
  const DType dt = prm.dt;
  const float* g = prm.g;
  const void* z = prm.z;
  const int64_t* ids = prm.ids;
  const float* pairs = prm.pairs;
  void* dz = prm.dz;
  const int64_t v0 = prm.v0, n = prm.V;
  const float tau = prm.tau;
  const float* temps = prm.temps;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = r0; r < r1; ++r) {
      const T* __restrict__ zr = (const T*)z + r * n;
      T* __restrict__ o = (T*)dz + r * n;
      const float t = temps ? temps[r] : tau;
      const LsePair p{pairs[2 * r], pairs[2 * r + 1]};
      const float gr = g[r];
      for (int64_t v = 0; v < n; ++v) o[v] = from_f32<T>(token_logprobs_grad(div_f32(to_f32(zr[v]), t), p, false, gr, t));
      const int64_t j = ids[r] - v0;
      if (j >= 0 && j < n) o[j] = from_f32<T>(token_logprobs_grad(div_f32(to_f32(zr[j]), t), p, true, gr, t));
    }
  });
}

// ---- intra-row splits (dense_split_kernels.h) ------------------------------------------------------------
static void silu_and_mul_cols(const SiluMulParams& p, int64_t row, int64_t c0, int64_t c1) {
  const DType dt = p.dt;
  const void* x = p.x;
  void* out = p.out;
  const int64_t d = p.d;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    const T* a = (const T*)x + row * 2 * d;
    silu_mul_range(a, a + d, (T*)out + row * d, c0, c1);
  });
}

static void scale_max(const LogitsParams& p, int64_t row, float* s_row, int64_t v0, int64_t v1, float* max,
                      int32_t* flags) {
  const float tau = p.temps ? p.temps[row] : p.tau;
  with_type(p.dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    scale_and_max((const T*)p.z + row * p.V + v0, s_row + v0, v1 - v0, tau, max, flags);
  });
}

static bool merge_max(const float* part_max, const int32_t* part_flags, int64_t parts, float* m, LsePair* special) {
  int32_t any;
  merge_maxima(part_max, part_flags, parts, m, &any);
  return lse_special_row(*m, any, special);
}

static LsePair pair_of_lanes(float m, float* lanes) { return lse_pair_of_sum(m, fold_lanes(lanes)); }

// log_softmax of a shared row whose s = z / tau the split pass left in out_f32's row: columns [v0, v1).
static void logp_cols(const LogitsParams& p, int64_t row, LsePair pair, int64_t v0, int64_t v1) {
  float* o = p.out_f32 + row * p.V;
  for (int64_t v = v0; v < v1; ++v) o[v] = logp_value(o[v], pair);
}

static void lane_exp_sums(const float* s, int64_t V, float m, int j0, int j1, float* lanes) {
  if (j1 - j0 == 16) return lane_exp_sums_w<16>(s, V, m, j0, lanes);
  if (j1 - j0 == 8) return lane_exp_sums_w<8>(s, V, m, j0, lanes);
  for (int j = j0; j < j1; ++j) {
    float acc = 0.0f;
    for (int64_t v = j; v < V; v += kReduceLanes) acc = lse_sum_step(acc, s[v], m);
    lanes[j] = acc;
  }
}

extern const DenseSplitKernels kDenseSplit;
const DenseSplitKernels kDenseSplit = {
    .silu_and_mul_cols = silu_and_mul_cols,
    .scale_max = scale_max,
    .merge_max = merge_max,
    .lane_exp_sums = lane_exp_sums,
    .pair_of_lanes = pair_of_lanes,
    .store_pair = store_pair,
    .logp_cols = logp_cols,
};

// GEMM (linear and its backward): gemm_kernels.cpp, compiled per ISA level like this file.
void gemm(const GemmParams& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1);

static void column_sum(const ColumnSumParams& p, int64_t n0, int64_t n1) {
  const DType dt = p.dt, out_dt = p.out_dt;
  const void* g = p.g;
  void* out = p.out;
  const int64_t rows = p.rows, cols = p.cols;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    with_type(out_dt, [&](auto* op) {
      using TO = std::remove_pointer_t<decltype(op)>;
      const T* gt = (const T*)g;
      for (int64_t n = n0; n < n1; ++n) {
        float acc = 0.0f;
        for (int64_t m = 0; m < rows; ++m) acc = acc + to_f32(gt[m * cols + n]);
        ((TO*)out)[n] = from_f32<TO>(acc);
      }
    });
  });
}

static void exp_range(const ElementwiseParams& p, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) p.out[i] = exp_f32(p.x[i]);
}
static void log_range(const ElementwiseParams& p, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) p.out[i] = log_f32(p.x[i]);
}

extern const KernelTable kTable;
const KernelTable kTable = {
#define ALIGNED_STR2(x) #x
#define ALIGNED_STR(x) ALIGNED_STR2(x)
    .isa = ALIGNED_STR(ALIGNED_ISA),
    .rms_norm = rms_norm,
    .fused_add_rms_norm = fused_add_rms_norm,
    .rms_inv_rows = rms_inv_rows,
    .rms_norm_backward_dx = rms_norm_backward_dx,
    .rms_norm_backward_dw = rms_norm_backward_dw,
    .silu_and_mul = silu_and_mul,
    .silu_and_mul_backward = silu_and_mul_backward,
    .rotary = rotary,
    .logsumexp_pairs = logsumexp_pairs,
    .log_softmax = log_softmax,
    .token_logprobs = token_logprobs,
    .logits_backward = logits_backward,
    .token_logprobs_backward_cols = token_logprobs_backward_cols,
    .gemm = gemm,
    .column_sum = column_sum,
    .exp_f32 = exp_range,
    .log_f32 = log_range,
};

}  // namespace aligned::cpu::ALIGNED_ISA
