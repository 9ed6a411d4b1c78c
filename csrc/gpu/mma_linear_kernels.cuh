// mma_linear_kernels.cuh — the `mma` linear on the GPU's bf16 matrix instruction (csrc/gpu/bf16_mma.cuh: CUDA
// mma.sync m16n8k16, HIP v_mfma_f32_16x16x16_bf16), one source for both vendors and the emulation target. The
// order is csrc/common/mma.h's, with the GPU unit's block kMmaGpuKBlock = 16:
//   for every output and every K-lane l of `lanes` (linear_lane_begin): acc = +0, then one instruction per
//   k-block of 16 in ascending k from the lane's first k, the fp32 accumulator carried in C; a lane's tail
//   block is padded with x = w = +0 (a block never spans two lanes); then linear_lane_fold over the lanes and
//   linear_epilogue (bias, one rounding) — or the unrounded fold for linear_mma_partial.
// Every instruction a kernel issues for an output element sees the same operands (that element's row of A and
// column of B over one k-block) and the same C, whatever the tile: the units compute each D element from those
// alone, so the tile, the grid and the schedule never change a bit. What the kernels never do: split a lane's
// K (beyond the 8 lanes), reorder its k-blocks, swap operands or change the instruction between M buckets.
//
// Two tilings here (mma_launch.cuh picks by M; all obey the above, the tests prove they give the same bits; the
// third, for M > 64, is the block-tiled kernel of mma_tiled_kernels.cuh):
//   mma_linear_rows_kernel   (16 < M <= 64) each warp (CUDA) / wave (HIP) owns a 16 x 16 output tile and runs the
//                            `lanes` chains one after another in registers; 4 warps per block (64 rows);
//   mma_linear_lanes_kernel  (M <= 16, decode) the block's 8 warps run the 8 K-lanes of one 16 x 16 tile in
//                            parallel (the fixed K split mma.h allows), their fp32 lane sums meet in shared
//                            memory and one thread per output folds them.
// Operands are read with element strides (the backward's transposed views too); rows past M, columns past N
// and k past the lane's end load +0.
#pragma once

#include <stdint.h>

#include "compat.cuh"  // first: the vendor runtime header defines __host__ / __device__ for common/
#include "bf16_mma.cuh"
#include "../common/mma.h"
#include "../common/params_linear.h"

namespace aligned::gpu::ALIGNED_GPU_BUILD {

constexpr int kMmaTile = 16;                                  // output rows and columns of one warp's tile
constexpr int kMmaNInstr = kMmaTile / kBf16MmaTileN;          // instructions per k-block: 2 (CUDA), 1 (HIP)
constexpr int kMmaRowWarps = 4;                               // rows kernel: warps (tiles) per block
constexpr int kMmaRowThreads = kMmaRowWarps * kBf16MmaWarpLanes;
constexpr int kMmaLaneThreads = kLinearLanes * kBf16MmaWarpLanes;  // lanes kernel: one warp per K-lane
constexpr int64_t kMmaLanesKernelMaxM = 16;                   // M bucket of the lanes kernel
constexpr size_t kMmaLanesSharedBytes = sizeof(float) * kLinearLanes * kMmaTile * kMmaTile;

// Negative controls (tests only; built by the emulated launcher on request, emulation.h Fault): 1 = each lane's
// chain cut in two halves summed afterwards, 2 = each lane's k-blocks in descending order, 3 = (tiled kernel)
// the lane sums folded left to right. 0 everywhere else.
enum MmaControl : int {
  kMmaControlNone = 0,
  kMmaControlSplitK = 1,
  kMmaControlReverseBlocks = 2,
  kMmaControlFoldChain = 3,
};

__device__ __forceinline__ uint32_t mma_elem(const bf16_t* base, int64_t i, int64_t limit_ok) {
  return limit_ok ? (uint32_t)base[i].bits : 0u;
}

// acc (+)= the unit's chain over the k-blocks [b0, b1) of the lane starting at k0 (blocks of kMmaGpuKBlock; k
// past k1 loads +0), for the warp's tile (m0, n0). The whole warp calls this with the same arguments.
__device__ __forceinline__ void mma_blocks(const GemmParams& p, int64_t m0, int64_t n0, int64_t k0, int64_t k1,
                                           int64_t b0, int64_t b1, bool reverse, float (&acc)[kMmaNInstr][4]) {
  const bf16_t* A = (const bf16_t*)p.A;
  const bf16_t* B = (const bf16_t*)p.B;
  const int lane = (int)(threadIdx.x % kBf16MmaWarpLanes);
  for (int64_t j = b0; j < b1; ++j) {
    const int64_t kb = k0 + (reverse ? (b1 - 1 - (j - b0)) : j) * kMmaGpuKBlock;
#if defined(ALIGNED_GPU_HIP)
    const int i = lane & 15, h = lane >> 4;
    const int64_t row = m0 + i, col = n0 + i;
    uint64_t a = 0, b = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t k = kb + 4 * h + e;
      a |= (uint64_t)mma_elem(A, row * p.a_sm + k * p.a_sk, row < p.M && k < k1) << (16 * e);
      b |= (uint64_t)mma_elem(B, col * p.b_sn + k * p.b_sk, col < p.N && k < k1) << (16 * e);
    }
    mfma_f32_16x16x16_bf16(acc[0], a, b);
#else
    const int g = lane >> 2, q = lane & 3;
    uint32_t a[4], b[2];
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // a[r]: row g + 8 (r & 1), k 2q + 8 (r >> 1) and the next k
      const int64_t row = m0 + g + 8 * (r & 1), k = kb + 2 * q + 8 * (r >> 1);
      a[r] = mma_elem(A, row * p.a_sm + k * p.a_sk, row < p.M && k < k1) |
             mma_elem(A, row * p.a_sm + (k + 1) * p.a_sk, row < p.M && k + 1 < k1) << 16;
    }
#pragma unroll
    for (int h = 0; h < kMmaNInstr; ++h) {
      const int64_t col = n0 + 8 * h + g;
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // b[r]: k 2q + 8r and the next k of column col
        const int64_t k = kb + 2 * q + 8 * r;
        b[r] = mma_elem(B, col * p.b_sn + k * p.b_sk, col < p.N && k < k1) |
               mma_elem(B, col * p.b_sn + (k + 1) * p.b_sk, col < p.N && k + 1 < k1) << 16;
      }
      mma_bf16_m16n8k16(acc[h], a, b);
    }
#endif
  }
}

// s = lane l's chain (mma.h) for the warp's tile; `control` only in the emulated negative controls.
__device__ __forceinline__ void mma_lane_chain(const GemmParams& p, int64_t m0, int64_t n0, int l, int control,
                                               float (&s)[kMmaNInstr][4]) {
  const int64_t k0 = linear_lane_begin(l, p.K, p.lanes), k1 = linear_lane_begin(l + 1, p.K, p.lanes);
  const int64_t blocks = (k1 - k0 + kMmaGpuKBlock - 1) / kMmaGpuKBlock;
#pragma unroll
  for (int h = 0; h < kMmaNInstr; ++h)
#pragma unroll
    for (int r = 0; r < 4; ++r) s[h][r] = 0.0f;
  if (control == kMmaControlSplitK && blocks >= 2) {  // NEGATIVE CONTROL: two chains, then one fp32 add
    float t[kMmaNInstr][4];
#pragma unroll
    for (int h = 0; h < kMmaNInstr; ++h)
#pragma unroll
      for (int r = 0; r < 4; ++r) t[h][r] = 0.0f;
    mma_blocks(p, m0, n0, k0, k1, 0, blocks / 2, false, s);
    mma_blocks(p, m0, n0, k0, k1, blocks / 2, blocks, false, t);
#pragma unroll
    for (int h = 0; h < kMmaNInstr; ++h)
#pragma unroll
      for (int r = 0; r < 4; ++r) s[h][r] = s[h][r] + t[h][r];
    return;
  }
  mma_blocks(p, m0, n0, k0, k1, 0, blocks, control == kMmaControlReverseBlocks, s);
}

// The tile element (row, col) a lane's accumulator register (h, r) holds (bf16_mma.cuh layouts).
__device__ __forceinline__ void mma_c_coords(int64_t m0, int64_t n0, int h, int r, int64_t& row, int64_t& col) {
  const int lane = (int)(threadIdx.x % kBf16MmaWarpLanes);
#if defined(ALIGNED_GPU_HIP)
  (void)h;
  row = m0 + 4 * (lane >> 4) + r;
  col = n0 + (lane & 15);
#else
  row = m0 + (lane >> 2) + 8 * (r >> 1);
  col = n0 + 8 * h + 2 * (lane & 3) + (r & 1);
#endif
}

// The fold of the lane sums and the epilogue of one output: TC = bf16_t (linear_mma: bias + one rounding) or
// float (linear_mma_partial: the unrounded sub-tree).
template <typename TC>
__device__ __forceinline__ void mma_store(const GemmParams& p, const float* lane_sums, int64_t row, int64_t col) {
  const float acc = linear_lane_fold(lane_sums, p.lanes);
  TC* C = (TC*)p.C;
  if constexpr (sizeof(TC) == sizeof(float)) C[row * p.c_sm + col] = acc;
  else C[row * p.c_sm + col] = linear_epilogue(acc, (const TC*)p.bias, col);
}

template <typename TC>
__global__ void __launch_bounds__(kMmaRowThreads) mma_linear_rows_kernel(GemmParams p, int control) {
  const int warp = (int)(threadIdx.x / kBf16MmaWarpLanes);
  const int64_t m0 = ((int64_t)blockIdx.y * kMmaRowWarps + warp) * kMmaTile, n0 = (int64_t)blockIdx.x * kMmaTile;
  if (m0 >= p.M) return;  // the whole warp: its tile is past the last row
  float s[kLinearLanes][kMmaNInstr][4];
  for (int l = 0; l < p.lanes; ++l) mma_lane_chain(p, m0, n0, l, control, s[l]);
#pragma unroll
  for (int h = 0; h < kMmaNInstr; ++h)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      int64_t row, col;
      mma_c_coords(m0, n0, h, r, row, col);
      if (row >= p.M || col >= p.N) continue;
      float v[kLinearLanes];
      for (int l = 0; l < p.lanes; ++l) v[l] = s[l][h][r];
      mma_store<TC>(p, v, row, col);
    }
}

// The lanes kernel's work for the tile (m0, n0) as a device function (sums: its kMmaLanesSharedBytes of shared
// memory). The grouped launches of the moe family (moe_kernels.cuh) call it for one expert's tile of <= 16 rows,
// with p's operands pointing at that expert: the same instructions on the same operands as aligned::linear_mma.
template <typename TC>
__device__ __forceinline__ void mma_lanes_tile(const GemmParams& p, int64_t m0, int64_t n0, int control,
                                               float* sums) {
  const int warp = (int)(threadIdx.x / kBf16MmaWarpLanes);
  if (warp < p.lanes) {  // warp-uniform: warp w runs K-lane w
    float s[kMmaNInstr][4];
    mma_lane_chain(p, m0, n0, warp, control, s);
#pragma unroll
    for (int h = 0; h < kMmaNInstr; ++h)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        int64_t row, col;
        mma_c_coords(m0, n0, h, r, row, col);
        sums[(warp * kMmaTile + (row - m0)) * kMmaTile + (col - n0)] = s[h][r];
      }
  }
  __syncthreads();
  for (int t = (int)threadIdx.x; t < kMmaTile * kMmaTile; t += (int)blockDim.x) {
    const int64_t row = m0 + t / kMmaTile, col = n0 + t % kMmaTile;
    if (row >= p.M || col >= p.N) continue;
    float v[kLinearLanes];
    for (int l = 0; l < p.lanes; ++l) v[l] = sums[l * kMmaTile * kMmaTile + t];
    mma_store<TC>(p, v, row, col);
  }
}

template <typename TC>
__global__ void __launch_bounds__(kMmaLaneThreads) mma_linear_lanes_kernel(GemmParams p, int control) {
  float* sums = dynamic_shared<float>();  // [kLinearLanes][kMmaTile][kMmaTile]
  mma_lanes_tile<TC>(p, (int64_t)blockIdx.y * kMmaTile, (int64_t)blockIdx.x * kMmaTile, control, sums);
}

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
