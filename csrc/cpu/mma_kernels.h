// mma_kernels.h — torch-free entry points of the CPU `mma` linear (csrc/common/mma.h defines the numbers;
// gemm_mma_kernels.cpp computes them with AVX512-BF16 vdpbf16ps, gemm_amx_mma_kernels.cpp with AMX-BF16
// tdpbf16ps).
//
// Unlike the fma / exact families, the mma kernels are compiled ONCE, for the one level that has the unit
// (CMake: ALIGNED_ISA=avx512bf16, the avx512 flags + -mavx512bf16): the profile's bits are the instruction's,
// so there is no generic or AVX2 fallback that could compute them. cpu_backend() hands out this table only on a
// CPU with avx512_bf16 (and AVX-512 F/BW/VL/DQ) whose chosen level is avx512 or amx; elsewhere `mma` is nullptr
// and the ops refuse by name. Which unit: the `amx` level (AMX tiles granted, amx_bf16) runs kMmaAmx, the
// `avx512` level kMma (ALIGNED_CPU_ISA=avx512 on an AMX CPU gives the bits every avx512_bf16 CPU shares).
#pragma once

#include <stdint.h>

#include "../common/mma.h"
#include "../common/params_linear.h"

namespace aligned::cpu {

struct MmaKernels {
  const char* unit;  // "avx512_bf16" (vdpbf16ps) or "amx_bf16" (tdpbf16ps): the unit named by aligned::MmaUnit
  MmaUnit unit_id;
  // C[m, n] = epilogue(linear_lane_fold over p.lanes (1, 2, 4, 8) lanes of the unit's chains of A[m, :] . B[n, :])
  // for rows [m0, m1) x columns [n0, n1) (mma.h). A bf16 with unit k-stride (a_sk == 1); B bf16 row-major
  // (b_sk == 1: the forward's weight) or column-major (b_sn == 1: the backward's w and x, read in place); C bf16
  // (+ bf16 bias, one rounding) or fp32 (linear_mma_partial: the unrounded sub-tree, no bias).
  void (*gemm)(const GemmParams& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1);
  // The unit's plain form, what the kernels are held to: fp32 C[m, n] = the lane tree over p.lanes lanes (no
  // bias, no rounding) for rows [m0, m1), one element at a time, any strides. avx512_bf16: mma.h's scalar model
  // of the instruction; amx_bf16 (no model exists): the instruction itself on 1 x 1 tiles, operand roles swapped.
  void (*reference)(const GemmParams& p, int64_t m0, int64_t m1);
  // gemm takes only a row-major B (b_sk == 1): the glue copies a column-major B (the backward's) first.
  bool row_major_b;
  // amx_bf16 only (else nullptr): weight rows [16 nb0, 16 nb1) of w [N, K] (row stride w_sn) in the unit's packed
  // layout, 8 lanes (mma.h mma_amx_lane_blocks); gemm reads it when GemmParams::B_packed is set.
  void (*pack_weight)(const uint16_t* w, int64_t w_sn, int64_t N, int64_t K, int64_t nb0, int64_t nb1, void* out);
};

}  // namespace aligned::cpu
