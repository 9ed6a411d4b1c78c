// gemm_fp32.cuh — the fp32 CUDA-core / VALU GEMM of aligned::linear and linear_backward (CUDA and HIP).
//
// C[m, n] = round_TC(acc + bias[n]), acc = chain over k = 0..K-1 of fma(A[m, k], B[n, k], acc), acc from +0
// (contract.h, linear_dot). This is a classic shared-memory-tiled SGEMM in which each thread owns a
// kThreadM x kThreadN block of outputs and runs each of their fma chains over k in order: the M/N tiles
// choose which chains run together and the K tiles (kTileK) only stage A and B through shared memory —
// the chain of every output element is the same single sequential fma chain, whatever the tile shapes,
// M, the grid, or the GPU. Hence CPU == CUDA == HIP bit for bit (operands are widened to fp32 exactly,
// fma is correctly rounded everywhere). No split-K, ever: K is never divided between threads or blocks.
// The K tail never pads the chain: a zero-padded fma(0, 0, acc) would turn acc = -0 into +0.
//
// Tensor cores / MFMA are not used: their per-vendor rounding (see DESIGN.md and
// shared/notes/gpu-kernels.md) breaks cross-vendor equality. A tensor-core path with its own fixed K
// order (and its own CPU emulation) is future work; it is not built here.
#pragma once

#include "compat.cuh"  // first: the vendor runtime header defines __host__/__device__/__forceinline__
#include "../common/contract.h"

namespace aligned::gpu {

// Tile shapes (constants of this file; the results do not depend on them).
constexpr int kTileM = 128;   // output rows per block
constexpr int kTileN = 128;   // output columns per block
constexpr int kTileK = 8;     // k values staged through shared memory per step
constexpr int kThreadM = 8;   // output rows per thread
constexpr int kThreadN = 8;   // output columns per thread
constexpr int kGemmThreads = (kTileM / kThreadM) * (kTileN / kThreadN);  // 256

// Thread (ty, tx) owns rows m0 + ty + i * (kTileM / kThreadM) and columns n0 + tx + j * (kTileN / kThreadN):
// strided ownership keeps the shared-memory reads of one k step conflict-free (broadcasts within rows).
template <typename TA, typename TB, typename TC>
__global__ void __launch_bounds__(kGemmThreads)
    gemm_fp32_kernel(const TA* __restrict__ A, int64_t a_sm, int64_t a_sk, const TB* __restrict__ B, int64_t b_sn,
                     int64_t b_sk, const TC* __restrict__ bias, TC* __restrict__ C, int64_t c_sm, int64_t M, int64_t N,
                     int64_t K) {
  constexpr int kRowsStride = kTileM / kThreadM;  // 16
  constexpr int kColsStride = kTileN / kThreadN;  // 16
  __shared__ float As[kTileK][kTileM];
  __shared__ float Bs[kTileK][kTileN];

  const int tid = threadIdx.x;
  const int ty = tid / kColsStride, tx = tid % kColsStride;
  const int64_t m0 = (int64_t)blockIdx.y * kTileM;
  const int64_t n0 = (int64_t)blockIdx.x * kTileN;

  float acc[kThreadM][kThreadN];
#pragma unroll
  for (int i = 0; i < kThreadM; ++i)
#pragma unroll
    for (int j = 0; j < kThreadN; ++j) acc[i][j] = 0.0f;

  for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
    const int kmax = (int)((K - k0) < kTileK ? (K - k0) : kTileK);
    // Stage A[m0.., k0..] and B[n0.., k0..] as fp32 (exact widening). Out-of-range entries are 0 and are
    // never used by a stored output (rows/columns past M/N are not written; k past K is not iterated).
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
      C[m * c_sm + n] = from_f32<TC>(bias ? acc[i][j] + to_f32(bias[n]) : acc[i][j]);
    }
  }
}

}  // namespace aligned::gpu
