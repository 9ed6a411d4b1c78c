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

// One work record: a (row block, split) forward item, or a row block for the merge (split = 0).
enum AttnWorkField : int {
  kWqBegin = 0,   // first query row of the sequence (packed q)
  kWqLen,         // new rows of the sequence
  kWnCtx,         // keys of the sequence
  kWkBegin,       // packed K/V: first key row of the sequence
  kWtableRow,     // paged: offset (int32 elements) of the sequence's block-table row; -1: packed
  kWg,            // KV head
  kWr0,           // first row of the block (relative to the sequence's first new row)
  kWnr,           // rows in the block
  kWnSplits,      // the block's partial stride in splits
  kWpartOffset,   // offset (floats) of the block's partials
  kWsplit,        // the item's split
  kAttnWorkFields
};

// ---- the plan buffer (plan/run form: CUDA-graph safe) ---------------------------------------------------
// FlashInfer's plan()/run() split at the op level. aligned::attention_plan builds the plan from HOST metadata
// (the planner above validates it there) and copies it, stream-ordered, into caller-owned persistent device
// buffers; the run ops (attention_varlen_planned, paged_attention_planned) then read only device memory:
// no host-to-device copy, no host read, no allocation sized by data values, and a grid fixed by the buffer's
// capacity C (every launch identical for every metadata of that capacity, so a captured CUDA graph replays
// the plan written before the replay, at the same address).
//   plan  int64 [kAttnPlanHeaderRows + 2 C, kAttnWorkFields]: the header rows, then C forward-item records
//         (rows 2 .. 2 + C), then C row-block records (rows 2 + C .. 2 + 2 C); unused rows are never read.
//   table int32 [any]: the block-table entries the plan uses, compacted (sequence b's entries at the offset
//         its records carry in kWtableRow); empty for packed plans.
//   workspace fp32 [any]: the split partials (the header's part_floats must fit).
// The kernels check the header against the run's tensors before reading any record; a plan that does not
// fit (another shape, more rows than q, a smaller workspace) sets DeviceError kErrAttentionPlan and the run
// writes NaN instead of touching memory out of bounds.
constexpr int64_t kAttnPlanHeaderRows = 2;
constexpr int64_t kAttnPlanMagic = 0x4e414c5041544e41LL;  // "ANTAPLAN"
enum AttnPlanField : int {
  kPMagic = 0,
  kPnItems,       // forward (block, split) items
  kPnBlocks,      // row blocks
  kPHq,
  kPHkv,
  kPD,
  kPCausal,
  kPTq,           // query rows the plan addresses (<= q.size(0) at the run)
  kPnKv,          // packed: key rows (<= k.size(0)); paged: cache blocks the ids were checked against
  kPBlockSize,    // 0: packed
  kPPartFloats,   // workspace floats the plan needs
  kPTableElems,   // table entries the plan uses
  kAttnPlanFields
};
static_assert(kAttnPlanFields <= kAttnPlanHeaderRows * kAttnWorkFields, "the header must fit its rows");

// Records per region of a plan buffer with `rows` rows (the capacity C).
inline int64_t attn_plan_capacity(int64_t rows) { return rows < kAttnPlanHeaderRows ? 0 : (rows - kAttnPlanHeaderRows) / 2; }

struct AttnPlanDims {
  int64_t Tq, n_kv, block_size;  // as kPTq, kPnKv, kPBlockSize
};

// A plan in the buffer format, compact on the host: `head` = header rows + the item records, `blocks` = the
// row-block records, `table` = the compacted block table. The glue copies head to plan rows [0, 2 + n_items)
// and blocks to rows [2 + C, 2 + C + n_blocks). Returns "" or an error naming the op and what does not fit.
struct AttnPackedPlan {
  std::vector<int64_t> head, blocks;
  std::vector<int32_t> table;
};
inline std::string attn_pack_plan(const AttnPlan& plan, const AttnShape& sh, const AttnPlanDims& dims,
                                  int64_t capacity, int64_t table_capacity, int64_t workspace_floats, const char* op,
                                  AttnPackedPlan* out) {
  const std::string pre = std::string("aligned::") + op + ": ";
  const int64_t ni = (int64_t)plan.items.size(), nb = (int64_t)plan.blocks.size();
  if (ni > capacity || nb > capacity)
    return pre + "the plan needs " + std::to_string(ni > nb ? ni : nb) + " work records but the plan buffer holds " +
           std::to_string(capacity) + " (allocate it with a larger capacity)";
  if (plan.part_floats > workspace_floats)
    return pre + "the plan needs a workspace of " + std::to_string(plan.part_floats) + " floats but it has " +
           std::to_string(workspace_floats) + " (allocate a larger workspace)";
  std::vector<int64_t> table_offset(plan.seqs.size(), -1);
  out->table.clear();
  for (size_t b = 0; b < plan.seqs.size(); ++b) {
    const AttnSeq& s = plan.seqs[b];
    if (!s.blocks) continue;
    table_offset[b] = (int64_t)out->table.size();
    const int64_t used = dims.block_size > 0 ? (s.n_ctx + dims.block_size - 1) / dims.block_size : 0;
    out->table.insert(out->table.end(), s.blocks, s.blocks + used);
  }
  if ((int64_t)out->table.size() > table_capacity)
    return pre + "the plan uses " + std::to_string(out->table.size()) + " block-table entries but the plan's table "
           "holds " + std::to_string(table_capacity) + " (allocate a larger table)";
  out->head.assign(kAttnPlanHeaderRows * kAttnWorkFields, 0);
  int64_t* h = out->head.data();
  h[kPMagic] = kAttnPlanMagic;
  h[kPnItems] = ni;
  h[kPnBlocks] = nb;
  h[kPHq] = sh.Hq;
  h[kPHkv] = sh.Hkv;
  h[kPD] = sh.D;
  h[kPCausal] = sh.causal ? 1 : 0;
  h[kPTq] = dims.Tq;
  h[kPnKv] = dims.n_kv;
  h[kPBlockSize] = dims.block_size;
  h[kPPartFloats] = plan.part_floats;
  h[kPTableElems] = (int64_t)out->table.size();
  auto put = [&](std::vector<int64_t>& w, const AttnBlock& b, int64_t split) {
    const AttnSeq& s = plan.seqs[b.seq];
    const int64_t rec[kAttnWorkFields] = {s.q_begin, s.q_len, s.n_ctx, s.k_begin, table_offset[b.seq],
                                          b.g, b.r0, b.nr, b.n_splits, b.part_offset, split};
    w.insert(w.end(), rec, rec + kAttnWorkFields);
  };
  out->head.reserve(out->head.size() + ni * kAttnWorkFields);
  for (const AttnItem& it : plan.items) put(out->head, plan.blocks[it.block], it.split);
  out->blocks.clear();
  out->blocks.reserve(nb * kAttnWorkFields);
  for (const AttnBlock& b : plan.blocks) put(out->blocks, b, 0);
  return "";
}

// The run's side of the header check, shared by the CPU glue (host plan: a TORCH_CHECK with this message)
// and the GPU kernels (device plan: the error flag). 0 when the plan fits, else which field does not.
struct AttnRunDims {
  int64_t Hq, Hkv, D;
  bool causal;
  int64_t q_rows, kv_rows;   // q.size(0); packed: k.size(0), paged: cache blocks
  int64_t block_size;        // 0: packed
  int64_t capacity, table_elems, workspace_floats;
};
ALIGNED_HD int attn_plan_mismatch(const int64_t* h, const AttnRunDims& r) {
  if (h[kPMagic] != kAttnPlanMagic) return 1;
  if (h[kPHq] != r.Hq || h[kPHkv] != r.Hkv || h[kPD] != r.D || h[kPCausal] != (r.causal ? 1 : 0)) return 2;
  if (h[kPBlockSize] != r.block_size) return 3;
  if (h[kPTq] > r.q_rows || h[kPnKv] > r.kv_rows) return 4;
  if (h[kPnItems] > r.capacity || h[kPnBlocks] > r.capacity || h[kPnItems] < 0 || h[kPnBlocks] < 0) return 5;
  if (h[kPTableElems] > r.table_elems || h[kPPartFloats] > r.workspace_floats) return 6;
  return 0;
}
inline const char* attn_plan_mismatch_text(int code) {
  switch (code) {
    case 1: return "plan is not an attention plan (never planned, or not written by aligned::attention_plan)";
    case 2: return "plan was made for other heads / head_dim / causal than this call";
    case 3: return "plan was made for another kind (packed vs paged) or block_size";
    case 4: return "plan addresses more query or key rows than this call's tensors have";
    case 5: return "plan holds more records than its buffer's capacity";
    case 6: return "plan needs a larger table or workspace than this call passes";
    default: return "plan fits";
  }
}

// Host side (CPU backend): a plan buffer back into the planner's structures: one AttnSeq per row block
// (seqs[i] = block i's sequence; the table pointer into the compact table) and the items block-major,
// splits ascending — the list attn_pack_plan was given, so the run computes the same bits.
inline void attn_unpack_plan(const int64_t* plan, int64_t capacity, const int32_t* table, AttnPlan* out) {
  *out = AttnPlan{};
  const int64_t nb = plan[kPnBlocks];
  const int64_t* blocks = plan + (kAttnPlanHeaderRows + capacity) * kAttnWorkFields;
  for (int64_t i = 0; i < nb; ++i) {
    const int64_t* w = blocks + i * kAttnWorkFields;
    out->seqs.push_back(AttnSeq{w[kWqBegin], w[kWqLen], w[kWnCtx], w[kWkBegin],
                                w[kWtableRow] >= 0 ? table + w[kWtableRow] : nullptr});
    out->blocks.push_back(AttnBlock{i, w[kWg], w[kWr0], w[kWnr], w[kWnSplits], w[kWpartOffset]});
    for (int64_t s = 0; s < w[kWnSplits]; ++s) out->items.push_back(AttnItem{i, s});
  }
  out->part_floats = plan[kPPartFloats];
}

}  // namespace aligned
