// run_args.h — what a backend's run function takes where one params struct cannot be filled up front, because
// the backends build different intermediates from the same checked tensors: the exact linear (the CPU packs x
// and may take its fp64 routes; a GPU packs x with its own kernels) and the moe experts (the CPU groups tokens
// by expert), and attention's backward (its plan and the forward's tensors). The glue body fills these once,
// after the checks; the backend only runs.
#pragma once

#include <ATen/ATen.h>

#include "../common/attention_plan.h"
#include "../common/params_attention.h"
#include "checks/exact.h"
#include "checks/moe.h"

namespace aligned::glue {

// linear_exact_packed (and linear_exact_partial): x [M, K] contiguous against a packed weight.
struct ExactPackedRun {
  LinearArgs<DType> a;       // dt, M, K, N, bias (contiguous or undefined)
  at::Tensor x;              // [M, K] contiguous
  at::Tensor wd, w_exp, w_bad;  // the packed weight (checks/exact.h)
  int64_t k_parts = 1;
  at::Tensor weight, weight_f64_bounds;  // the CPU's fp64 path: both defined, or both undefined
  at::Tensor out;            // [M, N] in dt (linear_exact_packed) or int64 [M, N, 2] (linear_exact_partial)
};

// moe_experts: the checked arguments (checks/moe.h), the projections' linear profile and the output [T, H].
struct MoeExpertsRun {
  MoeExpertsArgs<DType> a;
  ExpertsLinear linear = ExpertsLinear::kFma;  // the projections' profile (checks/moe.h)
  at::Tensor out;
};

// attention_varlen_backward: the problem, the host plan (with its key tiles), the forward's tensors and the
// gradients (dq [Tq, Hq, D]; dk, dv zeroed [Tk, Hkv, D]; delta [Tq, Hq] fp32 scratch). All contiguous.
struct AttnBackwardRun {
  AttnProblem problem;
  const AttnPlan* plan;
  at::Tensor q, k, v, grad_out, out, lse, delta, dq, dk, dv;
};

}  // namespace aligned::glue
