// gemm_fp32.cuh — the fp32 CUDA-core / VALU GEMM of aligned::linear, linear_partial and linear_backward
// (CUDA and HIP): the `fma` profile of csrc/common/contract.h.
//
// C[m, n] = round_TC(linear_lane_fold(s_0 .. s_{L-1}) (+ bias[n])), s_l = dot_chain over lane l of K,
// lane l = [linear_lane_begin(l, K, L), linear_lane_begin(l + 1, K, L)); L = 8 (linear), lanes
// (linear_partial, fp32 out, no bias), 1 (the backward's dx and dw: one chain over all of K).
//
// gemm_fp32_kernel computes ONE lane per block (blockIdx.z = lane): a classic shared-memory-tiled SGEMM in
// which each thread owns a kThreadM x kThreadN block of outputs and runs each of their fma chains over the
// lane's k in order. The M/N tiles choose which chains run together and the K tiles (kTileK) only stage A
// and B through shared memory — each lane's chain is the same single sequential fma chain, whatever the
// tile shapes, M, the grid, or the GPU. With L > 1 the lane sums go to an fp32 workspace [L, rows, N] (M in
// chunks of rows, to bound its memory) and lane_fold_kernel applies the contract's fixed tree, the bias and the one rounding (no atomics: every
// element is written once). Hence CPU == CUDA == HIP bit for bit (operands are widened to fp32 exactly,
// fma and + are correctly rounded everywhere). The lanes are also the GPU's split-K parallelism for small M:
// 8x more blocks, with a fixed, TP-compatible combine.
// The K tail never pads a chain: a zero-padded fma(0, 0, acc) would turn acc = -0 into +0.
//
// Tensor cores / MFMA are not used: their per-vendor rounding (see DESIGN.md and
// shared/notes/gpu-kernels.md) breaks cross-vendor equality (contract.h: the matrix-unit profile slot).
#pragma once

#include "compat.cuh"  // first: the vendor runtime header defines __host__/__device__/__forceinline__
#include "../common/contract.h"

namespace aligned::gpu::ALIGNED_GPU_BUILD {

// Tile shapes (constants of this file; the results do not depend on them).
constexpr int kTileM = 128;   // output rows per block
constexpr int kTileN = 128;   // output columns per block
constexpr int kTileK = 8;     // k values staged through shared memory per step
constexpr int kThreadM = 8;   // output rows per thread
constexpr int kThreadN = 8;   // output columns per thread
constexpr int kGemmThreads = (kTileM / kThreadM) * (kTileN / kThreadN);  // 256

// Thread (ty, tx) owns rows m0 + ty + i * (kTileM / kThreadM) and columns n0 + tx + j * (kTileN / kThreadN):
// strided ownership keeps the shared-memory reads of one k step conflict-free (broadcasts within rows).
// Lane blockIdx.z of `lanes`: writes C + blockIdx.z * c_lane (the lane's [M, N] slab; c_lane = 0 when lanes = 1).
template <typename TA, typename TB, typename TC>
__global__ void __launch_bounds__(kGemmThreads)
    gemm_fp32_kernel(const TA* __restrict__ A, int64_t a_sm, int64_t a_sk, const TB* __restrict__ B, int64_t b_sn,
                     int64_t b_sk, const TC* __restrict__ bias, TC* __restrict__ C, int64_t c_sm, int64_t M, int64_t N,
                     int64_t K, int lanes, int64_t c_lane) {
  constexpr int kRowsStride = kTileM / kThreadM;  // 16
  constexpr int kColsStride = kTileN / kThreadN;  // 16
  __shared__ float As[kTileK][kTileM];
  __shared__ float Bs[kTileK][kTileN];

  const int tid = threadIdx.x;
  const int ty = tid / kColsStride, tx = tid % kColsStride;
  const int64_t m0 = (int64_t)blockIdx.y * kTileM;
  const int64_t n0 = (int64_t)blockIdx.x * kTileN;
  const int64_t kb = linear_lane_begin(blockIdx.z, K, lanes), ke = linear_lane_begin(blockIdx.z + 1, K, lanes);
  C += (int64_t)blockIdx.z * c_lane;

  float acc[kThreadM][kThreadN];
#pragma unroll
  for (int i = 0; i < kThreadM; ++i)
#pragma unroll
    for (int j = 0; j < kThreadN; ++j) acc[i][j] = 0.0f;

  for (int64_t k0 = kb; k0 < ke; k0 += kTileK) {
    const int kmax = (int)((ke - k0) < kTileK ? (ke - k0) : kTileK);
    // Stage A[m0.., k0..] and B[n0.., k0..] as fp32 (exact widening). Out-of-range entries are 0 and are
    // never used by a stored output (rows/columns past M/N are not written; k past the lane is not iterated).
    for (int idx = tid; idx < kTileM * kTileK; idx += kGemmThreads) {
      const int mi = idx / kTileK, kk = idx % kTileK;
      const int64_t m = m0 + mi, k = k0 + kk;
      As[kk][mi] = (m < M && kk < kmax) ? to_f32(A[m * a_sm + k * a_sk]) : 0.0f;
    }
    for (int idx = tid; idx < kTileN * kTileK; idx += kGemmThreads) {
      const int ni = idx / kTileK, kk = idx % kTileK;
      const int64_t n = n0 + ni, k = k0 + kk;
      Bs[kk][ni] = (n < N && kk < kmax) ? to_f32(B[n * b_sn + k * b_sk]) : 0.0f;
    }
    __syncthreads();
    // One link of every chain this thread owns: acc[i][j] = fma(A[m_i, k0 + kk], B[n_j, k0 + kk], acc[i][j]).
    auto chain_link = [&](int kk) {
      float a[kThreadM], b[kThreadN];
#pragma unroll
      for (int i = 0; i < kThreadM; ++i) a[i] = As[kk][ty + i * kRowsStride];
#pragma unroll
      for (int j = 0; j < kThreadN; ++j) b[j] = Bs[kk][tx + j * kColsStride];
#pragma unroll
      for (int i = 0; i < kThreadM; ++i)
#pragma unroll
        for (int j = 0; j < kThreadN; ++j) acc[i][j] = fma_f32(a[i], b[j], acc[i][j]);
    };
    if (kmax == kTileK) {
#pragma unroll
      for (int kk = 0; kk < kTileK; ++kk) chain_link(kk);
    } else {  // K tail: exactly kmax more links of every chain
      for (int kk = 0; kk < kmax; ++kk) chain_link(kk);
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < kThreadM; ++i) {
    const int64_t m = m0 + ty + i * kRowsStride;
    if (m >= M) continue;
#pragma unroll
    for (int j = 0; j < kThreadN; ++j) {
      const int64_t n = n0 + tx + j * kColsStride;
      if (n >= N) continue;
      C[m * c_sm + n] = linear_epilogue(acc[i][j], bias, n);
    }
  }
}

// ---- small M (decode): gemm_small_m_kernel ------------------------------------------------------------------
// aligned::linear at M <= kSmallM rows (what a rollout's decode step runs). The tiled kernel above computes whole
// 128-row tiles — at M = 1 it does 128x the work and stages W element by element — and needs the lane workspace
// and a second launch for the tree. Here a block owns kSmallCols output columns and all 8 lanes of each: thread
// (column c, lane l) runs the lane-l chains of c for every row, acc[m] = fma(x[m, k], w[c, k], acc[m]) over the lane's
// k in increasing order (contract.h: the same single chain per (m, c, l)), streaming its slice of W with 16-byte
// loads (kSmallPrefetch vectors ahead of their fmas); the 8 lane sums of a column sit in 8 adjacent threads of one
// warp and are gathered by shuffles into linear_lane_fold — the contract's tree, the bias and the one rounding in
// the same kernel (linear_epilogue). No workspace, one launch, W read exactly once.
// Vector loads need contiguous rows of x and W and 16-byte aligned bases with row strides that keep every row
// aligned; otherwise (and for each lane's unaligned head and its tail) the same chain runs on element loads.
constexpr int kSmallM = 16;    // the launcher uses this kernel for M <= kSmallM (and lanes == 8)
constexpr int kSmallCols = 16;  // output columns per block
constexpr int kSmallThreads = kSmallCols * kLinearLanes;  // 128: 4 columns x 8 lanes per warp
constexpr int kSmallPrefetch = 8;  // 16-byte vectors of W in flight per thread (128 B: ~4 MB over the chip)

// The block's work as a device function: output columns [col_block * kSmallCols, +kSmallCols) of all M rows.
// TC = T (linear: bias + one rounding) or float (the unrounded 8-lane tree: moe_experts' down projection, whose
// y stays fp32). The grouped launches of the moe family (moe_kernels.cuh) call it for one expert's row tile, so
// an expert's rows run exactly the chains of aligned::linear.
template <typename T, typename TC, int kM>
__device__ __forceinline__ void gemm_small_m_cols(const T* __restrict__ A, int64_t a_sm, int64_t a_sk,
                                                  const T* __restrict__ B, int64_t b_sn, int64_t b_sk,
                                                  const TC* __restrict__ bias, TC* __restrict__ C, int64_t c_sm,
                                                  int64_t M, int64_t N, int64_t K, int64_t col_block) {
  constexpr int kV = kVecElems<T>;
  const int tid = threadIdx.x, l = tid % kLinearLanes;
  const int64_t n = col_block * kSmallCols + tid / kLinearLanes;
  const int64_t kb = linear_lane_begin(l, K, kLinearLanes), ke = linear_lane_begin(l + 1, K, kLinearLanes);
  float acc[kM];
#pragma unroll
  for (int m = 0; m < kM; ++m) acc[m] = 0.0f;
  if (n < N) {  // threads past N still reach the shuffles below (with zero sums, never stored)
    const T* w = B + n * b_sn;
    auto link = [&](int64_t k) {  // one fma of every row's chain at k
      const float wk = to_f32(w[k * b_sk]);
#pragma unroll
      for (int m = 0; m < kM; ++m)
        if (m < M) acc[m] = fma_f32(to_f32(A[m * a_sm + k * a_sk]), wk, acc[m]);
    };
    // Vectors: every row of x and of W 16-byte aligned at k whenever k is a multiple of kV.
    const bool vec = a_sk == 1 && b_sk == 1 && is_vec_aligned(A) && is_vec_aligned(B) && a_sm % kV == 0 &&
                     b_sn % kV == 0;
    int64_t k = kb;
    if (vec) {
      for (; k < ke && k % kV != 0; ++k) link(k);  // head up to the first aligned k
      for (; k + kSmallPrefetch * kV <= ke; k += kSmallPrefetch * kV) {
        int4 wraw[kSmallPrefetch];  // the raw vectors: kSmallPrefetch * 16 bytes in flight per thread
#pragma unroll
        for (int u = 0; u < kSmallPrefetch; ++u) wraw[u] = *reinterpret_cast<const int4*>(w + k + u * kV);
#pragma unroll
        for (int u = 0; u < kSmallPrefetch; ++u) {  // ... then the fmas, k ascending for every row
          T wt[kV];
          memcpy(wt, &wraw[u], 16);
#pragma unroll
          for (int m = 0; m < kM; ++m) {
            if (m >= M) continue;
            float xv[kV];
            load_vec_f32(A + m * a_sm + k + u * kV, xv);
#pragma unroll
            for (int i = 0; i < kV; ++i) acc[m] = fma_f32(xv[i], to_f32(wt[i]), acc[m]);
          }
        }
      }
    }
    for (; k < ke; ++k) link(k);  // tail (or every k without vectors)
  }
  // the 8 lane sums of column n: threads (tid & ~7) + j of this warp's 32-lane group
  const int base = (tid % kGroupLanes) & ~(kLinearLanes - 1);
#pragma unroll
  for (int m = 0; m < kM; ++m) {
    if (m >= M) break;  // uniform over the block
    float s[kLinearLanes];
#pragma unroll
    for (int j = 0; j < kLinearLanes; ++j) s[j] = shfl_idx32(acc[m], base + j);
    if (l == 0 && n < N) C[m * c_sm + n] = linear_epilogue(linear_lane_fold(s, kLinearLanes), bias, n);
  }
}

template <typename T, int kM>
__global__ void __launch_bounds__(kSmallThreads)
    gemm_small_m_kernel(const T* __restrict__ A, int64_t a_sm, int64_t a_sk, const T* __restrict__ B, int64_t b_sn,
                        int64_t b_sk, const T* __restrict__ bias, T* __restrict__ C, int64_t c_sm, int64_t M, int64_t N,
                        int64_t K) {
  gemm_small_m_cols<T, T, kM>(A, a_sm, a_sk, B, b_sn, b_sk, bias, C, c_sm, M, N, K, (int64_t)blockIdx.x);
}

// out[m, n] = linear_epilogue(linear_lane_fold(ws[0..lanes)[m, n]), bias, n): the contract's lane tree, the bias
// once, one rounding. ws is [lanes, M, N] fp32 (the lane sums of gemm_fp32_kernel), out row stride c_sm.
template <typename TC>
__global__ void lane_fold_kernel(const float* __restrict__ ws, int lanes, const TC* __restrict__ bias,
                                 TC* __restrict__ out, int64_t c_sm, int64_t M, int64_t N) {
  const int64_t MN = M * N;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < MN; i += (int64_t)gridDim.x * blockDim.x) {
    float s[kLinearLanes];
    for (int l = 0; l < lanes; ++l) s[l] = ws[l * MN + i];
    const int64_t m = i / N, n = i % N;
    out[m * c_sm + n] = linear_epilogue(linear_lane_fold(s, lanes), bias, n);
  }
}

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
