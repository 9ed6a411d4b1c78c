// params_logits.h — the params struct of the log-prob family (logsumexp, log_softmax, token_logprobs,
// token_logprobs_pairs, their backwards, token_logprobs_backward_cols): logits [T, V] with a temperature per
// row or one scalar. One struct for every op and every backend (CPU kernel table: csrc/cpu/cpu_kernels.h;
// GPU launchers: csrc/gpu/dense_api.h), filled once from tensors by make_logits_params (csrc/torch/make_params.h).
// An output or input the op does not use is nullptr.
#pragma once

#include <stdint.h>

#include "dtype.h"

namespace aligned {

// Which backward of the family a logits_backward call computes (contract.h). The CPU runs the three in one
// kernel switched on LogitsParams::mode; the GPU has one launcher per op and ignores the field.
enum class LogitsGrad : int { kTokenLogprobs = 0, kLogsumexp = 1, kLogSoftmax = 2 };

struct LogitsParams {
  DType dt;               // logits (and dz) dtype
  const void* z;          // [T, V] logits (token_logprobs_backward_cols: the column tile [T, V], V = tile width)
  int64_t T, V;
  float tau;              // the scalar temperature (used where temps == nullptr), a normal fp32 value
  const float* temps;     // [T] or nullptr; GPU: an entry not finite or < FLT_MIN gives a NaN row + kErrTemperature
  const int64_t* ids;     // [T] token ids (token_logprobs(+_backward)); GPU: outside [0, V): NaN row + kErrTokenId
  const float* g;         // backward: [T] (token_logprobs, logsumexp) or [T, V] (log_softmax), fp32
  float* pairs;           // CPU: [T, 2] the rows' contract (m, L) pairs (contract.h LsePair): written by
                          // logsumexp_pairs, read by the others when non-null (nullptr: computed in the pass)
  float* lse;             // [T] out (logsumexp), or nullptr
  float* out_f32;         // log_softmax [T, V] / token_logprobs [T] out, or nullptr
  void* dz;               // backward [T, V] out in dt, or nullptr
  int64_t v0;             // token_logprobs_backward_cols: the tile's first vocabulary column (ids are absolute)
  LogitsGrad mode;        // CPU logits_backward: which gradient
  int32_t* error_flags;   // GPU: [kNumDeviceErrors] device words (dense_api.h); CPU: nullptr (host checks)
};

}  // namespace aligned
