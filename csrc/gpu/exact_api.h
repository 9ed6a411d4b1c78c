// exact_api.h — the torch-free host interface of the GPU `exact` linear (csrc/gpu/exact_linear_kernels.cuh),
// used by the torch glue's GPU backends (csrc/torch/backends/gpu.h) and built by csrc/cuda/exact_linear.cu
// (nvcc) and csrc/hip/exact_linear.hip (hip-clang), and by their emulated builds (csrc/emu). Packed layouts: see
// csrc/cpu/exact_kernels.h (the GPU packs the same bytes).
#pragma once

#include <stdint.h>

#include "../common/params_exact.h"
#include "dense_api.h"

namespace aligned::gpu {

// The canonical form of each row of v [rows, K]: E (int32), S (int8, 1..4), non-finite flag (uint8).
struct ExactFormsParams {
  DType dt;
  const void* v;
  int64_t rows, K;
  int32_t* E;
  int8_t* S;
  uint8_t* bad;
};

// Digits of v [rows, K] into the zeroed packed buffer `out` (planes of `plane` bytes). weight_layout: the panel
// layout with `fixed_digits` digits for every row; else the x layout with each row's S.
struct ExactPackParams {
  DType dt;
  const void* v;
  int64_t rows, K, Kp, plane;
  const int32_t* E;
  const int8_t* S;  // x layout only
  int fixed_digits;  // weight layout only
  bool weight_layout;
  int8_t* out;
};

// out [M, N] = the exact linear of packed x (xd [4, Mp, Kp]) and the packed weight (+ bias [N] in dt).
using aligned::ExactGemmParams;  // common/params_exact.h, shared with the CPU backend

// The launchers of one build of csrc/gpu (compat.cuh ALIGNED_GPU_BUILD), as a table: each build defines one
// (exact_launch.cuh), and the glue's GPU backends call the table of theirs (csrc/torch/backends/gpu.h). Every
// launcher enqueues on `stream` and returns nullptr or the runtime's launch error.
struct ExactLaunchers {
  const char* (*exact_row_forms)(const ExactFormsParams& p, void* stream);
  const char* (*exact_pack_digits)(const ExactPackParams& p, void* stream);
  const char* (*exact_gemm)(const ExactGemmParams& p, void* stream);
};

}  // namespace aligned::gpu
