// moe_kernels.h — torch-free CPU kernels of the moe family (routing, combine, the plain reference), one table
// per ISA level like cpu_kernels.h. The expert matrix products are not here: the glue (ops_moe_cpu.cpp) runs
// them through cpu_kernels().gemm, the kernel of aligned::linear, so an expert's projections follow the linear
// contract by construction (whatever that contract's chain shape is). Every function handles rows
// [row_begin, row_end) and evaluates the per-token trees of csrc/common/moe.h.
#pragma once

#include <stdint.h>

#include "cpu_kernels.h"

namespace aligned::cpu {

struct MoeKernels {
  // logits [rows, E] (dt) -> scores [rows, E] fp32, ids [rows, k] int64, weights [rows, k] fp32.
  // scratch: E bytes per thread (caller-provided per range, at least E).
  void (*routing)(DType dt, const void* z, int64_t E, int64_t k, int scoring, bool renormalize, float* scores,
                  int64_t* ids, float* w, int64_t row_begin, int64_t row_end);
  // gw [rows, k] fp32, gs [rows, E] fp32 or nullptr, logits [rows, E] (dt), ids [rows, k] -> dz [rows, E] (dt)
  void (*routing_backward)(DType dt, const float* gw, const float* gs, const void* z, const int64_t* ids, int64_t E,
                           int64_t k, int scoring, bool renormalize, void* dz, int64_t row_begin, int64_t row_end);
  // y: fp32 expert outputs [assignments, H]; pos [rows, k]: row of y for (token, rank); w [rows, k] fp32;
  // ys [rows, H] fp32 and g [rows] fp32 (shared expert output and gate), either may be nullptr -> out [rows, H] (dt)
  void (*combine)(DType dt, const float* y, const int64_t* pos, const float* w, int64_t k, const float* ys,
                  const float* g, void* out, int64_t H, int64_t row_begin, int64_t row_end);
  // The plain per-token reference of the whole experts op (linear_dot per output, moe.h), for the tests.
  // sw13/sw2 may be nullptr (no shared expert); sgate may be nullptr (no gate).
  void (*experts_reference)(DType dt, const void* x, const float* w, const int64_t* ids, int64_t k, const void* w13,
                            const void* w2, int64_t H, int64_t I, const void* sw13, const void* sw2,
                            const void* sgate, int64_t Is, void* out, int64_t row_begin, int64_t row_end);
};

// The moe kernels of the same ISA level as cpu_kernels().
const MoeKernels& moe_kernels();

}  // namespace aligned::cpu
