// exact_kernels.h — torch-free entry points of the CPU `exact` linear (csrc/common/exact_linear.h defines
// the numbers; gemm_exact_kernels.cpp computes them, once per ISA level).
//
// Packed forms (built by the pack functions, consumed by exact_gemm):
//   x digits  xd[t][Mp][Kp]                 int8, t < Sx_max, rows padded to Mp = 16*ceil(M/16) and
//                                           k to Kp = 64*ceil(K/64) with zeros (AMX A-tiles, VNNI broadcasts)
//   w digits  wd[u][Np/16][Kp/4][16][4]     int8, u < Sw: panels of 16 output columns, k in quads (the AMX
//                                           B-tile / VNNI layout: 64 bytes = 16 columns x 4 k)
//   per row   exponent E (int32), digit count S (int8, x only), non-finite flag (uint8)
#pragma once

#include <stdint.h>

#include "../common/exact_linear.h"
#include "../common/params_exact.h"
#include "cpu_kernels.h"

namespace aligned::cpu {

using aligned::ExactGemmParams;  // common/params_exact.h, shared with the GPU launcher

// The fp64 path (exact_linear.h, "the fp64 path"): rows[i], i < R, of x (converted: x64 [R, ldx] doubles,
// ldx = 8 ceil(K / 8), zero padded) against weight rows [n0, n1) of w [N, K] in dt; out[rows[i], n] in dt.
// Only for row pairs meeting bound (B) (the glue checks; other outputs the glue recomputes on the digit path):
// then the sums are the digit path's exact sums.
struct ExactF64Params {
  DType dt;
  const double* x64;
  int64_t ldx;
  const int64_t* rows;
  int64_t R;
  const void* w;
  const uint8_t* w_bad;
  const void* bias;  // [N] in dt, or null
  void* out;         // [M, N] row-major in dt
  int64_t N, K;
  int64_t n0, n1;
};

// The fp64 split route (exact_linear.h, "the fp64 split route"): one x row cut into its two halves (x64: row 0
// = hi, row 1 = lo, [2, ldx] doubles, zero padded) against the listed output columns cols[j], j < ncols, whose
// weight rows (K elements in dt) are w_rows[j] (the weight's row, or its canonical rounding for a row whose
// form rounds); out_row[cols[j]] in dt (the row's [N] outputs). Only for columns whose pair the glue checked
// (both halves meet (B) with the weight row).
struct ExactF64SplitParams {
  DType dt;
  const double* x64;
  int64_t ldx;
  const void* const* w_rows;
  const int64_t* cols;
  int64_t ncols;
  const uint8_t* w_bad;
  const void* bias;  // [N] in dt, or null
  void* out_row;     // [N] in dt
  int64_t K;
};

struct ExactKernels {
  const char* isa;
  // rows [r0, r1) of x [M, K] (dtype dt): forms + digits into the packed buffers (xd planes hold
  // max_digits planes; a row writes its own S digits and zeros the rest)
  void (*pack_x)(DType dt, const void* x, int64_t K, int64_t Kp, int64_t x_plane, int max_digits, int8_t* xd,
                 int32_t* x_exp, int8_t* x_digits, uint8_t* x_bad, int64_t r0, int64_t r1);
  // rows [r0, r1) of a weight [N, K]: their canonical forms (E, S, bad)
  void (*w_forms)(DType dt, const void* w, int64_t K, aligned::exact::RowForm* forms, int64_t r0, int64_t r1);
  // rows [r0, r1) of the weight with Sw digits into the panel layout (padding rows/k must be pre-zeroed)
  void (*pack_w)(DType dt, const void* w, int64_t K, int64_t Kp, int64_t w_plane, int sw,
                 const aligned::exact::RowForm* forms, int8_t* wd, int32_t* w_exp, uint8_t* w_bad, int64_t r0,
                 int64_t r1);
  void (*gemm)(const ExactGemmParams& p);
  // which integer unit gemm would use here ("amx", "avx512-vnni", "avx512bw", "avx2", "generic")
  const char* (*unit)(bool use_amx);
  // the fp64 path: rows [r0, r1) of v [., K]: the bound b of exact_linear.h (f64_row_bound) and the NaN/inf flag
  void (*row_bounds)(DType dt, const void* v, int64_t K, int32_t* bound, uint8_t* bad, int64_t r0, int64_t r1);
  // x64[i] = row rows[i] of x as doubles (zero padded to ldx), i in [i0, i1)
  void (*f64_convert_rows)(DType dt, const void* x, int64_t K, int64_t ldx, const int64_t* rows, double* x64,
                           int64_t i0, int64_t i1);
  void (*f64_gemm)(const ExactF64Params& p);
  void (*f64_split_gemm)(const ExactF64SplitParams& p);
  // TP (exact_linear.h, "tensor parallelism"): rows [r0, r1) of v [., K]: their scans, int32 (emax, -lmin, bad)
  void (*row_scans)(DType dt, const void* v, int64_t K, int32_t* scans, int64_t r0, int64_t r1);
  // rows [r0, r1) of x packed as pack_x does, but against the given scans of the full rows
  void (*pack_x_scanned)(DType dt, const void* x, int64_t K, int64_t Kp, int64_t x_plane, int max_digits,
                         const int32_t* scans, int8_t* xd, int32_t* x_exp, int8_t* x_digits, uint8_t* x_bad,
                         int64_t r0, int64_t r1);
};

// The table for the process's ISA level (same choice as cpu_kernels()).
const ExactKernels& exact_kernels();
// AMX-INT8 present and the tile state granted (arch_prctl) — asked once per process.
bool amx_int8_usable();

}  // namespace aligned::cpu
