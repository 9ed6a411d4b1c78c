// attention_api.h — the torch-free host interface of the GPU attention kernels (CUDA and HIP): the forward
// over packed or paged K/V (attention_varlen, paged_attention) and the KV-cache write (reshape_and_cache).
//
// The host planner (csrc/common/attention_plan.h) validates the metadata and builds the work list on the
// host; attn_pack_work turns that list into flat int64 records that the glue uploads with one host-to-device
// copy. The kernels read nothing else of the metadata, so no launcher ever reads device memory back and no
// kernel can see an unchecked block id or offset. Launchers are defined once in attention_launch.cuh and
// compiled by nvcc (csrc/cuda/attention.cu) or hip-clang (csrc/hip/attention.hip), and for the emulation
// target (csrc/emu). Each returns nullptr or the runtime's launch error string.
#pragma once

#include <stdint.h>

#include <vector>

#include "../common/attention_plan.h"
#include "../common/params_attention.h"
#include "dense_api.h"

namespace aligned::gpu {

// Largest head_dim of the GPU kernels: a K tile is staged in shared memory as fp32 [32][D + 1] (33 KB at
// D = 256) and every lane holds ceil(D / 32) <= 8 accumulators in registers.
constexpr int64_t kGpuAttnMaxD = 256;

// The problem (common/params_attention.h, shared with the CPU backend) plus the work list and the outputs.
struct AttnFwdParams : AttnProblem {
  const int32_t* block_tables;  // paged: the block table [B, max_blocks] (device copy); else nullptr
  const int64_t* items;         // [n_items, kAttnWorkFields] forward items
  int64_t n_items;
  const int64_t* blocks;        // [n_blocks, kAttnWorkFields] row blocks (merge)
  int64_t n_blocks;
  float* part;                  // the plan's partial buffer (part_floats)
  void* out;                    // [Tq, Hq, D], dtype dt
  float* lse;                   // [Tq, Hq]
  // The plan buffer's header (both forms: the per-call form uploads a buffer of capacity = its own size).
  // n_items / n_blocks above are the grids (the capacity in the planned form); the kernels take the real
  // counts from the header and return at once in the blocks beyond them.
  const int64_t* plan_header;
  AttnRunDims run;              // what the header is checked against
  int32_t* error_flags;         // [kNumDeviceErrors] device words (kErrAttentionPlan), or nullptr
};

struct CacheWriteParams {
  DType dt;
  const void* k;        // [T, Hkv, D]
  const void* v;
  void* k_cache;        // [num_blocks, block_size, Hkv, D]
  void* v_cache;
  const int64_t* slots; // [T], -1 = padding
  int64_t T, row_elems, n_slots;
};

// Backward (deterministic: every gradient element is one fma chain in attention.h's order, no atomics).
struct AttnBwdParams {
  AttnFwdParams f;       // shapes, q/k/v, scale, causal (packed K/V only); f.out, f.lse, f.part unused
  const void* dout;      // [Tq, Hq, D]
  const void* out;       // the forward output [Tq, Hq, D]
  const float* lse;      // [Tq, Hq]
  float* delta;          // [Tq, Hq] scratch
  void* dq;              // [Tq, Hq, D]
  void* dk;              // [Tk, Hkv, D]
  void* dv;
  const int64_t* tiles;  // [n_tiles, kAttnWorkFields] key tiles: kWg = KV head, kWsplit = tile index
  int64_t n_tiles;
  int64_t rows;          // Tq * Hq
};

const char* launch_attention_forward(const AttnFwdParams& p, void* stream);
const char* launch_attention_backward(const AttnBwdParams& p, void* stream);
const char* launch_cache_write(const CacheWriteParams& p, void* stream);

// Host side: the work records of a plan, items first then blocks (one buffer, one upload).
// table_row_stride: max_blocks of the block table (paged plans), 0 for packed plans.
inline std::vector<int64_t> attn_pack_work(const AttnPlan& plan, int64_t table_row_stride) {
  std::vector<int64_t> w;
  w.reserve((plan.items.size() + plan.blocks.size()) * kAttnWorkFields);
  auto put = [&](const AttnBlock& b, int64_t split) {
    const AttnSeq& s = plan.seqs[b.seq];
    const int64_t rec[kAttnWorkFields] = {s.q_begin, s.q_len, s.n_ctx, s.k_begin,
                                          s.blocks ? b.seq * table_row_stride : -1,
                                          b.g, b.r0, b.nr, b.n_splits, b.part_offset, split};
    w.insert(w.end(), rec, rec + kAttnWorkFields);
  };
  for (const AttnItem& it : plan.items) put(plan.blocks[it.block], it.split);
  for (const AttnBlock& b : plan.blocks) put(b, 0);
  return w;
}

// Host side: backward records, row blocks (dq) first then key tiles (dk, dv).
inline std::vector<int64_t> attn_pack_backward(const AttnPlan& plan) {
  std::vector<int64_t> w;
  w.reserve((plan.blocks.size() + plan.key_tiles.size()) * kAttnWorkFields);
  auto put = [&](const AttnSeq& s, int64_t g, int64_t r0, int64_t nr, int64_t t) {
    const int64_t rec[kAttnWorkFields] = {s.q_begin, s.q_len, s.n_ctx, s.k_begin, -1, g, r0, nr, 0, 0, t};
    w.insert(w.end(), rec, rec + kAttnWorkFields);
  };
  for (const AttnBlock& b : plan.blocks) put(plan.seqs[b.seq], b.g, b.r0, b.nr, 0);
  for (const AttnKeyTile& k : plan.key_tiles) put(plan.seqs[k.seq], k.g, 0, plan.seqs[k.seq].q_len, k.t);
  return w;
}

}  // namespace aligned::gpu
