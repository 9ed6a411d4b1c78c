// gemm_amx_mma_kernels.cpp — the CPU GEMM of the `mma` profile (csrc/common/mma.h) on AMX-BF16 `tdpbf16ps`,
// the unit of a CPU whose kernel level is `amx` (AMX tiles granted, amx_bf16). Compiled in the avx512bf16 level
// (CMakeLists.txt: *_mma_kernels.cpp); the AMX functions carry their own target attribute. Torch-free.
//
//   C[m, n] = epilogue(linear_lane_fold over L lanes of s_l),  s_l = the tdpbf16ps chain of lane l:
//             acc = +0, then acc = tdpbf16ps(acc, x[m, kb .. kb + 32), w[n, kb .. kb + 32)) for the lane's
//             blocks kb = lo(l), lo(l) + 32, ... < lo(l + 1); the last block of a lane whose length is not a
//             multiple of 32 is padded with x = +0, w = +0 (mma.h: a block never spans two lanes)
//
// The instruction's arithmetic over its 32 products is the unit's own (not modelled: mma.h). What this file
// fixes is everything else: one instruction per (element, block), the blocks of a lane in ascending k, a fresh
// +0 accumulator per lane, the contract's fold, one rounding. Which other rows and columns share a tile, the tile
// an element lands in, M, N, the thread: none of them reaches an element's 32 products or their accumulator, so
// none can change its bits (the tests hold a row alone to the row in batches, threads 1 vs 2, and every result
// to kReference: one element per instruction, with 1x1 tiles and the operands in the other roles).
//
// Two paths, the same instructions per element:
//  * in place (gemm_typed; any weight, the trainer's, compiled graphs): the weight rows are the instruction's
//    FIRST operand, read where they lie — a tile is 16 weight rows x 32 k, one row-strided tile load. The
//    activations are the SECOND operand, packed per call into the unit's pair layout ([16 pairs][16 rows] per
//    block, zero past the lane's end and past the last row). The result tiles are C'[n][m]; the fold transposes
//    once per 16 x 16. Only two kinds of weight tile are staged through a zeroed buffer: a lane's last, partial
//    block (its padding must be +0, not the next lane's weights: inf * 0 would be NaN) and the rows past N of the
//    last 16-row block.
//  * packed (gemm_packed_typed; the rollout engine's registered weights, packed once by linear_mma_pack_weight and
//    cached by aligned_ops.linear_mma): the roles of the reference — activations first, the packed weight tiles
//    second (contiguous, zero-padded: one sequential stream at decode); C[m][n], no transpose.
//
// B must be row-major here (b_sk == 1); the glue (csrc/torch/backends/cpu_mma.cpp) hands a column-major B (the
// backward's w and x) over as a row-major copy, so the backward runs this same chain.
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <memory>

#include <immintrin.h>

#include "../common/mma.h"
#include "mma_kernels.h"
#include "simd.h"
#include "thread_buffer.h"

#ifndef ALIGNED_ISA
#error "ALIGNED_ISA must name the ISA level this translation unit is compiled for"
#endif
#if !defined(__AVX512BF16__) || !defined(__AVX512BW__)
#error "gemm_amx_mma_kernels.cpp is compiled for the avx512bf16 level only (CMakeLists.txt: ALIGNED_CPU_MMA_SOURCES)"
#endif

#define ALIGNED_AMX __attribute__((target("amx-tile,amx-bf16")))

namespace aligned::cpu::ALIGNED_ISA {

namespace {

namespace simd = aligned::cpu::ALIGNED_ISA::simd;
using V = simd::F32x16;

constexpr int kBlock = kMmaAmxBlock;     // k per instruction (mma.h): 16 pairs
constexpr int kTileDwords = 256;         // one 16 x 16 tile of 32-bit elements (1 KiB)
constexpr int kNB = 2;                   // weight-row blocks (16 rows each) per group: C tiles 0..3, A tiles 4, 5
constexpr int kMB = 2;                   // activation-row blocks per group: B tiles 6, 7
constexpr int64_t kRowChunk = 256;      // activation rows per pass (gemm): bounds the per-thread buffers
constexpr int kChunkGroups = 2;          // weight-row groups per chunk (lane_tiles' loop order: gemm_typed)
constexpr int kPrefetchRows = 2 * 16 * kNB;  // software prefetch distance: the weight-row group after next

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile 16 rows x 64 bytes. Loaded at the start of every call and released at its end: other code on the
// same thread (oneDNN, the exact profile's AMX-INT8) loads its own configuration.
__attribute__((noinline)) ALIGNED_AMX void amx_config_full() {
  TileConfig cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  // GCC 12 does not model ldtilecfg's read of the configuration: inlined, the stores above were measured deleted as
  // dead (a configuration of palette 1 with every tile 0 x 0: SIGILL at the first tile instruction). The asm makes
  // the configuration escape, so its stores stay.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

ALIGNED_AMX void amx_release() { _tile_release(); }

// Blocks of a lane [k0, k1): ceil((k1 - k0) / 32).
inline int64_t lane_blocks(int64_t k0, int64_t k1) { return (k1 - k0 + kBlock - 1) / kBlock; }

// Lane geometry of one call: lane l's blocks are q in [q0[l], q0[l + 1]) of the packed activations.
struct Lanes {
  int n;
  int64_t k0[kLinearLanes + 1];
  int64_t q0[kLinearLanes + 1];
  Lanes(int64_t K, int lanes) : n(lanes) {
    q0[0] = 0;
    for (int l = 0; l <= lanes; ++l) k0[l] = linear_lane_begin(l, K, lanes);
    for (int l = 0; l < lanes; ++l) q0[l + 1] = q0[l] + lane_blocks(k0[l], k0[l + 1]);
  }
};

// 16 rows of bf16, `cnt` <= 32 elements each from column kk (the rest +0); rows >= valid are +0.
inline void load_rows16(__m512 (&rows)[16], const uint16_t* a, int64_t a_sm, int valid, int64_t kk, int cnt) {
  const __mmask32 m = cnt >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << cnt) - 1u);
  for (int i = 0; i < 16; ++i)
    rows[i] = i < valid ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(m, a + i * a_sm + kk)) : _mm512_setzero_ps();
}

// Rows a[16 mb0 .. min(rows, 16 mb1)) in the unit's pair layout (the instruction's second operand): for row block
// mb (16 rows) and block q, xp[(mb * Q + q) * 256 + p * 16 + i] = (a[16 mb + i, k], a[16 mb + i, k + 1]) with
// k = kb + 2 p, +0 past the lane's end and for rows >= `rows`. The in-place path packs the activations so per
// call; linear_mma_pack_weight packs a weight so once (pack_weight).
void pack_pairs(uint32_t* __restrict xp, const uint16_t* a, int64_t a_sm, int64_t rows, const Lanes& ln,
                int64_t mb0, int64_t mb1) {
  const int64_t Q = ln.q0[ln.n];
  for (int64_t mb = mb0; mb < mb1 && mb * 16 < rows; ++mb) {
    const int valid = (int)std::min<int64_t>(16, rows - 16 * mb);
    const uint16_t* ab = a + 16 * mb * a_sm;
    for (int l = 0; l < ln.n; ++l) {
      int64_t q = ln.q0[l];
      for (int64_t kb = ln.k0[l]; kb < ln.k0[l + 1]; kb += kBlock, ++q) {
        __m512 r[16];
        load_rows16(r, ab, a_sm, valid, kb, (int)std::min<int64_t>(kBlock, ln.k0[l + 1] - kb));
        simd::transpose16(r);  // r[p] = pair p of the 16 rows
        uint32_t* dst = xp + (mb * Q + q) * kTileDwords;
        for (int p = 0; p < 16; ++p) _mm512_store_ps((float*)(dst + p * 16), r[p]);
      }
    }
  }
}

void pack_activations(uint32_t* __restrict xp, const uint16_t* a, int64_t a_sm, int64_t rows, const Lanes& ln) {
  pack_pairs(xp, a, a_sm, rows, ln, 0, (rows + 15) / 16);
}

// One 16 x 32 bf16 row tile: rows src[i * stride + kb .. + cnt) for i < valid, +0 elsewhere (past the lane's end, past
// the last row). The packed path's activation tiles and the in-place path's staged weight tiles.
inline void copy_row_tile(uint16_t* __restrict dst, const uint16_t* src, int64_t stride, int valid, int64_t kb,
                          int cnt) {
  const __mmask32 m = cnt >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << cnt) - 1u);
  for (int i = 0; i < 16; ++i)
    _mm512_store_si512(dst + i * 32, i < valid ? _mm512_maskz_loadu_epi16(m, src + i * stride + kb)
                                               : _mm512_setzero_si512());
}

// Rows a[0 .. rows) as the instruction's FIRST operand (the packed-weight path): row tiles of 16 rows x 32 k,
// xa[(mb * Q + q) * 512 + i * 32 + e] = a[16 mb + i, kb + e], +0 past the lane's end and for rows >= `rows`.
void pack_row_tiles(uint16_t* __restrict xa, const uint16_t* a, int64_t a_sm, int64_t rows, const Lanes& ln) {
  const int64_t Q = ln.q0[ln.n];
  for (int64_t mb = 0; mb * 16 < rows; ++mb) {
    const int valid = (int)std::min<int64_t>(16, rows - 16 * mb);
    for (int l = 0; l < ln.n; ++l) {
      int64_t q = ln.q0[l];
      for (int64_t kb = ln.k0[l]; kb < ln.k0[l + 1]; kb += kBlock, ++q)
        copy_row_tile(xa + (mb * Q + q) * 512, a + 16 * mb * a_sm, a_sm, valid, kb,
                      (int)std::min<int64_t>(kBlock, ln.k0[l + 1] - kb));
    }
  }
}

// Weight tile sources of one 16-row block: full blocks are read in place (row stride b_sn); a lane's partial last
// block, and every block of a block with fewer than 16 rows, from a zero-padded copy at stage[q] (q: the block's
// index over all lanes, as in the packed activations).
struct WeightBlock {
  const uint16_t* base;  // b + n * b_sn
  int64_t b_sn;
  int rows;              // valid rows (<= 16)
  uint16_t* stage;       // [Q][16][32]: the staged blocks, zero past `rows` and past the lane's end
  const uint16_t* tile(int64_t q, int64_t kb, bool partial) const {
    return partial || rows < 16 ? stage + q * 512 : base + kb;
  }
  int64_t stride(bool partial) const { return partial || rows < 16 ? 64 : b_sn * 2; }
};

// The 2 x 2 register tile both paths run: result tile 2 i + j (0..3) accumulates first-operand tile i (tile
// register 4 + i) times second-operand tile j (register 6 + j); kFirst, kSecond (1 or 2) of each are live.
template <int kFirst, int kSecond>
ALIGNED_AMX inline void zero_tiles() {
  _tile_zero(0);
  if (kSecond > 1) _tile_zero(1);
  if (kFirst > 1) _tile_zero(2);
  if (kFirst > 1 && kSecond > 1) _tile_zero(3);
}

// One block: the loads (row strides in bytes) and up to four tdpbf16ps. f1 is read only when kFirst > 1.
template <int kFirst, int kSecond>
ALIGNED_AMX inline void step_tiles(const void* f0, int64_t sf0, const void* f1, int64_t sf1, const void* s0,
                                   const void* s1) {
  _tile_loadd(4, f0, sf0);
  _tile_loadd(6, s0, 64);
  _tile_dpbf16ps(0, 4, 6);
  if (kSecond > 1) {
    _tile_loadd(7, s1, 64);
    _tile_dpbf16ps(1, 4, 7);
  }
  if (kFirst > 1) {
    _tile_loadd(5, f1, sf1);
    _tile_dpbf16ps(2, 5, 6);
    if (kSecond > 1) _tile_dpbf16ps(3, 5, 7);
  }
}

template <int kFirst, int kSecond>
ALIGNED_AMX inline void store_tiles(float* lt) {
  _tile_stored(0, lt, 64);
  if (kSecond > 1) _tile_stored(1, lt + kTileDwords, 64);
  if (kFirst > 1) _tile_stored(2, lt + 2 * kTileDwords, 64);
  if (kFirst > 1 && kSecond > 1) _tile_stored(3, lt + 3 * kTileDwords, 64);
}

// Lane sums of NBK weight-row blocks x MBK activation blocks over one lane: C'[n][m] tiles stored to
// lt[(i * kMB + j) * 256]. Tile numbers must be immediates: the block counts are template parameters.
template <int NBK, int MBK>
ALIGNED_AMX void lane_tiles(const WeightBlock* wb, const uint32_t* xq, int64_t Q, int64_t q0, int64_t k0,
                            int64_t k1, float* lt, bool prefetch) {
  zero_tiles<NBK, MBK>();
  int64_t q = q0;
  for (int64_t kb = k0; kb < k1; kb += kBlock, ++q) {
    const bool partial = k1 - kb < kBlock;
    // The weight rows two groups on, same k (a hint: past the matrix is harmless): decode streams the weight
    // from DRAM, 32 rows side by side in short pieces per lane, too many streams for the hardware prefetcher.
    // Only the first activation group asks (the others find the group's rows in L2).
    if (prefetch)
#pragma GCC unroll 16
      for (int r = 0; r < 16 * NBK; ++r)
        _mm_prefetch((const char*)(wb[0].base + (kPrefetchRows + r) * wb[0].b_sn + kb), _MM_HINT_T0);
    step_tiles<NBK, MBK>(wb[0].tile(q, kb, partial), wb[0].stride(partial),
                         NBK > 1 ? wb[1].tile(q, kb, partial) : nullptr, NBK > 1 ? wb[1].stride(partial) : 0,
                         xq + q * kTileDwords, xq + (Q + q) * kTileDwords);
  }
  store_tiles<NBK, MBK>(lt);
}

using LaneTilesFn = void (*)(const WeightBlock*, const uint32_t*, int64_t, int64_t, int64_t, int64_t, float*, bool);
constexpr LaneTilesFn kLaneTiles[2][2] = {{&lane_tiles<1, 1>, &lane_tiles<1, 2>}, {&lane_tiles<2, 1>, &lane_tiles<2, 2>}};

// Stage the weight tiles of one 16-row block that are not read in place (WeightBlock::tile).
void stage_weight_block(const WeightBlock& w, const Lanes& ln) {
  for (int l = 0; l < ln.n; ++l) {
    int64_t q = ln.q0[l];
    for (int64_t kb = ln.k0[l]; kb < ln.k0[l + 1]; kb += kBlock, ++q) {
      const int cnt = (int)std::min<int64_t>(kBlock, ln.k0[l + 1] - kb);
      if (cnt == kBlock && w.rows == 16) continue;
      copy_row_tile(w.stage + q * 512, w.base, w.b_sn, w.rows, kb, cnt);
    }
  }
}

// Fold the lane tiles of one (weight block i, activation block j) pair and store C[m][n] (+ bias, one rounding
// for bf16 C): per weight row r, the 16 rows' lane sums are folded by the contract's tree (element-wise, so the
// C' layout changes no bit), then transposed to rows of C.
template <typename TC>
void fold_store(const float* lt_all, int lanes, int tile, int64_t m_rows, int64_t n_cols, const TC* bias, TC* c,
                int64_t c_sm, int64_t n0) {
  __m512 f[16];
  for (int r = 0; r < 16; ++r) {
    V s[kLinearLanes];
    for (int l = 0; l < lanes; ++l) s[l] = V::load_aligned(lt_all + (l * kNB * kMB + tile) * kTileDwords + r * 16);
    f[r] = linear_lane_fold(s, lanes).v;
  }
  simd::transpose16(f);  // f[i] = activation row i's 16 weight-row results
  const int cnt = (int)std::min<int64_t>(16, n_cols);
  for (int i = 0; i < 16 && i < m_rows; ++i) {
    V acc(f[i]);
    if (bias) acc = acc + simd::load<V>(bias + n0, cnt);
    simd::store(c + i * c_sm + n0, acc, cnt);
  }
}

template <typename TC>
ALIGNED_AMX void gemm_typed(const uint16_t* a, int64_t a_sm, const uint16_t* b, int64_t b_sn, const TC* bias, TC* c,
                            int64_t c_sm, int64_t K, int lanes, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t rows = m1 - m0;
  if (rows <= 0 || n1 <= n0) return;
  const Lanes ln(K, lanes);
  const int64_t Q = ln.q0[lanes];
  const int64_t mblocks = (rows + 15) / 16;
  auto* xp = (uint32_t*)thread_buffer<0>((size_t)std::max<int64_t>(1, mblocks * Q) * kTileDwords * 4);
  pack_activations(xp, a + m0 * a_sm, a_sm, rows, ln);
  // staged weight tiles: at most every block of each weight block of a chunk
  auto* stage = (uint16_t*)thread_buffer<1>((size_t)std::max<int64_t>(1, kChunkGroups * kNB * Q) * 1024);
  constexpr int64_t kGroupFloats = (int64_t)kLinearLanes * kNB * kMB * kTileDwords;
  auto* lt = (float*)thread_buffer<2>(kChunkGroups * kGroupFloats * sizeof(float));  // (before the configuration)
  amx_config_full();
  // Per chunk of weight-row groups and activation group, the lanes run outermost: a lane's activation tiles
  // (2 x 16 rows x its k) stay in L1 while every group of the chunk streams its weight tiles past them (with the
  // groups outermost, both operands came from L2 at every step: measured 2x slower at M = 512).
  // (one activation group, i.e. decode: the groups outermost, each weight row streamed front to back once)
  const int chunk_groups = mblocks > kMB ? kChunkGroups : 1;
  for (int64_t nc = n0; nc < n1; nc += 16 * kNB * chunk_groups) {
    WeightBlock wb[kChunkGroups][kNB];
    int nbk[kChunkGroups] = {};
    int groups = 0;
    for (int g = 0; g < chunk_groups && nc + 16 * kNB * g < n1; ++g, ++groups) {
      const int64_t nb = nc + 16 * kNB * g;
      for (int i = 0; i < kNB && nb + 16 * i < n1; ++i, ++nbk[g]) {
        wb[g][i] = WeightBlock{b + (nb + 16 * i) * b_sn, b_sn, (int)std::min<int64_t>(16, n1 - nb - 16 * i),
                               stage + (g * kNB + i) * Q * 512};
        stage_weight_block(wb[g][i], ln);
      }
    }
    for (int64_t mb = 0; mb < mblocks; mb += kMB) {
      const int mbk = (int)std::min<int64_t>(kMB, mblocks - mb);
      for (int l = 0; l < lanes; ++l)
        for (int g = 0; g < groups; ++g)
          kLaneTiles[nbk[g] - 1][mbk - 1](wb[g], xp + mb * Q * kTileDwords, Q, ln.q0[l], ln.k0[l], ln.k0[l + 1],
                                          lt + g * kGroupFloats + l * kNB * kMB * kTileDwords, mb == 0);
      for (int g = 0; g < groups; ++g) {
        const int64_t nb = nc + 16 * kNB * g;
        for (int i = 0; i < nbk[g]; ++i)
          for (int j = 0; j < mbk; ++j)  // lane_tiles' tile of (weight block i, activation block j): 2 i + j
            fold_store(lt + g * kGroupFloats, lanes, i * 2 + j, rows - 16 * (mb + j), n1 - nb - 16 * i, bias,
                       c + (m0 + 16 * (mb + j)) * c_sm, c_sm, nb + 16 * i);
      }
    }
  }
  amx_release();
}

// ---- the packed-weight path ------------------------------------------------------------------------------------
// The weight packed once (linear_mma_pack_weight: the rollout engine's registered weights, cached across calls) is
// the instruction's SECOND operand, 1 KiB contiguous per (16-row block, block q) — one sequential stream, no
// staging —, and the activations are the FIRST operand (pack_row_tiles). Per element: the same 32 products onto
// the same accumulator, one instruction per block, as the in-place path with the roles swapped (the tests hold
// both to the reference, which uses these roles). C tiles are C[m][n]: the fold stores rows without a transpose.
template <int MBK, int NBK>
ALIGNED_AMX void lane_tiles_packed(const uint16_t* xa, const uint32_t* wp, int64_t Q, int64_t q0, int64_t q1,
                                   float* lt) {
  zero_tiles<MBK, NBK>();
  for (int64_t q = q0; q < q1; ++q)
    step_tiles<MBK, NBK>(xa + q * 512, 64, xa + (Q + q) * 512, 64, wp + q * kTileDwords, wp + (Q + q) * kTileDwords);
  store_tiles<MBK, NBK>(lt);
}

using LaneTilesPackedFn = void (*)(const uint16_t*, const uint32_t*, int64_t, int64_t, int64_t, float*);
constexpr LaneTilesPackedFn kLaneTilesPacked[2][2] = {{&lane_tiles_packed<1, 1>, &lane_tiles_packed<1, 2>},
                                                      {&lane_tiles_packed<2, 1>, &lane_tiles_packed<2, 2>}};

// Fold the lane tiles of one (activation block, weight block) tile, C[m][n] layout, and store its rows.
template <typename TC>
void fold_store_rows(const float* lt_all, int lanes, int tile, int64_t m_rows, int64_t n_cols, const TC* bias, TC* c,
                     int64_t c_sm, int64_t n0) {
  const int cnt = (int)std::min<int64_t>(16, n_cols);
  for (int i = 0; i < 16 && i < m_rows; ++i) {
    V s[kLinearLanes];
    for (int l = 0; l < lanes; ++l) s[l] = V::load_aligned(lt_all + (l * kNB * kMB + tile) * kTileDwords + i * 16);
    V acc = linear_lane_fold(s, lanes);
    if (bias) acc = acc + simd::load<V>(bias + n0, cnt);
    simd::store(c + i * c_sm + n0, acc, cnt);
  }
}

constexpr int64_t kPackedGroupFloats = (int64_t)kLinearLanes * kNB * kMB * kTileDwords;  // one group's lane tiles

template <typename TC>
ALIGNED_AMX void gemm_packed_typed(const uint16_t* a, int64_t a_sm, const uint32_t* wp, const TC* bias, TC* c,
                                   int64_t c_sm, int64_t K, int64_t N, int64_t m0, int64_t m1, int64_t n0,
                                   int64_t n1) {
  const int64_t rows = m1 - m0;
  if (rows <= 0 || n1 <= n0) return;
  if (n0 % 16) abort();  // run_gemm_tiles hands out whole 32-column panels
  const Lanes ln(K, kLinearLanes);
  const int64_t Q = ln.q0[kLinearLanes];
  const int64_t mblocks = (rows + 15) / 16;
  auto* xa = (uint16_t*)thread_buffer<0>((size_t)std::max<int64_t>(1, mblocks * Q) * 1024);
  pack_row_tiles(xa, a + m0 * a_sm, a_sm, rows, ln);
  const int chunk_groups = mblocks > kMB ? kChunkGroups : 1;  // as gemm_typed
  // Every buffer is fetched BEFORE the tile configuration is loaded: nothing between ldtilecfg and the tile
  // instructions may call out of this file (a lazily bound symbol's first call goes through the dynamic linker).
  auto* lt = (float*)thread_buffer<2>(kChunkGroups * kPackedGroupFloats * sizeof(float));
  amx_config_full();
  // (Folding one activation group's tiles interleaved with the next group's instructions, so the vector units
  // would work beside the AMX unit, measured no faster at M = 256 and 512: not done.)
  for (int64_t nc = n0; nc < n1; nc += 16 * kNB * chunk_groups) {
    int nbk[kChunkGroups] = {};
    int groups = 0;
    for (int g = 0; g < chunk_groups && nc + 16 * kNB * g < n1; ++g, ++groups)
      nbk[g] = (int)std::min<int64_t>(kNB, (n1 - (nc + 16 * kNB * g) + 15) / 16);
    for (int64_t mb = 0; mb < mblocks; mb += kMB) {
      const int mbk = (int)std::min<int64_t>(kMB, mblocks - mb);
      for (int l = 0; l < kLinearLanes; ++l)
        for (int g = 0; g < groups; ++g)
          kLaneTilesPacked[mbk - 1][nbk[g] - 1](xa + mb * Q * 512, wp + (nc / 16 + kNB * g) * Q * kTileDwords, Q,
                                                ln.q0[l], ln.q0[l + 1],
                                                lt + g * kPackedGroupFloats + l * kNB * kMB * kTileDwords);
      for (int g = 0; g < groups; ++g) {
        const int64_t nb = nc + 16 * kNB * g;
        for (int i = 0; i < mbk; ++i)
          for (int j = 0; j < nbk[g]; ++j)  // lane_tiles_packed's tile of (activation block i, weight block j)
            fold_store_rows(lt + g * kPackedGroupFloats, kLinearLanes, i * 2 + j, rows - 16 * (mb + i),
                            n1 - nb - 16 * j, bias, c + (m0 + 16 * (mb + i)) * c_sm, c_sm, nb + 16 * j);
      }
    }
  }
  amx_release();
}

// Weight rows [16 nb0, 16 nb1) of w [N, K] in the packed layout (mma_kernels.h pack_weight).
void pack_weight(const uint16_t* w, int64_t w_sn, int64_t N, int64_t K, int64_t nb0, int64_t nb1, void* out) {
  pack_pairs((uint32_t*)out, w, w_sn, N, Lanes(K, kLinearLanes), nb0, nb1);
}

// C = the mma profile's GEMM (mma_kernels.h) for rows [m0, m1) x columns [n0, n1).
void gemm(const GemmParams& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  // The glue makes only these here: bf16 operands, A and B with unit k-stride (cpu_mma.cpp copies a column-major
  // B to row-major for this unit), bf16 or fp32 C.
  if (p.adt != DType::BF16 || p.bdt != DType::BF16 || (p.K > 1 && (p.a_sk != 1 || p.b_sk != 1)) ||
      (p.cdt != DType::BF16 && p.cdt != DType::F32) || (p.cdt == DType::F32 && p.bias))
    abort();
  // Row chunks of kRowChunk: the per-thread activation buffers stay bounded (a thread may be handed every row:
  // run_gemm_tiles gives mchunk = M when there are enough column panels); rows are independent, so no bit moves.
  if (m1 - m0 > kRowChunk) {
    for (int64_t m = m0; m < m1; m += kRowChunk) gemm(p, m, std::min(m1, m + kRowChunk), n0, n1);
    return;
  }
  const auto* A = (const uint16_t*)p.A;
  const auto* B = (const uint16_t*)p.B;
  if (p.B_packed) {
    if (p.lanes != kLinearLanes) abort();  // packed for the linear's 8 lanes only
    const auto* wp = (const uint32_t*)p.B_packed;
    if (p.cdt == DType::BF16)
      gemm_packed_typed<bf16_t>(A, p.a_sm, wp, (const bf16_t*)p.bias, (bf16_t*)p.C, p.c_sm, p.K, p.N, m0, m1, n0, n1);
    else
      gemm_packed_typed<float>(A, p.a_sm, wp, nullptr, (float*)p.C, p.c_sm, p.K, p.N, m0, m1, n0, n1);
    return;
  }
  if (p.cdt == DType::BF16)
    gemm_typed<bf16_t>(A, p.a_sm, B, p.b_sn, (const bf16_t*)p.bias, (bf16_t*)p.C, p.c_sm, p.K, p.lanes, m0, m1, n0,
                       n1);
  else
    gemm_typed<float>(A, p.a_sm, B, p.b_sn, nullptr, (float*)p.C, p.c_sm, p.K, p.lanes, m0, m1, n0, n1);
}

// ---- the reference: one element per instruction ----------------------------------------------------------------
// 1 x 1 result tiles, the activation row as the FIRST operand and the weight column's pairs as the SECOND (the
// kernel's roles swapped), each block copied into zero-padded buffers. It shares with gemm() only the unit and the
// contract's order; equality to it is what the tests hold the kernel to (the unit's arithmetic has no model).
ALIGNED_AMX void reference_rows(const GemmParams& p, int64_t m0, int64_t m1) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  cfg.rows[0] = 1, cfg.colsb[0] = 4;   // C: 1 x 1 fp32
  cfg.rows[1] = 1, cfg.colsb[1] = 64;  // A: one row of 32 bf16
  cfg.rows[2] = 16, cfg.colsb[2] = 4;  // B: 16 pairs x 1 column
  asm volatile("" : : "r"(&cfg) : "memory");  // see amx_config_full
  _tile_loadconfig(&cfg);
  const auto* X = (const uint16_t*)p.A;
  const auto* W = (const uint16_t*)p.B;
  float* O = (float*)p.C;
  alignas(64) uint16_t xa[32];
  alignas(64) uint16_t wpair[32];
  alignas(64) float acc[16];
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t n = 0; n < p.N; ++n) {
      float s[kLinearLanes];
      for (int l = 0; l < p.lanes; ++l) {
        const int64_t k0 = linear_lane_begin(l, p.K, p.lanes), k1 = linear_lane_begin(l + 1, p.K, p.lanes);
        _tile_zero(0);
        for (int64_t kb = k0; kb < k1; kb += kBlock) {
          for (int e = 0; e < 32; ++e) {
            const int64_t k = kb + e;
            xa[e] = k < k1 ? X[m * p.a_sm + k * p.a_sk] : (uint16_t)0;
            wpair[e] = k < k1 ? W[n * p.b_sn + k * p.b_sk] : (uint16_t)0;  // pair e/2, half e%2
          }
          _tile_loadd(1, xa, 64);
          _tile_loadd(2, wpair, 4);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, acc, 4);
        s[l] = acc[0];
      }
      O[m * p.N + n] = linear_lane_fold(s, p.lanes);
    }
  _tile_release();
}

}  // namespace

extern const MmaKernels kMmaAmx;
const MmaKernels kMmaAmx = {
    .unit = "amx_bf16",
    .unit_id = MmaUnit::kAmxBf16,
    .gemm = &gemm,
    .reference = &reference_rows,
    .row_major_b = true,
    .pack_weight = &pack_weight,
};

}  // namespace aligned::cpu::ALIGNED_ISA
