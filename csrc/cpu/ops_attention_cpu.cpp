// ops_attention_cpu.cpp — schemas and CPU glue of the attention ops: argument checks (all host-side, before
// any kernel runs, so a bad block table or slot can never cause an out-of-bounds access), output
// allocation, and the split of work items over torch's intra-op threads. The arithmetic is in
// attention_kernels.cpp; its order is csrc/common/attention.h.
//
// Threading: the forward cuts every sequence into row blocks (kRowBlock rows x one KV head). With enough
// blocks each block computes all its KV splits and merges them itself; with few blocks (decode, short
// chunks) the (block, split) pairs are spread over threads and the merge runs afterwards. Both modes run
// the same per-split and merge functions, so the choice never changes a bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <string.h>
#include <torch/library.h>

#include <limits>
#include <vector>

#include "../common/attention.h"
#include "attention_kernels.h"
#include "glue_checks.h"

namespace aligned::cpu {
namespace generic { extern const AttentionTable kAttentionTable; }
#if defined(__x86_64__)
namespace avx2 { extern const AttentionTable kAttentionTable; }
namespace avx512 { extern const AttentionTable kAttentionTable; }
#endif

// Same ISA level as the dense kernels (ALIGNED_CPU_ISA forces it for both).
const AttentionTable& attention_kernels() {
  static const AttentionTable& table = []() -> const AttentionTable& {
    const char* isa = cpu_kernels().isa;
#if defined(__x86_64__)
    if (strcmp(isa, "avx512") == 0) return avx512::kAttentionTable;
    if (strcmp(isa, "avx2") == 0) return avx2::kAttentionTable;
#endif
    (void)isa;
    return generic::kAttentionTable;
  }();
  return table;
}

namespace {

constexpr int64_t kRowBlock = 16;

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op, const char* na, const char* nb) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "aligned::", op, ": ", nb, " must have the dtype of ", na, " (",
              a.scalar_type(), "), got ", b.scalar_type());
}

// Checks an int32 [B+1] offsets tensor: starts at 0, non-decreasing, ends at total. Returns a host copy.
std::vector<int64_t> check_offsets(const at::Tensor& cu, int64_t total, const char* op, const char* name) {
  check_cpu(cu, op, name);
  TORCH_CHECK(cu.scalar_type() == at::kInt, "aligned::", op, ": ", name, " must be int32, got ", cu.scalar_type());
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, "aligned::", op, ": ", name, " must be 1-D [batch + 1], got shape ",
              cu.sizes());
  auto c = cu.contiguous();
  const int32_t* p = c.data_ptr<int32_t>();
  std::vector<int64_t> v(c.size(0));
  for (int64_t i = 0; i < c.size(0); ++i) v[i] = p[i];
  TORCH_CHECK(v[0] == 0, "aligned::", op, ": ", name, "[0] must be 0, got ", v[0]);
  for (size_t i = 1; i < v.size(); ++i)
    TORCH_CHECK(v[i] >= v[i - 1], "aligned::", op, ": ", name, " must be non-decreasing, got ", v[i - 1], " then ",
                v[i], " at index ", i);
  TORCH_CHECK(v.back() == total, "aligned::", op, ": ", name, "[-1] must equal the number of rows (", total,
              "), got ", v.back());
  return v;
}

// Forward over the sequences of `a`; out [Tq, Hq, D] (q dtype), lse [Tq, Hq] fp32.
void run_forward(const AttnArgs& a, int64_t n_seqs, void* out, float* lse) {
  const auto& kern = attention_kernels();
  std::vector<AttnBlock> blocks;
  int64_t part_total = 0;
  const int64_t G = a.Hq / a.Hkv, stride = a.D + 2;
  for (int64_t b = 0; b < n_seqs; ++b) {
    const AttnSeq& s = a.seqs[b];
    for (int64_t g = 0; g < a.Hkv; ++g)
      for (int64_t r0 = 0; r0 < s.q_len; r0 += kRowBlock) {
        AttnBlock blk;
        blk.seq = b;
        blk.g = g;
        blk.r0 = r0;
        blk.nr = std::min(kRowBlock, s.q_len - r0);
        int64_t ns = 0;
        for (int64_t r = 0; r < blk.nr; ++r)
          ns = std::max(ns, attn_num_splits(attn_row_keys(s.n_ctx - s.q_len + r0 + r, s.n_ctx, a.causal)));
        blk.n_splits = ns;
        blk.part_offset = part_total;
        part_total += blk.nr * G * ns * stride;
        blocks.push_back(blk);
      }
  }
  const int64_t nb = (int64_t)blocks.size();
  if (nb == 0) return;
  const int64_t threads = at::get_num_threads();
  if (nb >= 4 * threads) {
    at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> part;
      for (int64_t i = b0; i < b1; ++i) {
        const AttnBlock& blk = blocks[i];
        part.resize(std::max<int64_t>(1, blk.nr * G * blk.n_splits * stride));
        kern.fwd_block(a, blk, 0, blk.n_splits, part.data());
        kern.merge_block(a, blk, part.data(), out, lse);
      }
    });
    return;
  }
  // Few blocks: parallel over (block, split), then merge.
  std::vector<float> part(std::max<int64_t>(1, part_total));
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t i = 0; i < nb; ++i)
    for (int64_t sp = 0; sp < blocks[i].n_splits; ++sp) items.emplace_back(i, sp);
  at::parallel_for(0, (int64_t)items.size(), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const AttnBlock& blk = blocks[items[i].first];
      kern.fwd_block(a, blk, items[i].second, items[i].second + 1, part.data() + blk.part_offset);
    }
  });
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) kern.merge_block(a, blocks[i], part.data() + blocks[i].part_offset, out, lse);
  });
}

struct VarlenInputs {
  at::Tensor q, k, v;
  std::vector<AttnSeq> seqs;
  AttnArgs args;
};

VarlenInputs prepare_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                            const at::Tensor& cu_k, double scale, bool causal, const char* op) {
  check_cpu(q, op, "q");
  check_cpu(k, op, "k");
  check_cpu(v, op, "v");
  DType dt = dtype_of<DType>(q, op, "q");
  check_same_dtype(q, k, op, "q", "k");
  check_same_dtype(q, v, op, "q", "v");
  TORCH_CHECK(q.dim() == 3, "aligned::", op, ": q must be [tokens, heads, head_dim], got shape ", q.sizes());
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3, "aligned::", op, ": k and v must be [tokens, kv_heads, head_dim], got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), "aligned::", op, ": k and v must have the same shape, got ", k.sizes(), " and ",
              v.sizes());
  const int64_t Hq = q.size(1), Hkv = k.size(1), D = q.size(2);
  TORCH_CHECK(D >= 1, "aligned::", op, ": head_dim must be >= 1, got ", D);
  TORCH_CHECK(k.size(2) == D, "aligned::", op, ": head_dim of k (", k.size(2), ") must equal head_dim of q (", D, ")");
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0, "aligned::", op, ": num_heads of q (", Hq,
              ") must be a multiple of num_kv_heads (", Hkv, ")");
  // the kernels use scale in fp32: 1e39 would become inf (every score NaN)
  TORCH_CHECK(std::isfinite((float)scale), "aligned::", op, ": scale must be finite in float32 (|scale| <= ",
              std::numeric_limits<float>::max(), "), got ", scale);
  auto oq = check_offsets(cu_q, q.size(0), op, "cu_seqlens_q");
  auto ok = check_offsets(cu_k, k.size(0), op, "cu_seqlens_k");
  TORCH_CHECK(oq.size() == ok.size(), "aligned::", op, ": cu_seqlens_q and cu_seqlens_k must have the same length, got ",
              oq.size(), " and ", ok.size());
  VarlenInputs in;
  in.q = q.contiguous();
  in.k = k.contiguous();
  in.v = v.contiguous();
  for (size_t b = 0; b + 1 < oq.size(); ++b)
    in.seqs.push_back(AttnSeq{oq[b], oq[b + 1] - oq[b], ok[b + 1] - ok[b], ok[b], nullptr});
  in.args = AttnArgs{dt, Hq, Hkv, D, (float)scale, causal, in.q.data_ptr(), in.k.data_ptr(), in.v.data_ptr(), 0,
                     in.seqs.data()};
  return in;
}

std::tuple<at::Tensor, at::Tensor> attention_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& cu_q, const at::Tensor& cu_k, double scale,
                                                    bool causal) {
  auto in = prepare_varlen(q, k, v, cu_q, cu_k, scale, causal, "attention_varlen");
  auto out = at::empty_like(in.q);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  run_forward(in.args, (int64_t)in.seqs.size(), out.data_ptr(), lse.data_ptr<float>());
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_q, const at::Tensor& cu_k, double scale, bool causal) {
  const char* op = "attention_varlen_backward";
  auto in = prepare_varlen(q, k, v, cu_q, cu_k, scale, causal, op);
  check_cpu(grad_out, op, "grad_out");
  check_cpu(out, op, "out");
  check_cpu(lse, op, "lse");
  TORCH_CHECK(grad_out.sizes() == q.sizes() && grad_out.scalar_type() == q.scalar_type(), "aligned::", op,
              ": grad_out must match q in shape and dtype, got ", grad_out.sizes(), " ", grad_out.scalar_type());
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(), "aligned::", op,
              ": out must match q in shape and dtype, got ", out.sizes(), " ", out.scalar_type());
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 2 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1),
              "aligned::", op, ": lse must be float32 [", q.size(0), ", ", q.size(1), "], got ", lse.scalar_type(), " ",
              lse.sizes());
  auto go = grad_out.contiguous(), oc = out.contiguous(), lc = lse.contiguous();
  const auto& a = in.args;
  const auto& kern = attention_kernels();
  auto delta = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  const int64_t rows = q.size(0) * q.size(1);
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(a.D, 1)), [&](int64_t i0, int64_t i1) {
    kern.bwd_delta(a.dt, go.data_ptr(), oc.data_ptr(), delta.data_ptr<float>(), a.D, i0, i1);
  });
  auto dq = at::empty_like(in.q), dk = at::zeros_like(in.k), dv = at::zeros_like(in.v);
  std::vector<AttnBlock> blocks;
  struct KTile { int64_t seq, g, t; };
  std::vector<KTile> ktiles;
  for (int64_t b = 0; b < (int64_t)in.seqs.size(); ++b) {
    const AttnSeq& s = in.seqs[b];
    for (int64_t g = 0; g < a.Hkv; ++g) {
      for (int64_t r0 = 0; r0 < s.q_len; r0 += kRowBlock)
        blocks.push_back(AttnBlock{b, g, r0, std::min(kRowBlock, s.q_len - r0), 0, 0});
      for (int64_t t = 0; t * kAttnTile < s.n_ctx; ++t) ktiles.push_back(KTile{b, g, t});
    }
  }
  const float* lp = lc.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  at::parallel_for(0, (int64_t)blocks.size(), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) kern.bwd_dq_block(a, blocks[i], go.data_ptr(), lp, dp, dq.data_ptr());
  });
  at::parallel_for(0, (int64_t)ktiles.size(), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      kern.bwd_dkdv_tile(a, ktiles[i].seq, ktiles[i].g, ktiles[i].t, go.data_ptr(), lp, dp, dk.data_ptr(),
                         dv.data_ptr());
  });
  return {dq, dk, dv};
}

void check_cache(const at::Tensor& c, const at::Tensor& ref, const char* ref_name, const char* op, const char* name) {
  check_cpu(c, op, name);
  check_same_dtype(ref, c, op, ref_name, name);
  TORCH_CHECK(c.dim() == 4, "aligned::", op, ": ", name,
              " must be [num_blocks, block_size, num_kv_heads, head_dim], got shape ", c.sizes());
  TORCH_CHECK(c.is_contiguous(), "aligned::", op, ": ", name, " must be contiguous");
}

void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& slot_mapping) {
  const char* op = "reshape_and_cache";
  check_cpu(k, op, "k");
  check_cpu(v, op, "v");
  check_cpu(slot_mapping, op, "slot_mapping");
  DType dt = dtype_of<DType>(k, op, "k");
  check_same_dtype(k, v, op, "k", "v");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes(), "aligned::", op,
              ": k and v must both be [tokens, num_kv_heads, head_dim], got ", k.sizes(), " and ", v.sizes());
  check_cache(k_cache, k, "k", op, "k_cache");
  check_cache(v_cache, k, "k", op, "v_cache");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "aligned::", op, ": k_cache and v_cache must have the same shape");
  TORCH_CHECK(k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2), "aligned::", op,
              ": cache heads/head_dim [", k_cache.size(2), ", ", k_cache.size(3), "] must match k [", k.size(1), ", ",
              k.size(2), "]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "aligned::", op, ": slot_mapping must be int64, got ",
              slot_mapping.scalar_type());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0), "aligned::", op,
              ": slot_mapping must be [", k.size(0), "], got ", slot_mapping.sizes());
  {  // two views of one buffer would make the k and v writes of a slot clobber each other
    const char* kb = (const char*)k_cache.data_ptr();
    const char* vb = (const char*)v_cache.data_ptr();
    const int64_t bytes = k_cache.numel() * (int64_t)k_cache.element_size();
    TORCH_CHECK(bytes == 0 || kb + bytes <= vb || vb + bytes <= kb, "aligned::", op,
                ": k_cache and v_cache must not overlap in memory (got two views of one buffer)");
  }
  auto sm = slot_mapping.contiguous();
  const int64_t* slots = sm.data_ptr<int64_t>();
  const int64_t n_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < sm.size(0); ++t)
    TORCH_CHECK(slots[t] >= -1 && slots[t] < n_slots, "aligned::", op, ": slot_mapping[", t, "] = ", slots[t],
                " is out of range [-1, ", n_slots, ")");
  auto kc = k.contiguous(), vc = v.contiguous();
  const int64_t row = k.size(1) * k.size(2);
  const auto& kern = attention_kernels();
  at::parallel_for(0, k.size(0), 64, [&](int64_t t0, int64_t t1) {
    kern.cache_write(dt, kc.data_ptr(), vc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots, row, t0, t1);
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& qsl,
                           double scale) {
  const char* op = "paged_attention";
  check_cpu(q, op, "q");
  DType dt = dtype_of<DType>(q, op, "q");
  TORCH_CHECK(q.dim() == 3, "aligned::", op, ": q must be [tokens, heads, head_dim], got shape ", q.sizes());
  check_cache(k_cache, q, "q", op, "k_cache");
  check_cache(v_cache, q, "q", op, "v_cache");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "aligned::", op, ": k_cache and v_cache must have the same shape, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t Hq = q.size(1), D = q.size(2), num_blocks = k_cache.size(0), bs = k_cache.size(1),
                Hkv = k_cache.size(2);
  TORCH_CHECK(D >= 1, "aligned::", op, ": head_dim must be >= 1, got ", D);
  TORCH_CHECK(k_cache.size(3) == D, "aligned::", op, ": head_dim of the cache (", k_cache.size(3),
              ") must equal head_dim of q (", D, ")");
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0, "aligned::", op, ": num_heads of q (", Hq,
              ") must be a multiple of num_kv_heads (", Hkv, ")");
  TORCH_CHECK(bs >= 1, "aligned::", op, ": block_size must be >= 1");
  // the kernels use scale in fp32: 1e39 would become inf (every score NaN)
  TORCH_CHECK(std::isfinite((float)scale), "aligned::", op, ": scale must be finite in float32 (|scale| <= ",
              std::numeric_limits<float>::max(), "), got ", scale);
  check_cpu(block_table, op, "block_table");
  check_cpu(seq_lens, op, "seq_lens");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2, "aligned::", op,
              ": block_table must be int32 [batch, max_blocks], got ", block_table.scalar_type(), " ",
              block_table.sizes());
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1, "aligned::", op,
              ": seq_lens must be int32 [batch], got ", seq_lens.scalar_type(), " ", seq_lens.sizes());
  auto oq = check_offsets(qsl, q.size(0), op, "query_start_loc");
  const int64_t B = (int64_t)oq.size() - 1;
  TORCH_CHECK(seq_lens.size(0) == B && block_table.size(0) == B, "aligned::", op,
              ": seq_lens and block_table must have batch = len(query_start_loc) - 1 = ", B, " rows, got ",
              seq_lens.size(0), " and ", block_table.size(0));
  auto bt = block_table.contiguous(), sl = seq_lens.contiguous();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int32_t* slp = sl.data_ptr<int32_t>();
  const int64_t max_blocks = bt.size(1);
  std::vector<AttnSeq> seqs;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = slp[b], ql = oq[b + 1] - oq[b];
    TORCH_CHECK(n >= 0, "aligned::", op, ": seq_lens[", b, "] = ", n, " is negative");
    TORCH_CHECK(ql <= n, "aligned::", op, ": sequence ", b, " has ", ql, " new tokens but seq_lens[", b, "] = ", n,
                " (seq_lens counts the context including the new tokens)");
    TORCH_CHECK(n <= max_blocks * bs, "aligned::", op, ": seq_lens[", b, "] = ", n,
                " is longer than the block table allows (", max_blocks, " blocks x ", bs, ")");
    const int64_t used = (n + bs - 1) / bs;
    for (int64_t i = 0; i < used; ++i) {
      const int32_t blk = btp[b * max_blocks + i];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "aligned::", op, ": block_table[", b, ", ", i, "] = ", blk,
                  " is out of range [0, ", num_blocks, ")");
    }
    seqs.push_back(AttnSeq{oq[b], ql, n, 0, btp + b * max_blocks});
  }
  auto qc = q.contiguous();
  auto out = at::empty_like(qc);
  auto lse = at::empty({q.size(0), Hq}, q.options().dtype(at::kFloat));
  AttnArgs a{dt, Hq, Hkv, D, (float)scale, true, qc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bs,
             seqs.data()};
  run_forward(a, B, out.data_ptr(), lse.data_ptr<float>());
  return out;
}

}  // namespace
}  // namespace aligned::cpu

TORCH_LIBRARY_FRAGMENT(aligned, m) {
  m.def(
      "attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale, "
      "bool causal=True) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_varlen_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale, bool causal) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("reshape_and_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(aligned, CPU, m) {
  m.impl("attention_varlen", &aligned::cpu::attention_varlen);
  m.impl("attention_varlen_backward", &aligned::cpu::attention_varlen_backward);
  m.impl("reshape_and_cache", &aligned::cpu::reshape_and_cache);
  m.impl("paged_attention", &aligned::cpu::paged_attention);
}
