// int_mma.cuh — the integer matrix instructions of the exact linear (csrc/gpu/exact_linear_kernels.cuh), one
// wrapper per vendor instruction, each documenting its fragment layout (who holds which element):
//
//   CUDA  mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 (sm_80+: sm_90a, sm_100a), one warp of 32 lanes,
//         D[16x8] = A[16x32] B[32x8] + C. Lane l, g = l / 4, q = l % 4 (PTX ISA, "Matrix Fragments for
//         mma.m16n8k32", .s8):  a[0] = A[g][4q..4q+3]      a[1] = A[g+8][4q..4q+3]
//                              a[2] = A[g][16+4q..+3]     a[3] = A[g+8][16+4q..+3]
//                              b[0] = B[4q..4q+3][g]      b[1] = B[16+4q..+3][g]
//                              c[0..1] = C[g][2q, 2q+1]   c[2..3] = C[g+8][2q, 2q+1]
//   HIP   v_mfma_i32_16x16x32_i8 (gfx942 and gfx950, CDNA3/4), one wave of 64 lanes, D[16x16] = A[16x32]
//         B[32x16] + C. Lane l, i = l % 16, h = l / 16 (AMD matrix instruction calculator):
//                              a (8 bytes) = A[i][8h..8h+7]   b (8 bytes) = B[8h..8h+7][i]
//                              c[r] = C[4h + r][i], r < 4
// Bytes are little-endian: element 0 of a register is its low byte. Both instructions are exact (int8 x int8
// products, int32 accumulation that the kernels keep below 2^31); the emulation target (csrc/emu/runtime.cpp)
// runs the same layouts, so the kernel source it executes is the one a GPU runs.
#pragma once

#include <stdint.h>

#include "compat.cuh"

namespace aligned::gpu::ALIGNED_GPU_BUILD {

#if defined(ALIGNED_GPU_HIP)
constexpr int kMatrixWarpLanes = 64;  // MFMA works on the whole wave64

// c += A * B for the 16x16x32 tile held by this wave (layout above).
__device__ __forceinline__ void mfma_i32_16x16x32_i8(int32_t (&c)[4], int64_t a, int64_t b) {
#if defined(ALIGNED_GPU_EMULATED)
  ::aligned::emu::MatrixFragment f;
  f.a[0] = (uint32_t)(uint64_t)a;
  f.a[1] = (uint32_t)((uint64_t)a >> 32);
  f.a[2] = f.a[3] = 0;
  f.b[0] = (uint32_t)(uint64_t)b;
  f.b[1] = (uint32_t)((uint64_t)b >> 32);
  for (int r = 0; r < 4; ++r) f.c[r] = c[r];
  ::aligned::emu::warp_matrix(::aligned::emu::MatrixOp::kMfmaI32x16x16x32I8, &f, ~0ull, false);
  for (int r = 0; r < 4; ++r) c[r] = f.c[r];
#elif defined(__HIP_DEVICE_COMPILE__)
  typedef int v4i __attribute__((ext_vector_type(4)));
  v4i acc = {c[0], c[1], c[2], c[3]};
  acc = __builtin_amdgcn_mfma_i32_16x16x32_i8((long)a, (long)b, acc, 0, 0, 0);
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
constexpr int kMatrixWarpLanes = 32;  // mma.sync works on one warp

// c += A * B for the 16x8x32 tile held by this warp (layout above).
__device__ __forceinline__ void mma_s8_m16n8k32(int32_t (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(ALIGNED_GPU_EMULATED)
  ::aligned::emu::MatrixFragment f;
  for (int r = 0; r < 4; ++r) {
    f.a[r] = a[r];
    f.c[r] = c[r];
  }
  f.b[0] = b[0];
  f.b[1] = b[1];
  ::aligned::emu::warp_matrix(::aligned::emu::MatrixOp::kMmaM16N8K32S8, &f, 0xffffffffu, true);
  for (int r = 0; r < 4; ++r) c[r] = f.c[r];
#elif defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  (void)c;
  (void)a;
  (void)b;
#endif
}
#endif

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
