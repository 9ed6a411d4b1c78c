// params_moe.h — the params structs of the moe family (moe_routing(_backward), moe_experts' combine, and the
// plain per-token reference of moe_experts), shared by every backend: the CPU kernel table
// (csrc/cpu/moe_kernels.h) takes them today, a GPU backend's launchers take the same structs. Filled once from
// tensors (csrc/torch/make_params.h). The per-token trees are csrc/common/moe.h; the expert projections run through
// the linear family's GemmParams (params_linear.h), so they follow the linear contract by construction.
#pragma once

#include <stdint.h>

#include "dtype.h"
#include "moe.h"

namespace aligned {

// What every top-k routing op reads and writes (moe_routing, moe_grouped_routing and their backwards): the
// router logits, the scores, ids and weights they produce, and the backward's gradients and dz. Each routing
// op's params extend it with its scoring rule (flash-attention's params inheritance).
struct MoeTopkParams {
  DType dt;                 // router logits (and dz) dtype
  const void* z;            // [T, E] router logits
  int64_t T, E, k;          // tokens, experts, experts per token
  bool renormalize;         // weights divided by their rank-order sum (moe.h)
  float* scores;            // forward: [T, E] fp32 score rows out
  int64_t* ids;             // forward: [T, k] out; backward: [T, k] in (every id in [0, E))
  float* w;                 // forward: [T, k] fp32 weights out
  const float* gw;          // backward: [T, k] fp32 gradient of the weights
  const float* gs;          // backward: [T, E] fp32 gradient of the scores, or nullptr (zero)
  void* dz;                 // backward: [T, E] out in dt
};

// moe_routing (scores, top-k ids and weights) and moe_routing_backward (dz); 1 <= k <= E.
struct MoeRoutingParams : MoeTopkParams {
  MoeScoring scoring;       // softmax or sigmoid (moe.h)
};

// The combine of moe_experts, per token in rank order (moe.h moe_combine_row):
// out[t] = round_dt(+0 + sum_r w[t, r] * y[pos[t, r]] (+ moe_shared_gate(gate_logit[t]) * ys[t])).
struct MoeCombineParams {
  DType dt;                 // out dtype
  const float* y;           // [assignments, H] fp32 routed expert outputs
  const int64_t* pos;       // [T, k]: the row of y holding (token t, rank r)
  const float* w;           // [T, k] fp32 routing weights
  int64_t T, k, H;
  const float* ys;          // [T, H] fp32 shared expert output, or nullptr (no shared expert)
  const float* gate_logit;  // [T] fp32 shared-gate logits (x . shared_gate, the linear contract), or nullptr
                            // (gate 1); the kernel applies moe_shared_gate
  void* out;                // [T, H] in dt
};

// The plain per-token reference of the whole moe_experts op (linear_dot per output, moe.h), for the tests.
struct MoeExpertsParams {
  DType dt;                 // x, weights and out dtype
  const void* x;            // [T, H]
  const float* w;           // [T, k] fp32 routing weights
  const int64_t* ids;       // [T, k]
  int64_t T, k, H, I;       // tokens, experts per token, hidden, routed intermediate
  const void* w13;          // [E, 2I, H] gate and up projections
  const void* w2;           // [E, H, I] down projections
  const void* sw13;         // [2Is, H] shared expert, or nullptr
  const void* sw2;          // [H, Is] shared expert, or nullptr
  const void* sgate;        // [H] shared gate, or nullptr (gate 1)
  int64_t Is;               // shared intermediate (0 without a shared expert)
  void* out;                // [T, H]
};

// moe_grouped_routing (scores, top-k ids and weights) and moe_grouped_routing_backward (dz): moe.h "grouped
// sigmoid routing"; 1 <= k <= topk_group * E / n_group, the scores are the unbiased sigmoids.
struct MoeGroupedRoutingParams : MoeTopkParams {
  const float* bias;        // [E] fp32 correction bias, or nullptr (none); forward only
  int64_t n_group;          // groups (E % n_group == 0)
  int64_t topk_group;       // groups kept (1 <= topk_group <= n_group)
  float scale;              // routed_scaling_factor, rounded to fp32 once
};

}  // namespace aligned
