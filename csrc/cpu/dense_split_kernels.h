// dense_split_kernels.h — CPU kernels that let threads share ONE row of the dense ops when a batch has fewer
// rows than threads (decode: 1..few tokens). Torch-free; compiled per ISA level with cpu_kernels.cpp.
//
// None of them changes a result bit, because none splits a reduction chain:
//   * silu_and_mul is elementwise: a row is cut into column ranges;
//   * logsumexp: the max over a row is exact (any split, any order; see cpu_kernels.cpp for the sign of a
//     zero maximum, which cannot reach an output), and the exp-sum is split by *lanes* of reduce.h: lane j
//     still accumulates k = j, j+32, ... in order, only different lanes run on different threads; the caller
//     folds the 32 lane sums with reduce.h's halving tree.
#pragma once

#include <stdint.h>

#include "cpu_kernels.h"

namespace aligned::cpu {

struct DenseSplitKernels {
  // out[row, c] = silu(x[row, c]) * x[row, d + c] for c in [c0, c1)
  void (*silu_and_mul_cols)(DType dt, const void* x, void* out, int64_t d, int64_t row, int64_t c0, int64_t c1);
  // s[v] = z[v] / tau for v in [v0, v1) of one row (fp32 scratch), *max = max of those s, *flags = OR of
  // contract.h logit_flags (NaN seen, +inf seen)
  void (*scale_max)(DType dt, const void* z_row, float* s_row, int64_t v0, int64_t v1, float tau, float* max,
                    int32_t* flags);
  // lanes[j] for j in [j0, j1): the reduce.h lane chain of exp(s[v] - m) over v = j, j+32, ... < V
  void (*lane_exp_sums)(const float* s_row, int64_t V, float m, int j0, int j1, float* lanes);
};

// The split kernels of the same ISA level as cpu_kernels().
const DenseSplitKernels& dense_split_kernels();

}  // namespace aligned::cpu
