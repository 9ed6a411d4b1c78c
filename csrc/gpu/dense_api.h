// dense_api.h — the torch-free host interface of the GPU dense kernels (CUDA and HIP).
//
// The torch glue's GPU backends (csrc/torch/backends/gpu.h) get one params struct per op (csrc/common/params_*.h,
// filled by csrc/torch/make_params.h: raw device pointers) and call the launcher from their build's table; the
// launchers are defined once in csrc/gpu/dense_launch.cuh and compiled by nvcc (csrc/cuda/dense.cu) or hip-clang
// (csrc/hip/dense.hip), and for the emulation target (csrc/emu). This header includes no vendor header, so the
// glue compiles as plain C++ and the stream travels as an opaque pointer (cudaStream_t / hipStream_t).
//
// Every launcher enqueues its kernels on `stream` and returns nullptr, or the runtime's error string
// when a launch failed. Shapes are already validated by the glue; zero-size problems launch nothing.
#pragma once

#include <stdint.h>

#include "../common/dtype.h"
#include "../common/params_dense.h"
#include "../common/params_linear.h"
#include "../common/params_logits.h"

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
  kErrExpertId = 4,           // moe_experts: a topk id outside [0, experts) (moe_api.h; the token's row is NaN)
  kNumDeviceErrors = 5,
};

// The params structs are the families' own, shared with the CPU backend (csrc/common/params_*.h); the
// glue fills them once from tensors (csrc/torch/make_params.h). Fields a GPU launcher ignores: LogitsParams::pairs,
// v0 and mode (the CPU's kernel table reads them).
using aligned::ColumnSumParams;
using aligned::ElementwiseParams;
using aligned::GemmParams;
using aligned::LogitsParams;
using aligned::RmsNormBackwardParams;
using aligned::RmsNormParams;
using aligned::RotaryParams;
using aligned::SiluMulParams;

// The launchers of one build of csrc/gpu (compat.cuh ALIGNED_GPU_BUILD), as a table: each build defines one
// (dense_launch.cuh), and the glue's GPU backends call the table of theirs (csrc/torch/backends/gpu.h). Every
// launcher enqueues on `stream` and returns nullptr or the runtime's launch error.
struct DenseLaunchers {
  const char* (*rms_norm)(const RmsNormParams& p, void* stream);
  const char* (*fused_add_rms_norm)(const RmsNormParams& p, void* stream);
  const char* (*rms_norm_backward)(const RmsNormBackwardParams& p, void* stream);
  const char* (*silu_and_mul)(const SiluMulParams& p, void* stream);
  const char* (*silu_and_mul_backward)(const SiluMulParams& p, void* stream);
  const char* (*rotary)(const RotaryParams& p, void* stream);
  const char* (*logsumexp)(const LogitsParams& p, void* stream);
  const char* (*log_softmax)(const LogitsParams& p, void* stream);
  const char* (*token_logprobs)(const LogitsParams& p, void* stream);
  const char* (*token_logprobs_backward)(const LogitsParams& p, void* stream);
  const char* (*logsumexp_backward)(const LogitsParams& p, void* stream);
  const char* (*log_softmax_backward)(const LogitsParams& p, void* stream);
  const char* (*gemm)(const GemmParams& p, void* stream);
  const char* (*column_sum)(const ColumnSumParams& p, void* stream);
  const char* (*exp_f32)(const ElementwiseParams& p, void* stream);
  const char* (*log_f32)(const ElementwiseParams& p, void* stream);
};

}  // namespace aligned::gpu
