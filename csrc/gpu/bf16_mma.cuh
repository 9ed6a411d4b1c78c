// bf16_mma.cuh — the bf16 -> fp32 matrix instruction of the `mma` linear (csrc/gpu/mma_linear_kernels.cuh), one
// wrapper per vendor, each documenting its fragment layout (who holds which element). One instruction shape per
// vendor, whatever M: the unit's internal order is not specified, so the kernels never swap operands or change
// the shape between M buckets (issue 27).
//
//   CUDA  mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (sm_80+: sm_90a, sm_100a, sm_120a), one warp of
//         32 lanes, D[16x8] = A[16x16] B[16x8] + C. Lane l, g = l / 4, q = l % 4 (PTX ISA, "Matrix Fragments
//         for mma.m16n8k16", .bf16; element 0 of a 32-bit register is its low half):
//                              a[0] = A[g][2q, 2q+1]       a[1] = A[g+8][2q, 2q+1]
//                              a[2] = A[g][8+2q, 8+2q+1]   a[3] = A[g+8][8+2q, 8+2q+1]
//                              b[0] = B[2q, 2q+1][g]       b[1] = B[8+2q, 8+2q+1][g]
//                              c[0..1] = C[g][2q, 2q+1]    c[2..3] = C[g+8][2q, 2q+1]   (fp32)
//   HIP   v_mfma_f32_16x16x16_bf16 (the _1k form; gfx942 and gfx950, CDNA3/4), one wave of 64 lanes,
//         D[16x16] = A[16x16] B[16x16] + C. Lane l, i = l % 16, h = l / 16 (AMD matrix instruction calculator):
//                              a (4 bf16) = A[i][4h..4h+3]   b (4 bf16) = B[4h..4h+3][i]
//                              c[r] = C[4h + r][i], r < 4   (fp32)
// The arithmetic of one instruction is the unit's (NOT an fma chain: see csrc/emu/bf16_mma_models.h for the
// published models); under emulation the runtime (csrc/emu/runtime.cpp) reads the same layouts and applies the
// scope's model, so the kernel source it runs is the one a GPU runs.
#pragma once

#include <stdint.h>

#include "compat.cuh"

namespace aligned::gpu::ALIGNED_GPU_BUILD {

#if defined(ALIGNED_GPU_HIP)
constexpr int kBf16MmaWarpLanes = 64;  // MFMA works on the whole wave64
constexpr int kBf16MmaTileN = 16;      // columns of one instruction

// c += A * B for the 16x16x16 tile held by this wave (layout above); a, b: 4 bf16 each, element 0 lowest.
__device__ __forceinline__ void mfma_f32_16x16x16_bf16(float (&c)[4], uint64_t a, uint64_t b) {
#if defined(ALIGNED_GPU_EMULATED)
  ::aligned::emu::MatrixFragment f;
  f.a[0] = (uint32_t)a;
  f.a[1] = (uint32_t)(a >> 32);
  f.a[2] = f.a[3] = 0;
  f.b[0] = (uint32_t)b;
  f.b[1] = (uint32_t)(b >> 32);
  memcpy(f.c, c, sizeof f.c);
  ::aligned::emu::warp_matrix(::aligned::emu::MatrixOp::kMfmaF32x16x16x16Bf16, &f, ~0ull, false);
  memcpy(c, f.c, sizeof f.c);
#elif defined(__HIP_DEVICE_COMPILE__)
  typedef short v4s __attribute__((ext_vector_type(4)));
  typedef float v4f __attribute__((ext_vector_type(4)));
  v4s va, vb;
  __builtin_memcpy(&va, &a, 8);
  __builtin_memcpy(&vb, &b, 8);
  v4f acc = {c[0], c[1], c[2], c[3]};
  acc = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(va, vb, acc, 0, 0, 0);
  c[0] = acc[0];
  c[1] = acc[1];
  c[2] = acc[2];
  c[3] = acc[3];
#else
  (void)c;
  (void)a;
  (void)b;
#endif
}

#else
constexpr int kBf16MmaWarpLanes = 32;  // mma.sync works on one warp
constexpr int kBf16MmaTileN = 8;       // columns of one instruction

// c += A * B for the 16x8x16 tile held by this warp (layout above).
__device__ __forceinline__ void mma_bf16_m16n8k16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(ALIGNED_GPU_EMULATED)
  ::aligned::emu::MatrixFragment f;
  for (int r = 0; r < 4; ++r) f.a[r] = a[r];
  f.b[0] = b[0];
  f.b[1] = b[1];
  memcpy(f.c, c, sizeof f.c);
  ::aligned::emu::warp_matrix(::aligned::emu::MatrixOp::kMmaM16N8K16Bf16, &f, 0xffffffffu, true);
  memcpy(c, f.c, sizeof f.c);
#elif defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  (void)c;
  (void)a;
  (void)b;
#endif
}
#endif

// One instruction on operands given element-wise (shared by kernels whose operands are not plain strided matrices,
// e.g. attention_mma_kernels.cuh): c (the C/D fragment of this lane, layout above) = STEP(c, A, B) with A 16 x 16
// and B 16 x kBf16MmaTileN, a_at(row, k) / b_at(k, col) returning the elements' bf16 bit patterns (the caller
// writes its own +0 padding there). The whole warp / wave calls it with the same operands.
template <class AAt, class BAt>
__device__ __forceinline__ void bf16_mma_step(float (&c)[4], const AAt& a_at, const BAt& b_at) {
  const int lane = (int)(threadIdx.x % kBf16MmaWarpLanes);
#if defined(ALIGNED_GPU_HIP)
  const int i = lane & 15, h = lane >> 4;
  uint64_t a = 0, b = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    a |= (uint64_t)a_at(i, 4 * h + e) << (16 * e);
    b |= (uint64_t)b_at(4 * h + e, i) << (16 * e);
  }
  mfma_f32_16x16x16_bf16(c, a, b);
#else
  const int g = lane >> 2, q = lane & 3;
  uint32_t a[4], b[2];
#pragma unroll
  for (int r = 0; r < 4; ++r) {  // a[r]: row g + 8 (r & 1), k 2q + 8 (r >> 1) and the next k
    const int row = g + 8 * (r & 1), k = 2 * q + 8 * (r >> 1);
    a[r] = (uint32_t)a_at(row, k) | (uint32_t)a_at(row, k + 1) << 16;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {  // b[r]: k 2q + 8r and the next k of column g
    const int k = 2 * q + 8 * r;
    b[r] = (uint32_t)b_at(k, g) | (uint32_t)b_at(k + 1, g) << 16;
  }
  mma_bf16_m16n8k16(c, a, b);
#endif
}

// The (row, col) of the one-instruction tile (16 x kBf16MmaTileN) that register r of this lane's C fragment holds.
__device__ __forceinline__ void bf16_mma_c_coords(int r, int& row, int& col) {
  const int lane = (int)(threadIdx.x % kBf16MmaWarpLanes);
#if defined(ALIGNED_GPU_HIP)
  row = 4 * (lane >> 4) + r;
  col = lane & 15;
#else
  row = (lane >> 2) + 8 * (r >> 1);
  col = 2 * (lane & 3) + (r & 1);
#endif
}

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
