// moe_kernels.h — torch-free CPU kernels of the moe family (routing, combine, the plain reference), one table
// per ISA level like cpu_kernels.h. The expert matrix products are not here: the CPU backend
// (csrc/torch/backends/cpu_moe.cpp) runs them through cpu_kernels().gemm, the kernel of aligned::linear, so an expert's projections follow the linear
// contract by construction (whatever that contract's chain shape is). Every function handles rows
// [row_begin, row_end) of its params struct (csrc/common/params_moe.h, shared with a GPU backend) and
// evaluates the per-token trees of csrc/common/moe.h.
#pragma once

#include <stdint.h>

#include "../common/params_moe.h"
#include "cpu_kernels.h"

namespace aligned::cpu {

struct MoeKernels {
  // rows [r0, r1): logits -> scores, ids, weights (moe.h routing)
  void (*routing)(const MoeRoutingParams& p, int64_t r0, int64_t r1);
  // rows [r0, r1): gw, gs (or nullptr), logits, ids -> dz
  void (*routing_backward)(const MoeRoutingParams& p, int64_t r0, int64_t r1);
  // tokens [t0, t1): out = the rank-order combine of the expert outputs (+ the gated shared expert)
  void (*combine)(const MoeCombineParams& p, int64_t t0, int64_t t1);
  // tokens [t0, t1): the plain per-token reference of the whole experts op (linear_dot per output, moe.h), for
  // the tests
  void (*experts_reference)(const MoeExpertsParams& p, int64_t t0, int64_t t1);
  // rows [r0, r1): logits (+ bias) -> scores, ids, weights (moe.h grouped sigmoid routing)
  void (*grouped_routing)(const MoeGroupedRoutingParams& p, int64_t r0, int64_t r1);
  // rows [r0, r1): gw, gs (or nullptr), logits, ids -> dz (moe.h grouped sigmoid routing, backward)
  void (*grouped_routing_backward)(const MoeGroupedRoutingParams& p, int64_t r0, int64_t r1);
};

// The moe kernels of the same ISA level as cpu_kernels().
const MoeKernels& moe_kernels();

}  // namespace aligned::cpu
