// dense_api.h — the torch-free host interface of the GPU dense kernels (CUDA and HIP).
//
// The torch glue (csrc/cuda/ops_cuda.cpp) fills one params struct per op with raw device pointers and
// calls the launcher; the launchers are defined once in csrc/gpu/dense_launch.cuh and compiled by nvcc
// (csrc/cuda/dense.cu) or hip-clang (csrc/hip/dense.hip). This header includes no vendor header, so the
// glue compiles as plain C++ and the stream travels as an opaque pointer (cudaStream_t / hipStream_t).
//
// Every launcher enqueues its kernels on `stream` and returns nullptr, or the runtime's error string
// when a launch failed. Shapes are already validated by the glue; zero-size problems launch nothing.
#pragma once

#include <stdint.h>

#include "../common/dtype.h"

namespace aligned::gpu {

using aligned::DType;  // common/dtype.h, shared with the CPU backend

// Data-value checks on the GPU run in the kernel, not on the host (a host check of device data is a
// synchronisation on every decode step and breaks CUDA-graph capture). A kernel that meets a bad value
// keeps every read in bounds, writes NaN for the row, and stores 1 into error_flags[code] (a plain store of
// the same constant by every finder: a flag, not a reduction). The glue passes one persistent int32 word per
// code per device; aligned_ops.check_device_errors() reads and clears them outside the hot path.
enum DeviceError : int {
  kErrRotaryPosition = 0,     // rotary_embedding(_backward): a position outside [0, max_position)
  kErrTemperature = 1,        // the log-prob family: a per-row temperature not finite or < FLT_MIN
  kErrTokenId = 2,            // token_logprobs(_backward): a token id outside [0, V)
  kErrAttentionPlan = 3,      // attention_varlen_planned / paged_attention_planned: the plan does not fit the call
  kNumDeviceErrors = 4,
};

struct RmsNormParams {
  DType dt, wdt;           // x/out dtype; weight dtype (== dt or F32)
  const void* x;           // [rows, H]
  const void* residual;    // fused_add_rms_norm only: [rows, H], else nullptr
  const void* w;           // [H]
  void* out;               // [rows, H]
  void* residual_out;      // fused_add_rms_norm only: [rows, H], else nullptr
  int64_t rows, H;
  float eps;
};

struct RmsNormBackwardParams {
  DType dt, wdt;
  const void* g;   // [rows, H]
  const void* x;   // [rows, H]
  const void* w;   // [H]
  void* dx;        // [rows, H]
  float* inv;      // [rows] scratch: 1/rms per row (written by the dx pass, read by the dw pass)
  float* dw;       // [H] fp32
  int64_t rows, H;
  float eps;
};

struct SiluMulParams {
  DType dt;
  const void* g;   // backward only: [rows, d], else nullptr
  const void* x;   // [rows, 2d]
  void* out;       // forward: [rows, d]; backward: dx [rows, 2d]
  int64_t rows, d;
};

struct RotaryParams {
  DType dt;
  const int64_t* positions;  // [T]; an entry outside [0, max_pos) gives NaN and error_flags[kErrRotaryPosition]
  const void* x;             // [T, heads, head_dim]
  void* out;                 // [T, heads, head_dim]
  const float* cache;        // [max_pos, rot]
  int64_t T, heads, head_dim, rot;
  bool is_neox, inverse;
  int64_t max_pos;           // rows of cache
  int32_t* error_flags;      // [kNumDeviceErrors] device words, or nullptr (values checked on the host)
};

// The log-prob family: logits [T, V]; temperature per row (temps) or the scalar tau.
struct LogitsParams {
  DType dt;
  const void* z;
  int64_t T, V;
  float tau;
  const float* temps;     // [T] or nullptr; an entry not finite or < FLT_MIN: NaN row + kErrTemperature
  const int64_t* ids;     // [T] (token_logprobs / backward); outside [0, V): NaN row + kErrTokenId
  const float* g;         // backward: [T] (token_logprobs, logsumexp) or [T, V] (log_softmax), fp32
  float* lse;             // [T] out (logsumexp), or nullptr
  float* out_f32;         // log_softmax [T, V] / token_logprobs [T], or nullptr
  void* dz;               // backward [T, V] in dt, or nullptr
  int32_t* error_flags;   // [kNumDeviceErrors] device words, or nullptr (values checked on the host)
};

// C[m, n] = round_TC(linear_lane_fold over `lanes` lanes of the fma chains of A[m, :] * B[n, :] (+ bias[n]))
// (contract.h, `fma` profile), element strides. adt == bdt; cdt == adt, or F32 (linear_partial).
struct GemmParams {
  DType adt, bdt, cdt;
  const void* A;
  int64_t a_sm, a_sk;
  const void* B;
  int64_t b_sn, b_sk;
  const void* bias;  // [N] in cdt, or nullptr
  void* C;           // [M, N] contiguous (row stride c_sm)
  int64_t c_sm;
  int64_t M, N, K;
  int lanes;         // 1, 2, 4 or 8 (8: linear; 1: backward chains)
  float* lane_ws;    // [lanes, ws_rows, N] fp32 scratch, required when lanes > 1
  int64_t ws_rows;   // rows the workspace holds: M is run in chunks of ws_rows rows (bounds its memory)
};

// out[n] = round(chain over m = 0..rows-1 of (. + g[m, n])), g [rows, cols] contiguous.
struct ColumnSumParams {
  DType dt, out_dt;
  const void* g;
  void* out;
  int64_t rows, cols;
};

struct ElementwiseParams {
  const float* x;
  float* out;
  int64_t n;
};

const char* launch_rms_norm(const RmsNormParams& p, void* stream);
const char* launch_fused_add_rms_norm(const RmsNormParams& p, void* stream);
const char* launch_rms_norm_backward(const RmsNormBackwardParams& p, void* stream);
const char* launch_silu_and_mul(const SiluMulParams& p, void* stream);
const char* launch_silu_and_mul_backward(const SiluMulParams& p, void* stream);
const char* launch_rotary(const RotaryParams& p, void* stream);
const char* launch_logsumexp(const LogitsParams& p, void* stream);
const char* launch_log_softmax(const LogitsParams& p, void* stream);
const char* launch_token_logprobs(const LogitsParams& p, void* stream);
const char* launch_token_logprobs_backward(const LogitsParams& p, void* stream);
const char* launch_logsumexp_backward(const LogitsParams& p, void* stream);
const char* launch_log_softmax_backward(const LogitsParams& p, void* stream);
const char* launch_gemm(const GemmParams& p, void* stream);
const char* launch_column_sum(const ColumnSumParams& p, void* stream);
const char* launch_exp_f32(const ElementwiseParams& p, void* stream);
const char* launch_log_f32(const ElementwiseParams& p, void* stream);

}  // namespace aligned::gpu
