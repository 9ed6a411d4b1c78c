// params_exact.h — the params struct of the `exact` linear's GEMM (csrc/common/exact_linear.h defines the
// numbers): packed x digits times the packed weight digits, combined exactly, rounded once. Shared by every
// backend (CPU kernel table: csrc/cpu/exact_kernels.h; GPU launcher: csrc/gpu/exact_api.h). Packed layouts:
// csrc/cpu/exact_kernels.h (the GPU packs the same bytes). Since the sum is exact, no field below can change
// a bit: the tile range, k_parts, use_amx and chunk_k only choose how the same integers are summed.
#pragma once

#include <stdint.h>

#include "dtype.h"

namespace aligned {

struct ExactGemmParams {
  DType dt;              // x / weight / bias / out dtype
  // activations (packed per call)
  const int8_t* xd;      // [max digits][Mp][Kp] int8
  int64_t x_plane;       // Mp * Kp
  const int32_t* x_exp;  // [M] row exponents E
  const int8_t* x_digits;  // [M] row digit counts S
  const uint8_t* x_bad;  // [M] non-finite flags
  // weight (packed once per weight version)
  const int8_t* wd;      // [Sw][Np/16][Kp/4][16][4] int8
  int64_t w_plane;       // Np * Kp
  const int32_t* w_exp;  // [N] (the GPU reads only the 64-padded width it checks)
  const uint8_t* w_bad;  // [N]
  int w_digits;          // Sw
  // output
  const void* bias;      // [N] in dt, or null
  void* out;             // [M, N] row-major in dt
  int64_t M, N, K, Kp;   // K: CPU only (the GPU works on Kp)
  // CPU: the tile range this call computes: rows [m0, m1) (m0 % 16 == 0), columns [n0, n1) (n0 % 16 == 0)
  int64_t m0, m1, n0, n1;
  int k_parts;           // CPU: >= 1, the 64-wide k blocks cut into this many parts, each summed on its own
                         // and combined exactly (tests use it to show split-K invariance)
  bool use_amx;          // CPU, avx512 level only: AMX-INT8 tiles instead of VNNI (same integers)
  int64_t chunk_k;       // GPU: k per int32 level sum, a multiple of 32, <= 8192 (set from k_parts)
  int64_t* partial;      // CPU: when set, each output's split accumulator (hi, lo) goes to partial[(m N + n) 2 +
                         // {0, 1}] unrounded (linear_exact_partial: exact_linear.h, "tensor parallelism"),
                         // nothing to out
};

}  // namespace aligned
