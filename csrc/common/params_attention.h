// params_attention.h — the attention family's params core, shared by every backend: the problem every
// attention kernel computes (dtype, heads, head_dim, scale, causality, q/k/v, packed or paged K/V). The CPU
// backend's AttnArgs (csrc/cpu/attention_kernels.h: + the plan's sequences) and the GPU launchers'
// AttnFwdParams (csrc/gpu/attention_api.h: + the uploaded work list, partials, outputs) extend it, so the
// problem is described once and filled once (make_attn_problem) by every glue. Torch-free.
#pragma once

#include <stdint.h>

#include "attention_mma.h"
#include "attention_plan.h"
#include "dtype.h"

namespace aligned {

struct AttnProblem {
  DType dt;             // q / k / v / out dtype
  int64_t Hq, Hkv, D;   // query heads, KV heads, head_dim
  float scale;          // softmax scale (fp32: the contract's operand)
  bool causal;
  const void* q;        // [Tq, Hq, D]
  const void* k;        // packed [Tk, Hkv, D] or paged cache [num_blocks, block_size, Hkv, D]
  const void* v;
  int64_t block_size;   // 0: packed K/V
  int profile;          // AttnProfile (attention_mma.h): kAttnProfileFma (attention.h) or kAttnProfileMma
};

inline AttnProblem make_attn_problem(DType dt, const AttnShape& sh, double scale, bool causal, const void* q,
                                     const void* k, const void* v, int64_t block_size,
                                     int profile = kAttnProfileFma) {
  AttnProblem p{};
  p.dt = dt;
  p.Hq = sh.Hq;
  p.Hkv = sh.Hkv;
  p.D = sh.D;
  p.scale = (float)scale;
  p.causal = causal;
  p.q = q;
  p.k = k;
  p.v = v;
  p.block_size = block_size;
  p.profile = profile;
  return p;
}

}  // namespace aligned
