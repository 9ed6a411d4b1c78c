// attention_kernels.h — torch-free entry points of the CPU attention kernels (varlen, paged, backward,
// KV-cache write). The arithmetic per (query row, head) is the one written down in
// csrc/common/attention.h; these functions only decide which rows/heads/splits one call computes, so the
// torch glue can spread work items over threads without changing any bit.
//
// Work units (row blocks, (block, split) items, key tiles) come from the host planner,
// csrc/common/attention_plan.h, which also validated the metadata they point into.
#pragma once

#include <stdint.h>

#include "../common/attention_plan.h"
#include "../common/params_attention.h"
#include "cpu_kernels.h"

namespace aligned::cpu {

using aligned::AttnBlock;
using aligned::AttnProblem;
using aligned::AttnSeq;

// The problem (common/params_attention.h, shared with the GPU launchers) plus the plan's sequences.
struct AttnArgs : AttnProblem {
  const AttnSeq* seqs;
};

struct AttentionTable {
  const char* isa;
  // partials of splits [s0, s1) of a block
  void (*fwd_block)(const AttnArgs& a, const AttnBlock& b, int64_t s0, int64_t s1, float* part);
  // merge a block's partials into out [Tq, Hq, D] (dtype a.dt) and lse [Tq, Hq]
  void (*merge_block)(const AttnArgs& a, const AttnBlock& b, const float* part, void* out, float* lse);
  // delta[i] = fma chain over d of dO * O, for flat (row, head) indices [i0, i1)
  void (*bwd_delta)(DType dt, const void* dout, const void* out, float* delta, int64_t D, int64_t i0, int64_t i1);
  // dq rows of a block (packed K/V only)
  void (*bwd_dq_block)(const AttnArgs& a, const AttnBlock& b, const void* dout, const float* lse,
                       const float* delta, void* dq);
  // dk, dv of key tile t (keys [32t, 32t+32)) of sequence seq, KV head g
  void (*bwd_dkdv_tile)(const AttnArgs& a, int64_t seq, int64_t g, int64_t t, const void* dout, const float* lse,
                        const float* delta, void* dk, void* dv);
  // cache[slot] = k[t] for tokens [t0, t1) with slot >= 0 (rows of Hkv * D elements)
  void (*cache_write)(DType dt, const void* k, const void* v, void* k_cache, void* v_cache, const int64_t* slots,
                      int64_t row_elems, int64_t t0, int64_t t1);
};

const AttentionTable& attention_kernels();  // same ISA level as cpu_kernels()

}  // namespace aligned::cpu
