// attention_plan.h — the host-side planner of every attention path (torch-free, host only).
//
// FlashInfer's split, applied to our contract: a *plan* turns the metadata the engine holds on the host
// (query/key offsets, the context length of each sequence, its block-table row) into a work list, and
// validates that metadata while doing so; the *run* (CPU threads today, GPU blocks tomorrow) only consumes
// the list. Consequences:
//   * every data-dependent check (offsets monotone, block ids in range, seq_lens within the table) happens
//     here, once, on host memory — no kernel ever reads device data back to the host to validate it, and a
//     bad table can never reach a kernel as an out-of-bounds address;
//   * the work list is a pure function of the metadata: which (row block, KV head, split) items exist, in
//     which order, and where each item's partials live. The arithmetic per (row, head) is attention.h's,
//     and the split boundaries are absolute (attention.h), so how the list is cut over threads or blocks
//     cannot change a bit.
//
// Work units (see attention.h for the arithmetic):
//   * a row block = rows [r0, r0 + nr) (relative to the sequence's first new row) of one sequence, for one
//     KV head g and all G = Hq / Hkv query heads that share it (K/V tiles are unpacked once per block);
//   * a forward item = (row block, split s): it writes the split's partials (m, l, acc[D]) of every (row,
//     head) of the block to the block's partial buffer, laid out [(r * G + h) * n_splits + s] * (D + 2);
//     the block's merge (attn_merge per row) runs after all its splits.
//   * a backward key tile = (sequence, KV head, tile t): dk, dv of keys [32t, 32t + 32).
#pragma once

#include <stdint.h>

#include <string>
#include <vector>

#include "attention.h"

namespace aligned {

struct AttnSeq {
  int64_t q_begin;        // first query row of the sequence in q (packed)
  int64_t q_len;          // number of query rows (new tokens)
  int64_t n_ctx;          // number of keys of the sequence (context incl. the new tokens)
  int64_t k_begin;        // packed K/V: first key row of the sequence
  const int32_t* blocks;  // paged K/V: the sequence's block_table row (nullptr when packed)
};

struct AttnBlock {
  int64_t seq, g, r0, nr;
  int64_t n_splits;     // max splits over the block's rows (the partial layout's stride)
  int64_t part_offset;  // offset (floats) of this block's partials in the plan's buffer
};

struct AttnItem {
  int64_t block, split;
};

struct AttnKeyTile {
  int64_t seq, g, t;
};

// Rows per row block. A scheduling constant, not part of the contract: any value gives the same bits.
constexpr int64_t kAttnRowBlock = 16;

struct AttnPlan {
  std::vector<AttnSeq> seqs;
  std::vector<AttnBlock> blocks;   // forward and backward row blocks
  std::vector<AttnItem> items;     // forward (block, split) items, block-major, splits ascending
  std::vector<AttnKeyTile> key_tiles;  // backward only
  int64_t part_floats = 0;         // size of the forward partial buffer
};

// Problem shape shared by the planner and the kernels.
struct AttnShape {
  int64_t Hq, Hkv, D;
  bool causal;
};

namespace plan_detail {

inline std::string prefix(const char* op) { return std::string("aligned::") + op + ": "; }

// Checks host offsets [B+1]: starts at 0, non-decreasing, ends at total. "" when valid.
inline std::string check_offsets(const int32_t* cu, int64_t n, int64_t total, const char* op, const char* name) {
  if (cu[0] != 0) return prefix(op) + name + "[0] must be 0, got " + std::to_string(cu[0]);
  for (int64_t i = 1; i < n; ++i)
    if (cu[i] < cu[i - 1])
      return prefix(op) + name + " must be non-decreasing, got " + std::to_string(cu[i - 1]) + " then " +
             std::to_string(cu[i]) + " at index " + std::to_string(i);
  if (cu[n - 1] != total)
    return prefix(op) + name + "[-1] must equal the number of rows (" + std::to_string(total) + "), got " +
           std::to_string(cu[n - 1]);
  return "";
}

inline void add_forward_blocks(const AttnShape& sh, AttnPlan* plan) {
  const int64_t G = sh.Hq / sh.Hkv, stride = sh.D + 2;
  for (int64_t b = 0; b < (int64_t)plan->seqs.size(); ++b) {
    const AttnSeq& s = plan->seqs[b];
    for (int64_t g = 0; g < sh.Hkv; ++g)
      for (int64_t r0 = 0; r0 < s.q_len; r0 += kAttnRowBlock) {
        AttnBlock blk{b, g, r0, s.q_len - r0 < kAttnRowBlock ? s.q_len - r0 : kAttnRowBlock, 0, plan->part_floats};
        for (int64_t r = 0; r < blk.nr; ++r) {
          const int64_t ns = attn_num_splits(attn_row_keys(s.n_ctx - s.q_len + r0 + r, s.n_ctx, sh.causal));
          if (ns > blk.n_splits) blk.n_splits = ns;
        }
        plan->part_floats += blk.nr * G * blk.n_splits * stride;
        for (int64_t sp = 0; sp < blk.n_splits; ++sp) plan->items.push_back(AttnItem{(int64_t)plan->blocks.size(), sp});
        plan->blocks.push_back(blk);
      }
  }
}

inline void add_backward_tiles(const AttnShape& sh, AttnPlan* plan) {
  for (int64_t b = 0; b < (int64_t)plan->seqs.size(); ++b)
    for (int64_t g = 0; g < sh.Hkv; ++g)
      for (int64_t t = 0; t * kAttnTile < plan->seqs[b].n_ctx; ++t) plan->key_tiles.push_back(AttnKeyTile{b, g, t});
}

}  // namespace plan_detail

// Packed variable-length batch (training, one-shot prefill): cu_q, cu_k host int32 [n_offsets].
// Returns "" and fills *plan, or an error message naming the op and the argument.
inline std::string plan_varlen(const int32_t* cu_q, const int32_t* cu_k, int64_t n_offsets, int64_t Tq, int64_t Tk,
                               const AttnShape& sh, bool backward, const char* op, AttnPlan* plan) {
  std::string err = plan_detail::check_offsets(cu_q, n_offsets, Tq, op, "cu_seqlens_q");
  if (err.empty()) err = plan_detail::check_offsets(cu_k, n_offsets, Tk, op, "cu_seqlens_k");
  if (!err.empty()) return err;
  *plan = AttnPlan{};
  for (int64_t b = 0; b + 1 < n_offsets; ++b)
    plan->seqs.push_back(AttnSeq{cu_q[b], cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b], cu_k[b], nullptr});
  plan_detail::add_forward_blocks(sh, plan);
  if (backward) plan_detail::add_backward_tiles(sh, plan);
  return "";
}

// Paged KV cache (chunked prefill, decode): query_start_loc host int32 [B+1], seq_lens host int32 [B],
// block_table host int32 [B, max_blocks] (row-major). The plan's sequences point into block_table, which
// must outlive the run.
inline std::string plan_paged(const int32_t* query_start_loc, const int32_t* seq_lens, const int32_t* block_table,
                              int64_t B, int64_t max_blocks, int64_t num_blocks, int64_t block_size, int64_t Tq,
                              const AttnShape& sh, const char* op, AttnPlan* plan) {
  using plan_detail::prefix;
  std::string err = plan_detail::check_offsets(query_start_loc, B + 1, Tq, op, "query_start_loc");
  if (!err.empty()) return err;
  *plan = AttnPlan{};
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = seq_lens[b], ql = query_start_loc[b + 1] - query_start_loc[b];
    const std::string sb = std::to_string(b);
    if (n < 0) return prefix(op) + "seq_lens[" + sb + "] = " + std::to_string(n) + " is negative";
    if (ql > n)
      return prefix(op) + "sequence " + sb + " has " + std::to_string(ql) + " new tokens but seq_lens[" + sb +
             "] = " + std::to_string(n) + " (seq_lens counts the context including the new tokens)";
    if (n > max_blocks * block_size)
      return prefix(op) + "seq_lens[" + sb + "] = " + std::to_string(n) + " is longer than the block table allows (" +
             std::to_string(max_blocks) + " blocks x " + std::to_string(block_size) + ")";
    const int32_t* row = block_table + b * max_blocks;
    for (int64_t i = 0; i < (n + block_size - 1) / block_size; ++i)
      if (row[i] < 0 || row[i] >= num_blocks)
        return prefix(op) + "block_table[" + sb + ", " + std::to_string(i) + "] = " + std::to_string(row[i]) +
               " is out of range [0, " + std::to_string(num_blocks) + ")";
    plan->seqs.push_back(AttnSeq{query_start_loc[b], ql, n, 0, row});
  }
  plan_detail::add_forward_blocks(sh, plan);
  return "";
}

// KV-cache write: every slot in [-1, n_slots). "" when valid.
inline std::string check_slots(const int64_t* slots, int64_t T, int64_t n_slots, const char* op) {
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] < -1 || slots[t] >= n_slots)
      return plan_detail::prefix(op) + "slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slots[t]) +
             " is out of range [-1, " + std::to_string(n_slots) + ")";
  return "";
}

}  // namespace aligned
