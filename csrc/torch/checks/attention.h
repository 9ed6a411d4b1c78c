// checks/attention.h — argument checks of the attention family (attention_varlen and its backward,
// reshape_and_cache, paged_attention, the plan and its run forms), written once for every backend's glue
// body (csrc/torch/glue/attention.h).
//
// Split the same way as the family's work: these checks look only at tensor *metadata* (dtype, rank,
// shapes, strides, scalars) and never read tensor data, so they cost nothing on a GPU and never sync.
// Checks that need data values (offsets monotone, block ids and slots in range) are the planner's
// (csrc/common/attention_plan.h), which runs on the host copies of that metadata the engine already
// keeps. Each glue body checks devices first (B::Call::on_device), then calls these.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "../../common/attention_mma.h"
#include "../../common/attention_plan.h"
#include "../../gpu/attention_api.h"  // kGpuAttnMaxD: the mma kernel's widest head_dim
#include "common.h"

namespace aligned {

namespace attn_detail {

inline void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op, const char* na, const char* nb) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "aligned::", op, ": ", nb, " must have the dtype of ", na, " (",
              a.scalar_type(), "), got ", b.scalar_type());
}

// scale multiplies fp32 scores: it must be a finite fp32 number (a double that rounds to inf, or that
// underflows to 0, would silently turn every score into inf/NaN or 0).
inline void check_scale(double scale, const char* op) {
  const float f = (float)scale;
  TORCH_CHECK(std::isfinite(f), "aligned::", op, ": scale must be finite in float32 (|scale| <= ",
              std::numeric_limits<float>::max(), "), got ", scale);
  TORCH_CHECK(scale == 0.0 || f != 0.0f, "aligned::", op, ": scale = ", scale,
              " underflows to 0 in float32 (every score would be 0)");
}

inline void check_heads(int64_t Hq, int64_t Hkv, int64_t D, const char* op) {
  TORCH_CHECK(D >= 1, "aligned::", op, ": head_dim must be >= 1, got ", D);
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0, "aligned::", op, ": num_heads of q (", Hq,
              ") must be a multiple of num_kv_heads (", Hkv, ")");
}

inline void check_offsets_meta(const at::Tensor& cu, const char* op, const char* name) {
  TORCH_CHECK(cu.scalar_type() == at::kInt, "aligned::", op, ": ", name, " must be int32, got ", cu.scalar_type());
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, "aligned::", op, ": ", name, " must be 1-D [batch + 1], got shape ",
              cu.sizes());
}

inline void check_cache(const at::Tensor& c, const at::Tensor& ref, const char* ref_name, const char* op,
                        const char* name) {
  check_same_dtype(ref, c, op, ref_name, name);
  TORCH_CHECK(c.dim() == 4, "aligned::", op, ": ", name,
              " must be [num_blocks, block_size, num_kv_heads, head_dim], got shape ", c.sizes());
  TORCH_CHECK(c.is_contiguous(), "aligned::", op, ": ", name, " must be contiguous");
}

// The bytes a tensor's elements can touch, [lo, hi) (any strides; empty: an empty span).
inline std::pair<const char*, const char*> byte_span(const at::Tensor& t) {
  const auto* base = (const char*)t.data_ptr();
  if (t.numel() == 0) return {base, base};
  int64_t lo = 0, hi = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t reach = (t.size(d) - 1) * t.stride(d);
    (reach < 0 ? lo : hi) += reach;
  }
  const auto es = (int64_t)t.element_size();
  return {base + lo * es, base + (hi + 1) * es};
}

// Two tensors an op reads from and writes to (or writes both) must not share memory: a write through one would
// change what the other holds while the op runs, in an order that depends on the threads (found: reshape_and_cache
// with k a view of k_cache gave other bits at 1 and 2 threads). Conservative: the spans, not the elements.
inline void check_disjoint(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name,
                           const char* op) {
  const auto sa = byte_span(a), sb = byte_span(b);
  if (sa.first == sa.second || sb.first == sb.second) return;
  TORCH_CHECK(sa.second <= sb.first || sb.second <= sa.first, "aligned::", op, ": ", a_name, " and ", b_name,
              " must not overlap in memory (two views of one buffer?)");
}

// Two views of one buffer as k_cache and v_cache would make every K write clobber V (or the reverse).
inline void check_caches_disjoint(const at::Tensor& k_cache, const at::Tensor& v_cache, const char* op) {
  check_disjoint(k_cache, "k_cache", v_cache, "v_cache", op);
}

}  // namespace attn_detail

// A planner's verdict as a torch error (the planner itself is torch-free).
inline void check_plan(const std::string& err) { TORCH_CHECK(err.empty(), err); }

template <class DTypeEnum>
struct AttnCheck {
  DTypeEnum dt;
  AttnShape shape;
};

template <class DTypeEnum>
AttnCheck<DTypeEnum> check_attention_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& cu_q, const at::Tensor& cu_k, double scale, bool causal,
                                            const char* op) {
  using namespace attn_detail;
  DTypeEnum dt = dtype_of<DTypeEnum>(q, op, "q");
  check_same_dtype(q, k, op, "q", "k");
  check_same_dtype(q, v, op, "q", "v");
  TORCH_CHECK(q.dim() == 3, "aligned::", op, ": q must be [tokens, heads, head_dim], got shape ", q.sizes());
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3, "aligned::", op, ": k and v must be [tokens, kv_heads, head_dim], got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), "aligned::", op, ": k and v must have the same shape, got ", k.sizes(), " and ",
              v.sizes());
  const int64_t Hq = q.size(1), Hkv = k.size(1), D = q.size(2);
  TORCH_CHECK(k.size(2) == D, "aligned::", op, ": head_dim of k (", k.size(2), ") must equal head_dim of q (", D, ")");
  check_heads(Hq, Hkv, D, op);
  check_scale(scale, op);
  check_offsets_meta(cu_q, op, "cu_seqlens_q");
  check_offsets_meta(cu_k, op, "cu_seqlens_k");
  TORCH_CHECK(cu_q.size(0) == cu_k.size(0), "aligned::", op,
              ": cu_seqlens_q and cu_seqlens_k must have the same length, got ", cu_q.size(0), " and ", cu_k.size(0));
  return {dt, AttnShape{Hq, Hkv, D, causal}};
}

inline void check_attention_varlen_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& out,
                                            const at::Tensor& lse, const char* op) {
  TORCH_CHECK(grad_out.sizes() == q.sizes() && grad_out.scalar_type() == q.scalar_type(), "aligned::", op,
              ": grad_out must match q in shape and dtype, got ", grad_out.sizes(), " ", grad_out.scalar_type());
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(), "aligned::", op,
              ": out must match q in shape and dtype, got ", out.sizes(), " ", out.scalar_type());
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 2 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1),
              "aligned::", op, ": lse must be float32 [", q.size(0), ", ", q.size(1), "], got ", lse.scalar_type(), " ",
              lse.sizes());
}

template <class DTypeEnum>
DTypeEnum check_reshape_and_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  using namespace attn_detail;
  const char* op = "reshape_and_cache";
  DTypeEnum dt = dtype_of<DTypeEnum>(k, op, "k");
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
  TORCH_CHECK(!k_cache.is_same(v_cache), "aligned::", op, ": k_cache and v_cache must be different tensors");
  check_caches_disjoint(k_cache, v_cache, op);
  check_disjoint(k, "k", k_cache, "k_cache", op);
  check_disjoint(k, "k", v_cache, "v_cache", op);
  check_disjoint(v, "v", k_cache, "k_cache", op);
  check_disjoint(v, "v", v_cache, "v_cache", op);
  return dt;
}

// Planner metadata (offsets, seq_lens, block tables) must be host tensors on every backend: the planner
// reads their values, and the GPU glue never reads device memory back (pass the engine's host copy: vLLM's
// *_cpu buffers, a trainer's host cu_seqlens). One refusal, one message, for the CPU and the GPU glue.
inline void check_attention_metadata_host(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "aligned::", op, ": ", name,
              " must be a CPU (host) tensor: the planner validates it on the host and no attention op reads device "
              "memory back (pass the engine's host copy), got device ",
              t.device());
}

// q and the paged caches (shared by paged_attention and paged_attention_planned).
template <class DTypeEnum>
AttnCheck<DTypeEnum> check_paged_q_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                         double scale, const char* op) {
  using namespace attn_detail;
  DTypeEnum dt = dtype_of<DTypeEnum>(q, op, "q");
  TORCH_CHECK(q.dim() == 3, "aligned::", op, ": q must be [tokens, heads, head_dim], got shape ", q.sizes());
  check_cache(k_cache, q, "q", op, "k_cache");
  check_cache(v_cache, q, "q", op, "v_cache");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "aligned::", op, ": k_cache and v_cache must have the same shape, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "aligned::", op, ": head_dim of the cache (", k_cache.size(3),
              ") must equal head_dim of q (", D, ")");
  check_heads(Hq, Hkv, D, op);
  TORCH_CHECK(k_cache.size(1) >= 1, "aligned::", op, ": block_size must be >= 1");
  check_scale(scale, op);
  return {dt, AttnShape{Hq, Hkv, D, true}};
}

inline void check_paged_metadata(const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& qsl,
                                 const char* op) {
  using namespace attn_detail;
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2, "aligned::", op,
              ": block_table must be int32 [batch, max_blocks], got ", block_table.scalar_type(), " ",
              block_table.sizes());
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1, "aligned::", op,
              ": seq_lens must be int32 [batch], got ", seq_lens.scalar_type(), " ", seq_lens.sizes());
  check_offsets_meta(qsl, op, "query_start_loc");
  const int64_t B = qsl.size(0) - 1;
  TORCH_CHECK(seq_lens.size(0) == B && block_table.size(0) == B, "aligned::", op,
              ": seq_lens and block_table must have batch = len(query_start_loc) - 1 = ", B, " rows, got ",
              seq_lens.size(0), " and ", block_table.size(0));
}

template <class DTypeEnum>
AttnCheck<DTypeEnum> check_paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                           const at::Tensor& block_table, const at::Tensor& seq_lens,
                                           const at::Tensor& qsl, double scale,
                                           const char* op = "paged_attention") {
  const auto c = check_paged_q_cache<DTypeEnum>(q, k_cache, v_cache, scale, op);
  check_paged_metadata(block_table, seq_lens, qsl, op);
  return c;
}

// ---- MLA (attention.h "MLA: latent attention") -----------------------------------------------------------
// One shared latent KV row per token, [latent (kv_lora_rank) || k_rope], as the single KV head; values are its first
// kv_lora_rank dims. The sizes are the caller's (q's last dim = the row width), never constants.
inline void check_mla_rank(int64_t kv_lora_rank, int64_t D, const char* op) {
  TORCH_CHECK(kv_lora_rank >= 1 && kv_lora_rank <= D, "aligned::", op, ": kv_lora_rank must be in [1, ", D,
              "] (the latent part of the ", D, "-wide [latent || rope] row), got ", kv_lora_rank);
}

template <class DTypeEnum>
AttnCheck<DTypeEnum> check_mla_varlen(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& cu_q,
                                      const at::Tensor& cu_k, int64_t kv_lora_rank, double scale, bool causal,
                                      const char* op) {
  using namespace attn_detail;
  DTypeEnum dt = dtype_of<DTypeEnum>(q, op, "q");
  check_same_dtype(q, kv, op, "q", "kv");
  TORCH_CHECK(q.dim() == 3, "aligned::", op, ": q must be [tokens, heads, kv_lora_rank + rope_dim], got shape ",
              q.sizes());
  TORCH_CHECK(kv.dim() == 2, "aligned::", op, ": kv must be [tokens, kv_lora_rank + rope_dim] (one latent row per "
              "token), got shape ", kv.sizes());
  const int64_t Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(kv.size(1) == D, "aligned::", op, ": the row width of kv (", kv.size(1), ") must equal q's last dim (",
              D, ")");
  TORCH_CHECK(Hq >= 1, "aligned::", op, ": q must have >= 1 head, got ", Hq);
  check_mla_rank(kv_lora_rank, D, op);
  check_scale(scale, op);
  check_offsets_meta(cu_q, op, "cu_seqlens_q");
  check_offsets_meta(cu_k, op, "cu_seqlens_k");
  TORCH_CHECK(cu_q.size(0) == cu_k.size(0), "aligned::", op,
              ": cu_seqlens_q and cu_seqlens_k must have the same length, got ", cu_q.size(0), " and ", cu_k.size(0));
  return {dt, AttnShape{Hq, 1, D, causal}};
}

inline void check_mla_varlen_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& out,
                                      const at::Tensor& lse, int64_t kv_lora_rank, const char* op) {
  const std::vector<int64_t> want{q.size(0), q.size(1), kv_lora_rank};
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(want) && grad_out.scalar_type() == q.scalar_type(), "aligned::", op,
              ": grad_out must be [", want[0], ", ", want[1], ", ", want[2], "] in q's dtype, got ", grad_out.sizes(),
              " ", grad_out.scalar_type());
  TORCH_CHECK(out.sizes() == at::IntArrayRef(want) && out.scalar_type() == q.scalar_type(), "aligned::", op,
              ": out must be [", want[0], ", ", want[1], ", ", want[2], "] in q's dtype, got ", out.sizes(), " ",
              out.scalar_type());
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 2 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1),
              "aligned::", op, ": lse must be float32 [", q.size(0), ", ", q.size(1), "], got ", lse.scalar_type(), " ",
              lse.sizes());
}

// The latent cache: [num_blocks, block_size, kv_lora_rank + rope_dim], contiguous (vLLM's MLA layout).
inline void check_mla_cache(const at::Tensor& cache, const at::Tensor& ref, const char* ref_name, const char* op) {
  attn_detail::check_same_dtype(ref, cache, op, ref_name, "kv_cache");
  TORCH_CHECK(cache.dim() == 3, "aligned::", op,
              ": kv_cache must be [num_blocks, block_size, kv_lora_rank + rope_dim], got shape ", cache.sizes());
  TORCH_CHECK(cache.is_contiguous(), "aligned::", op, ": kv_cache must be contiguous");
  TORCH_CHECK(cache.size(1) >= 1, "aligned::", op, ": block_size must be >= 1");
}

template <class DTypeEnum>
AttnCheck<DTypeEnum> check_mla_paged(const at::Tensor& q, const at::Tensor& kv_cache, int64_t kv_lora_rank,
                                     double scale, const char* op) {
  DTypeEnum dt = dtype_of<DTypeEnum>(q, op, "q");
  TORCH_CHECK(q.dim() == 3, "aligned::", op, ": q must be [tokens, heads, kv_lora_rank + rope_dim], got shape ",
              q.sizes());
  check_mla_cache(kv_cache, q, "q", op);
  const int64_t Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(kv_cache.size(2) == D, "aligned::", op, ": the row width of kv_cache (", kv_cache.size(2),
              ") must equal q's last dim (", D, ")");
  TORCH_CHECK(Hq >= 1, "aligned::", op, ": q must have >= 1 head, got ", Hq);
  check_mla_rank(kv_lora_rank, D, op);
  attn_detail::check_scale(scale, op);
  return {dt, AttnShape{Hq, 1, D, true}};
}

template <class DTypeEnum>
DTypeEnum check_mla_reshape_and_cache(const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& kv_cache,
                                      const at::Tensor& slot_mapping, const char* op) {
  DTypeEnum dt = dtype_of<DTypeEnum>(kv_c, op, "kv_c");
  attn_detail::check_same_dtype(kv_c, k_pe, op, "kv_c", "k_pe");
  TORCH_CHECK(kv_c.dim() == 2 && k_pe.dim() == 2 && kv_c.size(0) == k_pe.size(0), "aligned::", op,
              ": kv_c must be [tokens, kv_lora_rank] and k_pe [tokens, rope_dim], got ", kv_c.sizes(), " and ",
              k_pe.sizes());
  TORCH_CHECK(kv_c.size(1) >= 1, "aligned::", op, ": kv_lora_rank (kv_c's last dim) must be >= 1");
  check_mla_cache(kv_cache, kv_c, "kv_c", op);
  TORCH_CHECK(kv_cache.size(2) == kv_c.size(1) + k_pe.size(1), "aligned::", op, ": the row width of kv_cache (",
              kv_cache.size(2), ") must equal kv_lora_rank + rope_dim (", kv_c.size(1), " + ", k_pe.size(1), ")");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "aligned::", op, ": slot_mapping must be int64, got ",
              slot_mapping.scalar_type());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == kv_c.size(0), "aligned::", op,
              ": slot_mapping must be [", kv_c.size(0), "], got ", slot_mapping.sizes());
  attn_detail::check_disjoint(kv_c, "kv_c", kv_cache, "kv_cache", op);
  attn_detail::check_disjoint(k_pe, "k_pe", kv_cache, "kv_cache", op);
  return dt;
}

// ---- plan/run form (attention_plan.h "the plan buffer") ---------------------------------------------------
// The buffers' metadata: plan int64 [2 + 2C, kAttnWorkFields], table int32 [n], contiguous; the capacity of the
// split partials (workspace_floats) a size, never a data value.
inline void check_plan_buffers(const at::Tensor& plan, const at::Tensor& table, int64_t workspace_floats,
                               const char* op) {
  TORCH_CHECK(plan.scalar_type() == at::kLong && plan.dim() == 2 && plan.size(1) == kAttnWorkFields &&
                  plan.size(0) >= kAttnPlanHeaderRows && plan.is_contiguous(),
              "aligned::", op, ": plan must be a contiguous int64 [", kAttnPlanHeaderRows, " + 2 * capacity, ",
              kAttnWorkFields, "] tensor (aligned_ops.AttentionPlan), got ", plan.scalar_type(), " ", plan.sizes());
  TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 1 && table.is_contiguous(), "aligned::", op,
              ": plan_table must be a contiguous int32 1-D tensor, got ", table.scalar_type(), " ", table.sizes());
  TORCH_CHECK(workspace_floats >= 0, "aligned::", op, ": workspace_floats must be >= 0, got ", workspace_floats);
}

// plan_info: the plan's info on the HOST (int64 [kAttnPlanFields], attention_plan writes it beside the device
// buffers; FlashInfer's plan_info vector), so a run checks the call against its plan without reading the device.
inline void check_plan_info_tensor(const at::Tensor& plan_info, const char* op) {
  TORCH_CHECK(plan_info.device().is_cpu(), "aligned::", op,
              ": plan_info must be a CPU (host) tensor (aligned_ops.AttentionPlan.info), got device ",
              plan_info.device());
  TORCH_CHECK(plan_info.scalar_type() == at::kLong && plan_info.dim() == 1 && plan_info.size(0) == kAttnPlanFields &&
                  plan_info.is_contiguous(),
              "aligned::", op, ": plan_info must be a contiguous int64 [", kAttnPlanFields,
              "] tensor (aligned_ops.AttentionPlan.info), got ", plan_info.scalar_type(), " ", plan_info.sizes());
}

// The info a run was given: the plan it describes, or the refusal of a never-planned one.
inline AttnPlanInfo plan_info_of(const at::Tensor& plan_info, const char* op) {
  check_plan_info_tensor(plan_info, op);
  AttnPlanInfo info;
  TORCH_CHECK(AttnPlanInfo::from_vector(plan_info.data_ptr<int64_t>(), &info), "aligned::", op, ": ",
              attn_plan_mismatch_text(1));
  return info;
}

// A run form's call against its plan's info, on the host, before any launch: the op's heads, head_dim, causality,
// kind and block size, its query rows (exactly the plan's: no row may stay unwritten), key rows / cache blocks, and
// the buffers' capacities. The GPU kernels check the device header against the same run dims again.
inline AttnRunDims check_plan_call(const AttnPlanInfo& info, const AttnShape& sh, int64_t q_rows, int64_t kv_rows,
                                   int64_t block_size, const at::Tensor& plan, const at::Tensor& table,
                                   int64_t workspace_floats, const char* op) {
  const AttnRunDims run{sh.Hq, sh.Hkv, sh.D, sh.causal, q_rows, kv_rows, block_size,
                        attn_plan_capacity(plan.size(0)), table.numel(), workspace_floats, info.metadata_hash};
  int64_t v[kAttnPlanFields];
  info.to_vector(v);
  const int bad = attn_plan_mismatch(v, run);
  TORCH_CHECK(bad == 0, "aligned::", op, ": ", attn_plan_mismatch_text(bad));
  return run;
}

// The varlen metadata of a call against the plan's fingerprint: a plan of other offsets with the same token count
// would otherwise compute its own segmentation. `what`: which plan (the run's, or the forward's for a backward).
inline void check_plan_offsets(const AttnPlanInfo& info, const at::Tensor& cu_q, const at::Tensor& cu_k,
                               const char* op, const char* what) {
  const auto cq = cu_q.contiguous(), ck = cu_k.contiguous();
  TORCH_CHECK(attn_varlen_metadata_hash(cq.data_ptr<int32_t>(), ck.data_ptr<int32_t>(), cq.size(0)) ==
                  info.metadata_hash,
              "aligned::", op, ": cu_seqlens_q / cu_seqlens_k are not the offsets ", what,
              " was made from (another segmentation of the rows?): plan it from this call's offsets");
}

// attention_plan's host half, the same for every backend: metadata checks and the planner. block_table absent: a
// packed (varlen) plan, query_start_loc = cu_seqlens_q, kv_lens = cu_seqlens_k; present: a paged plan, kv_lens =
// seq_lens, block ids checked against num_cache_blocks x block_size.
inline AttnPlan plan_from_host_metadata(const at::Tensor& qsl, const at::Tensor& kv_lens,
                                        const std::optional<at::Tensor>& block_table, int64_t Hq, int64_t Hkv,
                                        int64_t D, bool causal, int64_t num_cache_blocks, int64_t block_size,
                                        const char* op) {
  using namespace attn_detail;
  check_heads(Hq, Hkv, D, op);
  const bool paged = block_table.has_value();
  check_attention_metadata_host(qsl, op, "query_start_loc");
  check_attention_metadata_host(kv_lens, op, "kv_lens");
  check_offsets_meta(qsl, op, "query_start_loc");
  const AttnShape shape{Hq, Hkv, D, causal};
  const auto ql = qsl.contiguous();
  const int64_t Tq = ql.data_ptr<int32_t>()[ql.size(0) - 1];
  AttnPlan plan;
  if (!paged) {
    check_offsets_meta(kv_lens, op, "kv_lens (cu_seqlens_k)");
    TORCH_CHECK(kv_lens.size(0) == qsl.size(0), "aligned::", op,
                ": cu_seqlens_q and cu_seqlens_k must have the same length, got ", qsl.size(0), " and ",
                kv_lens.size(0));
    const auto ck = kv_lens.contiguous();
    check_plan(plan_varlen(ql.data_ptr<int32_t>(), ck.data_ptr<int32_t>(), ql.size(0), Tq,
                           ck.data_ptr<int32_t>()[ck.size(0) - 1], shape, false, op, &plan));
  } else {
    check_attention_metadata_host(*block_table, op, "block_table");
    check_paged_metadata(*block_table, kv_lens, qsl, op);
    TORCH_CHECK(num_cache_blocks >= 0 && block_size >= 1, "aligned::", op,
                ": a paged plan needs num_cache_blocks >= 0 and block_size >= 1, got ", num_cache_blocks, " and ",
                block_size);
    TORCH_CHECK(causal, "aligned::", op, ": paged attention is causal (causal must be True)");
    const auto bt = block_table->contiguous(), sl = kv_lens.contiguous();
    check_plan(plan_paged(ql.data_ptr<int32_t>(), sl.data_ptr<int32_t>(), bt.data_ptr<int32_t>(), sl.size(0),
                          bt.size(1), num_cache_blocks, block_size, Tq, shape, op, &plan));
  }
  return plan;
}

// attention_plan's check of a plan against the caller's buffers (the capacity C, the table, the workspace).
inline void check_plan_fits_buffers(const AttnPlan& p, const at::Tensor& plan, const at::Tensor& table,
                                    int64_t workspace_floats, const char* op) {
  const int64_t capacity = attn_plan_capacity(plan.size(0)), records = p.info.capacity();
  TORCH_CHECK(records <= capacity, "aligned::", op, ": the plan needs ", records,
              " work records but the plan buffer holds ", capacity, " (allocate it with a larger capacity)");
  TORCH_CHECK(p.info.part_floats <= workspace_floats, "aligned::", op, ": the plan needs a workspace of ",
              p.info.part_floats, " floats but it has ", workspace_floats, " (allocate a larger workspace)");
  TORCH_CHECK(p.info.table_elems <= table.numel(), "aligned::", op, ": the plan uses ", p.info.table_elems,
              " block-table entries but the plan's table holds ", table.numel(), " (allocate a larger table)");
}

// attention_plan_size: what a plan of this metadata needs — {records (the capacity), table entries, workspace
// floats} — so a caller can size (or grow, outside graph capture) its persistent buffers.
inline std::vector<int64_t> attention_plan_size(const at::Tensor& qsl, const at::Tensor& kv_lens,
                                                const std::optional<at::Tensor>& block_table, int64_t Hq,
                                                int64_t Hkv, int64_t D, bool causal, int64_t num_cache_blocks,
                                                int64_t block_size) {
  const AttnPlan p = plan_from_host_metadata(qsl, kv_lens, block_table, Hq, Hkv, D, causal, num_cache_blocks,
                                             block_size, "attention_plan_size");
  return {p.info.capacity(), p.info.table_elems, p.info.part_floats};
}

// attention_plan_layout: the buffers a plan of `capacity` records takes — {plan rows, plan columns, plan_info
// length} — so a caller allocates them without knowing the format.
inline std::vector<int64_t> attention_plan_layout(int64_t capacity) {
  TORCH_CHECK(capacity >= 0, "aligned::attention_plan_layout: capacity must be >= 0, got ", capacity);
  return {kAttnPlanHeaderRows + 2 * capacity, kAttnWorkFields, kAttnPlanFields};
}

// The numerics profile of an attention call (attention_varlen, paged_attention and their run forms: the schemas'
// `profile`): "fma" (attention.h, every dtype) or "mma" (attention_mma.h: bfloat16 only, head_dim <= 256 — the
// GPU kernel's; the backend's run refuses where it has no matrix unit kernel: the CPU).
template <class DTypeEnum>
int check_attention_profile(c10::string_view profile, DTypeEnum dt, int64_t D, const char* op) {
  if (profile == "fma") return kAttnProfileFma;
  TORCH_CHECK(profile == "mma", "aligned::", op, ": profile must be 'fma' or 'mma', got '", std::string(profile),
              "'");
  TORCH_CHECK(dt == DTypeEnum::BF16, "aligned::", op, ": the mma profile's attention takes bfloat16 q/k/v (the "
              "matrix unit's input type; float16 / float32 run profile='fma')");
  TORCH_CHECK(D <= gpu::kGpuAttnMaxD, "aligned::", op, ": the mma profile's attention supports head_dim <= ",
              gpu::kGpuAttnMaxD, ", got ", D);
  return kAttnProfileMma;
}

}  // namespace aligned
