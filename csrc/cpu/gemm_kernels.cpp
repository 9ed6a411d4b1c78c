// gemm_kernels.cpp — the CPU GEMM behind aligned::linear, linear_partial and linear_backward, compiled once
// per ISA level (CMake builds every csrc/cpu/*_kernels.cpp with -DALIGNED_ISA=generic / avx2 / avx512 and the
// matching -m flags; the table in cpu_kernels.cpp points at this file's `gemm`). Torch-free: raw pointers only.
//
//   C[m, n] = round_TC(tree(s_0 .. s_{L-1}) (+ bias[n])),  s_l = dot_chain of lane l:
//             acc = +0, then acc = fma(A[m, k], B[n, k], acc) for k in [lo(l), lo(l + 1)), lo(l) = floor(l*K/L)
//   (contract.h, `fma` profile: L = 8 for linear, L = lanes for linear_partial (fp32 out, no bias), L = 1 —
//   one plain chain — for the backward's dx and dw.)
//
// Each lane is ONE sequential fp32 fma chain; the L lane sums are combined by linear_lane_fold (the fixed
// pairwise tree) in the epilogue, then the bias is added once and the result rounded once. Nothing below
// splits or reorders a lane: tiling and threads only choose which chains run side by side, so the bits
// cannot depend on M, on the tile an element lands in, on the thread that computes it, or on the ISA level
// (a vector fma lane computes exactly the scalar fma_f32). Lanes are computed one after another into L
// lane tiles (the accumulators restart at +0 at every lane boundary) and folded when the tile is done.
//
// Design (GotoBLAS-like, without K blocking across lane boundaries):
//  * B is packed in panels of kNR = 32 output columns: bp[k][j] = fp32(B[n0 + j, k]), zero for columns past
//    N. Widening bf16/f16 -> fp32 is exact. Row-major weights (B[n, k] contiguous in k) are transposed
//    16x16 in registers on AVX-512; column-major B (backward: W^T, x^T) is a plain widening copy.
//  * Microkernel: kMR rows x 32 columns of accumulators in registers (AVX-512: 8 x 2 zmm), runs the chain of
//    one lane with one broadcast of A[m, k] per row and one fma per register and stores the lane tile.
//  * Large M: per block of kMC rows, each panel is packed over the full K (fits L2 for K <= ~6k, streams
//    from L3 beyond) and reused by all kMR-row groups and all lanes of the block; the A block stays in L3.
//  * Small M (decode, <= 16 rows) with a row-major weight on AVX-512: no packing buffer. 16 weight rows x 16 k
//    (bf16: x 32 k, as dword pairs) are transposed in registers and each transposed vector feeds the fma
//    chains of up to 8 rows directly; bf16/f16 activation rows are widened to fp32 once. Memory traffic is
//    one read of the weight (two for 9..16 rows).
//  * Other small-M cases (column-major B in the backward, AVX2/generic levels): the panel is packed kKC
//    k-steps at a time into an L1-resident buffer right before the fma steps consume it; the accumulators
//    stay in registers across chunks of a lane (same chain, just fed in pieces).
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <memory>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "../common/contract.h"
#include "cpu_kernels.h"
#include "simd.h"

#ifndef ALIGNED_ISA
#error "ALIGNED_ISA must name the ISA level this translation unit is compiled for"
#endif

namespace aligned::cpu::ALIGNED_ISA {

void gemm(const GemmParams& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1);

namespace {

using aligned::bf16_t;
using aligned::f16_t;

#define ALIGNED_INLINE inline __attribute__((always_inline))

// ---- this level's fp32 vector (simd.h); fma_f32 on it is the fused IEEE fma (same bits as the scalar) -----
namespace simd = aligned::cpu::ALIGNED_ISA::simd;
using Vec = simd::VecF32;
#if defined(__AVX512F__)
constexpr int kMR = 8;  // 8 rows x 2 zmm = 16 accumulators, 2 B registers, 1 broadcast
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kMR = 3;  // 3 rows x 4 ymm = 12 accumulators (16 ymm registers in all)
#else
constexpr int kMR = 2;
#endif

constexpr int kNR = 32;              // columns per packed panel
constexpr int kNV = kNR / Vec::kLanes;    // vectors per microkernel row
constexpr int64_t kKC = 128;         // k-steps per L1 chunk on the small-M path (128 x 32 x 4 B = 16 KiB)
constexpr int64_t kMC = 256;         // rows per block on the large-M path (A block stays in L3)

// ---- packing: bp[k][j] = fp32(B[n0 + j, k0 + k]) for k < kc, j < 32 (zero for j >= nw) -----------------
#if defined(__AVX512F__)
// Up to 16 consecutive elements as exact fp32, nothing past `cnt` touched (simd.h's masked widening load).
template <typename T>
static ALIGNED_INLINE __m512 load16_f32(const T* p, int cnt) { return simd::load<simd::F32x16>(p, cnt).v; }

#endif

template <typename TB>
static void pack_panel(float* __restrict bp, const TB* __restrict b, int64_t b_sn, int64_t b_sk, int64_t n0,
                       int64_t nw, int64_t k0, int64_t kc) {
  const TB* base = b + n0 * b_sn + k0 * b_sk;
  if (b_sn == 1 && nw == kNR) {  // column-major B: each k is 32 consecutive elements
    for (int64_t k = 0; k < kc; ++k) {
      const TB* src = base + k * b_sk;
      float* dst = bp + k * kNR;
      for (int j = 0; j < kNR; ++j) dst[j] = to_f32(src[j]);
    }
    return;
  }
#if defined(__AVX512F__)
  if (b_sk == 1) {  // row-major B (the weight in the forward): 16 x 16 transposes
    for (int64_t kk = 0; kk < kc; kk += 16) {
      const int cnt = (int)std::min<int64_t>(16, kc - kk);
      for (int h = 0; h < 2; ++h) {
        __m512 r[16];
        if (h * 16 >= nw) {
          for (int c = 0; c < cnt; ++c) _mm512_store_ps(bp + (kk + c) * kNR + h * 16, _mm512_setzero_ps());
          continue;
        }
        for (int i = 0; i < 16; ++i) {
          const int64_t j = h * 16 + i;
          r[i] = j < nw ? load16_f32(base + j * b_sn + kk, cnt) : _mm512_setzero_ps();
        }
        simd::transpose16(r);
        for (int c = 0; c < cnt; ++c) _mm512_store_ps(bp + (kk + c) * kNR + h * 16, r[c]);
      }
    }
    return;
  }
#endif
  for (int64_t k = 0; k < kc; ++k) {
    float* dst = bp + k * kNR;
    for (int64_t j = 0; j < kNR; ++j) dst[j] = j < nw ? to_f32(base[j * b_sn + k * b_sk]) : 0.0f;
  }
}

// ---- microkernel: MR rows x 32 columns, fma steps k = 0..kc-1 of the chains held in acc -----------------
template <int MR, typename TA>
static ALIGNED_INLINE void fma_steps(Vec (&acc)[MR][kNV], const TA* __restrict a, int64_t a_sm,
                                     int64_t a_sk, const float* __restrict bp, int64_t kc) {
  for (int64_t k = 0; k < kc; ++k) {
    const float* bk = bp + k * kNR;
    Vec bv[kNV];
#pragma GCC unroll 32
    for (int v = 0; v < kNV; ++v) bv[v] = Vec::load_aligned(bk + v * Vec::kLanes);
    const TA* ak = a + k * a_sk;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const Vec av(to_f32(ak[r * a_sm]));
#pragma GCC unroll 32
      for (int v = 0; v < kNV; ++v) acc[r][v] = fma_f32(av, bv[v], acc[r][v]);
    }
  }
}

template <int MR>
static ALIGNED_INLINE void zero_acc(Vec (&acc)[MR][kNV]) {
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 32
    for (int v = 0; v < kNV; ++v) acc[r][v] = Vec::zero();
}

template <int MR>
static ALIGNED_INLINE void store_acc(Vec (&acc)[MR][kNV], float* tile) {
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 32
    for (int v = 0; v < kNV; ++v) acc[r][v].store_aligned(tile + r * kNR + v * Vec::kLanes);
}

// Epilogue: C[m, n0 + j] = round_TC(tile[r][j] (+ bias[n0 + j])) — one fp32 add, one rounding
// (contract.h: linear_epilogue; written out per branch so the loops vectorise).
template <typename TC>
static void store_tile(const float* tile, int rows, const TC* bias, TC* c, int64_t c_sm, int64_t n0, int64_t nw) {
  for (int r = 0; r < rows; ++r) {
    const float* t = tile + r * kNR;
    TC* crow = c + r * c_sm + n0;
    if (bias) {
      for (int64_t j = 0; j < nw; ++j) crow[j] = from_f32<TC>(t[j] + to_f32(bias[n0 + j]));
    } else {
      for (int64_t j = 0; j < nw; ++j) crow[j] = from_f32<TC>(t[j]);
    }
  }
}

// Lane tiles lt[l] (kMR x kNR floats each, `rows` x `nw` used) -> tile, by the contract's lane tree
// (linear_lane_fold, unrolled per lane count so the column loop vectorises without reassociation).
constexpr int kTileFloats = kMR * kNR;
template <int L>
static void fold_lane_tiles_n(const float* __restrict lt, int rows, int64_t nw, float* __restrict tile) {
  for (int r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < nw; ++j) {
      float s[L];
#pragma GCC unroll 8
      for (int l = 0; l < L; ++l) s[l] = lt[l * kTileFloats + r * kNR + j];
      tile[r * kNR + j] = linear_lane_fold(s, L);
    }
  }
}
static void fold_lane_tiles(const float* lt, int lanes, int rows, int64_t nw, float* tile) {
  switch (lanes) {
    case 2: fold_lane_tiles_n<2>(lt, rows, nw, tile); break;
    case 4: fold_lane_tiles_n<4>(lt, rows, nw, tile); break;
    default: fold_lane_tiles_n<8>(lt, rows, nw, tile); break;
  }
}

// Runs chain(k0, k1, lane_tile) for every lane of K and folds the lane tiles into `tile`. One lane: the chain
// writes `tile` directly (a 1-lane tree is the chain itself).
template <typename Chain>
static ALIGNED_INLINE void run_lanes(int lanes, int64_t K, int rows, int64_t nw, float* tile, float* lane_tiles,
                                     Chain&& chain) {
  if (lanes == 1) {
    chain((int64_t)0, K, tile);
    return;
  }
  for (int l = 0; l < lanes; ++l)
    chain(linear_lane_begin(l, K, lanes), linear_lane_begin(l + 1, K, lanes), lane_tiles + l * kTileFloats);
  fold_lane_tiles(lane_tiles, lanes, rows, nw, tile);
}

// Full-K microkernel on a packed panel.
template <int MR, typename TA>
static void micro_full(const TA* a, int64_t a_sm, int64_t a_sk, const float* bp, int64_t K, float* tile) {
  Vec acc[MR][kNV];
  zero_acc<MR>(acc);
  fma_steps<MR, TA>(acc, a, a_sm, a_sk, bp, K);
  store_acc<MR>(acc, tile);
}

// Small-M microkernel: packs the panel kKC k-steps at a time into the L1 buffer `chunk` just before use.
template <int MR, typename TA, typename TB>
static void micro_streamed(const TA* a, int64_t a_sm, int64_t a_sk, const TB* b, int64_t b_sn, int64_t b_sk,
                           int64_t n0, int64_t nw, int64_t K, float* chunk, float* tile) {
  Vec acc[MR][kNV];
  zero_acc<MR>(acc);
  for (int64_t k0 = 0; k0 < K; k0 += kKC) {
    const int64_t kc = std::min(kKC, K - k0);
    pack_panel(chunk, b, b_sn, b_sk, n0, nw, k0, kc);
    fma_steps<MR, TA>(acc, a + k0 * a_sk, a_sm, a_sk, chunk, kc);
  }
  store_acc<MR>(acc, tile);
}

#if defined(__AVX512F__)
// Decode path (a few rows, row-major B): no packing buffer at all. 16 weight rows x 16 k are loaded and
// transposed in registers, and each transposed vector (one k, 16 columns) feeds the MR fma chains directly.
// bf16 rows are loaded as 16 dword pairs (k, k+1) and transposed once per 32 k: the pair splits into the
// even k (shift left 16) and odd k (mask the high half), both exact widenings.
// One block of the direct path: 16 weight rows (row pointers clamped to valid rows, rows past nw masked to
// zero) x kBlock k-steps starting at kk (kFull: all kBlock steps exist, so every index below is a constant
// and the transposed vectors stay in registers; otherwise `cnt` steps, for the tail of K).
template <int MR, bool kFull, typename TA, typename TB>
static ALIGNED_INLINE void direct_block(__m512 (&acc)[MR], const TA* a, int64_t a_sm, int64_t a_sk,
                                        const TB* const (&rp)[16], const uint32_t (&rv)[16], int64_t kk, int cnt_rt) {
  constexpr bool kPairs = std::is_same_v<TB, bf16_t>;
  constexpr int kBlock = kPairs ? 32 : 16;
  const int cnt = kFull ? kBlock : cnt_rt;
  [[maybe_unused]] const uint32_t kmask = kFull ? 0xffffffffu : ((1u << cnt) - 1u);
  __m512 rows[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if constexpr (kPairs)
      rows[i] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi16((__mmask32)(rv[i] & kmask), rp[i] + kk));
    else
      rows[i] = load16_f32(rp[i] + kk, rv[i] ? cnt : 0);
  }
  simd::transpose16(rows);
  if constexpr (kPairs) {
    const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
#pragma GCC unroll 16
    for (int c = 0; c < (cnt + 1) / 2; ++c) {
      const __m512i pr = _mm512_castps_si512(rows[c]);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pr, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(pr, hi_mask));
      const TA* ak = a + (kk + 2 * c) * a_sk;
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(to_f32(ak[r * a_sm])), even, acc[r]);
      if (kFull || 2 * c + 1 < cnt) {
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(to_f32(ak[r * a_sm + a_sk])), odd, acc[r]);
      }
    }
  } else {
#pragma GCC unroll 16
    for (int c = 0; c < cnt; ++c) {
      const TA* ak = a + (kk + c) * a_sk;
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(to_f32(ak[r * a_sm])), rows[c], acc[r]);
    }
  }
}

template <int MR, typename TA, typename TB>
static void direct16(const TA* a, int64_t a_sm, int64_t a_sk, const TB* b, int64_t b_sn, int64_t n0, int64_t nw,
                     int64_t K, float* tile) {
  constexpr int kBlock = std::is_same_v<TB, bf16_t> ? 32 : 16;
  __m512 acc[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const TB* rp[16];
  uint32_t rv[16];
  for (int i = 0; i < 16; ++i) {
    rp[i] = b + (n0 + std::min<int64_t>(i, nw - 1)) * b_sn;
    rv[i] = i < nw ? 0xffffffffu : 0u;
  }
  int64_t kk = 0;
  for (; kk + kBlock <= K; kk += kBlock) direct_block<MR, true, TA, TB>(acc, a, a_sm, a_sk, rp, rv, kk, kBlock);
  if (kk < K) direct_block<MR, false, TA, TB>(acc, a, a_sm, a_sk, rp, rv, kk, (int)(K - kk));
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) _mm512_store_ps(tile + r * kNR, acc[r]);
}

constexpr int kDirectRows = 8;  // rows per pass of the direct (no-pack) path
constexpr int64_t kDirectMaxRows = 16;  // beyond this, packing the panel once and reusing it wins

template <typename TA, typename TB>
using Direct = void (*)(const TA*, int64_t, int64_t, const TB*, int64_t, int64_t, int64_t, int64_t, float*);

template <typename TA, typename TB, int... R>
static Direct<TA, TB> pick_direct(int rows, std::integer_sequence<int, R...>) {
  Direct<TA, TB> fns[] = {&direct16<R + 1, TA, TB>...};
  return fns[rows - 1];
}
#endif

template <typename TA>
using MicroFull = void (*)(const TA*, int64_t, int64_t, const float*, int64_t, float*);

template <typename TA, int... R>
static MicroFull<TA> pick_full(int rows, std::integer_sequence<int, R...>) {
  MicroFull<TA> fns[] = {&micro_full<R + 1, TA>...};
  return fns[rows - 1];
}

template <typename TA, typename TB>
using MicroStreamed = void (*)(const TA*, int64_t, int64_t, const TB*, int64_t, int64_t, int64_t, int64_t, int64_t,
                               float*, float*);

template <typename TA, typename TB, int... R>
static MicroStreamed<TA, TB> pick_streamed(int rows, std::integer_sequence<int, R...>) {
  MicroStreamed<TA, TB> fns[] = {&micro_streamed<R + 1, TA, TB>...};
  return fns[rows - 1];
}

// Packed-panel buffer of the calling thread, grown on demand and kept (threads are torch's pool); freed at
// thread exit.
struct FreePanel {
  void operator()(void* p) const { free(p); }
};
static float* thread_panel_buffer(int64_t floats) {
  thread_local std::unique_ptr<float, FreePanel> buf;
  thread_local int64_t cap = 0;
  if (floats > cap) {
    buf.reset();
    cap = std::max<int64_t>(floats, 2 * cap);
    buf.reset((float*)aligned_alloc(64, (size_t)((cap * 4 + 63) / 64 * 64)));
    if (!buf) abort();
  }
  return buf.get();
}

template <typename TA, typename TB, typename TC>
static void gemm_typed(const TA* a, int64_t a_sm, int64_t a_sk, const TB* b, int64_t b_sn, int64_t b_sk,
                       const TC* bias, TC* c, int64_t c_sm, int64_t K, int lanes, int64_t m0, int64_t m1, int64_t n0,
                       int64_t n1) {
  alignas(64) float tile[kTileFloats];
  alignas(64) float lane_tiles[kLinearLanes * kTileFloats];
  const int64_t rows = m1 - m0;
  if (rows <= 0 || n1 <= n0) return;
  const auto seq = std::make_integer_sequence<int, kMR>{};
#if defined(__AVX512F__)
  if (rows <= kDirectMaxRows && b_sk == 1) {
    if constexpr (!std::is_same_v<TA, float>) {
      // Widen the few activation rows to fp32 once (exact), so every broadcast is a plain fp32 load.
      float* af = thread_panel_buffer(rows * std::max<int64_t>(K, 1));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < K; ++k) af[r * K + k] = to_f32(a[(m0 + r) * a_sm + k * a_sk]);
      gemm_typed<float, TB, TC>(af, K, 1, b, b_sn, b_sk, bias, c + m0 * c_sm, c_sm, K, lanes, 0, rows, n0, n1);
      return;
    }
    for (int64_t nb = n0; nb < n1; nb += 16) {
      const int64_t nw = std::min<int64_t>(16, n1 - nb);
      for (int64_t m = m0; m < m1; m += kDirectRows) {
        const int r = (int)std::min<int64_t>(kDirectRows, m1 - m);
        const auto fn = pick_direct<TA, TB>(r, std::make_integer_sequence<int, kDirectRows>{});
        run_lanes(lanes, K, r, nw, tile, lane_tiles, [&](int64_t k0, int64_t k1, float* t) {
          fn(a + m * a_sm + k0 * a_sk, a_sm, a_sk, b + k0, b_sn, nb, nw, k1 - k0, t);
        });
        store_tile(tile, r, bias, c + m * c_sm, c_sm, nb, nw);
      }
    }
    return;
  }
#endif
  if (rows <= kMR) {
    alignas(64) float chunk[kKC * kNR];
    auto fn = pick_streamed<TA, TB>((int)rows, seq);
    for (int64_t nb = n0; nb < n1; nb += kNR) {
      const int64_t nw = std::min<int64_t>(kNR, n1 - nb);
      run_lanes(lanes, K, (int)rows, nw, tile, lane_tiles, [&](int64_t k0, int64_t k1, float* t) {
        fn(a + m0 * a_sm + k0 * a_sk, a_sm, a_sk, b + k0 * b_sk, b_sn, b_sk, nb, nw, k1 - k0, chunk, t);
      });
      store_tile(tile, (int)rows, bias, c + m0 * c_sm, c_sm, nb, nw);
    }
    return;
  }
  float* bp = thread_panel_buffer(std::max<int64_t>(K, 1) * kNR);
  for (int64_t mb = m0; mb < m1; mb += kMC) {
    const int64_t me = std::min(m1, mb + kMC);
    for (int64_t nb = n0; nb < n1; nb += kNR) {
      const int64_t nw = std::min<int64_t>(kNR, n1 - nb);
      pack_panel(bp, b, b_sn, b_sk, nb, nw, 0, K);
      for (int64_t m = mb; m < me; m += kMR) {
        const int r = (int)std::min<int64_t>(kMR, me - m);
        const auto fn = r == kMR ? &micro_full<kMR, TA> : pick_full<TA>(r, seq);
        run_lanes(lanes, K, r, nw, tile, lane_tiles, [&](int64_t k0, int64_t k1, float* t) {
          fn(a + m * a_sm + k0 * a_sk, a_sm, a_sk, bp + k0 * kNR, k1 - k0, t);
        });
        store_tile(tile, r, bias, c + m * c_sm, c_sm, nb, nw);
      }
    }
  }
}

}  // namespace

// C[m, n] = round(tree over `lanes` lanes of the chains of A[m, :] * B[n, :] (+ bias[n])) for rows [m0, m1) x
// columns [n0, n1), element strides. One storage type T for A and B; C is T (linear, backward) or fp32
// (linear_partial): the 5 instantiations that are used, not 27.
void gemm(const GemmParams& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const DType adt = p.adt, bdt = p.bdt, cdt = p.cdt;
  const void *A = p.A, *B = p.B, *bias = p.bias;
  void* C = p.C;
  const int64_t a_sm = p.a_sm, a_sk = p.a_sk, b_sn = p.b_sn, b_sk = p.b_sk, c_sm = p.c_sm, K = p.K;
  const int lanes = p.lanes;
  if (bdt != adt || (cdt != adt && cdt != DType::F32)) abort();  // callers (make_params.h) only make these
  with_type(adt, [&](auto* ap) {
    using T = std::remove_pointer_t<decltype(ap)>;
    if (cdt == adt)
      gemm_typed<T, T, T>((const T*)A, a_sm, a_sk, (const T*)B, b_sn, b_sk, (const T*)bias, (T*)C, c_sm, K, lanes, m0,
                          m1, n0, n1);
    else
      gemm_typed<T, T, float>((const T*)A, a_sm, a_sk, (const T*)B, b_sn, b_sk, (const float*)bias, (float*)C, c_sm,
                              K, lanes, m0, m1, n0, n1);
  });
}

}  // namespace aligned::cpu::ALIGNED_ISA
