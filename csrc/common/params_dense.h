// params_dense.h — the params structs of the dense family (rms_norm, fused_add_rms_norm, rms_norm_backward,
// silu_and_mul(_backward), rotary_embedding(_backward)) and of the _exp_f32/_log_f32 numerics hooks: one
// struct per op, shared by every backend. Torch-free and vendor-free: the CPU kernel tables
// (csrc/cpu/cpu_kernels.h) and the GPU launchers (csrc/gpu/dense_api.h) both take these structs, and one
// function per struct fills it from tensors after the shared checks (csrc/torch/make_params.h) — no backend's glue
// types the fields itself. Each backend only supplies run(params) (CPU: run(params, row range)).
//
// Pointers are raw element pointers of contiguous tensors unless a stride says otherwise; a tensor the op
// does not use is nullptr.
#pragma once

#include <stdint.h>

#include "dtype.h"

namespace aligned {

// rms_norm and fused_add_rms_norm: out = rms_norm(x (+ residual)) * w, row by row (contract.h).
struct RmsNormParams {
  DType dt, wdt;           // x/out dtype; weight dtype (== dt or F32)
  const void* x;           // [rows, H]
  const void* residual;    // fused_add_rms_norm only: [rows, H], else nullptr
  const void* w;           // [H]
  void* out;               // [rows, H]
  void* residual_out;      // fused_add_rms_norm only: [rows, H] (x + residual, rounded), else nullptr
  int64_t rows, H;         // x viewed as [rows, H]
  float eps;               // added to the mean square in fp32 (contract.h rms_inv)
};

// rms_norm_backward: dx per row; dw per column, one chain over the rows in order (never split).
struct RmsNormBackwardParams {
  DType dt, wdt;   // x/grad/dx dtype; weight dtype (== dt or F32)
  const void* g;   // [rows, H] incoming gradient
  const void* x;   // [rows, H]
  const void* w;   // [H]
  void* dx;        // [rows, H]
  float* inv;      // [rows] scratch: 1/rms per row (written by the dx pass, read by the dw pass)
  float* dw;       // [H] fp32 (the glue rounds it to the weight dtype)
  int64_t rows, H;
  float eps;       // as in RmsNormParams
};

// silu_and_mul (out = silu(x[:, :d]) * x[:, d:]) and its backward (out = dx).
struct SiluMulParams {
  DType dt;        // x/g/out dtype
  const void* g;   // backward only: [rows, d], else nullptr
  const void* x;   // [rows, 2d]
  void* out;       // forward: [rows, d]; backward: dx [rows, 2d]
  int64_t rows, d;
};

// silu_and_mul of contiguous rows x [rows, 2d] -> out [rows, d] addressed by pointer (the moe family's expert
// activations over gathered row blocks, csrc/torch/backends/cpu_moe.cpp).
inline SiluMulParams silu_and_mul_rows_params(DType dt, const void* x, void* out, int64_t rows, int64_t d) {
  SiluMulParams p{};
  p.dt = dt;
  p.g = nullptr;
  p.x = x;
  p.out = out;
  p.rows = rows;
  p.d = d;
  return p;
}

// rotary_embedding (inverse = false) and its backward (inverse = true: the transposed rotation).
struct RotaryParams {
  DType dt;                  // x/out dtype
  const int64_t* positions;  // [T]; on the GPU an entry outside [0, max_pos) gives NaN + kErrRotaryPosition
  const void* x;             // [T, heads, head_dim]
  void* out;                 // [T, heads, head_dim]
  const float* cache;        // [max_pos, rot] fp32: cos in the first rot/2 columns, sin in the rest
  int64_t T, heads, head_dim, rot;  // rot: rotated dims per head (even, <= head_dim); the rest is copied
  bool is_neox, inverse;     // neox: halves pair (i, i + rot/2), else (2i, 2i+1); inverse: backward
  int64_t max_pos;           // rows of cache
  int32_t* error_flags;      // GPU: [kNumDeviceErrors] device words (dense_api.h); CPU: nullptr (host checks)
};

// _exp_f32 / _log_f32: the contract's scalar exp/log (numerics.h) over a buffer, for the numerics tests.
struct ElementwiseParams {
  const float* x;  // [n]
  float* out;      // [n]
  int64_t n;
};

}  // namespace aligned
