// params_linear.h — the params structs of the `fma` linear family (contract.h, `fma` profile): the GEMM
// behind linear, linear_partial and linear_backward's dx/dw, and the column sum behind its bias gradient.
// Shared by every backend (CPU kernel table: csrc/cpu/cpu_kernels.h, which also runs the moe family's
// expert projections through it; GPU launchers: csrc/gpu/dense_api.h) and filled from tensors once
// (csrc/torch/make_params.h). The exact profile's GEMM params: params_exact.h.
#pragma once

#include <stdint.h>

#include "dtype.h"

namespace aligned {

// C[m, n] = round_cdt(linear_lane_fold over `lanes` lanes of the fma chains of A[m, :] * B[n, :] (+ bias[n]))
// — contract.h, `fma` profile. Element strides; adt == bdt; cdt == adt, or F32 (linear_partial: the unrounded
// sub-tree).
struct GemmParams {
  DType adt, bdt, cdt;  // A, B and C dtypes
  const void* A;        // [M, K], element strides (a_sm, a_sk)
  int64_t a_sm, a_sk;
  const void* B;        // [N, K], element strides (b_sn, b_sk)
  int64_t b_sn, b_sk;
  const void* bias;     // [N] in cdt, or nullptr
  void* C;              // [M, N], row stride c_sm, unit column stride
  int64_t c_sm;
  int64_t M, N, K;
  int lanes;            // 1, 2, 4 or 8 (8: linear; 1: the backward's single chains)
  float* lane_ws;       // GPU: [lanes, ws_rows, N] fp32 lane sums, required when lanes > 1; CPU: unused
  const void* B_packed; // CPU amx_bf16 only: B in that unit's packed layout (linear_mma_pack_weight, 8 lanes), read
                        // instead of B's rows (the same values: the same bits); nullptr elsewhere
  int64_t ws_rows;      // GPU: rows the workspace holds (M runs in chunks of ws_rows rows); CPU: unused
};

// The GEMM of contiguous row-major operands A [M, K], B [N, K] -> C [M, N] (no bias): the moe family's expert
// projections over gathered row blocks (csrc/torch/backends/cpu_moe.cpp), which address slices by pointer.
inline GemmParams row_major_gemm_params(DType dt, const void* A, const void* B, DType cdt, void* C, int64_t M,
                                        int64_t N, int64_t K, int lanes) {
  GemmParams p{};
  p.adt = p.bdt = dt;
  p.cdt = cdt;
  p.A = A;
  p.a_sm = K;
  p.a_sk = 1;
  p.B = B;
  p.b_sn = K;
  p.b_sk = 1;
  p.bias = nullptr;
  p.C = C;
  p.c_sm = N;
  p.M = M;
  p.N = N;
  p.K = K;
  p.lanes = lanes;
  return p;
}

// The GPU lane workspace's rows for an M x N GEMM with `lanes` lanes: at most ~64 MiB of fp32 lane sums at a
// time, in whole 128-row tiles (rows are independent, so the chunking changes no bit).
inline int64_t gemm_workspace_rows(int64_t M, int64_t N, int lanes) {
  const int64_t budget_rows = ((int64_t)64 << 20) / ((int64_t)lanes * N * 4) / 128 * 128;
  const int64_t rows = budget_rows > 128 ? budget_rows : 128;
  return M < rows ? M : rows;
}

// out[n] = round_out_dt(chain over m = 0..rows-1 of (. + g[m, n])): linear_backward's bias gradient.
struct ColumnSumParams {
  DType dt, out_dt;  // g dtype; out dtype (== dt)
  const void* g;     // [rows, cols] contiguous
  void* out;         // [cols]
  int64_t rows, cols;
};

}  // namespace aligned
