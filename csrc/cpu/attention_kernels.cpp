// attention_kernels.cpp — CPU attention (forward over packed or paged K/V, backward, KV-cache write),
// compiled once per ISA level like cpu_kernels.cpp (-DALIGNED_ISA=generic / avx2 / avx512).
//
// Design: the per-(row, head) arithmetic is csrc/common/attention.h, nothing else. What this file adds is
// data movement and vectorisation that cannot change any element's expression tree:
//   * a K tile (32 keys) is unpacked once per row block into fp32 K^T [D][32] (exact widening), and the
//     V tile into fp32 [32][D]; all rows of the block and all G query heads of the KV head reuse them;
//   * scores of up to 4 (row, head) pairs are computed together: for d ascending, acc[i][j] =
//     fma(q_i[d], K^T[d][j], acc[i][j]) — one independent sequential fma chain per (pair, key), vectorised
//     across the 32 keys (two AVX-512 registers per pair, 8 chains in flight);
//   * the online-softmax update, the per-tile PV chain and the split merge are the header's functions;
//   * paged and packed K/V differ only in the key-row address (attention.h: KvRows).
// A tile lane beyond a row's valid keys is computed (from zero padding or another row's key) but never
// read: max, exp, sum and PV only use lanes j < nv (the header's rules), so it cannot leak into a result.
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../common/attention.h"
#include "attention_kernels.h"
#include "simd.h"
#include "thread_buffer.h"

#ifndef ALIGNED_ISA
#error "ALIGNED_ISA must name the ISA level this translation unit is compiled for"
#endif

namespace aligned::cpu::ALIGNED_ISA {

using aligned::bf16_t;
using aligned::f16_t;
constexpr int kT = kAttnTile;

// Key/value rows of one sequence: base pointers plus the shared paged-KV accessor (attention.h: KvRows).
template <typename T>
struct KeyRows {
  const T* k;
  const T* v;
  KvRows at;
  int64_t D;
  int64_t offset(int64_t j, int64_t g) const { return at.offset(j, g); }
};

template <typename T>
static KeyRows<T> key_rows(const AttnArgs& a, const AttnSeq& s) {
  return KeyRows<T>{(const T*)a.k, (const T*)a.v, KvRows{a.Hkv, a.D, a.block_size, s.k_begin, s.blocks}, a.D};
}

// Unpack keys [j0, j0 + n) (n <= 32) of head g: kt = K^T [D][32] (lanes >= n zeroed), and optionally
// vt = V^T [D][32], vr = V rows [32][D], kr = K rows [32][D].
template <typename T>
static void unpack_tile(const KeyRows<T>& kr_src, int64_t g, int64_t j0, int n, float* kt, float* vt, float* vr,
                        float* kr) {
  const int64_t D = kr_src.D;
  for (int j = 0; j < kT; ++j) {
    if (j < n) {
      const int64_t off = kr_src.offset(j0 + j, g);
      const T* kp = kr_src.k + off;
      const T* vp = kr_src.v + off;
      for (int64_t d = 0; d < D; ++d) {
        const float kv = to_f32(kp[d]);
        const float vv = to_f32(vp[d]);
        kt[d * kT + j] = kv;
        if (vt) vt[d * kT + j] = vv;
        if (vr) vr[j * D + d] = vv;
        if (kr) kr[j * D + d] = kv;
      }
    } else {
      for (int64_t d = 0; d < D; ++d) {
        kt[d * kT + j] = 0.0f;
        if (vt) vt[d * kT + j] = 0.0f;
        if (vr) vr[j * D + d] = 0.0f;
        if (kr) kr[j * D + d] = 0.0f;
      }
    }
  }
}

#if defined(__AVX512F__)
// The forward's tile unpack (kt = K^T [D][32], vr = V rows [32][D]) with AVX-512: 16 keys x 16 dims widened
// (exact, simd.h load) and transposed in registers (moves only), so K^T is written 16 floats at a time instead of
// one strided float per element (the scalar unpack was the largest piece of decode attention's time). Same
// values in the same places as unpack_tile; D % 16 == 0 only (the caller falls back otherwise).
template <typename T>
static void unpack_tile_kv16(const KeyRows<T>& src, int64_t g, int64_t j0, int n, float* kt, float* vr,
                             const T** vrows = nullptr) {
  using V = simd::F32x16;
  const int64_t D = src.D;
  for (int h = 0; h < kT / 16; ++h) {
    const T* kp[16];
    for (int i = 0; i < 16; ++i) {
      const int j = 16 * h + i;
      kp[i] = j < n ? src.k + src.offset(j0 + j, g) : nullptr;
      if (vrows) {  // the caller reads the value rows in place (widened in registers: the same fp32 values)
        vrows[j] = j < n ? src.v + src.offset(j0 + j, g) : nullptr;
        continue;
      }
      float* vj = vr + (int64_t)j * D;
      if (j < n) {
        const T* vp = src.v + src.offset(j0 + j, g);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(vj + d, simd::load<V>(vp + d).v);
      } else {
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(vj + d, _mm512_setzero_ps());
      }
    }
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = kp[i] ? simd::load<V>(kp[i] + d0).v : _mm512_setzero_ps();
      simd::transpose16(r);  // r[c] = dim d0 + c of the 16 keys
      for (int c = 0; c < 16; ++c) _mm512_storeu_ps(kt + (d0 + c) * kT + 16 * h, r[c]);  // (std::vector: unaligned)
    }
  }
}
#endif

// The tile probabilities of attn_tile_update: 16 keys at a time on AVX-512 (simd.h TileProbs: the scalar
// AttnTileProbs's bits, tests/common/test_simd_conformance.py), the header's scalar loop on the other levels.
#if defined(__AVX512F__)
constexpr simd::TileProbs<simd::F32x16, kAttnTile> kTileProbs{};
constexpr simd::TileMax32 kTileMax{};  // m_new with attn_tile_max's bits (simd.h)
#else
constexpr AttnTileProbs kTileProbs{};
constexpr AttnTileMax kTileMax{};
#endif

// out[i][j] = fma chain over d ascending of (x_i[d], mt[d][j]) from +0, for R vectors x_i (attention.h:
// attn_dot for every lane j). R independent pairs share each load of mt.
template <int R>
static void dots_R(const float* const* x, const float* mt, int64_t D, float (*out)[kT]) {
  float acc[R][kT];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < kT; ++j) acc[i][j] = 0.0f;
  for (int64_t d = 0; d < D; ++d) {
    const float* row = mt + d * kT;
    for (int i = 0; i < R; ++i) {
      const float xd = x[i][d];
      for (int j = 0; j < kT; ++j) acc[i][j] = fma_f32(xd, row[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < kT; ++j) out[i][j] = acc[i][j];
}

static void dots(int n, const float* const* x, const float* mt, int64_t D, float (*out)[kT]) {
  switch (n) {
    case 4: dots_R<4>(x, mt, D, out); break;
    case 3: dots_R<3>(x, mt, D, out); break;
    case 2: dots_R<2>(x, mt, D, out); break;
    case 1: dots_R<1>(x, mt, D, out); break;
    default: break;
  }
}

#if defined(__AVX512F__)
// attn_tile_update for R (query row, head) pairs of one tile at once, head_dim DC (64 or 128), value row j at
// vrows[j] (the cache's T, widened exactly in registers; read for j below the largest nv of the pairs only): per
// pair exactly attn_tile_update's expressions in its order — m_new (kTileMax), mu, alpha, the probabilities
// (kTileProbs), pv[d] = the chain over j < nv of attn_pv_step, l, acc[d] = attn_acc_step, m — with the pairs
// interleaved: the R pairs' pv chains share each value row (R * DC/16 independent accumulators: one pair's DC/16
// chains of nv dependent fmas were latency-bound) and their alphas are one vector exp_f32 (lane by lane the scalar's
// bits, tests/common/simd_conformance.cpp). st[i] = the pair's split state {m, l, acc[DC]}.
template <int64_t DC, int R, typename T>
static void tile_update_pairs(const float (*sc)[kT], const int* nv, float* const* st, const T* const* vrows) {
  using V = simd::F32x16;
  constexpr int kC = (int)(DC / 16);
  float m_new[R], mu[R];
  alignas(64) float shift[16] = {}, alpha[16];
  for (int i = 0; i < R; ++i) {
    m_new[i] = kTileMax(sc[i], nv[i], st[i][0]);
    mu[i] = attn_shift(m_new[i]);
    shift[i] = st[i][0] - mu[i];
  }
  simd::store(alpha, exp_f32(simd::load<V>(shift)), 16);
  alignas(64) float p[R][kT];
  for (int i = 0; i < R; ++i) kTileProbs(sc[i], nv[i], mu[i], p[i]);
  int n_max = nv[0];
  for (int i = 1; i < R; ++i) n_max = std::max(n_max, nv[i]);
  // 32 dims (two vectors) of every pair per pass, R x 2 accumulators in registers. A pair whose chain has ended
  // (j >= nv: the causal diagonal) keeps its value through a select, so the loops have no per-pair trip count (with
  // one, the compiler kept the accumulators on the stack).
  for (int c = 0; c < kC; c += 2) {
    V pv[R][2];
    for (int i = 0; i < R; ++i) pv[i][0] = pv[i][1] = V::zero();
    for (int j = 0; j < n_max; ++j) {
      const V v0 = simd::load<V>(vrows[j] + 16 * c), v1 = simd::load<V>(vrows[j] + 16 * c + 16);
      for (int i = 0; i < R; ++i) {
        const __mmask16 on = j < nv[i] ? (__mmask16)0xffff : (__mmask16)0;
        const V pj(p[i][j]);
        pv[i][0] = _mm512_mask_blend_ps(on, pv[i][0].v, attn_pv_step(pj, v0, pv[i][0]).v);
        pv[i][1] = _mm512_mask_blend_ps(on, pv[i][1].v, attn_pv_step(pj, v1, pv[i][1]).v);
      }
    }
    for (int i = 0; i < R; ++i) {
      const V a(alpha[i]);
      float* acc = st[i] + 2 + 16 * c;
      simd::store(acc, attn_acc_step(simd::load<V>(acc), a, pv[i][0]), 16);
      simd::store(acc + 16, attn_acc_step(simd::load<V>(acc + 16), a, pv[i][1]), 16);
    }
  }
  for (int i = 0; i < R; ++i) {
    const float ts = fold_lanes(p[i]);
    st[i][1] = attn_tile_l(st[i][1], alpha[i], ts);
    st[i][0] = m_new[i];
  }
}

template <int64_t DC, typename T>
static void tile_update_group(const float (*sc)[kT], const int* nv, float* const* st, const T* const* vrows, int cnt) {
  if constexpr (DC == 64) {
    switch (cnt) {
      case 4: return tile_update_pairs<DC, 4>(sc, nv, st, vrows);
      case 3: return tile_update_pairs<DC, 3>(sc, nv, st, vrows);
      case 2: return tile_update_pairs<DC, 2>(sc, nv, st, vrows);
      default: return tile_update_pairs<DC, 1>(sc, nv, st, vrows);
    }
  } else {  // 128: two pairs at a time (2 x 8 accumulators)
    for (int i = 0; i < cnt; i += 2) {
      if (cnt - i >= 2) tile_update_pairs<DC, 2>(sc + i, nv + i, st + i, vrows);
      else tile_update_pairs<DC, 1>(sc + i, nv + i, st + i, vrows);
    }
  }
}
#endif

template <typename T>
static void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]);
}

// Rows of a block: their key counts.
static void block_row_keys(const AttnArgs& a, const AttnSeq& s, const AttnBlock& b, int64_t* nk) {
  for (int64_t r = 0; r < b.nr; ++r)
    nk[r] = attn_row_keys(s.n_ctx - s.q_len + b.r0 + r, s.n_ctx, a.causal);
}

// DC > 0: head_dim known at compile time (64, 128), so the per-tile PV/acc vectors stay in registers.
// Only the speed differs: every expression is the same as with a runtime D.
template <typename T, int64_t DC>
static void fwd_block_t(const AttnArgs& a, const AttnBlock& b, int64_t s0, int64_t s1, float* part) {
  const AttnSeq& s = a.seqs[b.seq];
  const int64_t D = DC > 0 ? DC : a.D, G = a.Hq / a.Hkv, nr = b.nr, P = nr * G;
  const KeyRows<T> src = key_rows<T>(a, s);
  // scratch (thread_buffer.h): the rows' key counts and the active pairs (int64, first: aligned), then from the next
  // 64 bytes q widened, the tile's K^T and V rows, pv
  const int64_t n_idx = (nr + P + 7) / 8 * 8, nf = P * D + 2 * D * kT + D;
  int64_t* nk = (int64_t*)thread_buffer<3>(n_idx * sizeof(int64_t) + nf * sizeof(float));
  int64_t* active = nk + nr;
  float* qf = (float*)(nk + n_idx);
  float* kt = qf + P * D;
  float* vr = kt + D * kT;
  float* pv = vr + kT * D;
  int64_t n_active = 0;
  block_row_keys(a, s, b, nk);
  int64_t nk_max = 0;
  for (int64_t r = 0; r < nr; ++r) nk_max = std::max(nk_max, nk[r]);
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t h = 0; h < G; ++h)
      widen((const T*)a.q + ((s.q_begin + b.r0 + r) * a.Hq + b.g * G + h) * D, qf + (r * G + h) * D, D);
  const int64_t stride = D + 2;
  for (int64_t sp = s0; sp < s1; ++sp) {
    const int64_t key0 = sp * kAttnSplit;
    if (key0 >= nk_max) break;
    for (int64_t pr = 0; pr < P; ++pr) {
      if (nk[pr / G] <= key0) continue;
      float* st = part + (pr * b.n_splits + sp) * stride;
      st[0] = neg_inf_f32();
      st[1] = 0.0f;
      for (int64_t d = 0; d < D; ++d) st[2 + d] = 0.0f;
    }
    const int64_t t_end = std::min<int64_t>((sp + 1) * kAttnTilesPerSplit, (nk_max + kT - 1) / kT);
    for (int64_t t = sp * kAttnTilesPerSplit; t < t_end; ++t) {
      const int64_t j0 = t * kT;
      const int n = (int)std::min<int64_t>(kT, nk_max - j0);
#if defined(__AVX512F__)
      const T* vrows[kT];
      if constexpr (DC == 64 || DC == 128) unpack_tile_kv16(src, b.g, j0, n, kt, nullptr, vrows);
      else if (D % 16 == 0) unpack_tile_kv16(src, b.g, j0, n, kt, vr);
      else
#endif
        unpack_tile(src, b.g, j0, n, kt, nullptr, vr, nullptr);
      n_active = 0;
      for (int64_t pr = 0; pr < P; ++pr)
        if (nk[pr / G] > j0) active[n_active++] = pr;
      for (int64_t i0 = 0; i0 < n_active; i0 += 4) {
        const int cnt = (int)std::min<int64_t>(4, n_active - i0);
        const float* xs[4];
        float sc[4][kT];
        for (int i = 0; i < cnt; ++i) xs[i] = qf + active[i0 + i] * D;
        dots(cnt, xs, kt, D, sc);
        for (int i = 0; i < cnt; ++i)
          for (int j = 0; j < kT; ++j) sc[i][j] = sc[i][j] * a.scale;
#if defined(__AVX512F__)
        if constexpr (DC == 64 || DC == 128) {
          int nv[4];
          float* st[4];
          for (int i = 0; i < cnt; ++i) {
            const int64_t pr = active[i0 + i];
            nv[i] = (int)std::min<int64_t>(kT, nk[pr / G] - j0);
            st[i] = part + (pr * b.n_splits + sp) * stride;
          }
          tile_update_group<DC>(sc, nv, st, vrows, cnt);
          continue;
        }
#endif
        for (int i = 0; i < cnt; ++i) {
          const int64_t pr = active[i0 + i];
          const int nv = (int)std::min<int64_t>(kT, nk[pr / G] - j0);
          float* st = part + (pr * b.n_splits + sp) * stride;
          const float* vbase = vr;
          attn_tile_update(sc[i], nv, [&](int j) { return vbase + j * D; }, D, &st[0], &st[1], st + 2, pv,
                           kTileProbs, kTileMax);
        }
      }
    }
  }
}

static void fwd_block(const AttnArgs& a, const AttnBlock& b, int64_t s0, int64_t s1, float* part) {
  with_type(a.dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    if (a.D == 128) fwd_block_t<T, 128>(a, b, s0, s1, part);
    else if (a.D == 64) fwd_block_t<T, 64>(a, b, s0, s1, part);
    else fwd_block_t<T, 0>(a, b, s0, s1, part);
  });
}

#if defined(__AVX512F__)
// attention.h attn_merge with 16 output elements per vector (D % 16 == 0, bf16 / fp32 out): each lane is its
// element's expressions — attn_merge_step's fma chain over the splits, attn_merge_out's IEEE division, one rounding
// (simd.h store: from_f32's bits) — with the statistics and weights computed once per row as there. The scalar
// form divided element by element: ~1/4 of prefill attention.
template <typename T>
static void attn_merge16(const float* part, int64_t stride, int64_t n_splits, int64_t D, float* w, T* out,
                         float* lse) {
  using V = simd::F32x16;
  float M, Mu, L;
  attn_merge_stats(part, stride, n_splits, &M, &Mu, &L);
  for (int64_t s = 0; s < n_splits; ++s) w[s] = attn_merge_weight(part, stride, s, Mu);
  for (int64_t d = 0; d < D; d += 16) {
    V O = V::zero();
    for (int64_t s = 0; s < n_splits; ++s) O = attn_merge_step(simd::load<V>(part + s * stride + 2 + d), V(w[s]), O);
    simd::store(out + d, attn_merge_out(O, L), 16);
  }
  *lse = attn_merge_lse(M, L);
}
#endif

static void merge_block(const AttnArgs& a, const AttnBlock& b, const float* part, void* out, float* lse) {
  const AttnSeq& s = a.seqs[b.seq];
  const int64_t D = a.D, G = a.Hq / a.Hkv;
  // scratch: the rows' key counts (int64, first: aligned), then the split weights
  const int64_t n_w = std::max<int64_t>(b.n_splits, 1);
  int64_t* nk = (int64_t*)thread_buffer<4>(b.nr * sizeof(int64_t) + n_w * sizeof(float));
  float* w = (float*)(nk + b.nr);
  block_row_keys(a, s, b, nk);
  with_type(a.dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = 0; r < b.nr; ++r) {
      const int64_t ns = attn_num_splits(nk[r]);
      for (int64_t h = 0; h < G; ++h) {
        const int64_t row = (s.q_begin + b.r0 + r) * a.Hq + b.g * G + h;
        const float* pr = part + (r * G + h) * b.n_splits * (D + 2);
#if defined(__AVX512F__)
        if constexpr (simd::kVectorStore<simd::F32x16, T>) {
          if (D % 16 == 0) {
            attn_merge16(pr, D + 2, ns, D, w, (T*)out + row * D, lse + row);
            continue;
          }
        }
#endif
        attn_merge(pr, D + 2, ns, D, w, (T*)out + row * D, lse + row);
      }
    }
  });
}

static void bwd_delta(DType dt, const void* dout, const void* out, float* delta, int64_t D, int64_t i0, int64_t i1) {
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t i = i0; i < i1; ++i) delta[i] = attn_dot((const T*)dout + i * D, (const T*)out + i * D, D);
  });
}

template <typename T>
static void bwd_dq_block_t(const AttnArgs& a, const AttnBlock& b, const void* dout, const float* lse,
                           const float* delta, void* dq) {
  const AttnSeq& s = a.seqs[b.seq];
  const int64_t D = a.D, G = a.Hq / a.Hkv, nr = b.nr, P = nr * G;
  const KeyRows<T> src = key_rows<T>(a, s);
  std::vector<int64_t> nk(nr), rowidx(P);
  block_row_keys(a, s, b, nk.data());
  int64_t nk_max = 0;
  for (int64_t r = 0; r < nr; ++r) nk_max = std::max(nk_max, nk[r]);
  std::vector<float> qf(P * D), dof(P * D), acc(P * D, 0.0f), kt(D * kT), vt(D * kT), krow(kT * D);
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t h = 0; h < G; ++h) {
      const int64_t pr = r * G + h;
      rowidx[pr] = (s.q_begin + b.r0 + r) * a.Hq + b.g * G + h;
      widen((const T*)a.q + rowidx[pr] * D, qf.data() + pr * D, D);
      widen((const T*)dout + rowidx[pr] * D, dof.data() + pr * D, D);
    }
  std::vector<int64_t> active;
  for (int64_t t = 0; t * kT < nk_max; ++t) {
    const int64_t j0 = t * kT;
    const int n = (int)std::min<int64_t>(kT, nk_max - j0);
    unpack_tile(src, b.g, j0, n, kt.data(), vt.data(), nullptr, krow.data());
    active.clear();
    for (int64_t pr = 0; pr < P; ++pr)
      if (nk[pr / G] > j0) active.push_back(pr);
    for (size_t i0 = 0; i0 < active.size(); i0 += 4) {
      const int cnt = (int)std::min<size_t>(4, active.size() - i0);
      const float* xs[4];
      const float* ds_in[4];
      float sc[4][kT], dp[4][kT];
      for (int i = 0; i < cnt; ++i) {
        xs[i] = qf.data() + active[i0 + i] * D;
        ds_in[i] = dof.data() + active[i0 + i] * D;
      }
      dots(cnt, xs, kt.data(), D, sc);
      dots(cnt, ds_in, vt.data(), D, dp);
      for (int i = 0; i < cnt; ++i) {
        const int64_t pr = active[i0 + i];
        const int nv = (int)std::min<int64_t>(kT, nk[pr / G] - j0);
        const float l = lse[rowidx[pr]], dl = delta[rowidx[pr]];
        float* ac = acc.data() + pr * D;
        for (int j = 0; j < nv; ++j) {
          const float p = attn_bwd_prob(sc[i][j] * a.scale, l);
          const float ds = attn_bwd_ds(p, dp[i][j], dl);
          const float* kj = krow.data() + j * D;
          for (int64_t d = 0; d < D; ++d) ac[d] = fma_f32(ds, kj[d], ac[d]);
        }
      }
    }
  }
  for (int64_t pr = 0; pr < P; ++pr)
    for (int64_t d = 0; d < D; ++d) ((T*)dq)[rowidx[pr] * D + d] = from_f32<T>(acc[pr * D + d] * a.scale);
}

static void bwd_dq_block(const AttnArgs& a, const AttnBlock& b, const void* dout, const float* lse, const float* delta,
                         void* dq) {
  with_type(a.dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    bwd_dq_block_t<T>(a, b, dout, lse, delta, dq);
  });
}

template <typename T>
static void bwd_dkdv_tile_t(const AttnArgs& a, int64_t seq, int64_t g, int64_t t, const void* dout, const float* lse,
                            const float* delta, void* dk, void* dv) {
  const AttnSeq& s = a.seqs[seq];
  const int64_t D = a.D, G = a.Hq / a.Hkv;
  const KeyRows<T> src = key_rows<T>(a, s);
  const int64_t j0 = t * kT;
  const int n = (int)std::min<int64_t>(kT, s.n_ctx - j0);
  std::vector<float> kt(D * kT), vt(D * kT), dka(kT * D, 0.0f), dva(kT * D, 0.0f);
  unpack_tile(src, g, j0, n, kt.data(), vt.data(), nullptr, nullptr);
  // (row, head) pairs that see key j0, in the contract's order: row ascending, then head ascending.
  int64_t r_first = 0;
  if (a.causal) r_first = std::max<int64_t>(0, j0 - (s.n_ctx - s.q_len));
  const int64_t P = (s.q_len - std::min(r_first, s.q_len)) * G;
  std::vector<float> qf(4 * D), dof(4 * D);
  for (int64_t i0 = 0; i0 < P; i0 += 4) {
    const int cnt = (int)std::min<int64_t>(4, P - i0);
    const float* xs[4];
    const float* ys[4];
    int64_t rowidx[4];
    int nv[4];
    for (int i = 0; i < cnt; ++i) {
      const int64_t r = r_first + (i0 + i) / G, h = (i0 + i) % G;
      rowidx[i] = (s.q_begin + r) * a.Hq + g * G + h;
      nv[i] = (int)std::min<int64_t>(n, attn_row_keys(s.n_ctx - s.q_len + r, s.n_ctx, a.causal) - j0);
      widen((const T*)a.q + rowidx[i] * D, qf.data() + i * D, D);
      widen((const T*)dout + rowidx[i] * D, dof.data() + i * D, D);
      xs[i] = qf.data() + i * D;
      ys[i] = dof.data() + i * D;
    }
    float sc[4][kT], dp[4][kT];
    dots(cnt, xs, kt.data(), D, sc);
    dots(cnt, ys, vt.data(), D, dp);
    for (int i = 0; i < cnt; ++i) {
      const float l = lse[rowidx[i]], dl = delta[rowidx[i]];
      for (int j = 0; j < nv[i]; ++j) {
        const float p = attn_bwd_prob(sc[i][j] * a.scale, l);
        const float ds = attn_bwd_ds(p, dp[i][j], dl);
        float* dkj = dka.data() + j * D;
        float* dvj = dva.data() + j * D;
        for (int64_t d = 0; d < D; ++d) {
          dkj[d] = fma_f32(ds, xs[i][d], dkj[d]);
          dvj[d] = fma_f32(p, ys[i][d], dvj[d]);
        }
      }
    }
  }
  for (int j = 0; j < n; ++j) {
    const int64_t off = src.offset(j0 + j, g);
    for (int64_t d = 0; d < D; ++d) {
      ((T*)dk)[off + d] = from_f32<T>(dka[j * D + d] * a.scale);
      ((T*)dv)[off + d] = from_f32<T>(dva[j * D + d]);
    }
  }
}

static void bwd_dkdv_tile(const AttnArgs& a, int64_t seq, int64_t g, int64_t t, const void* dout, const float* lse,
                          const float* delta, void* dk, void* dv) {
  with_type(a.dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    bwd_dkdv_tile_t<T>(a, seq, g, t, dout, lse, delta, dk, dv);
  });
}

static void cache_write(DType dt, const void* k, const void* v, void* k_cache, void* v_cache, const int64_t* slots,
                        int64_t row_elems, int64_t t0, int64_t t1) {
  const int64_t es = dt == DType::F32 ? 4 : 2;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    memcpy((char*)k_cache + slot * row_elems * es, (const char*)k + t * row_elems * es, (size_t)(row_elems * es));
    if (v_cache != nullptr)  // nullptr: one cache (MLA's latent row is its own value)
      memcpy((char*)v_cache + slot * row_elems * es, (const char*)v + t * row_elems * es, (size_t)(row_elems * es));
  }
}

extern const AttentionTable kAttentionTable;
const AttentionTable kAttentionTable = {
#define ALIGNED_ATTN_STR2(x) #x
#define ALIGNED_ATTN_STR(x) ALIGNED_ATTN_STR2(x)
    ALIGNED_ATTN_STR(ALIGNED_ISA), fwd_block, merge_block, bwd_delta, bwd_dq_block, bwd_dkdv_tile, cache_write,
};

}  // namespace aligned::cpu::ALIGNED_ISA
