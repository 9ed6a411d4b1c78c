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
// that depends on prefill vs decode); 2 = FlashAttention's shared V operand: ONE PV pass per tile with V cut at
// the group's longest row, so a row multiplies its masked keys' values by P = +0 (attention_mma.h says why that
// is not neutral on the unit). The invariance tests must catch both.
enum AttnMmaControl : int {
  kAttnMmaControlNone = 0,
  kAttnMmaControlReverseDByQLen = 1,
  kAttnMmaControlSharedV = 2,
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
__host__ __device__ inline int attn_mma_d_instr(int64_t D) {
  const int64_t need = (D + kBf16MmaTileN - 1) / kBf16MmaTileN;
  const int64_t b64 = 64 / kBf16MmaTileN, b128 = 128 / kBf16MmaTileN;
  return need <= b64 ? (int)b64 : need <= b128 ? (int)b128 : kAttnMmaDInstr;
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

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
