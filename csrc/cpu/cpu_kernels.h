// cpu_kernels.h — the torch-free entry points of the CPU backend.
//
// Every function takes its op's params struct (csrc/common/params_*.h, shared with the GPU backend) and
// computes a half-open range of rows [row_begin, row_end) so that the torch glue can hand disjoint row ranges
// to threads (at::parallel_for). Threads only ever split *rows* (or output tiles);
// the reduction inside a row follows csrc/common/contract.h, so thread count cannot change bits.
//
// The kernels are compiled once per ISA level (generic x86-64, AVX2+FMA, AVX-512) into namespaces of
// the same shape; `cpu_kernels()` returns the table for the best level the running CPU supports.
// Every level computes identical bits (same expression trees, no contraction), only faster.
#pragma once

#include <stdint.h>

#include "../common/dtype.h"
#include "../common/numerics.h"
#include "../common/params_dense.h"
#include "../common/params_linear.h"
#include "../common/params_logits.h"

namespace aligned::cpu {

using aligned::DType;      // common/dtype.h: the storage dtypes, shared with the GPU kernels
using aligned::with_type;  // the one place kernels turn the run-time dtype into a template argument

using aligned::LogitsGrad;  // common/params_logits.h: which backward a logits_backward call computes

// Every entry takes its family's params struct (csrc/common/params_*.h, the same struct the GPU launchers
// take, filled by csrc/torch/make_params.h) and the range of rows (or columns) this call computes; the glue splits
// ranges across threads, never a reduction.
struct KernelTable {
  const char* isa;
  // rows [r0, r1) of x [rows, H]
  void (*rms_norm)(const RmsNormParams& p, int64_t r0, int64_t r1);
  void (*fused_add_rms_norm)(const RmsNormParams& p, int64_t r0, int64_t r1);
  // rows [r0, r1): inv[r] = 1/rms of x row r (rms_inv_rows), dx (rms_norm_backward_dx)
  void (*rms_inv_rows)(const RmsNormBackwardParams& p, int64_t r0, int64_t r1);
  void (*rms_norm_backward_dx)(const RmsNormBackwardParams& p, int64_t r0, int64_t r1);
  // dw[col] for col in [c0, c1): one chain over all rows in order, reading p.inv (after rms_inv_rows)
  void (*rms_norm_backward_dw)(const RmsNormBackwardParams& p, int64_t c0, int64_t c1);
  // rows [r0, r1): x [rows, 2d] -> out [rows, d] (backward: g [rows, d], x -> dx [rows, 2d] in p.out)
  void (*silu_and_mul)(const SiluMulParams& p, int64_t r0, int64_t r1);
  void (*silu_and_mul_backward)(const SiluMulParams& p, int64_t r0, int64_t r1);
  // tokens [t0, t1) of x [T, heads, head_dim]; cache [max_pos, rot] fp32
  void (*rotary)(const RotaryParams& p, int64_t t0, int64_t t1);
  // The log-prob family, rows [r0, r1) of logits [T, V]; tau per row (temps[t]) or the scalar. A row's
  // statistics are the contract's pair (m, L) (contract.h LsePair), stored as pairs[2t], pairs[2t + 1].
  // logsumexp_pairs writes p.pairs (and p.lse[t] = m + L when p.lse is set).
  void (*logsumexp_pairs)(const LogitsParams& p, int64_t r0, int64_t r1);
  // out_f32 [T, V]; p.pairs == nullptr: each row's pair is computed in the same pass
  void (*log_softmax)(const LogitsParams& p, int64_t r0, int64_t r1);
  // out_f32[t] = logp of column ids[t] from the given pairs: the expression log_softmax evaluates there
  void (*token_logprobs)(const LogitsParams& p, int64_t r0, int64_t r1);
  // dz [T, V] in the logits dtype for p.mode; g is [T] (token_logprobs, logsumexp) or [T, V] (log_softmax),
  // fp32; ids only for token_logprobs; p.pairs == nullptr: computed here
  void (*logits_backward)(const LogitsParams& p, int64_t r0, int64_t r1);
  // token_logprobs backward on the column tile [v0, v0 + V) of rows whose pairs are known (the fused LM head's
  // weight-gradient sweep, python/aligned_ops/ops/lm_head.py): z and dz are [T, V] (the tile), ids are absolute
  // vocabulary indices (a row whose id is outside the tile has no "1" term there). The elements equal
  // logits_backward(kTokenLogprobs)'s for those columns bit for bit (same helper, same operands).
  void (*token_logprobs_backward_cols)(const LogitsParams& p, int64_t r0, int64_t r1);
  // C[m, n] = round(linear_lane_fold over p.lanes lanes (1, 2, 4, 8) of the fma chains of A[m, :] * B[n, :]
  // (+ bias[n])) — contract.h, `fma` profile. Computes the output tile rows [m0, m1) x cols [n0, n1): the one
  // entry with a 2-D range (threads take output tiles; every element is still one tree over all of K).
  void (*gemm)(const GemmParams& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1);
  // out[n] = chain over m of (. + g[m, n]) for n in [n0, n1)
  void (*column_sum)(const ColumnSumParams& p, int64_t n0, int64_t n1);
  // out[i] = the contract's scalar exp / log (numerics.h) for i in [i0, i1), for the tests
  void (*exp_f32)(const ElementwiseParams& p, int64_t i0, int64_t i1);
  void (*log_f32)(const ElementwiseParams& p, int64_t i0, int64_t i1);
};

const KernelTable& cpu_kernels();

}  // namespace aligned::cpu
