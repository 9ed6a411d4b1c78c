// cpu_kernels.h — the torch-free entry points of the CPU backend.
//
// Every function computes a half-open range of rows [row_begin, row_end) so that the torch glue can hand
// disjoint row ranges to threads (at::parallel_for). Threads only ever split *rows* (or output tiles);
// the reduction inside a row follows csrc/common/contract.h, so thread count cannot change bits.
//
// The kernels are compiled once per ISA level (generic x86-64, AVX2+FMA, AVX-512) into namespaces of
// the same shape; `cpu_kernels()` returns the table for the best level the running CPU supports.
// Every level computes identical bits (same expression trees, no contraction), only faster.
#pragma once

#include <stdint.h>

#include "../common/dtype.h"
#include "../common/numerics.h"

namespace aligned::cpu {

using aligned::DType;      // common/dtype.h: the storage dtypes, shared with the GPU kernels
using aligned::with_type;  // the one place kernels turn the run-time dtype into a template argument

// Which backward of the log-prob family a logits_backward call computes (contract.h).
enum class LogitsGrad : int { kTokenLogprobs = 0, kLogsumexp = 1, kLogSoftmax = 2 };

struct KernelTable {
  const char* isa;
  // rows of x [rows, H]; weight [H] in dtype wdt (== dt or F32)
  void (*rms_norm)(DType dt, DType wdt, const void* x, const void* w, void* out, int64_t H, float eps,
                   int64_t row_begin, int64_t row_end);
  void (*fused_add_rms_norm)(DType dt, DType wdt, const void* x, const void* res, const void* w, void* out,
                             void* res_out, int64_t H, float eps, int64_t row_begin, int64_t row_end);
  void (*rms_norm_backward_dx)(DType dt, DType wdt, const void* g, const void* x, const void* w, void* dx,
                               int64_t H, float eps, int64_t row_begin, int64_t row_end);
  // dw[col] for col in [col_begin, col_end): chain over all rows in order; writes fp32 partial-free result
  void (*rms_norm_backward_dw)(DType dt, const void* g, const void* x, float* dw, int64_t rows, int64_t H,
                               float eps, const float* inv_per_row, int64_t col_begin, int64_t col_end);
  void (*rms_inv_rows)(DType dt, const void* x, float* inv, int64_t H, float eps, int64_t row_begin,
                       int64_t row_end);
  // x [rows, 2d] -> out [rows, d]
  void (*silu_and_mul)(DType dt, const void* x, void* out, int64_t d, int64_t row_begin, int64_t row_end);
  void (*silu_and_mul_backward)(DType dt, const void* g, const void* x, void* dx, int64_t d, int64_t row_begin,
                                int64_t row_end);
  // x [T, heads, head_dim] rows = tokens; cache [max_pos, rot] fp32
  void (*rotary)(DType dt, const int64_t* positions, const void* x, void* out, const float* cache, int64_t heads,
                 int64_t head_dim, int64_t rot, bool is_neox, bool inverse, int64_t row_begin, int64_t row_end);
  // logits [T, V]; tau per row (temps[t]) or the scalar when temps == nullptr. A row's statistics are the
  // contract's pair (m, L) (contract.h LsePair), stored as pairs[2t], pairs[2t + 1].
  void (*logsumexp_pairs)(DType dt, const void* z, float* pairs, int64_t V, float tau, const float* temps,
                          int64_t row_begin, int64_t row_end);
  // pairs == nullptr: each row's pair is computed in the same pass
  void (*log_softmax)(DType dt, const void* z, const float* pairs, float* out, int64_t V, float tau,
                      const float* temps, int64_t row_begin, int64_t row_end);
  // dz [T, V] in the logits dtype; g is [T] (token_logprobs, logsumexp) or [T, V] (log_softmax), fp32;
  // ids only for token_logprobs; pairs == nullptr: computed here
  void (*logits_backward)(LogitsGrad mode, DType dt, const float* g, const void* z, const int64_t* ids,
                          const float* pairs, void* dz, int64_t V, float tau, const float* temps,
                          int64_t row_begin, int64_t row_end);
  // token_logprobs backward on the column tile [v0, v0 + n) of rows whose pairs are known (the fused LM head's
  // weight-gradient sweep, python/aligned_ops/lm_head.py): z and dz are [rows, n] (row stride n), ids are
  // absolute vocabulary indices (a row whose id is outside the tile has no "1" term there). The elements equal
  // logits_backward(kTokenLogprobs)'s for those columns bit for bit (same helper, same operands).
  void (*token_logprobs_backward_cols)(DType dt, const float* g, const void* z, const int64_t* ids,
                                       const float* pairs, void* dz, int64_t v0, int64_t n, float tau,
                                       const float* temps, int64_t row_begin, int64_t row_end);
  // C[m, n] = round(linear_lane_fold over `lanes` lanes (1, 2, 4, 8) of the fma chains of A[m, :] * B[n, :]
  // (+ bias[n])) — contract.h, `fma` profile — element strides given; adt == bdt, cdt == adt or F32.
  // Computes the output tile rows [m0, m1) x cols [n0, n1).
  void (*gemm)(DType adt, const void* A, int64_t a_sm, int64_t a_sk, DType bdt, const void* B, int64_t b_sn,
               int64_t b_sk, const void* bias, DType cdt, void* C, int64_t c_sm, int64_t K, int lanes, int64_t m0,
               int64_t m1, int64_t n0, int64_t n1);
  // db[n] = chain over m of (. + g[m, n]) for n in [n0, n1)
  void (*column_sum)(DType dt, const void* g, int64_t rows, int64_t cols, DType out_dt, void* out, int64_t n0,
                     int64_t n1);
  float (*exp_f32)(float);  // the contract's scalar exp/log (numerics.h), for tests
  float (*log_f32)(float);
};

const KernelTable& cpu_kernels();

}  // namespace aligned::cpu
