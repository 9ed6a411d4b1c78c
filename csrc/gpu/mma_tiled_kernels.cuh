// mma_tiled_kernels.cuh — the block-tiled `mma` linear for the compute-bound bucket (M > kMmaTiledMinM rows):
// the same instructions on the same operands as mma_linear_kernels.cuh (csrc/common/mma.h's order), with the
// operands staged through shared memory and each warp register-blocked, so every element loaded from global
// memory feeds many instructions.
//
// The order (mma.h), unchanged: for every output and K-lane l: acc = +0, one instruction per k-block of 16 in
// ascending k from linear_lane_begin(l), the lane's tail block padded with x = w = +0; then linear_lane_fold and
// linear_epilogue. A D element of the unit depends only on its row of A, its column of B over the k-block and its
// C, so which rows / columns share an instruction (the tile) never changes a bit: the tests hold this kernel to the
// lanes and rows kernels and to the host model, bitwise (tests/emulated/test_emulated_linear_mma_tiled.py).
//
// Tiling (one CTA of 256 threads = kMmaTiledM x kMmaTiledN = 128 x 64 outputs):
//   CUDA  8 warps in 4 (M) x 2 (N), warp tile 32 x 32 = 2 x 4 mma.sync m16n8k16 per k-block (A fragments reused
//         by 4 instructions, B by 2);
//   HIP   4 waves in 2 x 2, wave tile 64 x 32 = 4 x 2 v_mfma_f32_16x16x16_bf16 per k-block.
// Why these: the progressive fold (below) holds 4 accumulator sets, so a thread's accumulator storage is
// 4 x (its tile's fp32 outputs) = 4 x 32: on CUDA 3 sets in registers (96 of 255) + the bottom one in shared
// memory (1 CTA of 8 warps per SM on H100/H200 — the occupancy of CUTLASS's large-tile kernels); on CDNA3 all 4
// in registers (128 of 512 VGPRs / AGPRs). A 64 x 64 warp tile would need 4 x 128 registers: not possible with
// the lane stack, hence 32 x 32 (CUDA) / 64 x 32 (HIP).
//
// K loop: a step = one k-block (16 k) of one lane, the steps of all lanes in the contract's order (lane 0's blocks
// ascending, then lane 1's, ...); a pipeline stage = 2 consecutive steps (one barrier and one async-copy group per
// 32 k; the two may belong to two lanes), kMmaTiledStages = 3 stages in flight (6 step buffers). Per step: A
// [128][24] and B [64][24] bf16 (rows padded from 16 to 24 elements = 48 bytes: the fragment reads of a warp, rows
// g = 0..7 x words q = 0..3, hit 32 distinct banks; 48 is a multiple of 16 for the 16-byte copies) = 9 KiB, 54 KiB
// for the 6 buffers (+ 32 KiB for the fold stack's bottom on CUDA, below: 86 KiB after the opt-in; gfx942: 54 KiB
// of its 64 KiB LDS).
// Staging paths (chosen by the launcher):
//   vector  (kMmaTiledVector) A and B with unit k-stride, rows and bases 16-byte aligned, every lane boundary a
//           multiple of 8 (e.g. K % 64 == 0): 16-byte copies of 8 k, a chunk wholly inside or wholly past its
//           lane's end (the latter zero-filled). CUDA: cp.async (__pipeline_memcpy_async, zero-fill for rows past
//           M / columns past N / k past the lane), which the emulator models (copied when the wait retires it);
//           HIP: 16-byte loads to registers and stores to LDS (CDNA3 has no async global->LDS copy of this form).
//   element (kMmaTiledElement) anything else — odd K, lanes not 8-aligned, the backward's transposed views
//           (element strides a_sm / a_sk / b_sn / b_sk): element loads with the bounds of mma_linear_kernels.cuh,
//           the fast-moving thread index on the unit-stride axis, stored to the same shared layout.
// What the emulated tests prove about this pipeline, and what they cannot: the emulator runs the warps in lockstep
// up to each instruction and lands a cp.async when its wait retires it, so a missing / too-short wait (a stage read
// before its copies landed) is caught, and a missing barrier is caught by the barrier_noop control
// (test_tiled_barrier_noop_caught). A stage buffer overwritten while another warp still reads it (write-after-read
// across warps, e.g. issue() moved above the __syncthreads) passes every emulated test: only hardware checks that
// (compute-sanitizer racecheck on a GPU run of this kernel). Here it holds by construction: issue() refills the
// buffers of the stage consumed one iteration earlier, only after the __syncthreads every warp reaches once done
// with it.
// The fold: the lanes finish in order 0..lanes-1 and linear_lane_fold's tree pairs adjacent lanes level by level,
// so it is evaluated as the lanes complete (a binary counter) with at most 3 held partial sums + the running
// chain: A = s0; A += s1; B = s2; B += s3, A += B; B = s4; B += s5; C = s6; C += s7, B += C, A += B — exactly
// ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)) for 8 lanes and the sub-trees for 1, 2, 4.
#pragma once

#include <stdint.h>

#include "compat.cuh"  // first: the vendor runtime header defines __host__ / __device__ for common/
#include "bf16_mma.cuh"
#include "mma_linear_kernels.cuh"
#include "../common/mma.h"
#include "../common/params_linear.h"
#if defined(ALIGNED_GPU_CUDA) && !defined(ALIGNED_GPU_EMULATED)
#include <cuda_pipeline_primitives.h>
#endif

namespace aligned::gpu::ALIGNED_GPU_BUILD {

#if defined(ALIGNED_GPU_HIP)
constexpr int kMmaTiledWarpsM = 2, kMmaTiledWarpsN = 2;  // waves per CTA in M and N
constexpr int kMmaTiledFragM = 4, kMmaTiledFragN = 2;    // instructions per wave per k-block in M and N
#else
constexpr int kMmaTiledWarpsM = 4, kMmaTiledWarpsN = 2;
constexpr int kMmaTiledFragM = 2, kMmaTiledFragN = 4;
#endif
constexpr int kMmaTiledWarpM = kMmaTiledFragM * 16;              // warp tile rows
constexpr int kMmaTiledWarpN = kMmaTiledFragN * kBf16MmaTileN;   // warp tile columns
constexpr int kMmaTiledM = kMmaTiledWarpsM * kMmaTiledWarpM;     // 128
constexpr int kMmaTiledN = kMmaTiledWarpsN * kMmaTiledWarpN;     // 64
constexpr int kMmaTiledThreads = kMmaTiledWarpsM * kMmaTiledWarpsN * kBf16MmaWarpLanes;  // 256
constexpr int kMmaTiledStepsPerStage = 2;  // k-blocks per barrier / async-copy group
constexpr int kMmaTiledStages = 3;         // pipeline stages in flight
constexpr int kMmaTiledBuffers = kMmaTiledStages * kMmaTiledStepsPerStage;  // step buffers: step t uses t % 6
constexpr int kMmaTiledRow = kMmaGpuKBlock + 8;  // shared row: 16 k + 8 padding (bank conflicts), 48 bytes
constexpr int kMmaTiledStageElems = (kMmaTiledM + kMmaTiledN) * kMmaTiledRow;
constexpr size_t kMmaTiledStageBytes = sizeof(bf16_t) * kMmaTiledBuffers * kMmaTiledStageElems;  // 54 KiB
constexpr int kMmaTiledAccRegs = kMmaTiledFragM * kMmaTiledFragN * 4;  // fp32 outputs per thread: 32
// The bottom of the fold stack (fa: s01, then s0123, then the total) lives in shared memory on CUDA, one column
// per thread (conflict-free): with all 4 sets in registers ptxas needs > 255 registers on sm_90 and spills; fa is
// touched 4 times per tile (lanes 0, 1, 3, 7) against 2 x 8 x (K / 16) instructions. CDNA3 has 512 VGPRs / AGPRs
// per lane and 64 KiB of LDS: there all 4 sets stay in registers.
#if defined(ALIGNED_GPU_HIP)
constexpr bool kMmaTiledFoldInShared = false;
#else
constexpr bool kMmaTiledFoldInShared = true;
#endif
constexpr size_t kMmaTiledSharedBytes =
    kMmaTiledStageBytes + (kMmaTiledFoldInShared ? sizeof(float) * kMmaTiledAccRegs * kMmaTiledThreads : 0);
constexpr int64_t kMmaTiledMinM = 64;  // launcher bucket: M > 64 runs this kernel
static_assert(kMmaTiledM == 128 && kMmaTiledN == 64 && kMmaTiledThreads == 256, "the tile the comments describe");
static_assert(kMmaTiledSharedBytes <= (kMmaTiledFoldInShared ? 99 * 1024 : 64 * 1024),
              "86 KiB on CUDA (after the opt-in; sm_120 allows 99 KiB), 54 KiB on HIP (gfx942: 64 KiB of LDS)");

enum MmaTiledStaging : int { kMmaTiledElement = 0, kMmaTiledVector = 1 };
// The largest K this kernel takes: its k indices are 32-bit (registers: the 4 accumulator sets leave little room),
// and the furthest one formed, a block's start + 15 (element path) / the lane end + 15 (block count), stays below
// 2^31 when K <= 2^31 - 32. The launcher refuses larger K.
constexpr int64_t kMmaTiledMaxK = 0x7fffffff - 31;

// The step cursor of the K loop: lane l, its j-th k-block of `blocks`, the lane's [k0, k1). 32-bit: K <= kMmaTiledMaxK.
struct MmaTiledCursor {
  int l, j, blocks, k0, k1;
  __device__ __forceinline__ void enter_lane(const GemmParams& p, int lane) {
    l = lane;
    j = 0;
    k0 = (int)linear_lane_begin(lane, p.K, p.lanes);
    k1 = (int)linear_lane_begin(lane + 1, p.K, p.lanes);
    blocks = (k1 - k0 + kMmaGpuKBlock - 1) / kMmaGpuKBlock;
  }
  // To the next step that issues an instruction (empty lanes, K < 8, have none).
  __device__ __forceinline__ void skip_empty(const GemmParams& p) {
    while (j >= blocks && l + 1 < p.lanes) enter_lane(p, l + 1);
  }
  __device__ __forceinline__ void advance(const GemmParams& p) {
    ++j;
    skip_empty(p);
  }
  __device__ __forceinline__ int kb(bool reverse) const {
    return k0 + (reverse ? blocks - 1 - j : j) * kMmaGpuKBlock;
  }
};

// Stage the k-block [kb, kb + 16) (k >= k1 as +0) of rows m0.. of A and columns n0.. of B into shared `As` / `Bs`.
template <int kStaging>
__device__ __forceinline__ void mma_tiled_stage(const GemmParams& p, int64_t m0, int64_t n0, int kb, int k1,
                                                bf16_t* As, bf16_t* Bs) {
  const bf16_t* A = (const bf16_t*)p.A;
  const bf16_t* B = (const bf16_t*)p.B;
  const int tid = (int)threadIdx.x;
  if constexpr (kStaging == kMmaTiledVector) {
    // 16-byte chunks of 8 k: every lane boundary is a multiple of 8, so a chunk is inside its lane or past it.
    constexpr int kChunks = (kMmaTiledM + kMmaTiledN) * (kMmaGpuKBlock / 8);
    for (int c = tid; c < kChunks; c += kMmaTiledThreads) {
      const int r = c >> 1, half = c & 1;
      const int k = kb + 8 * half;
      const bool is_a = r < kMmaTiledM;
      const int64_t idx = is_a ? m0 + r : n0 + (r - kMmaTiledM);
      const bool ok = (is_a ? idx < p.M : idx < p.N) && k < k1;
      const bf16_t* base = is_a ? A : B;
      const bf16_t* src = ok ? base + idx * (is_a ? p.a_sm : p.b_sn) + k : base;
      bf16_t* dst = (is_a ? As + r * kMmaTiledRow : Bs + (r - kMmaTiledM) * kMmaTiledRow) + 8 * half;
#if defined(ALIGNED_GPU_HIP)
      int4 v = make_int4(0, 0, 0, 0);
      if (ok) v = *(const int4*)src;
      *(int4*)dst = v;
#else
      __pipeline_memcpy_async(dst, src, 16, ok ? 0 : 16);
#endif
    }
  } else {
    // Element loads: consecutive threads walk the operand's unit-stride axis where it has one.
    auto load = [&](const bf16_t* base, int64_t s_row, int64_t s_k, int64_t rows0, int64_t rows_end, int nrows,
                    bf16_t* dst) {
      const bool k_fast = s_k == 1 || s_row != 1;
      for (int e = tid; e < nrows * kMmaGpuKBlock; e += kMmaTiledThreads) {
        const int r = k_fast ? e / kMmaGpuKBlock : e % nrows, c = k_fast ? e % kMmaGpuKBlock : e / nrows;
        const int64_t row = rows0 + r;
        const int k = kb + c;
        bf16_t v;
        v.bits = (uint16_t)mma_elem(base, row * s_row + k * s_k, row < rows_end && k < k1);
        dst[r * kMmaTiledRow + c] = v;
      }
    };
    load(A, p.a_sm, p.a_sk, m0, p.M, kMmaTiledM, As);
    load(B, p.b_sn, p.b_sk, n0, p.N, kMmaTiledN, Bs);
  }
}

__device__ __forceinline__ void mma_tiled_commit() {
#if !defined(ALIGNED_GPU_HIP)
  __pipeline_commit();
#endif
}
__device__ __forceinline__ void mma_tiled_wait(int pending) {
#if !defined(ALIGNED_GPU_HIP)
  __pipeline_wait_prior((size_t)pending);
#else
  (void)pending;
#endif
}

using MmaTiledAcc = float[kMmaTiledFragM][kMmaTiledFragN][4];

// The warp's instructions of one k-block: every (fragment row i, fragment column j) of its tile, the operands
// read from the staged block (layouts: bf16_mma.cuh, identical to mma_blocks' global reads).
__device__ __forceinline__ void mma_tiled_block(const bf16_t* As, const bf16_t* Bs, int wm, int wn, MmaTiledAcc& acc) {
  const int lane = (int)(threadIdx.x % kBf16MmaWarpLanes);
#if defined(ALIGNED_GPU_HIP)
  const int i = lane & 15, h = lane >> 4;
  uint64_t a[kMmaTiledFragM], b[kMmaTiledFragN];
#pragma unroll
  for (int fm = 0; fm < kMmaTiledFragM; ++fm) a[fm] = *(const uint64_t*)(As + (wm + 16 * fm + i) * kMmaTiledRow + 4 * h);
#pragma unroll
  for (int fn = 0; fn < kMmaTiledFragN; ++fn) b[fn] = *(const uint64_t*)(Bs + (wn + 16 * fn + i) * kMmaTiledRow + 4 * h);
#pragma unroll
  for (int fm = 0; fm < kMmaTiledFragM; ++fm)
#pragma unroll
    for (int fn = 0; fn < kMmaTiledFragN; ++fn) mfma_f32_16x16x16_bf16(acc[fm][fn], a[fm], b[fn]);
#else
  const int g = lane >> 2, q = lane & 3;
  uint32_t b[kMmaTiledFragN][2];
#pragma unroll
  for (int fn = 0; fn < kMmaTiledFragN; ++fn)
#pragma unroll
    for (int r = 0; r < 2; ++r)  // b[r]: k 2q + 8r and the next k of column g
      b[fn][r] = *(const uint32_t*)(Bs + (wn + 8 * fn + g) * kMmaTiledRow + 2 * q + 8 * r);
#pragma unroll
  for (int fm = 0; fm < kMmaTiledFragM; ++fm) {
    uint32_t a[4];
#pragma unroll
    for (int r = 0; r < 4; ++r)  // a[r]: row g + 8 (r & 1), k 2q + 8 (r >> 1) and the next k
      a[r] = *(const uint32_t*)(As + (wm + 16 * fm + g + 8 * (r & 1)) * kMmaTiledRow + 2 * q + 8 * (r >> 1));
#pragma unroll
    for (int fn = 0; fn < kMmaTiledFragN; ++fn) mma_bf16_m16n8k16(acc[fm][fn], a, b[fn]);
  }
#endif
}

__device__ __forceinline__ void mma_tiled_set(MmaTiledAcc& d, const MmaTiledAcc& s) {
#pragma unroll
  for (int fm = 0; fm < kMmaTiledFragM; ++fm)
#pragma unroll
    for (int fn = 0; fn < kMmaTiledFragN; ++fn)
#pragma unroll
      for (int r = 0; r < 4; ++r) d[fm][fn][r] = s[fm][fn][r];
}
__device__ __forceinline__ void mma_tiled_add(MmaTiledAcc& d, const MmaTiledAcc& s) {  // d = d + s (fp32 adds)
#pragma unroll
  for (int fm = 0; fm < kMmaTiledFragM; ++fm)
#pragma unroll
    for (int fn = 0; fn < kMmaTiledFragN; ++fn)
#pragma unroll
      for (int r = 0; r < 4; ++r) d[fm][fn][r] = d[fm][fn][r] + s[fm][fn][r];
}
__device__ __forceinline__ void mma_tiled_zero(MmaTiledAcc& d) {
#pragma unroll
  for (int fm = 0; fm < kMmaTiledFragM; ++fm)
#pragma unroll
    for (int fn = 0; fn < kMmaTiledFragN; ++fn)
#pragma unroll
      for (int r = 0; r < 4; ++r) d[fm][fn][r] = 0.0f;
}

// fa, the bottom of the fold stack: registers or this thread's column of shared memory (kMmaTiledFoldInShared).
struct MmaTiledFoldBottom {
  float* sh;  // [kMmaTiledAccRegs][kMmaTiledThreads] when in shared memory
  MmaTiledAcc reg;
  __device__ __forceinline__ float& at(int fm, int fn, int r) {
    if constexpr (kMmaTiledFoldInShared)
      return sh[((fm * kMmaTiledFragN + fn) * 4 + r) * kMmaTiledThreads + (int)threadIdx.x];
    else
      return reg[fm][fn][r];
  }
  __device__ __forceinline__ void set(const MmaTiledAcc& v) {
#pragma unroll
    for (int fm = 0; fm < kMmaTiledFragM; ++fm)
#pragma unroll
      for (int fn = 0; fn < kMmaTiledFragN; ++fn)
#pragma unroll
        for (int r = 0; r < 4; ++r) at(fm, fn, r) = v[fm][fn][r];
  }
  __device__ __forceinline__ void add(const MmaTiledAcc& v) {  // fa = fa + v (fp32 adds, the tree's)
#pragma unroll
    for (int fm = 0; fm < kMmaTiledFragM; ++fm)
#pragma unroll
      for (int fn = 0; fn < kMmaTiledFragN; ++fn)
#pragma unroll
        for (int r = 0; r < 4; ++r) at(fm, fn, r) = at(fm, fn, r) + v[fm][fn][r];
  }
};

// kControl: kMmaControlNone in every GPU build; the emulated launcher's negative controls build the others.
template <typename TC, int kStaging, int kControl>
__global__ void __launch_bounds__(kMmaTiledThreads) mma_linear_tiled_kernel(GemmParams p) {
  bf16_t* smem = dynamic_shared<bf16_t>();  // [kMmaTiledBuffers][A 128 rows | B 64 rows][kMmaTiledRow], fold
  const int warp = (int)(threadIdx.x / kBf16MmaWarpLanes);
  const int wm = (warp / kMmaTiledWarpsN) * kMmaTiledWarpM, wn = (warp % kMmaTiledWarpsN) * kMmaTiledWarpN;
  const int64_t m0 = (int64_t)blockIdx.y * kMmaTiledM, n0 = (int64_t)blockIdx.x * kMmaTiledN;
  constexpr bool kReverse = kControl == kMmaControlReverseBlocks;

  // Producer: the steps in the contract's order, kMmaTiledStages - 1 stages ahead of the consumer.
  MmaTiledCursor ld;
  ld.enter_lane(p, 0);
  ld.skip_empty(p);
  int total = 0;  // steps (instructions per output) over all lanes
  for (int l = 0; l < p.lanes; ++l)
    total += (int)((linear_lane_begin(l + 1, p.K, p.lanes) - linear_lane_begin(l, p.K, p.lanes) + kMmaGpuKBlock - 1) /
                   kMmaGpuKBlock);
  int issued = 0;
  auto issue = [&]() {  // stage the next stage's steps (those < total) into their buffers; one commit group each
#pragma unroll
    for (int s = 0; s < kMmaTiledStepsPerStage; ++s, ++issued) {
      if (issued < total) {
        bf16_t* As = smem + (issued % kMmaTiledBuffers) * kMmaTiledStageElems;
        mma_tiled_stage<kStaging>(p, m0, n0, ld.kb(kReverse), ld.k1, As, As + kMmaTiledM * kMmaTiledRow);
        ld.advance(p);
      }
    }
    mma_tiled_commit();
  };
#pragma unroll 1
  for (int s = 0; s < kMmaTiledStages - 1; ++s) issue();

  MmaTiledAcc acc, fb, fc, split;  // running chain; fold stack (fa, fb, fc); split: negative control only
  MmaTiledFoldBottom fa;
  fa.sh = (float*)(smem + kMmaTiledBuffers * kMmaTiledStageElems);
  int step = 0;
#pragma unroll 1
  for (int l = 0; l < p.lanes; ++l) {
    const int blocks = (int)((linear_lane_begin(l + 1, p.K, p.lanes) - linear_lane_begin(l, p.K, p.lanes) +
                              kMmaGpuKBlock - 1) / kMmaGpuKBlock);
    mma_tiled_zero(acc);
#pragma unroll 1
    for (int j = 0; j < blocks; ++j, ++step) {
      if (step % kMmaTiledStepsPerStage == 0) {  // the first step of a stage (uniform over the CTA)
        mma_tiled_wait(kMmaTiledStages - 2);     // this thread's copies of this stage landed
        __syncthreads();  // everyone's did; and everyone finished the previous stage (its buffers are free)
        issue();
      }
      if constexpr (kControl == kMmaControlSplitK) {  // NEGATIVE CONTROL: the lane's chain cut in two halves
        if (blocks >= 2 && j == blocks / 2) {
          mma_tiled_set(split, acc);
          mma_tiled_zero(acc);
        }
      }
      const bf16_t* As = smem + (step % kMmaTiledBuffers) * kMmaTiledStageElems;
      mma_tiled_block(As, As + kMmaTiledM * kMmaTiledRow, wm, wn, acc);
    }
    if constexpr (kControl == kMmaControlSplitK) {
      if (blocks >= 2) {
        mma_tiled_add(split, acc);
        mma_tiled_set(acc, split);
      }
    }
    // The progressive fold of linear_lane_fold (header comment); the negative control folds left to right.
    if constexpr (kControl == kMmaControlFoldChain) {
      if (l == 0) fa.set(acc);
      else fa.add(acc);
    } else {
      if (l == 0) {
        fa.set(acc);
      } else if (l == 1) {
        fa.add(acc);
      } else if (l == 2 || l == 4) {
        mma_tiled_set(fb, acc);
      } else if (l == 3) {
        mma_tiled_add(fb, acc);
        fa.add(fb);
      } else if (l == 5) {
        mma_tiled_add(fb, acc);
      } else if (l == 6) {
        mma_tiled_set(fc, acc);
      } else {
        mma_tiled_add(fc, acc);
        mma_tiled_add(fb, fc);
        fa.add(fb);
      }
    }
  }
  mma_tiled_wait(0);  // retire the trailing empty groups (nothing is pending past `total`)

  // Epilogue: bias and one rounding (linear_mma) or the unrounded fold (linear_mma_partial), per output.
  TC* C = (TC*)p.C;
  const int lane = (int)(threadIdx.x % kBf16MmaWarpLanes);
#pragma unroll
  for (int fm = 0; fm < kMmaTiledFragM; ++fm)
#pragma unroll
    for (int fn = 0; fn < kMmaTiledFragN; ++fn)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
#if defined(ALIGNED_GPU_HIP)
        const int64_t row = m0 + wm + 16 * fm + 4 * (lane >> 4) + r, col = n0 + wn + 16 * fn + (lane & 15);
#else
        const int64_t row = m0 + wm + 16 * fm + (lane >> 2) + 8 * (r >> 1),
                      col = n0 + wn + 8 * fn + 2 * (lane & 3) + (r & 1);
#endif
        if (row >= p.M || col >= p.N) continue;
        if constexpr (sizeof(TC) == sizeof(float)) C[row * p.c_sm + col] = fa.at(fm, fn, r);
        else C[row * p.c_sm + col] = linear_epilogue(fa.at(fm, fn, r), (const TC*)p.bias, col);
      }
}

// The launcher's staging choice: the vector path needs unit k-strides, 16-byte aligned bases and rows, and every
// lane boundary on a multiple of 8 k (then a 16-byte chunk never straddles a lane's end).
inline int mma_tiled_staging(const GemmParams& p) {
  if (p.a_sk != 1 || p.b_sk != 1 || p.a_sm % 8 != 0 || p.b_sn % 8 != 0) return kMmaTiledElement;
  if (((uintptr_t)p.A | (uintptr_t)p.B) % 16 != 0) return kMmaTiledElement;
  for (int l = 0; l <= p.lanes; ++l)
    if (linear_lane_begin(l, p.K, p.lanes) % 8 != 0) return kMmaTiledElement;
  return kMmaTiledVector;
}

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
