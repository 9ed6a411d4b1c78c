// dense_split_kernels.h — CPU kernels that let threads share ONE row of the dense ops when a batch has fewer
// rows than threads (decode: 1..few tokens). Torch-free; compiled per ISA level with cpu_kernels.cpp.
//
// None of them changes a result bit, because none splits a reduction chain:
//   * silu_and_mul is elementwise: a row is cut into column ranges;
//   * logsumexp: the max over a row is exact in any split and order, the sign of a zero maximum included (the
//     total order's max: contract.h lse_max_merge), and the exp-sum is split by *lanes* of reduce.h: lane j
//     still accumulates k = j, j+32, ... in order, only different lanes run on different threads; the 32 lane
//     sums are folded with reduce.h's halving tree (pair_of_lanes).
// The glue only splits ranges and calls these in order; every fold is here, next to the kernels' own.
#pragma once

#include <stdint.h>

#include "../common/contract.h"
#include "cpu_kernels.h"

namespace aligned::cpu {

struct DenseSplitKernels {
  // out[row, c] = silu(x[row, c]) * x[row, d + c] for c in [c0, c1)
  void (*silu_and_mul_cols)(const SiluMulParams& p, int64_t row, int64_t c0, int64_t c1);
  // One shared row of the log-prob family, in three steps on the threads with a fold between them:
  //   scale_max: s[v] = z[row, v] / tau_row for v in [v0, v1) (fp32 scratch s_row), *max = max of those s,
  //              *flags = OR of contract.h logit_flags (NaN seen, +inf seen);
  //   merge_max: the parts' maxima and flags folded (the same fold a whole row's lane maxima take); returns
  //              true with the pair in *special when the row is special (contract.h lse_special_row);
  //   lane_exp_sums: lanes[j] for j in [j0, j1), the reduce.h lane chain of exp(s[v] - m), v = j, j+32, ... < V;
  //   pair_of_lanes: the 32 lanes folded by reduce.h's halving tree into the row's (m, L) pair.
  void (*scale_max)(const LogitsParams& p, int64_t row, float* s_row, int64_t v0, int64_t v1, float* max,
                    int32_t* flags);
  bool (*merge_max)(const float* part_max, const int32_t* part_flags, int64_t parts, float* m, LsePair* special);
  void (*lane_exp_sums)(const float* s_row, int64_t V, float m, int j0, int j1, float* lanes);
  LsePair (*pair_of_lanes)(float m, float* lanes);  // folds in place (reduce.h fold_lanes)
  // The row's pair into p.pairs (and its logsumexp into p.lse when set), as logsumexp_pairs stores it.
  void (*store_pair)(const LogitsParams& p, int64_t row, LsePair pair);
  // log_softmax of the row for v in [v0, v1), from s = z / tau left in p.out_f32's row by scale_max
  void (*logp_cols)(const LogitsParams& p, int64_t row, LsePair pair, int64_t v0, int64_t v1);
};

// The split kernels of the same ISA level as cpu_kernels().
const DenseSplitKernels& dense_split_kernels();

}  // namespace aligned::cpu
