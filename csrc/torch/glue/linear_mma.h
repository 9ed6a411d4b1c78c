// glue/linear_mma.h — the `mma` linear profile (csrc/common/mma.h: the matrix unit's bf16 instruction in the
// `fma` profile's 8 lanes and tree, + bias once, one rounding) for the linear glue bodies (glue/linear.h, one
// per op for every profile), and its families: linear_mma, linear_mma_partial, linear_mma_backward (LinearMma)
// and the scalar model of the unit the kernels are held to, _linear_mma_reference (LinearMmaReference: a test
// hook).
//
// The backend supplies mma_gemm(call, params) — its unit's GEMM over its own tiling (which never changes a bit:
// every output is one lane tree over all of K), refusing by the op's name where the machine has no unit —,
// column_sum (db: the fp32 column chains, as linear_backward's) and linear_mma_reference.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "linear.h"

namespace aligned::glue {

struct MmaLinear {
  static constexpr LinearOpNames kOps{"linear_mma", "linear_mma_partial", "linear_mma_backward",
                                      "_linear_mma_reference"};
  static constexpr LinearDtypes kDtypes = LinearDtypes::kBf16Only;
  // The unit's kernels read pairs along contiguous rows of A and B: a weight whose rows do not have unit stride
  // is copied (a view with unit k-stride is read in place).
  static at::Tensor weight_operand(const at::Tensor& w) { return w.stride(1) == 1 ? w : w.contiguous(); }
  template <class B>
  static void gemm(const typename B::Call& call, const GemmParams& p) {
    B::mma_gemm(call, p);
  }
  template <class B>
  static void reference(const typename B::Call& call, const GemmParams& p) {
    B::linear_mma_reference(call, p);
  }
  // Backward on the unit, every GEMM the profile's 8-lane linear: w and x are read in place as column-major B
  // operands; g^T is one contiguous copy (the unit reads its A operand along its rows).
  static GemmParams dx_params(const LinearArgs<DType>& a, const at::Tensor& g, const at::Tensor& w,
                              const at::Tensor& dx) {
    return make_linear_mma_dx_params(a, g, w, dx);
  }
  static at::Tensor dw_grad_operand(const at::Tensor& g) { return g.t().contiguous(); }
  static GemmParams dw_params(const LinearArgs<DType>& a, const at::Tensor& gt, const at::Tensor& x,
                              const at::Tensor& dw) {
    return make_linear_mma_dw_params(a, gt, x, dw);
  }
};

struct LinearMma {
  template <class B>
  static constexpr std::tuple ops{
      Op{"linear_mma", &linear<MmaLinear, B>},
      Op{"linear_mma_partial", &linear_partial<MmaLinear, B>},
      Op{"linear_mma_backward", &linear_backward<MmaLinear, B>},
  };
};

struct LinearMmaReference {
  template <class B>
  static constexpr std::tuple ops{Op{"_linear_mma_reference", &linear_reference<MmaLinear, B>}};
};

}  // namespace aligned::glue
