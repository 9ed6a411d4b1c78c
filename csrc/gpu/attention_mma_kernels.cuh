// attention_mma_kernels.cuh — the forward of attention under the `mma` profile (csrc/common/attention_mma.h) on
// the bf16 matrix instruction (bf16_mma.cuh: CUDA mma.sync m16n8k16, HIP v_mfma_f32_16x16x16_bf16), one source
// for both vendors and the emulation target. The split merge is attention_kernels.cuh's attention_merge_kernel
// (attention.h step 4, unchanged), reading the partials this kernel writes in the same layout.
//
// FA2 structure over the plan's work items (attention_plan.h: one item = (sequence, KV head, row block of <= 16
// rows, KV split of 512 keys), so prefill, chunked prefill, prefix hits and decode are one kernel):
//   * a block is kAttnMmaWarps warps (CUDA) / waves (HIP); the item's (row, head) pairs (nr rows x the G query
//     heads of the KV head: decode packs the GQA group into the rows) are taken 16 at a time, one group of 16 per
//     warp — the 16 rows of its instructions;
//   * per 32-key tile of the split: S = Q K^T, one instruction per (8 or 16 keys, 16-block of head_dim), the
//     d-blocks ascending from C = +0 (attn_mma_dot); the scaled scores go to the warp's shared S; lane i < 16 runs
//     row i's online-softmax step with attention.h's pieces (m, l in its registers) and writes the row's bf16 P
//     and alpha; then PV, one instruction per (8 or 16 columns of head_dim, key-block), 2 key-blocks from C = +0,
//     and acc = fma(acc, alpha, pv) in the C fragments. Rows whose nv differ (the causal diagonal) get one PV pass
//     per distinct nv with V cut at it, each row keeping its own (attention_mma.h "what a masked key
//     contributes");
//   * the split's state (m, l, acc) goes to the plan's partial slot; no atomics, no order but the contract's.
// Operands are read element-wise from global memory in the fragment layouts (correct first: no staging of K/V
// tiles in shared memory, no ldmatrix / cp.async pipelining yet — its speed on a GPU is unmeasured).
#pragma once

#include "compat.cuh"  // first: the vendor runtime header before numerics.h (ALIGNED_HD)

#include "../common/attention_mma.h"
#include "attention_api.h"
#include "bf16_mma.cuh"

namespace aligned::gpu::ALIGNED_GPU_BUILD {

constexpr int kAttnMmaWarps = 4;                                    // warps (waves) per block
constexpr int kAttnMmaRows = 16;                                    // (row, head) pairs per warp: the MMA's M
constexpr int kAttnMmaThreads = kAttnMmaWarps * kBf16MmaWarpLanes;  // 128 (CUDA), 256 (HIP)
constexpr int kAttnMmaSInstr = kAttnTile / kBf16MmaTileN;           // S instructions per tile and d-block
constexpr int kAttnMmaDInstr = (int)(kGpuAttnMaxD / kBf16MmaTileN);  // PV column instructions at most
constexpr int64_t kAttnMmaMaxD = kGpuAttnMaxD;                      // the largest head_dim of this kernel

// Negative controls (tests only; the emulated launcher builds them on request, emulation.h Fault), 0 everywhere
// else: 1 = the score's d-blocks in descending order for items of sequences with more than one new row (an order
// that depends on prefill vs decode), and in the backward dk / dv's pair-blocks in descending order;
// 2 = FlashAttention's shared operand: ONE pass per tile with the operand cut at the group's longest row — the
// forward's PV with V (a row multiplies its masked keys' values by P = +0: attention_mma.h says why that is not
// neutral on the unit), the backward's dq with K (dS = +0 times a masked key) and dk / dv with q and dO (dS / P =
// +0 times a pair that does not see the key); 3 = dk / dv's pair-blocks counted from the batch's global (row,
// head) pair index (offset q_begin * G mod 16) instead of the sequence's own: a sequence's gradients then depend
// on the rows before it in the batch. The invariance tests must catch each.
enum AttnMmaControl : int {
  kAttnMmaControlNone = 0,
  kAttnMmaControlReverseDByQLen = 1,
  kAttnMmaControlSharedV = 2,
  kAttnMmaControlPairBlocksGlobal = 3,
};

// The warp's shared scratch: the tile's scaled scores, its bf16 P, each row's alpha and nv, and whether each row
// is active in the split.
struct AttnMmaWarpScratch {
  float s[kAttnMmaRows][kAttnTile];
  bf16_t p[kAttnMmaRows][kAttnTile];
  float alpha[kAttnMmaRows];
  int nv[kAttnMmaRows];
  int active[kAttnMmaRows];
};

__device__ __forceinline__ uint16_t attn_mma_bits(const bf16_t* base, int64_t i, bool ok) {
  return ok ? base[i].bits : (uint16_t)0;
}

// The head_dim bucket of a launch (attention_launch.cuh): the C fragments of acc a lane holds, kDInstr instructions
// of kBf16MmaTileN columns — registers only, never a bit (every bucket runs the same chains on the same operands).
constexpr int kAttnMmaDInstr64 = 64 / kBf16MmaTileN;    // head_dim <= 64
constexpr int kAttnMmaDInstr128 = 128 / kBf16MmaTileN;  // head_dim <= 128
__host__ __device__ inline int attn_mma_d_instr(int64_t D) {
  const int64_t need = (D + kBf16MmaTileN - 1) / kBf16MmaTileN;
  return need <= kAttnMmaDInstr64 ? kAttnMmaDInstr64 : need <= kAttnMmaDInstr128 ? kAttnMmaDInstr128 : kAttnMmaDInstr;
}
// The backward dk/dv kernel's slices: at most kAttnMmaDInstr128 instructions of columns per block.
inline int64_t attn_mma_dkdv_slices(int64_t D) {
  const int64_t per_slice = (int64_t)kAttnMmaDInstr128 * kBf16MmaTileN;
  return (D + per_slice - 1) / per_slice;
}

template <typename T, int kDInstr = kAttnMmaDInstr>
__global__ void __launch_bounds__(kAttnMmaThreads) attention_mma_split_kernel(AttnFwdParams p, int control) {
  static_assert(sizeof(T) == sizeof(bf16_t), "the mma profile's attention takes bfloat16");
  __shared__ AttnMmaWarpScratch scratch[kAttnMmaWarps];
  if (!attn_plan_fits(p) || (int64_t)blockIdx.x >= p.plan_header[kPnItems]) return;  // uniform over the block
  const int64_t* w = p.items + (int64_t)blockIdx.x * kAttnWorkFields;
  const int64_t D = p.D, G = p.Hq / p.Hkv, P = w[kWnr] * G, sp = w[kWsplit], ns = w[kWnSplits], g = w[kWg];
  const int64_t key0 = sp * kAttnSplit, stride = D + 2;
  const KvRows kv = work_kv_rows(p, w);
  const bf16_t* Q = (const bf16_t*)p.q;
  const bf16_t* K = (const bf16_t*)p.k;
  const bf16_t* V = (const bf16_t*)p.v;
  const int lane = (int)(threadIdx.x % kBf16MmaWarpLanes), warp = (int)(threadIdx.x / kBf16MmaWarpLanes);
  AttnMmaWarpScratch& sc = scratch[warp];
  const int64_t d_blocks = (D + kMmaGpuKBlock - 1) / kMmaGpuKBlock;
  const bool reverse_d = control == kAttnMmaControlReverseDByQLen && w[kWqLen] > 1;
  // the q row (element offset) of the group's pair i, or -1 past the item's pairs
  const auto q_row = [&](int64_t pr) -> int64_t {
    if (pr >= P) return -1;
    return ((w[kWqBegin] + w[kWr0] + pr / G) * p.Hq + g * G + pr % G) * D;
  };
  for (int64_t grp = warp; grp * kAttnMmaRows < P; grp += kAttnMmaWarps) {  // uniform over the warp
    const int64_t pr0 = grp * kAttnMmaRows;
    // the group's keys in this split: up to its longest row (every lane computes the same)
    int64_t nk_max = 0;
    for (int i = 0; i < kAttnMmaRows && pr0 + i < P; ++i) {
      const int64_t n = work_row_keys(p, w, (pr0 + i) / G);
      nk_max = n > nk_max ? n : nk_max;
    }
    const int64_t key_end = nk_max < key0 + kAttnSplit ? nk_max : key0 + kAttnSplit;
    if (key_end <= key0) continue;  // no row of the group sees this split (uniform)
    // lane i < 16: row i's softmax state
    const int64_t nk_i = lane < kAttnMmaRows && pr0 + lane < P ? work_row_keys(p, w, (pr0 + lane) / G) : 0;
    float m = neg_inf_f32(), l = 0.0f;
    if (lane < kAttnMmaRows) sc.active[lane] = nk_i > key0;
    float acc[kDInstr][4];
#pragma unroll
    for (int n = 0; n < kDInstr; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[n][r] = 0.0f;
    for (int64_t j0 = key0; j0 < key_end; j0 += kAttnTile) {
      // S = Q K^T for the tile (keys past key_end load +0: their scores are never read)
      float sf[kAttnMmaSInstr][4];
#pragma unroll
      for (int n = 0; n < kAttnMmaSInstr; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) sf[n][r] = 0.0f;
      for (int64_t b = 0; b < d_blocks; ++b) {
        const int64_t d0 = (reverse_d ? d_blocks - 1 - b : b) * kMmaGpuKBlock;
        const auto a_at = [&](int row, int k) -> uint16_t {
          const int64_t qr = q_row(pr0 + row), d = d0 + k;
          return attn_mma_bits(Q, qr + d, qr >= 0 && d < D);
        };
#pragma unroll
        for (int n = 0; n < kAttnMmaSInstr; ++n) {
          const auto b_at = [&](int k, int col) -> uint16_t {  // B[d][key] = K[key][d]
            const int64_t j = j0 + n * kBf16MmaTileN + col, d = d0 + k;
            return j < key_end && d < D ? K[kv.offset(j, g) + d].bits : (uint16_t)0;
          };
          bf16_mma_step(sf[n], a_at, b_at);
        }
      }
#pragma unroll
      for (int n = 0; n < kAttnMmaSInstr; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          int row, col;
          bf16_mma_c_coords(r, row, col);
          sc.s[row][n * kBf16MmaTileN + col] = sf[n][r] * p.scale;
        }
      warp_sync();
      // the online-softmax step of row `lane` (attention.h step 3 pieces; attention_mma.h step 3')
      if (lane < kAttnMmaRows) {
        const int64_t left = nk_i - j0;
        const int nv = left <= 0 ? 0 : (left < kAttnTile ? (int)left : kAttnTile);
        sc.nv[lane] = nv;
        if (nv > 0) {
          const float m_new = attn_tile_max(sc.s[lane], nv, m);
          const float mu = attn_shift(m_new);
          const float alpha = exp_f32(m - mu);
          float pf[kAttnTile];
          for (int j = 0; j < kAttnTile; ++j) {
            pf[j] = attn_tile_prob(sc.s[lane][j], j, nv, mu);
            sc.p[lane][j] = attn_mma_prob(pf[j]);
          }
          l = attn_tile_l(l, alpha, fold_lanes(pf));
          sc.alpha[lane] = alpha;
          m = m_new;
        } else {
          for (int j = 0; j < kAttnTile; ++j) sc.p[lane][j].bits = 0;
        }
      }
      warp_sync();
      // PV: one pass per distinct nv of the group's rows (in row order), V cut at that nv; a row keeps its own
      int nv_max = 0;  // (the shared-V negative control's one pass)
      for (int r1 = 0; r1 < kAttnMmaRows; ++r1) nv_max = sc.nv[r1] > nv_max ? sc.nv[r1] : nv_max;
      const bool shared_v = control == kAttnMmaControlSharedV;
      for (int r0 = 0; r0 < kAttnMmaRows; ++r0) {  // uniform over the warp
        const int nvp = shared_v ? nv_max : sc.nv[r0];
        bool seen = nvp <= 0 || (shared_v && r0 > 0);
        for (int r1 = 0; r1 < r0 && !seen; ++r1) seen = sc.nv[r1] == nvp;
        if (seen) continue;
        const auto a_pv = [&](int kb) {
          return [&, kb](int row, int k) -> uint16_t {
            const int j = kb * kMmaGpuKBlock + k;
            return j < nvp ? sc.p[row][j].bits : (uint16_t)0;
          };
        };
#pragma unroll
        for (int n = 0; n < kDInstr; ++n) {
          const int64_t c0 = (int64_t)n * kBf16MmaTileN;
          if (c0 >= D) break;
          float pv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          for (int kb = 0; kb < kAttnMmaKeyBlocks; ++kb) {
            const auto b_at = [&](int k, int col) -> uint16_t {  // B[key][d] = V[key][d], keys >= nvp as +0
              const int j = kb * kMmaGpuKBlock + k;
              const int64_t d = c0 + col;
              return j < nvp && d < D ? V[kv.offset(j0 + j, g) + d].bits : (uint16_t)0;
            };
            bf16_mma_step(pv, a_pv(kb), b_at);
          }
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            int row, col;
            bf16_mma_c_coords(r, row, col);
            if (shared_v ? sc.nv[row] > 0 : sc.nv[row] == nvp)
              acc[n][r] = attn_acc_step(acc[n][r], sc.alpha[row], pv[r]);
          }
        }
      }
      warp_sync();  // the next tile overwrites the scratch
    }
    // the split's partials of the group's active rows
    if (lane < kAttnMmaRows && sc.active[lane]) {
      float* st = p.part + w[kWpartOffset] + ((pr0 + lane) * ns + sp) * stride;
      st[0] = m;
      st[1] = l;
    }
#pragma unroll
    for (int n = 0; n < kDInstr; ++n) {
      const int64_t c0 = (int64_t)n * kBf16MmaTileN;
      if (c0 >= D) break;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        int row, col;
        bf16_mma_c_coords(r, row, col);
        if (pr0 + row >= P || !sc.active[row] || c0 + col >= D) continue;
        p.part[w[kWpartOffset] + ((pr0 + row) * ns + sp) * stride + 2 + c0 + col] = acc[n][r];
      }
    }
    warp_sync();  // the next group overwrites `active`
  }
}

// ---- backward (attention_mma.h "backward"; packed K/V) ---------------------------------------------------------
// delta: attention_kernels.cuh's attention_bwd_delta_kernel (an fma chain). Then two kernels, both on the unit:
//   attention_mma_bwd_dq_kernel    one plan row block per block, a warp per group of 16 (row, head) pairs: per
//                                  32-key tile S and dP (= dO V^T) as the forward's S, then p, ds per pair (lane i),
//                                  then dq's chain over the tile's 2 key-blocks carried in C, one pass per distinct
//                                  nv of the block's rows (keys >= nv as +0 in both operands);
//   attention_mma_bwd_dkdv_kernel  one plan key tile (32 keys) per block, a warp per 16 keys: per block of 16 pairs
//                                  (ascending) S and dP with the pairs as the A rows (as in the forward: the operands
//                                  are never swapped), P and dS per pair, then dk += dS^T q and dv += P^T dO with
//                                  the keys as the rows, one pass per distinct mask of the pairs a key sees; a key
//                                  no pair of the block sees skips the block.
//                                  Above 128 columns the columns are split over gridDim.y slices of 128 (each
//                                  slice recomputes the blocks' S and dP and runs its own columns' chains, the same
//                                  bits): dk and dv of 256 columns in one block (2 x 32 x 4 accumulators per lane)
//                                  spilled ~1.1 KB per thread on sm_80/90 (ptxas -v); 128 per slice do not.
// Each accumulator is one chain of the contract whatever the grid; no atomics.
constexpr int kAttnMmaBwdKeyWarps = kAttnTile / kAttnMmaRows;  // dkdv: warps per key tile (16 keys each)
constexpr int kAttnMmaBwdKeyThreads = kAttnMmaBwdKeyWarps * kBf16MmaWarpLanes;
constexpr int kAttnMmaKInstr16 = kAttnMmaRows / kBf16MmaTileN;  // instructions over 16 keys: 2 (CUDA), 1 (HIP)

struct AttnMmaBwdScratch {
  float s[kAttnMmaRows][kAttnTile];
  float dp[kAttnMmaRows][kAttnTile];
  bf16_t p[kAttnMmaRows][kAttnTile];
  bf16_t ds[kAttnMmaRows][kAttnTile];
  int nk[kAttnMmaRows];
  uint32_t mask[kAttnMmaRows];
};

// c[n] = the unit's chain over head_dim of A (16 rows: a_row(i) -> element offset or -1) and B = the rows b_row(c)
// of X (n-th group of kBf16MmaTileN columns: b_row(col) -> offset or -1), from +0: S = Q K^T and dP = dO V^T.
template <int kN, class ARow, class BRow>
__device__ __forceinline__ void attn_mma_head_dim_products(const bf16_t* A, const bf16_t* B, int64_t D,
                                                           const ARow& a_row, const BRow& b_row,
                                                           float (&c)[kN][4]) {
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) c[n][r] = 0.0f;
  const int64_t d_blocks = (D + kMmaGpuKBlock - 1) / kMmaGpuKBlock;
  for (int64_t b = 0; b < d_blocks; ++b) {
    const int64_t d0 = b * kMmaGpuKBlock;
    const auto a_at = [&](int row, int k) -> uint16_t {
      const int64_t o = a_row(row), d = d0 + k;
      return o >= 0 && d < D ? A[o + d].bits : (uint16_t)0;
    };
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      const auto b_at = [&](int k, int col) -> uint16_t {
        const int64_t o = b_row(n * kBf16MmaTileN + col), d = d0 + k;
        return o >= 0 && d < D ? B[o + d].bits : (uint16_t)0;
      };
      bf16_mma_step(c[n], a_at, b_at);
    }
  }
}

template <int kDInstr = kAttnMmaDInstr>
__global__ void __launch_bounds__(kAttnMmaThreads) attention_mma_bwd_dq_kernel(AttnBwdParams p, int control) {
  __shared__ AttnMmaBwdScratch scratch[kAttnMmaWarps];
  // The group's key count per pair and the tile's key row offsets, computed once per group / tile and read by the dq
  // passes (the key counts by the narrower buckets only: see nv_of): recomputed there (work_row_keys, kv.offset:
  // 64-bit divisions behind branches, which the compiler does not hoist) per column instruction and pass, CUDA's
  // head_dim <= 128 bucket (kDInstr = 16) spilled 240 B per thread on sm_90, 276 B on sm_80, 152 B on sm_100 (ptxas
  // -v); with the tables 208-222 registers, no spill, 2 blocks of 128 threads per SM instead of 3 (speed
  // unmeasured). Integer values only: the same operands, the same bits.
  __shared__ int64_t pair_keys[kAttnMmaWarps][kAttnMmaRows], tile_key_off[kAttnMmaWarps][kAttnTile];
  const AttnFwdParams& f = p.f;
  const int64_t* w = f.blocks + (int64_t)blockIdx.x * kAttnWorkFields;
  const int64_t D = f.D, G = f.Hq / f.Hkv, P = w[kWnr] * G, g = w[kWg];
  const KvRows kv = work_kv_rows(f, w);
  const bf16_t* Q = (const bf16_t*)f.q;
  const bf16_t* K = (const bf16_t*)f.k;
  const bf16_t* V = (const bf16_t*)f.v;
  const bf16_t* dO = (const bf16_t*)p.dout;
  const int lane = (int)(threadIdx.x % kBf16MmaWarpLanes), warp = (int)(threadIdx.x / kBf16MmaWarpLanes);
  AttnMmaBwdScratch& sc = scratch[warp];
  for (int64_t grp = warp; grp * kAttnMmaRows < P; grp += kAttnMmaWarps) {  // uniform over the warp
    const int64_t pr0 = grp * kAttnMmaRows;
    const auto row_of = [&](int64_t i) -> int64_t {  // (row, head) index of the group's pair i, or -1
      const int64_t pr = pr0 + i;
      return pr < P ? (w[kWqBegin] + w[kWr0] + pr / G) * f.Hq + g * G + pr % G : -1;
    };
    const auto a_off = [&](int i) -> int64_t { const int64_t r = row_of(i); return r < 0 ? -1 : r * D; };
    int64_t nk_max = 0;
    for (int i = 0; i < kAttnMmaRows && pr0 + i < P; ++i) {
      const int64_t n = work_row_keys(f, w, (pr0 + i) / G);
      nk_max = n > nk_max ? n : nk_max;
    }
    const int64_t ri = lane < kAttnMmaRows ? row_of(lane) : -1;
    const int64_t nk_i = ri >= 0 ? work_row_keys(f, w, (pr0 + lane) / G) : 0;
    const float lse_i = ri >= 0 ? p.lse[ri] : 0.0f, delta_i = ri >= 0 ? p.delta[ri] : 0.0f;
    // 0 past P (read after the first tile's warp_sync); the widest bucket reads the keys per row instead (below)
    if (kDInstr < kAttnMmaDInstr && lane < kAttnMmaRows) pair_keys[warp][lane] = nk_i;
    float acc[kDInstr][4];
#pragma unroll
    for (int n = 0; n < kDInstr; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[n][r] = 0.0f;
    for (int64_t j0 = 0; j0 < nk_max; j0 += kAttnTile) {
      const auto key_off = [&](int c) -> int64_t {
        const int64_t j = j0 + c;
        return j < nk_max ? kv.offset(j, g) : -1;
      };
      // (the previous tile's and group's readers of the tables are past the tile's closing warp_sync)
      if (lane < kAttnTile) tile_key_off[warp][lane] = key_off(lane);
      warp_sync();
      float sf[kAttnMmaSInstr][4], df[kAttnMmaSInstr][4];
      attn_mma_head_dim_products<kAttnMmaSInstr>(Q, K, D, a_off, key_off, sf);
      attn_mma_head_dim_products<kAttnMmaSInstr>(dO, V, D, a_off, key_off, df);
#pragma unroll
      for (int n = 0; n < kAttnMmaSInstr; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          int row, col;
          bf16_mma_c_coords(r, row, col);
          sc.s[row][n * kBf16MmaTileN + col] = sf[n][r] * f.scale;
          sc.dp[row][n * kBf16MmaTileN + col] = df[n][r];
        }
      warp_sync();
      if (lane < kAttnMmaRows) {
        for (int c = 0; c < kAttnTile; ++c) {
          float ds = 0.0f;
          if (j0 + c < nk_i) ds = attn_bwd_ds(attn_bwd_prob(sc.s[lane][c], lse_i), sc.dp[lane][c], delta_i);
          sc.ds[lane][c] = j0 + c < nk_i ? attn_mma_prob(ds) : bf16_t{0};
        }
      }
      warp_sync();
      for (int kb = 0; kb < kAttnMmaKeyBlocks; ++kb) {
        const int64_t k0 = j0 + kb * kMmaGpuKBlock;
        const auto nv_of = [&](int i) -> int {
          // (the widest bucket counts the keys here, the same value: with the table its 255 registers spilled more,
          // 68 / 144 B of stores / loads on sm_80/90 instead of 48 / 32)
          const int64_t ii = pr0 + i;
          const int64_t nk = kDInstr < kAttnMmaDInstr ? pair_keys[warp][i] : ii < P ? work_row_keys(f, w, ii / G) : 0;
          const int64_t n = nk - k0;  // (a pair past P: 0 keys, n <= 0)
          return n <= 0 ? 0 : (n < kMmaGpuKBlock ? (int)n : kMmaGpuKBlock);
        };
        int nv_max = 0;  // (the shared-operand negative control's one pass)
        for (int r1 = 0; r1 < kAttnMmaRows; ++r1) nv_max = nv_of(r1) > nv_max ? nv_of(r1) : nv_max;
        const bool shared_k = control == kAttnMmaControlSharedV;
        for (int r0 = 0; r0 < kAttnMmaRows; ++r0) {  // one pass per distinct nv of the block (uniform)
          const int nvp = shared_k ? nv_max : nv_of(r0);
          bool seen = nvp <= 0 || (shared_k && r0 > 0);
          for (int r1 = 0; r1 < r0 && !seen; ++r1) seen = nv_of(r1) == nvp;
          if (seen) continue;
          const auto a_at = [&](int row, int k) -> uint16_t {
            return k < nvp ? sc.ds[row][kb * kMmaGpuKBlock + k].bits : (uint16_t)0;
          };
#pragma unroll
          for (int n = 0; n < kDInstr; ++n) {
            const int64_t c0 = (int64_t)n * kBf16MmaTileN;
            if (c0 >= D) break;
            const auto b_at = [&](int k, int col) -> uint16_t {  // B[key][d] = K[key][d], keys >= nvp as +0
              const int64_t d = c0 + col;
              return k < nvp && d < D ? K[tile_key_off[warp][kb * kMmaGpuKBlock + k] + d].bits : (uint16_t)0;
            };
            float t[4] = {acc[n][0], acc[n][1], acc[n][2], acc[n][3]};
            bf16_mma_step(t, a_at, b_at);
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              int row, col;
              bf16_mma_c_coords(r, row, col);
              if (shared_k ? nv_of(row) > 0 : nv_of(row) == nvp) acc[n][r] = t[r];
            }
          }
        }
      }
      warp_sync();  // the next tile overwrites the scratch
    }
#pragma unroll
    for (int n = 0; n < kDInstr; ++n) {
      const int64_t c0 = (int64_t)n * kBf16MmaTileN;
      if (c0 >= D) break;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        int row, col;
        bf16_mma_c_coords(r, row, col);
        const int64_t rr = row_of(row);
        if (rr >= 0 && c0 + col < D) ((bf16_t*)p.dq)[rr * D + c0 + col] = from_f32<bf16_t>(acc[n][r] * f.scale);
      }
    }
  }
}

// kColumnSlices: gridDim.y slices of kDInstr instructions of columns (D > 128); false: one block holds every column
// (no slice offset to keep live: the D <= 128 instances keep their registers).
template <int kDInstr = kAttnMmaDInstr, bool kColumnSlices = false>
__global__ void __launch_bounds__(kAttnMmaBwdKeyThreads) attention_mma_bwd_dkdv_kernel(AttnBwdParams p, int control) {
  __shared__ AttnMmaBwdScratch scratch[kAttnMmaBwdKeyWarps];
  const AttnFwdParams& f = p.f;
  const int64_t* w = p.tiles + (int64_t)blockIdx.x * kAttnWorkFields;
  const int64_t D = f.D, G = f.Hq / f.Hkv, g = w[kWg], q_len = w[kWqLen], n_ctx = w[kWnCtx], P = q_len * G;
  const KvRows kv = work_kv_rows(f, w);
  const bf16_t* Q = (const bf16_t*)f.q;
  const bf16_t* K = (const bf16_t*)f.k;
  const bf16_t* V = (const bf16_t*)f.v;
  const bf16_t* dO = (const bf16_t*)p.dout;
  const int lane = (int)(threadIdx.x % kBf16MmaWarpLanes), warp = (int)(threadIdx.x / kBf16MmaWarpLanes);
  AttnMmaBwdScratch& sc = scratch[warp];
  // this slice's first head_dim column (gridDim.y slices of kDInstr instructions: attn_mma_dkdv_slices)
  const int64_t d_slice0 = kColumnSlices ? (int64_t)blockIdx.y * kDInstr * kBf16MmaTileN : 0;
  const int64_t kw0 = w[kWsplit] * kAttnTile + warp * kAttnMmaRows;  // the warp's first key
  if (kw0 >= n_ctx) return;  // uniform over the warp (no barrier below spans warps)
  const int64_t n_keys = n_ctx - kw0 < kAttnMmaRows ? n_ctx - kw0 : kAttnMmaRows;
  const auto pair_row = [&](int64_t e) { return (w[kWqBegin] + e / G) * f.Hq + g * G + e % G; };
  const auto pair_keys = [&](int64_t e) { return attn_row_keys(n_ctx - q_len + e / G, n_ctx, f.causal); };
  float ak[kDInstr][4], av[kDInstr][4];
#pragma unroll
  for (int n = 0; n < kDInstr; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) ak[n][r] = av[n][r] = 0.0f;
  // (negative control 3: the blocks start at the batch's global pair index, shifted by q_begin * G mod 16)
  const int64_t shift = control == kAttnMmaControlPairBlocksGlobal ? (w[kWqBegin] * G) % kAttnMmaRows : 0;
  const int64_t n_pair_blocks = (P + shift + kAttnMmaRows - 1) / kAttnMmaRows;
  const auto in_seq = [&](int64_t e) { return e >= 0 && e < P; };
  // (negative control 1: the pair-blocks in descending order for sequences with more than one new row)
  const bool reverse = control == kAttnMmaControlReverseDByQLen && q_len > 1;
  const bool shared_op = control == kAttnMmaControlSharedV;  // (negative control 2: one pass, the pairs' union)
  for (int64_t pb = 0; pb < n_pair_blocks; ++pb) {  // pair-blocks ascending (uniform)
    const int64_t e0 = (reverse ? n_pair_blocks - 1 - pb : pb) * kAttnMmaRows - shift;
    int64_t nk_blk = 0;
    for (int i = 0; i < kAttnMmaRows && e0 + i < P; ++i) {
      if (!in_seq(e0 + i)) continue;
      const int64_t n = pair_keys(e0 + i);
      nk_blk = n > nk_blk ? n : nk_blk;
    }
    if (nk_blk <= kw0) continue;  // no pair of the block sees a key of the warp
    const auto a_off = [&](int i) -> int64_t { return in_seq(e0 + i) ? pair_row(e0 + i) * D : -1; };
    const auto key_off = [&](int c) -> int64_t { return c < n_keys ? kv.offset(kw0 + c, g) : -1; };
    float sf[kAttnMmaKInstr16][4], df[kAttnMmaKInstr16][4];
    attn_mma_head_dim_products<kAttnMmaKInstr16>(Q, K, D, a_off, key_off, sf);
    attn_mma_head_dim_products<kAttnMmaKInstr16>(dO, V, D, a_off, key_off, df);
#pragma unroll
    for (int n = 0; n < kAttnMmaKInstr16; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        int row, col;
        bf16_mma_c_coords(r, row, col);
        sc.s[row][n * kBf16MmaTileN + col] = sf[n][r] * f.scale;
        sc.dp[row][n * kBf16MmaTileN + col] = df[n][r];
      }
    warp_sync();
    if (lane < kAttnMmaRows) {  // pair `lane`: its P and dS over the warp's 16 keys
      const int64_t e = e0 + lane;
      const int64_t nk = in_seq(e) ? pair_keys(e) : 0;
      const int64_t ri = in_seq(e) ? pair_row(e) : 0;
      sc.nk[lane] = (int)(nk - kw0 < 0 ? 0 : (nk - kw0 > kAttnMmaRows ? kAttnMmaRows : nk - kw0));
      for (int c = 0; c < kAttnMmaRows; ++c) {
        const bool sees = c < n_keys && kw0 + c < nk;
        float pj = 0.0f, dsj = 0.0f;
        if (sees) {
          pj = attn_bwd_prob(sc.s[lane][c], p.lse[ri]);
          dsj = attn_bwd_ds(pj, sc.dp[lane][c], p.delta[ri]);
        }
        sc.p[lane][c] = sees ? attn_mma_prob(pj) : bf16_t{0};
        sc.ds[lane][c] = sees ? attn_mma_prob(dsj) : bf16_t{0};
      }
    }
    warp_sync();
    if (lane < kAttnMmaRows) {  // key `lane`: the mask of the block's pairs that see it
      uint32_t m = 0;
      for (int i = 0; i < kAttnMmaRows; ++i)
        if (lane < n_keys && lane < sc.nk[i]) m |= 1u << i;
      sc.mask[lane] = m;
    }
    warp_sync();
    uint32_t mask_union = 0;  // (the shared-operand negative control's one pass)
    for (int c1 = 0; c1 < kAttnMmaRows; ++c1) mask_union |= sc.mask[c1];
    for (int c0k = 0; c0k < kAttnMmaRows; ++c0k) {  // one pass per distinct non-empty mask (uniform)
      const uint32_t mp = shared_op ? mask_union : sc.mask[c0k];
      bool seen = mp == 0 || (shared_op && c0k > 0);
      for (int c1 = 0; c1 < c0k && !seen; ++c1) seen = sc.mask[c1] == mp;
      if (seen) continue;
      const auto a_ds = [&](int row, int k) -> uint16_t { return (mp >> k) & 1u ? sc.ds[k][row].bits : (uint16_t)0; };
      const auto a_p = [&](int row, int k) -> uint16_t { return (mp >> k) & 1u ? sc.p[k][row].bits : (uint16_t)0; };
#pragma unroll
      for (int n = 0; n < kDInstr; ++n) {
        const int64_t c0 = d_slice0 + (int64_t)n * kBf16MmaTileN;
        if (c0 >= D) break;
        const auto b_q = [&](int k, int col) -> uint16_t {
          const int64_t d = c0 + col;
          return (mp >> k) & 1u && d < D ? Q[pair_row(e0 + k) * D + d].bits : (uint16_t)0;
        };
        const auto b_do = [&](int k, int col) -> uint16_t {
          const int64_t d = c0 + col;
          return (mp >> k) & 1u && d < D ? dO[pair_row(e0 + k) * D + d].bits : (uint16_t)0;
        };
        float tk[4] = {ak[n][0], ak[n][1], ak[n][2], ak[n][3]};
        float tv[4] = {av[n][0], av[n][1], av[n][2], av[n][3]};
        bf16_mma_step(tk, a_ds, b_q);
        bf16_mma_step(tv, a_p, b_do);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          int row, col;
          bf16_mma_c_coords(r, row, col);
          if (shared_op ? sc.mask[row] != 0 : sc.mask[row] == mp) {
            ak[n][r] = tk[r];
            av[n][r] = tv[r];
          }
        }
      }
    }
    warp_sync();  // the next block overwrites the scratch
  }
#pragma unroll
  for (int n = 0; n < kDInstr; ++n) {
    const int64_t c0 = d_slice0 + (int64_t)n * kBf16MmaTileN;
    if (c0 >= D) break;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      int row, col;
      bf16_mma_c_coords(r, row, col);
      if (row >= n_keys || c0 + col >= D) continue;
      const int64_t off = kv.offset(kw0 + row, g) + c0 + col;
      ((bf16_t*)p.dk)[off] = from_f32<bf16_t>(ak[n][r] * f.scale);
      ((bf16_t*)p.dv)[off] = from_f32<bf16_t>(av[n][r]);
    }
  }
}

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
