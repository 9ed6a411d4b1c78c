// gemm_mma_kernels.cpp — the CPU GEMM of the `mma` profile (csrc/common/mma.h) on AVX512-BF16 `vdpbf16ps`.
// Compiled once, for the avx512bf16 level only (CMakeLists.txt: the *_mma_kernels.cpp sources); torch-free.
//
//   C[m, n] = epilogue(linear_lane_fold over L lanes of s_l),  s_l = the vdpbf16ps chain of lane l:
//             acc = +0, then acc = vdpbf16ps(acc, (A[m, k], A[m, k+1]), (B[n, k], B[n, k+1])) for the lane's
//             pairs k = lo(l), lo(l) + 2, ... < lo(l + 1); an odd lane ends in the pair (A[m, k], +0) x (B[n, k], +0)
//
// One fp32 lane of the instruction holds one output column's chain: a zmm accumulator is 16 output columns of
// one row, and each step feeds it the row's pair broadcast (32 bits) against the 16 columns' pairs. The lanes of
// K are computed one after another into lane tiles (the accumulators restart at +0 at every lane start) and
// folded by the contract's tree in the epilogue. Nothing splits or reorders a lane's pairs: tiles, paths and
// threads only choose which chains run side by side, so the bits cannot depend on M, the tile an element lands
// in, the path (direct / packed) or the thread — every path issues the same instruction on the same pairs in
// the same order for an element.
//
// Paths (the weight B is row-major [N, K]: the forward's weight, the backward's transposed copies). Each issues,
// for every output element, the same instruction on the same two pairs in the same order — which path runs is a
// function of the row count only, and the conformance tests hold every path to mma.h's reference:
//  * direct, rows <= 8 (decode): no packing buffer. 16 weight rows x 32 k (= 16 pairs per row) are loaded and
//    transposed 16x16 in registers, giving per pair one vector of 16 columns' pairs, which feeds the chains of the
//    rows directly (the row's pair broadcast). One read of the weight. The lane's last block is a masked load:
//    elements past the lane read as +0, the contract's padding of an odd lane.
//  * row-lane, rows 9..16 and 24..32: the rows' pairs are packed once ([pair][16 or 32 rows]) and each step
//    broadcasts one weight column's pair against them (rows in the zmm lanes, 8 weight columns at a time; the
//    instruction's model is symmetric in its operands) — no weight transpose, one read of the weight.
//  * packed, rows 17..23 and > 32, and every row count when B is column-major (the backward reads w and x in
//    place: the panel packs pairs of k-rows by interleaving, no transpose): per block of kMC rows, each 32-column panel is packed once over every lane
//    (pairs of a lane consecutive, [pair][32 columns], zero columns past N) and reused by all kMR-row groups: a
//    group's step is 2 aligned loads and 2 * kMR instructions with the row's pair broadcast.
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <memory>
#include <type_traits>
#include <utility>

#include <immintrin.h>

#include "../common/mma.h"
#include "mma_kernels.h"
#include "simd.h"

#ifndef ALIGNED_ISA
#error "ALIGNED_ISA must name the ISA level this translation unit is compiled for"
#endif
#if !defined(__AVX512BF16__) || !defined(__AVX512BW__)
#error "gemm_mma_kernels.cpp is compiled for the avx512bf16 level only (CMakeLists.txt: ALIGNED_CPU_MMA_SOURCES)"
#endif

namespace aligned::cpu::ALIGNED_ISA {

namespace {

#define ALIGNED_INLINE inline __attribute__((always_inline))

namespace simd = aligned::cpu::ALIGNED_ISA::simd;

constexpr int kMR = 8;                  // rows per packed-path microkernel (8 x 2 zmm accumulators; 12: no faster)
constexpr int kNR = 32;                 // columns per packed panel and per tile row
constexpr int kDirectRows = 8;          // rows of the direct path (8 accumulators + 16 pair vectors: no spill)
constexpr int kRowLanes = 32;           // most rows of the row-lane path (one zmm lane per row, 1-2 zmm per column)
constexpr int kRowLanesMin2 = 24;       // 2 zmm per column from here (17..23 rows: the packed path is faster)
constexpr int kTileRows = 32;
constexpr int kTileFloats = kTileRows * kNR;  // one lane tile: up to 32 rows x 32 columns
constexpr int64_t kMC = 256;            // rows per block of the packed path

static ALIGNED_INLINE uint32_t load_u32(const uint16_t* p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

// The pair (a[k], a[k+1]) of a lane ending at k1, as the instruction's 32-bit element (even element in the low
// half); the last pair of an odd lane is (a[k1-1], +0).
static ALIGNED_INLINE uint32_t pair_of(const uint16_t* a, int64_t k, int64_t k1) {
  return k + 1 < k1 ? load_u32(a + k) : (uint32_t)a[k];
}

// One step of 16 chains: acc[j] = vdpbf16ps lane j of (acc[j], the broadcast pair, column j's pair).
static ALIGNED_INLINE __m512 dp_step(__m512 acc, uint32_t a_pair, __m512 b_pairs) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)a_pair), (__m512bh)_mm512_castps_si512(b_pairs));
}


// 16 rows of bf16 from column kk: `cnt` <= 32 elements each (the rest +0), rows past `valid` all +0.
template <bool kFull>
static ALIGNED_INLINE void load_rows(__m512 (&rows)[16], const uint16_t* const (&rp)[16], int valid, int64_t kk,
                                     int cnt) {
  const __mmask32 m = kFull || cnt >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << cnt) - 1u);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if (kFull && i < valid)
      rows[i] = _mm512_castsi512_ps(_mm512_loadu_si512(rp[i] + kk));
    else
      rows[i] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(i < valid ? m : (__mmask32)0, rp[i] + kk));
  }
}

// ---- direct path: MR rows x 16 columns, one lane [k0, k1), no packing ----------------------------------------
template <int MR, bool kFull>
static ALIGNED_INLINE void direct_block(__m512 (&acc)[MR], const uint16_t* a, int64_t a_sm,
                                        const uint16_t* const (&rp)[16], int valid, int64_t kk, int64_t k1) {
  const int cnt = kFull ? 32 : (int)(k1 - kk);
  __m512 rows[16];
  load_rows<kFull>(rows, rp, valid, kk, cnt);
  simd::transpose16(rows);
  const int pairs = kFull ? 16 : (cnt + 1) / 2;
#pragma GCC unroll 16
  for (int c = 0; c < pairs; ++c) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const uint16_t* ar = a + r * a_sm;
      acc[r] = dp_step(acc[r], kFull ? load_u32(ar + kk + 2 * c) : pair_of(ar, kk + 2 * c, k1), rows[c]);
    }
  }
}

// Lane [k0, k1) of rows a[0 .. MR) (row stride a_sm, absolute k) against weight rows n0 .. n0 + nw (nw <= 16):
// tile[r][0..16) (row stride kNR).
template <int MR>
static void direct16(const uint16_t* a, int64_t a_sm, const uint16_t* b, int64_t b_sn, int64_t n0, int64_t nw,
                     int64_t k0, int64_t k1, float* tile) {
  __m512 acc[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const uint16_t* rp[16];
  for (int i = 0; i < 16; ++i) rp[i] = b + (n0 + std::min<int64_t>(i, nw - 1)) * b_sn;
  const int valid = (int)nw;
  int64_t kk = k0;
  for (; kk + 32 <= k1; kk += 32) direct_block<MR, true>(acc, a, a_sm, rp, valid, kk, k1);
  if (kk < k1) direct_block<MR, false>(acc, a, a_sm, rp, valid, kk, k1);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) _mm512_store_ps(tile + r * kNR, acc[r]);
}

using DirectFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                          float*);
template <int... R>
static DirectFn pick_direct(int rows, std::integer_sequence<int, R...>) {
  static constexpr DirectFn fns[] = {&direct16<R + 1>...};
  return fns[rows - 1];
}

// ---- packed path ----------------------------------------------------------------------------------------------
// Pairs of `lanes` lanes of K: lane l's pairs start at pair index pair_begin(l) of the packed panel.
static ALIGNED_INLINE int64_t lane_pairs(int64_t k0, int64_t k1) { return (k1 - k0 + 1) / 2; }

// bp[q][j] = the pair (B[n0 + j, k], B[n0 + j, k + 1]) of packed pair q (lanes one after another), 0 for j >= nw;
// W = 32 (a weight panel) or 16 (the row-lane path's rows of A) 32-bit elements per pair.
template <int W>
static void pack_pairs(uint32_t* __restrict bp, const uint16_t* b, int64_t b_sn, int64_t n0, int64_t nw, int64_t K,
                       int lanes) {
  int64_t q = 0;
  for (int l = 0; l < lanes; ++l) {
    const int64_t k0 = linear_lane_begin(l, K, lanes), k1 = linear_lane_begin(l + 1, K, lanes);
    for (int h = 0; h < W / 16; ++h) {
      const int64_t nh = std::min<int64_t>(16, std::max<int64_t>(0, nw - 16 * h));
      const uint16_t* rp[16];
      for (int i = 0; i < 16; ++i)  // rows past nh: a valid row, masked off by load_rows
        rp[i] = b + (n0 + std::min<int64_t>(16 * h + i, nw - 1)) * b_sn;
      for (int64_t kk = k0; kk < k1; kk += 32) {
        const int cnt = (int)std::min<int64_t>(32, k1 - kk);
        __m512 rows[16];
        if (cnt == 32)
          load_rows<true>(rows, rp, (int)nh, kk, cnt);
        else
          load_rows<false>(rows, rp, (int)nh, kk, cnt);
        simd::transpose16(rows);
        const int64_t q0 = q + (kk - k0) / 2;
        for (int c = 0; c < (cnt + 1) / 2; ++c) _mm512_store_ps((float*)(bp + (q0 + c) * W + 16 * h), rows[c]);
      }
    }
    q += lane_pairs(k0, k1);
  }
}

// The same panel from a column-major B (B[n, k] at b[k * b_sk + n]: the backward's w and x read in place, no
// transposed copy): pair q of a lane is the two k-rows (k, k+1) of 32 consecutive columns, interleaved by 16 bits.
static void pack_pairs_cols(uint32_t* __restrict bp, const uint16_t* b, int64_t b_sk, int64_t n0, int64_t nw,
                            int64_t K, int lanes) {
  int64_t q = 0;
  for (int l = 0; l < lanes; ++l) {
    const int64_t k0 = linear_lane_begin(l, K, lanes), k1 = linear_lane_begin(l + 1, K, lanes);
    for (int64_t k = k0; k < k1; k += 2, ++q) {
      const uint16_t* r0 = b + k * b_sk + n0;
      const uint16_t* r1 = b + (k + 1) * b_sk + n0;  // read only when k + 1 < k1 (else the pair's +0 half)
      for (int h = 0; h < kNR / 16; ++h) {
        const int cnt = (int)std::max<int64_t>(0, std::min<int64_t>(16, nw - 16 * h));
        const __mmask16 m = cnt >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cnt) - 1u);
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r0 + 16 * h));
        const __m512i hi = k + 1 < k1 ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r1 + 16 * h))
                                      : _mm512_setzero_si512();
        _mm512_store_si512(bp + q * kNR + 16 * h, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
  }
}

// One lane of MR rows x 32 columns on the packed panel bp (the lane's pairs): tile[r][0..32).
template <int MR>
static void micro_packed(const uint16_t* a, int64_t a_sm, const uint32_t* __restrict bp, int64_t k0, int64_t k1,
                         float* tile) {
  __m512 acc[MR][2];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t full = (k1 - k0) / 2;
  for (int64_t q = 0; q < full; ++q) {
    const __m512 b0 = _mm512_load_ps((const float*)(bp + q * kNR));
    const __m512 b1 = _mm512_load_ps((const float*)(bp + q * kNR + 16));
    const int64_t k = k0 + 2 * q;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const uint32_t ap = load_u32(a + r * a_sm + k);
      acc[r][0] = dp_step(acc[r][0], ap, b0);
      acc[r][1] = dp_step(acc[r][1], ap, b1);
    }
  }
  if ((k1 - k0) & 1) {  // the odd lane's last pair: (A[m, k1 - 1], +0)
    const __m512 b0 = _mm512_load_ps((const float*)(bp + full * kNR));
    const __m512 b1 = _mm512_load_ps((const float*)(bp + full * kNR + 16));
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const uint32_t ap = a[r * a_sm + k1 - 1];
      acc[r][0] = dp_step(acc[r][0], ap, b0);
      acc[r][1] = dp_step(acc[r][1], ap, b1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    _mm512_store_ps(tile + r * kNR, acc[r][0]);
    _mm512_store_ps(tile + r * kNR + 16, acc[r][1]);
  }
}

using PackedFn = void (*)(const uint16_t*, int64_t, const uint32_t*, int64_t, int64_t, float*);
template <int... R>
static PackedFn pick_packed(int rows, std::integer_sequence<int, R...>) {
  static constexpr PackedFn fns[] = {&micro_packed<R + 1>...};
  return fns[rows - 1];
}

// ---- row-lane path: 9..32 rows, one zmm lane per ROW ------------------------------------------------------------
// ap: the rows' pairs of the lane, [pair][16 * RZ rows] (pack_pairs of A, rows past M zero; RZ = 1 or 2 zmm per
// column). Each step broadcasts one weight column's pair against the rows' pairs: per element the same instruction
// on the same two pairs, in the same order, as every other path (the unit's model is symmetric in its operands:
// fma(x, w, c) == fma(w, x, c), DAZ on both; the conformance tests hold this path to the reference like the
// others), so the bits are the same — and no weight transpose is needed, which the direct path pays per 8 rows.
// 8 weight rows at a time: 16 rows K = 2048 / 4096 elements apart all map to one L1 set (8 ways) and were measured
// 2x slower than 8 (which fit).
constexpr int kRowLaneCols = 8;
constexpr int64_t kRowLanePrefetch = 128;  // least prefetch distance, elements (4 lines); rowlane: 2 groups of rows

template <int RZ, bool kFull>
static ALIGNED_INLINE void rowlane_block(__m512 (&acc)[kRowLaneCols][RZ], const uint32_t* __restrict ap,
                                         const uint16_t* const (&wr)[kRowLaneCols], int64_t kk, int64_t k1,
                                         int64_t ahead) {
  const int cnt = kFull ? 32 : (int)(k1 - kk);
  const __mmask32 m = kFull ? (__mmask32)0xffffffffu : (__mmask32)((1u << cnt) - 1u);
  alignas(64) uint32_t w_pairs[kRowLaneCols][16];  // the columns' next 16 pairs (one line per weight row)
#pragma GCC unroll 8
  for (int j = 0; j < kRowLaneCols; ++j) {
    _mm512_store_si512(w_pairs[j], kFull ? _mm512_loadu_si512(wr[j] + kk) : _mm512_maskz_loadu_epi16(m, wr[j] + kk));
    _mm_prefetch((const char*)(wr[j] + kk + ahead), _MM_HINT_T0);  // a hint: past the matrix is harmless
  }
  const int pairs = kFull ? 16 : (cnt + 1) / 2;  // an odd tail's last pair is (B[n, k1 - 1], +0): the masked load
#pragma GCC unroll 16
  for (int c = 0; c < pairs; ++c) {
    __m512 av[RZ];
#pragma GCC unroll 2
    for (int z = 0; z < RZ; ++z) av[z] = _mm512_load_ps((const float*)(ap + (c * RZ + z) * 16));
#pragma GCC unroll 8
    for (int j = 0; j < kRowLaneCols; ++j)
#pragma GCC unroll 2
      for (int z = 0; z < RZ; ++z) acc[j][z] = dp_step(acc[j][z], w_pairs[j][c], av[z]);
  }
}

// Lane [k0, k1) of 16 * RZ rows against the kRowLaneCols weight rows n0 .. n0 + 8 (rows past nw clamped:
// computed, not stored). The accumulators are stored as they are, column-major: tile[(j * RZ + z) * 16 + r] = row
// 16 z + r of column j (fold_and_store_cols transposes once per 16 columns, after the lane fold — the fold is
// element-wise, so the layout cannot change a bit; a 16x16 transpose per lane was ~1/5 of the path's instructions at
// K = 896). The caller walks all lanes of these 8 weight rows before the next 8, so each weight row streams front to
// back (prefetch-friendly) instead of a lane's short piece at a time.
template <int RZ>
static void rowlane(const uint32_t* __restrict ap, const uint16_t* b, int64_t b_sn, int64_t n0, int64_t nw,
                    int64_t k0, int64_t k1, float* tile) {
  __m512 acc[kRowLaneCols][RZ];
#pragma GCC unroll 8
  for (int j = 0; j < kRowLaneCols; ++j)
#pragma GCC unroll 2
    for (int z = 0; z < RZ; ++z) acc[j][z] = _mm512_setzero_ps();
  const uint16_t* wr[kRowLaneCols];
  for (int j = 0; j < kRowLaneCols; ++j) wr[j] = b + (n0 + std::min<int64_t>(j, nw - 1)) * b_sn;
  int64_t kk = k0;
  // Prefetch distance: the same k of the weight row two groups on (row n0 + j + 2 kRowLaneCols, 16 rows on:
  // 2 kRowLaneCols * b_sn elements ahead; the group after next, so its lines have a whole group's lanes to arrive),
  // or kRowLanePrefetch elements when that is farther (only for a row stride b_sn below 8). A fixed distance within
  // the row was too short when K is short (K = 896: 28 lines a row, too short a stream for the hardware prefetcher to
  // ramp up: measured 0.7x oneDNN's decode GEMM with DRAM-resident weights). Past the matrix it is only a hint.
  const int64_t ahead = std::max<int64_t>(kRowLanePrefetch, 2 * kRowLaneCols * b_sn);
  for (; kk + 32 <= k1; kk += 32) rowlane_block<RZ, true>(acc, ap + (kk - k0) / 2 * 16 * RZ, wr, kk, k1, ahead);
  if (kk < k1) rowlane_block<RZ, false>(acc, ap + (kk - k0) / 2 * 16 * RZ, wr, kk, k1, ahead);
#pragma GCC unroll 8
  for (int j = 0; j < kRowLaneCols; ++j)
#pragma GCC unroll 2
    for (int z = 0; z < RZ; ++z) _mm512_store_ps(tile + (j * RZ + z) * 16, acc[j][z]);
}

// ---- epilogue -------------------------------------------------------------------------------------------------
// The lane tiles lt[l] (kTileFloats apart, rows kNR apart) -> C: per row, 16 columns at a time, the contract's
// tree (linear_lane_fold on simd.h vectors: each vector lane computes the float tree; one lane: the chain itself),
// then linear_epilogue's one fp32 add of the bias and one rounding (simd.h store: RNE, NaN kept — lane by lane
// from_f32's bits). Vectorised because at short lanes (the backward's dw over a few tokens) it is most of the work.
using V = simd::F32x16;

template <typename TC>
static void fold_and_store(const float* lt, int lanes, int rows, const TC* bias, TC* c, int64_t c_sm, int64_t n0,
                           int64_t nw) {
  for (int r = 0; r < rows; ++r) {
    TC* crow = c + r * c_sm + n0;
    for (int64_t j = 0; j < nw; j += 16) {
      const int cnt = (int)std::min<int64_t>(16, nw - j);
      V s[kLinearLanes];
      for (int l = 0; l < lanes; ++l) s[l] = simd::load<V>(lt + l * kTileFloats + r * kNR + j, cnt);
      V acc = linear_lane_fold(s, lanes);
      if (bias) acc = acc + simd::load<V>(bias + n0 + j, cnt);
      simd::store(crow + j, acc, cnt);  // TC is bf16_t or float: vector stores (simd.h kVectorStore)
    }
  }
}

// fold_and_store for the row-lane path's column-major lane tiles (rowlane): per 16 rows (z), each column's 16 rows
// folded over the lanes (the same element-wise tree), the 16 columns transposed to rows once, then the bias and
// the rounding store of fold_and_store. Columns >= nw are never stored.
template <typename TC>
static void fold_and_store_cols(const float* lt, int lanes, int rz, int rows, const TC* bias, TC* c, int64_t c_sm,
                                int64_t n0, int64_t nw) {
  const int cnt = (int)std::min<int64_t>(16, nw);
  for (int z = 0; z * 16 < rows; ++z) {
    __m512 f[16];
    for (int j = 0; j < 16; ++j) {
      V s[kLinearLanes];
      for (int l = 0; l < lanes; ++l) s[l] = V::load_aligned(lt + l * kTileFloats + (j * rz + z) * 16);
      f[j] = linear_lane_fold(s, lanes).v;
    }
    simd::transpose16(f);  // f[r] = row 16 z + r's 16 columns
    for (int r = 0; r < 16 && 16 * z + r < rows; ++r) {
      V acc(f[r]);
      if (bias) acc = acc + simd::load<V>(bias + n0, cnt);
      simd::store(c + (16 * z + r) * c_sm + n0, acc, cnt);
    }
  }
}

// Runs chain(lane, k0, k1, lane_tile) for every lane of K into the lane tiles (the fold is fold_and_store's).
template <typename Chain>
static ALIGNED_INLINE void run_lanes(int lanes, int64_t K, float* lane_tiles, Chain&& chain) {
  for (int l = 0; l < lanes; ++l)
    chain(l, linear_lane_begin(l, K, lanes), linear_lane_begin(l + 1, K, lanes), lane_tiles + l * kTileFloats);
}

// Packed-panel buffer of the calling thread, grown on demand and kept (threads are torch's pool); freed at
// thread exit.
struct FreePanel {
  void operator()(void* p) const { free(p); }
};
static uint32_t* thread_panel_buffer(int64_t dwords) {
  thread_local std::unique_ptr<uint32_t, FreePanel> buf;
  thread_local int64_t cap = 0;
  if (dwords > cap) {
    buf.reset();
    cap = std::max<int64_t>(dwords, 2 * cap);
    buf.reset((uint32_t*)aligned_alloc(64, (size_t)((cap * 4 + 63) / 64 * 64)));
    if (!buf) abort();
  }
  return buf.get();
}

template <typename TC>
static void gemm_typed(const uint16_t* a, int64_t a_sm, const uint16_t* b, int64_t b_sn, int64_t b_sk, const TC* bias,
                       TC* c, int64_t c_sm, int64_t K, int lanes, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const bool b_cols = b_sk != 1;  // column-major B (b_sn == 1): the packed path, whatever the row count
  alignas(64) float lane_tiles[kLinearLanes * kTileFloats];
  const int64_t rows = m1 - m0;
  if (rows <= 0 || n1 <= n0) return;
  if (K == 0) {  // every lane empty: +0 (then the bias)
    std::fill(lane_tiles, lane_tiles + kTileFloats, 0.0f);
    for (int64_t m = m0; m < m1; m += kMR)
      for (int64_t nb = n0; nb < n1; nb += kNR)
        fold_and_store(lane_tiles, 1, (int)std::min<int64_t>(kMR, m1 - m), bias, c + m * c_sm, c_sm, nb,
                       std::min<int64_t>(kNR, n1 - nb));
    return;
  }
  int64_t lane_q[kLinearLanes + 1];  // first packed pair of each lane
  lane_q[0] = 0;
  for (int l = 0; l < lanes; ++l)
    lane_q[l + 1] = lane_q[l] + lane_pairs(linear_lane_begin(l, K, lanes), linear_lane_begin(l + 1, K, lanes));
  if (!b_cols && rows > kDirectRows && (rows <= 16 || (rows >= kRowLanesMin2 && rows <= kRowLanes))) {
    const int rz = rows <= 16 ? 1 : 2;  // (rows 17..23 would waste 1/3 of the lanes: the packed path below)
    uint32_t* ap = thread_panel_buffer(lane_q[lanes] * 16 * rz);
    if (rz == 1)
      pack_pairs<16>(ap, a + m0 * a_sm, a_sm, 0, rows, K, lanes);
    else
      pack_pairs<32>(ap, a + m0 * a_sm, a_sm, 0, rows, K, lanes);
    const auto fn = rz == 1 ? &rowlane<1> : &rowlane<2>;
    for (int64_t nb = n0; nb < n1; nb += 16) {
      const int64_t nw = std::min<int64_t>(16, n1 - nb);
      // 8 weight rows through every lane, then the next 8 (rowlane's note); each call writes columns h .. h + 8 of
      // its column-major lane tile (columns of a group past nw: clamped rows, computed, never stored).
      for (int64_t h = 0; h < 16; h += kRowLaneCols) {
        if (h >= nw) {  // no weight row left for this group: defined (unused) columns for the fold's loads
          for (int l = 0; l < lanes; ++l)
            std::fill(lane_tiles + l * kTileFloats + h * rz * 16, lane_tiles + l * kTileFloats + 16 * rz * 16, 0.0f);
          break;
        }
        const int64_t hw = std::min<int64_t>(kRowLaneCols, nw - h);
        for (int l = 0; l < lanes; ++l)
          fn(ap + lane_q[l] * 16 * rz, b, b_sn, nb + h, hw, linear_lane_begin(l, K, lanes),
             linear_lane_begin(l + 1, K, lanes), lane_tiles + l * kTileFloats + h * rz * 16);
      }
      fold_and_store_cols(lane_tiles, lanes, rz, (int)rows, bias, c + m0 * c_sm, c_sm, nb, nw);
    }
    return;
  }
  if (!b_cols && rows <= kDirectRows) {
    for (int64_t nb = n0; nb < n1; nb += 16) {
      const int64_t nw = std::min<int64_t>(16, n1 - nb);
      for (int64_t m = m0; m < m1; m += kDirectRows) {
        const int r = (int)std::min<int64_t>(kDirectRows, m1 - m);
        const DirectFn fn = pick_direct(r, std::make_integer_sequence<int, kDirectRows>{});
        run_lanes(lanes, K, lane_tiles, [&](int, int64_t k0, int64_t k1, float* t) {
          fn(a + m * a_sm, a_sm, b, b_sn, nb, nw, k0, k1, t);
        });
        fold_and_store(lane_tiles, lanes, r, bias, c + m * c_sm, c_sm, nb, nw);
      }
    }
    return;
  }
  uint32_t* bp = thread_panel_buffer(lane_q[lanes] * kNR);
  for (int64_t mb = m0; mb < m1; mb += kMC) {
    const int64_t me = std::min(m1, mb + kMC);
    for (int64_t nb = n0; nb < n1; nb += kNR) {
      const int64_t nw = std::min<int64_t>(kNR, n1 - nb);
      if (b_cols)
        pack_pairs_cols(bp, b, b_sk, nb, nw, K, lanes);
      else
        pack_pairs<kNR>(bp, b, b_sn, nb, nw, K, lanes);
      for (int64_t m = mb; m < me; m += kMR) {
        const int r = (int)std::min<int64_t>(kMR, me - m);
        const PackedFn fn = r == kMR ? &micro_packed<kMR> : pick_packed(r, std::make_integer_sequence<int, kMR>{});
        run_lanes(lanes, K, lane_tiles, [&](int l, int64_t k0, int64_t k1, float* t) {
          fn(a + m * a_sm, a_sm, bp + lane_q[l] * kNR, k0, k1, t);
        });
        fold_and_store(lane_tiles, lanes, r, bias, c + m * c_sm, c_sm, nb, nw);
      }
    }
  }
}

// C = the mma profile's GEMM (mma_kernels.h) for rows [m0, m1) x columns [n0, n1).
void gemm(const GemmParams& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  // The glue (csrc/torch/glue/linear_mma.h) makes only these: bf16 operands, A with unit k-stride, B row-major (unit k-stride)
  // or column-major (unit n-stride), bf16 or fp32 C.
  const bool b_ok = p.b_sk == 1 || p.b_sn == 1;
  if (p.adt != DType::BF16 || p.bdt != DType::BF16 || (p.K > 1 && (p.a_sk != 1 || !b_ok)) ||
      (p.cdt != DType::BF16 && p.cdt != DType::F32) || (p.cdt == DType::F32 && p.bias))
    abort();
  const auto* A = (const uint16_t*)p.A;
  const auto* B = (const uint16_t*)p.B;
  const int64_t b_sk = p.K > 1 ? p.b_sk : 1;
  if (p.cdt == DType::BF16)
    gemm_typed<bf16_t>(A, p.a_sm, B, p.b_sn, b_sk, (const bf16_t*)p.bias, (bf16_t*)p.C, p.c_sm, p.K, p.lanes, m0, m1,
                       n0, n1);
  else
    gemm_typed<float>(A, p.a_sm, B, p.b_sn, b_sk, nullptr, (float*)p.C, p.c_sm, p.K, p.lanes, m0, m1, n0, n1);
}

// The reference: mma.h's scalar model of the instruction, one element at a time.
void reference_rows(const GemmParams& p, int64_t m0, int64_t m1) {
  const auto* xp = (const bf16_t*)p.A;
  const auto* wp = (const bf16_t*)p.B;
  float* o = (float*)p.C;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t n = 0; n < p.N; ++n)
      o[m * p.N + n] = linear_mma_partial_dot(xp + m * p.a_sm, p.a_sk, wp + n * p.b_sn, p.b_sk, p.K, p.lanes);
}

}  // namespace

extern const MmaKernels kMma;
const MmaKernels kMma = {
    .unit = "avx512_bf16",
    .unit_id = MmaUnit::kAvx512Bf16,
    .gemm = &gemm,
    .reference = &reference_rows,
    .row_major_b = false,
    .pack_weight = nullptr,
};

}  // namespace aligned::cpu::ALIGNED_ISA
