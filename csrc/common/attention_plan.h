// attention_plan.h — the attention plan: ONE named structure, ONE serialisation, used by every attention path
// (per-call and planned, forward and backward, CPU and GPU). Torch-free, host only (the header check is also
// compiled for the GPU kernels).
//
// FlashInfer's plan()/run() split, applied to our contract: the planner turns the metadata the engine holds on
// the host (query/key offsets, each sequence's context length, its block-table row) into an AttnPlan, and
// validates that metadata while doing so; a run only consumes the plan. Consequences:
//   * every data-dependent check (offsets monotone, block ids in range, seq_lens within the table) happens once,
//     here, on host memory — no kernel reads device data back, and a bad table never reaches a kernel;
//   * the plan is a pure function of the metadata: which (row block, KV head, split) items exist, in which
//     order, where each item's partials live. The arithmetic per (row, head) is attention.h's, and the split
//     boundaries are absolute (attention.h), so how the items are spread over threads or blocks cannot change a
//     bit.
//
// The plan (AttnPlan):
//   info       AttnPlanInfo — what the plan was made for (heads, head_dim, causal, packed or paged and the block
//              size, the query rows it covers, the key rows / cache blocks, a fingerprint of its metadata) and
//              what it holds (record counts, the partials it needs, the table entries it uses). FlashInfer's
//              PlanInfo: to_vector() / from_vector() are its one serialisation, kept on the host by the caller
//              (aligned_ops.AttentionPlan.info) and given back to every run, which checks the call against it
//              before launching anything (check_plan_call: an error naming the op and the argument).
//   items      the forward (row block, split) work records, block-major, splits ascending;
//   blocks     the row-block records (the split merge; the backward's dq);
//   key_tiles  backward plans only: the (sequence, KV head, 32-key tile) records of dk / dv;
//   table      paged plans: the block-table entries the plan uses, compacted (a record's kWtableRow points here).
// A record is kAttnWorkFields int64 (AttnWorkField): the same bytes on the host (the CPU runs read them in
// place, through AttnPlanView: nothing is unpacked per layer) and on a device (the GPU kernels read them).
//
// The plan buffer (the plan/run form, CUDA-graph safe): plan int64 [kAttnPlanHeaderRows + 2 C, kAttnWorkFields]
// = the info's vector in the header rows, then C item records (rows 2 .. 2 + C), then C block records (rows
// 2 + C .. 2 + 2 C); plan_table int32 [>= table entries]. aligned::attention_plan writes it (stream-ordered on
// a device) once per step; the run forms then read only these buffers (no copy, no host read, grids fixed by the
// capacity C, so a captured graph replays whatever plan was written before the replay). The kernels check the
// header against the run (attn_plan_mismatch, replay form: the buffer, not the captured info, is the plan) before
// reading a record; a plan that does not fit the tensors sets DeviceError kErrAttentionPlan and the run writes
// NaN into every row — never out-of-bounds reads or stale bits in planned rows.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "attention.h"

namespace aligned {

// Rows per row block. A scheduling constant, not part of the contract: any value gives the same bits.
constexpr int64_t kAttnRowBlock = 16;

// Problem shape shared by the planner and the kernels.
struct AttnShape {
  int64_t Hq, Hkv, D;
  bool causal;
};

// ---- the work record ------------------------------------------------------------------------------------
// A forward item (row block, split), a row block (split = 0), or a backward key tile (kWsplit = the tile).
enum AttnWorkField : int {
  kWqBegin = 0,   // first query row of the sequence (packed q)
  kWqLen,         // new rows of the sequence
  kWnCtx,         // keys of the sequence
  kWkBegin,       // packed K/V: first key row of the sequence
  kWtableRow,     // paged: offset (int32 elements) of the sequence's entries in the plan's table; -1: packed
  kWg,            // KV head
  kWr0,           // first row of the block (relative to the sequence's first new row)
  kWnr,           // rows in the block
  kWnSplits,      // the block's partial stride in splits
  kWpartOffset,   // offset (floats) of the block's partials
  kWsplit,        // the item's split (forward), or the key tile (backward)
  kAttnWorkFields
};

// The CPU kernels' view of one record (csrc/cpu/attention_kernels.h): the sequence it belongs to and its block.
struct AttnSeq {
  int64_t q_begin;        // first query row of the sequence in q (packed)
  int64_t q_len;          // number of query rows (new tokens)
  int64_t n_ctx;          // number of keys of the sequence (context incl. the new tokens)
  int64_t k_begin;        // packed K/V: first key row of the sequence
  const int32_t* blocks;  // paged K/V: the sequence's block-table entries (nullptr when packed)
};
struct AttnBlock {
  int64_t seq, g, r0, nr;
  int64_t n_splits;     // max splits over the block's rows (the partial layout's stride)
  int64_t part_offset;  // offset (floats) of this block's partials in the plan's partial buffer
};
inline AttnSeq attn_record_seq(const int64_t* w, const int32_t* table) {
  return AttnSeq{w[kWqBegin], w[kWqLen], w[kWnCtx], w[kWkBegin], w[kWtableRow] >= 0 ? table + w[kWtableRow] : nullptr};
}
inline AttnBlock attn_record_block(const int64_t* w) {  // the block of sequence 0 (the record's own)
  return AttnBlock{0, w[kWg], w[kWr0], w[kWnr], w[kWnSplits], w[kWpartOffset]};
}

// ---- the plan info (FlashInfer's PlanInfo) ----------------------------------------------------------------
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
  kPTq,           // query rows the plan covers (== q.size(0) at the run)
  kPnKv,          // packed: key rows (<= k.size(0)); paged: cache blocks the ids were checked against
  kPBlockSize,    // 0: packed
  kPPartFloats,   // workspace floats the plan needs
  kPTableElems,   // table entries the plan uses
  kPMetaHash,     // the fingerprint of the metadata the plan was made from (attn_metadata_hash)
  kAttnPlanFields
};
static_assert(kAttnPlanFields <= kAttnPlanHeaderRows * kAttnWorkFields, "the header must fit its rows");

struct AttnPlanInfo {
  int64_t n_items = 0, n_blocks = 0;
  int64_t Hq = 0, Hkv = 0, D = 0;
  bool causal = true;
  int64_t q_rows = 0, n_kv = 0, block_size = 0;
  int64_t part_floats = 0, table_elems = 0;
  int64_t metadata_hash = 0;

  // The serialisation: kAttnPlanFields int64, magic first (the header rows of the plan buffer hold the same).
  void to_vector(int64_t* v) const {
    for (int i = 0; i < kAttnPlanFields; ++i) v[i] = 0;
    v[kPMagic] = kAttnPlanMagic;
    v[kPnItems] = n_items;
    v[kPnBlocks] = n_blocks;
    v[kPHq] = Hq;
    v[kPHkv] = Hkv;
    v[kPD] = D;
    v[kPCausal] = causal ? 1 : 0;
    v[kPTq] = q_rows;
    v[kPnKv] = n_kv;
    v[kPBlockSize] = block_size;
    v[kPPartFloats] = part_floats;
    v[kPTableElems] = table_elems;
    v[kPMetaHash] = metadata_hash;
  }
  // false: v holds no plan (never planned, or not written by attention_plan).
  static bool from_vector(const int64_t* v, AttnPlanInfo* out) {
    if (v[kPMagic] != kAttnPlanMagic || v[kPnItems] < 0 || v[kPnBlocks] < 0) return false;
    out->n_items = v[kPnItems];
    out->n_blocks = v[kPnBlocks];
    out->Hq = v[kPHq];
    out->Hkv = v[kPHkv];
    out->D = v[kPD];
    out->causal = v[kPCausal] != 0;
    out->q_rows = v[kPTq];
    out->n_kv = v[kPnKv];
    out->block_size = v[kPBlockSize];
    out->part_floats = v[kPPartFloats];
    out->table_elems = v[kPTableElems];
    out->metadata_hash = v[kPMetaHash];
    return true;
  }
  int64_t capacity() const { return n_items > n_blocks ? n_items : n_blocks; }  // records per buffer region
};

// ---- the plan -------------------------------------------------------------------------------------------
struct AttnPlan {
  AttnPlanInfo info;
  std::vector<int64_t> items, blocks, key_tiles;  // records, kAttnWorkFields each
  std::vector<int32_t> table;
};

// A plan as its runs read it: the info and where its records and table are (host vectors of an AttnPlan, or a
// plan buffer).
struct AttnPlanView {
  AttnPlanInfo info;
  const int64_t* items;
  const int64_t* blocks;
  const int32_t* table;
};
inline AttnPlanView attn_plan_view(const AttnPlan& p) {
  return AttnPlanView{p.info, p.items.data(), p.blocks.data(), p.table.data()};
}
// Records per region of a plan buffer with `rows` rows (the capacity C), and where the regions start.
inline int64_t attn_plan_capacity(int64_t rows) {
  return rows < kAttnPlanHeaderRows ? 0 : (rows - kAttnPlanHeaderRows) / 2;
}
inline int64_t attn_plan_items_offset() { return kAttnPlanHeaderRows * kAttnWorkFields; }
inline int64_t attn_plan_blocks_offset(int64_t capacity) { return (kAttnPlanHeaderRows + capacity) * kAttnWorkFields; }
// The plan buffer's header rows: the info's vector, zero-padded.
inline std::vector<int64_t> attn_plan_header(const AttnPlanInfo& info) {
  std::vector<int64_t> h(kAttnPlanHeaderRows * kAttnWorkFields, 0);
  info.to_vector(h.data());
  return h;
}
inline AttnPlanView attn_plan_buffer_view(const AttnPlanInfo& info, const int64_t* plan, int64_t capacity,
                                          const int32_t* table) {
  return AttnPlanView{info, plan + attn_plan_items_offset(), plan + attn_plan_blocks_offset(capacity), table};
}

// ---- the fingerprint of a plan's metadata -----------------------------------------------------------------
// FNV-1a over the int64 values that define the plan (the kind, the offsets, the context lengths, the table
// entries used): the run forms compare it with the call's metadata (varlen) and with the plan buffer's header
// (every run, in the kernels too), so a plan made from other metadata is refused, not silently computed.
struct AttnMetaHash {
  uint64_t h = 1469598103934665603ull;
  void add(int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (uint64_t)((v >> (8 * i)) & 0xff);
      h *= 1099511628211ull;
    }
  }
  int64_t value() const { return (int64_t)h; }
};
// The varlen fingerprint: the offsets cu_q, cu_k (host int32 [n]).
inline int64_t attn_varlen_metadata_hash(const int32_t* cu_q, const int32_t* cu_k, int64_t n) {
  AttnMetaHash m;
  m.add(1);  // packed
  m.add(n);
  for (int64_t i = 0; i < n; ++i) m.add(cu_q[i]);
  for (int64_t i = 0; i < n; ++i) m.add(cu_k[i]);
  return m.value();
}

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

inline void put(std::vector<int64_t>& w, const AttnSeq& s, int64_t table_row, int64_t g, int64_t r0, int64_t nr,
                int64_t n_splits, int64_t part_offset, int64_t split) {
  const int64_t rec[kAttnWorkFields] = {s.q_begin, s.q_len, s.n_ctx, s.k_begin, table_row, g, r0, nr, n_splits,
                                        part_offset, split};
  w.insert(w.end(), rec, rec + kAttnWorkFields);
}

// The records of the sequences (their table rows already in plan->table): row blocks, their (block, split)
// items block-major, and, for a backward plan, the key tiles; then the info's counts.
inline void add_records(const AttnShape& sh, const std::vector<AttnSeq>& seqs, const std::vector<int64_t>& table_row,
                        bool backward, AttnPlan* plan) {
  const int64_t G = sh.Hq / sh.Hkv, stride = sh.D + 2;
  int64_t part_floats = 0;
  for (size_t b = 0; b < seqs.size(); ++b) {
    const AttnSeq& s = seqs[b];
    for (int64_t g = 0; g < sh.Hkv; ++g)
      for (int64_t r0 = 0; r0 < s.q_len; r0 += kAttnRowBlock) {
        const int64_t nr = s.q_len - r0 < kAttnRowBlock ? s.q_len - r0 : kAttnRowBlock;
        int64_t n_splits = 0;
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t ns = attn_num_splits(attn_row_keys(s.n_ctx - s.q_len + r0 + r, s.n_ctx, sh.causal));
          if (ns > n_splits) n_splits = ns;
        }
        for (int64_t sp = 0; sp < n_splits; ++sp)
          put(plan->items, s, table_row[b], g, r0, nr, n_splits, part_floats, sp);
        put(plan->blocks, s, table_row[b], g, r0, nr, n_splits, part_floats, 0);
        part_floats += nr * G * n_splits * stride;
      }
  }
  if (backward)
    for (size_t b = 0; b < seqs.size(); ++b)
      for (int64_t g = 0; g < sh.Hkv; ++g)
        for (int64_t t = 0; t * kAttnTile < seqs[b].n_ctx; ++t)
          put(plan->key_tiles, seqs[b], -1, g, 0, seqs[b].q_len, 0, 0, t);
  AttnPlanInfo& i = plan->info;
  i.n_items = (int64_t)plan->items.size() / kAttnWorkFields;
  i.n_blocks = (int64_t)plan->blocks.size() / kAttnWorkFields;
  i.Hq = sh.Hq;
  i.Hkv = sh.Hkv;
  i.D = sh.D;
  i.causal = sh.causal;
  i.part_floats = part_floats;
  i.table_elems = (int64_t)plan->table.size();
}

}  // namespace plan_detail

// Packed variable-length batch (training, one-shot prefill): cu_q, cu_k host int32 [n_offsets]. `backward`: the
// key tiles too. Returns "" and fills *plan, or an error message naming the op and the argument.
inline std::string plan_varlen(const int32_t* cu_q, const int32_t* cu_k, int64_t n_offsets, int64_t Tq, int64_t Tk,
                               const AttnShape& sh, bool backward, const char* op, AttnPlan* plan) {
  std::string err = plan_detail::check_offsets(cu_q, n_offsets, Tq, op, "cu_seqlens_q");
  if (err.empty()) err = plan_detail::check_offsets(cu_k, n_offsets, Tk, op, "cu_seqlens_k");
  if (!err.empty()) return err;
  *plan = AttnPlan{};
  std::vector<AttnSeq> seqs;
  for (int64_t b = 0; b + 1 < n_offsets; ++b)
    seqs.push_back(AttnSeq{cu_q[b], cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b], cu_k[b], nullptr});
  plan_detail::add_records(sh, seqs, std::vector<int64_t>(seqs.size(), -1), backward, plan);
  plan->info.q_rows = Tq;
  plan->info.n_kv = Tk;
  plan->info.block_size = 0;
  plan->info.metadata_hash = attn_varlen_metadata_hash(cu_q, cu_k, n_offsets);
  return "";
}

// Paged KV cache (chunked prefill, decode): query_start_loc host int32 [B+1], seq_lens host int32 [B],
// block_table host int32 [B, max_blocks] (row-major). The plan copies the entries it uses into its own table.
inline std::string plan_paged(const int32_t* query_start_loc, const int32_t* seq_lens, const int32_t* block_table,
                              int64_t B, int64_t max_blocks, int64_t num_blocks, int64_t block_size, int64_t Tq,
                              const AttnShape& sh, const char* op, AttnPlan* plan) {
  using plan_detail::prefix;
  std::string err = plan_detail::check_offsets(query_start_loc, B + 1, Tq, op, "query_start_loc");
  if (!err.empty()) return err;
  *plan = AttnPlan{};
  std::vector<AttnSeq> seqs;
  std::vector<int64_t> table_row;
  AttnMetaHash hash;
  hash.add(2);  // paged
  hash.add(B);
  hash.add(block_size);
  hash.add(num_blocks);
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
    const int64_t used = (n + block_size - 1) / block_size;
    for (int64_t i = 0; i < used; ++i)
      if (row[i] < 0 || row[i] >= num_blocks)
        return prefix(op) + "block_table[" + sb + ", " + std::to_string(i) + "] = " + std::to_string(row[i]) +
               " is out of range [0, " + std::to_string(num_blocks) + ")";
    hash.add(query_start_loc[b]);
    hash.add(n);
    for (int64_t i = 0; i < used; ++i) hash.add(row[i]);
    table_row.push_back((int64_t)plan->table.size());
    plan->table.insert(plan->table.end(), row, row + used);
    seqs.push_back(AttnSeq{query_start_loc[b], ql, n, 0, nullptr});
  }
  hash.add(query_start_loc[B]);
  plan_detail::add_records(sh, seqs, table_row, false, plan);
  plan->info.q_rows = Tq;
  plan->info.n_kv = num_blocks;
  plan->info.block_size = block_size;
  plan->info.metadata_hash = hash.value();
  return "";
}

// KV-cache write: every slot in [-1, n_slots) (-1: a padding token, not written), and no slot twice: two tokens
// written to one slot would leave whichever write lands last, which depends on the thread count and the run (the
// cache would no longer be a function of the tokens). "" when valid. O(T) when the written slots increase (a
// prefill's own blocks) or the cache has at most 256 slots per written token (a bitmap of the cache); else
// O(T log T).
inline std::string check_slots(const int64_t* slots, int64_t T, int64_t n_slots, const char* op) {
  int64_t written = 0, last = -1;
  bool increasing = true;
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] < -1 || slots[t] >= n_slots)
      return plan_detail::prefix(op) + "slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slots[t]) +
             " is out of range [-1, " + std::to_string(n_slots) + ")";
    if (slots[t] < 0) continue;
    increasing = increasing && slots[t] > last;
    last = slots[t];
    ++written;
  }
  if (increasing) return "";
  auto twice = [&](int64_t first, int64_t second) {
    return plan_detail::prefix(op) + "slot_mapping[" + std::to_string(first) + "] and slot_mapping[" +
           std::to_string(second) + "] are both " + std::to_string(slots[second]) +
           ": two tokens cannot be written to one cache slot";
  };
  if (n_slots <= 256 * written) {
    std::vector<uint64_t> seen(static_cast<size_t>((n_slots + 63) / 64), 0);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = slots[t];
      if (s < 0) continue;
      uint64_t& word = seen[static_cast<size_t>(s / 64)];
      const uint64_t bit = uint64_t(1) << (s % 64);
      if (word & bit) {
        int64_t first = 0;
        while (slots[first] != s) ++first;
        return twice(first, t);
      }
      word |= bit;
    }
    return "";
  }
  std::vector<std::pair<int64_t, int64_t>> by_slot;  // (slot, token)
  by_slot.reserve(static_cast<size_t>(written));
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0) by_slot.emplace_back(slots[t], t);
  std::sort(by_slot.begin(), by_slot.end());
  // the same pair the bitmap names: the first token (in token order) whose slot an earlier token took, and that
  // earlier token — of each repeated slot, its first two tokens; of those, the one with the earliest second
  int64_t first = -1, second = -1;
  for (size_t i = 1; i < by_slot.size(); ++i)
    if (by_slot[i].first == by_slot[i - 1].first && (i < 2 || by_slot[i - 2].first != by_slot[i].first) &&
        (second < 0 || by_slot[i].second < second)) {
      first = by_slot[i - 1].second;
      second = by_slot[i].second;
    }
  return second < 0 ? "" : twice(first, second);
}

// ---- the run's check: a plan against the call ------------------------------------------------------------
// What a run knows without reading any plan data: its tensors' sizes, the buffers' capacities, and the
// fingerprint of the plan it was given (the host info's). The same verdict on the host (a clear error before
// any launch) and in the GPU kernels (the device header against the captured call: DeviceError
// kErrAttentionPlan and NaN outputs). 0 when the plan fits, else the first rule it breaks.
struct AttnRunDims {
  int64_t Hq, Hkv, D;
  bool causal;
  int64_t q_rows, kv_rows;   // q.size(0); packed: k.size(0), paged: cache blocks
  int64_t block_size;        // 0: packed
  int64_t capacity, table_elems, workspace_floats;
  int64_t metadata_hash;     // the fingerprint of the plan the run was given
};
// `replay` (the GPU kernels' check of the device header): a captured CUDA graph replays the run dims of its
// capture while the buffer holds the plan written for this step, so the two rules that tie the buffer to the
// captured call — exactly q's rows (7) and the captured fingerprint (8) — are the host's alone (check_plan_call,
// at capture and on every eager call). The device keeps what protects memory: shapes, kind, row and block
// bounds, capacities. A replayed plan for fewer rows than the graph's padded q: the merge kernel writes NaN into
// the padding rows (never uninitialised bits; vLLM discards them).
ALIGNED_HD int attn_plan_mismatch(const int64_t* h, const AttnRunDims& r, bool replay = false) {
  if (h[kPMagic] != kAttnPlanMagic) return 1;
  if (h[kPHq] != r.Hq || h[kPHkv] != r.Hkv || h[kPD] != r.D || h[kPCausal] != (r.causal ? 1 : 0)) return 2;
  if (h[kPBlockSize] != r.block_size) return 3;
  if (h[kPTq] > r.q_rows || h[kPnKv] > r.kv_rows) return 4;
  if (!replay && h[kPTq] < r.q_rows) return 7;  // rows the plan does not cover would stay unwritten
  if (h[kPnItems] > r.capacity || h[kPnBlocks] > r.capacity || h[kPnItems] < 0 || h[kPnBlocks] < 0) return 5;
  if (h[kPTableElems] > r.table_elems || h[kPPartFloats] > r.workspace_floats) return 6;
  if (!replay && h[kPMetaHash] != r.metadata_hash) return 8;
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
    case 7: return "plan covers fewer query rows than q has (its rows would stay unwritten): plan it from this "
                   "call's metadata";
    case 8: return "plan buffer holds another plan than plan_info (pass the info attention_plan wrote with it)";
    default: return "plan fits";
  }
}

}  // namespace aligned
