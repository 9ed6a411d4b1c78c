// glue/attention.h — the attention family's glue bodies: attention_varlen (+ backward), reshape_and_cache,
// paged_attention, and the plan/run form (attention_plan, attention_varlen_planned, paged_attention_planned);
// attention_plan_size (family AttentionSizes: host metadata only, the CPU key).
//
// The four steps of glue/dense.h, with the planner between the checks and the run: the host planner
// (csrc/common/attention_plan.h) validates the data-dependent metadata — offsets, sequence lengths, block
// tables, which every backend takes as HOST tensors (checks/attention.h) — and builds the one plan (AttnPlan);
// the backend's run only consumes it (CPU: its records read in place, items over threads; GPU: its records in
// the plan-buffer format, uploaded in one copy, or, in the planned forms, already on the device). The arithmetic
// per (row, head) is attention.h's.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

#include "../checks/attention.h"
#include "../registration.h"
#include "../run_args.h"

namespace aligned::glue {

template <class B>
std::tuple<at::Tensor, at::Tensor> attention_varlen_run(const char* op, const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v, const at::Tensor& cu_q,
                                                        const at::Tensor& cu_k, double scale, bool causal,
                                                        c10::string_view profile = "fma") {
  const typename B::Call call(op, q, "q");
  call.on_device(k, "k");
  call.on_device(v, "v");
  check_attention_metadata_host(cu_q, op, "cu_seqlens_q");
  check_attention_metadata_host(cu_k, op, "cu_seqlens_k");
  const auto c = check_attention_varlen<DType>(q, k, v, cu_q, cu_k, scale, causal, op);
  const int prof = check_attention_profile<DType>(profile, c.dt, c.shape.D, op);
  const auto cq = cu_q.contiguous(), ck = cu_k.contiguous();
  AttnPlan plan;
  check_plan(plan_varlen(cq.data_ptr<int32_t>(), ck.data_ptr<int32_t>(), cq.size(0), q.size(0), k.size(0), c.shape,
                         false, op, &plan));
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto out = at::empty_like(qc);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  B::attention_forward(call, make_attn_problem(c.dt, c.shape, scale, causal, qc.data_ptr(), kc.data_ptr(),
                                               vc.data_ptr(), 0, prof),
                       plan, out.data_ptr(), lse.data_ptr<float>());
  return {out, lse};
}

// plan_info (optional): the info of the plan the forward ran (attention_varlen_planned); the backward plans again
// from cu_seqlens (the key tiles are the backward's own), so it first checks that these are the offsets that plan
// was made from — never a gradient of another segmentation than the forward's.
template <class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward_run(
    const char* op, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_q, const at::Tensor& cu_k, double scale,
    bool causal, const std::optional<at::Tensor>& plan_info, c10::string_view profile = "fma") {
  const typename B::Call call(op, grad_out, "grad_out");
  call.on_device(out, "out");
  call.on_device(lse, "lse");
  call.on_device(q, "q");
  call.on_device(k, "k");
  call.on_device(v, "v");
  check_attention_metadata_host(cu_q, op, "cu_seqlens_q");
  check_attention_metadata_host(cu_k, op, "cu_seqlens_k");
  const auto c = check_attention_varlen<DType>(q, k, v, cu_q, cu_k, scale, causal, op);
  const int prof = check_attention_profile<DType>(profile, c.dt, c.shape.D, op);
  if (plan_info.has_value() && plan_info->defined()) {
    const AttnPlanInfo info = plan_info_of(*plan_info, op);
    TORCH_CHECK(info.block_size == 0 && info.Hq == c.shape.Hq && info.Hkv == c.shape.Hkv && info.D == c.shape.D &&
                    info.causal == causal && info.q_rows == q.size(0) && info.n_kv == k.size(0),
                "aligned::", op, ": the forward's plan was made for another problem (heads, head_dim, causal, or "
                "rows) than this backward");
    check_plan_offsets(info, cu_q, cu_k, op, "the forward's plan");
  }
  const auto cq = cu_q.contiguous(), ck = cu_k.contiguous();
  AttnPlan plan;
  check_plan(plan_varlen(cq.data_ptr<int32_t>(), ck.data_ptr<int32_t>(), cq.size(0), q.size(0), k.size(0), c.shape,
                         true, op, &plan));
  check_attention_varlen_backward(grad_out, q, out, lse, op);
  AttnBackwardRun r;
  r.q = q.contiguous();
  r.k = k.contiguous();
  r.v = v.contiguous();
  r.problem =
      make_attn_problem(c.dt, c.shape, scale, causal, r.q.data_ptr(), r.k.data_ptr(), r.v.data_ptr(), 0, prof);
  r.plan = &plan;
  r.grad_out = grad_out.contiguous();
  r.out = out.contiguous();
  r.lse = lse.contiguous();
  r.delta = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  r.dq = at::empty_like(r.q);
  r.dk = at::zeros_like(r.k);
  r.dv = at::zeros_like(r.v);
  B::attention_backward(call, r);
  return {r.dq, r.dk, r.dv};
}

// The slot mapping of a cache write into a cache of n_slots rows (both cache writes): host metadata is checked here,
// by the planner's rule (check_slots: in range, no slot twice); a slot mapping on the op's device is not read by the
// host (the kernel skips any slot outside the cache; a repeated slot there is the caller's: vLLM's never repeats).
// Returns it contiguous.
template <class Call>
at::Tensor cache_slots(const Call& call, const at::Tensor& slot_mapping, int64_t n_slots, const char* op) {
  const bool host_slots = slot_mapping.device().is_cpu();
  if (!host_slots) call.on_device(slot_mapping, "slot_mapping");
  auto sm = slot_mapping.contiguous();
  if (host_slots) check_plan(check_slots(sm.data_ptr<int64_t>(), sm.size(0), n_slots, op));
  return sm;
}

template <class B>
void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& slot_mapping) {
  const char* op = "reshape_and_cache";
  const typename B::Call call(op, k, "k");
  call.on_device(v, "v");
  call.on_device(k_cache, "k_cache");
  call.on_device(v_cache, "v_cache");
  const DType dt = check_reshape_and_cache<DType>(k, v, k_cache, v_cache, slot_mapping);
  const at::Tensor sm = cache_slots(call, slot_mapping, k_cache.size(0) * k_cache.size(1), op);
  B::cache_write(call, dt, k.contiguous(), v.contiguous(), k_cache, v_cache, sm);
}

template <class B>
at::Tensor paged_attention_run(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                               const at::Tensor& qsl, double scale, c10::string_view profile = "fma") {
  const typename B::Call call(op, q, "q");
  call.on_device(k_cache, "k_cache");
  call.on_device(v_cache, "v_cache");
  check_attention_metadata_host(block_table, op, "block_table");
  check_attention_metadata_host(seq_lens, op, "seq_lens");
  check_attention_metadata_host(qsl, op, "query_start_loc");
  const auto c = check_paged_attention<DType>(q, k_cache, v_cache, block_table, seq_lens, qsl, scale, op);
  const int prof = check_attention_profile<DType>(profile, c.dt, c.shape.D, op);
  auto bt = block_table.contiguous(), sl = seq_lens.contiguous(), ql = qsl.contiguous();
  AttnPlan plan;
  check_plan(plan_paged(ql.data_ptr<int32_t>(), sl.data_ptr<int32_t>(), bt.data_ptr<int32_t>(), sl.size(0),
                        bt.size(1), k_cache.size(0), k_cache.size(1), q.size(0), c.shape, op, &plan));
  auto qc = q.contiguous();
  auto out = at::empty_like(qc);
  auto lse = at::empty({q.size(0), c.shape.Hq}, q.options().dtype(at::kFloat));
  B::attention_forward(call, make_attn_problem(c.dt, c.shape, scale, true, qc.data_ptr(), k_cache.data_ptr(),
                                               v_cache.data_ptr(), k_cache.size(1), prof),
                       plan, out.data_ptr(), lse.data_ptr<float>());
  return out;
}

// ---- plan/run form (attention_plan.h "the plan buffer") ----------------------------------------------------
// attention_plan: host metadata in; the plan's info written into plan_info (host) and the plan into the caller's
// buffers (plan, plan_table: on the run's device), checked against their capacities and workspace_floats (the
// run's partial capacity). The only host-to-device step of the plan/run form, once per step.
template <class B>
void attention_plan(const at::Tensor& plan, const at::Tensor& table, const at::Tensor& plan_info,
                    const at::Tensor& qsl, const at::Tensor& kv_lens, const std::optional<at::Tensor>& block_table,
                    int64_t Hq, int64_t Hkv, int64_t D, bool causal, int64_t num_cache_blocks, int64_t block_size,
                    int64_t workspace_floats) {
  const char* op = "attention_plan";
  const typename B::Call call(op, plan, "plan");
  call.on_device(table, "plan_table");
  check_plan_buffers(plan, table, workspace_floats, op);
  check_plan_info_tensor(plan_info, op);
  const AttnPlan p =
      plan_from_host_metadata(qsl, kv_lens, block_table, Hq, Hkv, D, causal, num_cache_blocks, block_size, op);
  check_plan_fits_buffers(p, plan, table, workspace_floats, op);
  B::write_plan(call, plan, table, p);
  p.info.to_vector(plan_info.data_ptr<int64_t>());  // last: a failed write leaves no info of a plan not written
}

// The run forms: the call checked against the plan's host info (a clear error), then the launches over the plan
// buffers — no planning, no copy, no read of device memory (the kernels check the device header again).
// attention_run_planned is their one body after the op's own checks: packed K/V (block_size 0, no table; the
// call's cu_seqlens checked against the plan's fingerprint) or the paged cache (block_size > 0, the plan's table).
template <class B>
std::tuple<at::Tensor, at::Tensor> attention_run_planned(const typename B::Call& call, const char* op,
                                                         const AttnCheck<DType>& c, const at::Tensor& q,
                                                         const at::Tensor& k, const at::Tensor& v, int64_t kv_rows,
                                                         int64_t block_size, const at::Tensor& plan,
                                                         const at::Tensor& table, const at::Tensor& plan_info,
                                                         int64_t workspace_floats, double scale,
                                                         const at::Tensor* cu_q, const at::Tensor* cu_k,
                                                         c10::string_view profile = "fma") {
  const int prof = check_attention_profile<DType>(profile, c.dt, c.shape.D, op);
  call.on_device(plan, "plan");
  if (block_size > 0) call.on_device(table, "plan_table");
  check_plan_buffers(plan, table, workspace_floats, op);
  const AttnPlanInfo info = plan_info_of(plan_info, op);
  const AttnRunDims run =
      check_plan_call(info, c.shape, q.size(0), kv_rows, block_size, plan, table, workspace_floats, op);
  if (cu_q != nullptr) check_plan_offsets(info, *cu_q, *cu_k, op, "the plan");  // no other segmentation silently
  auto qc = q.contiguous();
  auto out = at::empty_like(qc);
  auto lse = at::empty({q.size(0), c.shape.Hq}, q.options().dtype(at::kFloat));
  B::attention_forward_planned(call, make_attn_problem(c.dt, c.shape, scale, c.shape.causal, qc.data_ptr(),
                                                       k.data_ptr(), v.data_ptr(), block_size, prof),
                               info, plan, table, workspace_floats, run, out.data_ptr(), lse.data_ptr<float>());
  return {out, lse};
}

template <class B>
std::tuple<at::Tensor, at::Tensor> attention_varlen_planned(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, const at::Tensor& cu_q,
                                                            const at::Tensor& cu_k, const at::Tensor& plan,
                                                            const at::Tensor& plan_info, int64_t workspace_floats,
                                                            double scale, bool causal, c10::string_view profile) {
  const char* op = "attention_varlen_planned";
  const typename B::Call call(op, q, "q");
  call.on_device(k, "k");
  call.on_device(v, "v");
  check_attention_metadata_host(cu_q, op, "cu_seqlens_q");
  check_attention_metadata_host(cu_k, op, "cu_seqlens_k");
  const auto c = check_attention_varlen<DType>(q, k, v, cu_q, cu_k, scale, causal, op);
  const at::Tensor no_table = at::empty({0}, plan.options().dtype(at::kInt));
  return attention_run_planned<B>(call, op, c, q, k.contiguous(), v.contiguous(), k.size(0), 0, plan, no_table,
                                  plan_info, workspace_floats, scale, &cu_q, &cu_k, profile);
}

template <class B>
at::Tensor paged_attention_planned_run(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                       const at::Tensor& v_cache, const at::Tensor& plan, const at::Tensor& table,
                                       const at::Tensor& plan_info, int64_t workspace_floats, double scale,
                                       c10::string_view profile = "fma") {
  const typename B::Call call(op, q, "q");
  call.on_device(k_cache, "k_cache");
  call.on_device(v_cache, "v_cache");
  const auto c = check_paged_q_cache<DType>(q, k_cache, v_cache, scale, op);
  return std::get<0>(attention_run_planned<B>(call, op, c, q, k_cache, v_cache, k_cache.size(0), k_cache.size(1),
                                              plan, table, plan_info, workspace_floats, scale, nullptr, nullptr,
                                              profile));
}

// What a plan of this host metadata needs (host only: the same on every backend).
template <class B>
std::vector<int64_t> attention_plan_size_op(const at::Tensor& qsl, const at::Tensor& kv_lens,
                                            const std::optional<at::Tensor>& block_table, int64_t Hq, int64_t Hkv,
                                            int64_t D, bool causal, int64_t num_cache_blocks, int64_t block_size) {
  return attention_plan_size(qsl, kv_lens, block_table, Hq, Hkv, D, causal, num_cache_blocks, block_size);
}

// The ops of the bodies above (each body takes its op's name, so an MLA op that runs one names itself in errors).
template <class B>
std::tuple<at::Tensor, at::Tensor> attention_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& cu_q, const at::Tensor& cu_k, double scale,
                                                    bool causal, c10::string_view profile) {
  return attention_varlen_run<B>("attention_varlen", q, k, v, cu_q, cu_k, scale, causal, profile);
}

template <class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_q, const at::Tensor& cu_k, double scale, bool causal,
    const std::optional<at::Tensor>& plan_info, c10::string_view profile) {
  return attention_varlen_backward_run<B>("attention_varlen_backward", grad_out, q, k, v, out, lse, cu_q, cu_k, scale,
                                          causal, plan_info, profile);
}

template <class B>
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& qsl,
                           double scale, c10::string_view profile) {
  return paged_attention_run<B>("paged_attention", q, k_cache, v_cache, block_table, seq_lens, qsl, scale, profile);
}

template <class B>
at::Tensor paged_attention_planned(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& plan, const at::Tensor& table, const at::Tensor& plan_info,
                                   int64_t workspace_floats, double scale, c10::string_view profile) {
  return paged_attention_planned_run<B>("paged_attention_planned", q, k_cache, v_cache, plan, table, plan_info,
                                        workspace_floats, scale, profile);
}

// ---- MLA: latent attention (attention.h "MLA") ---------------------------------------------------------------
// The latent row [latent || k_rope] (width D) is the one KV head of the attention above, as both its keys and its
// values: scores over all D dims, and the value dims d < kv_lora_rank are the row's first dims (each output
// element is its own fma chain, so the dims d >= kv_lora_rank — computed, then dropped — cannot change them).
// One attention contract, one plan (Hkv = 1, head_dim = D), the same tiles and splits, so MLA decode, chunked
// prefill, prefix hits and the trainer's varlen give the same bits as each other.
inline at::Tensor mla_head(const at::Tensor& rows) { return rows.contiguous().unsqueeze(-2); }  // [..., 1, D]
inline at::Tensor mla_values(const at::Tensor& out, int64_t kv_lora_rank) {
  return out.narrow(2, 0, kv_lora_rank).contiguous();
}
// [T, H, Dv] -> [T, H, D] fp32, zero beyond Dv (exact widening; a zero dO / O dim adds fma(0, x, acc) = acc).
inline at::Tensor mla_widen_padded(const at::Tensor& x, int64_t D) {
  auto w = at::zeros({x.size(0), x.size(1), D}, x.options().dtype(at::kFloat));
  w.narrow(2, 0, x.size(2)).copy_(x);
  return w;
}

template <class B>
std::tuple<at::Tensor, at::Tensor> mla_attention_varlen(const at::Tensor& q, const at::Tensor& kv,
                                                        const at::Tensor& cu_q, const at::Tensor& cu_k,
                                                        int64_t kv_lora_rank, double scale, bool causal) {
  const char* op = "mla_attention_varlen";
  const typename B::Call call(op, q, "q");
  call.on_device(kv, "kv");
  check_attention_metadata_host(cu_q, op, "cu_seqlens_q");
  check_attention_metadata_host(cu_k, op, "cu_seqlens_k");
  check_mla_varlen<DType>(q, kv, cu_q, cu_k, kv_lora_rank, scale, causal, op);
  const at::Tensor kvh = mla_head(kv);
  auto [out, lse] = attention_varlen_run<B>(op, q, kvh, kvh, cu_q, cu_k, scale, causal);
  return {mla_values(out, kv_lora_rank), lse};
}

// Backward (attention.h "MLA", backward): attention's backward over the widened fp32 operands (the same scores,
// p, ds as the forward's, whose operands are widened exactly), then dkv = dk + dv on the value dims in fp32 and
// ONE rounding of dq and dkv to the input dtype.
template <class B>
std::tuple<at::Tensor, at::Tensor> mla_attention_varlen_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                                 const at::Tensor& kv, const at::Tensor& out,
                                                                 const at::Tensor& lse, const at::Tensor& cu_q,
                                                                 const at::Tensor& cu_k, int64_t kv_lora_rank,
                                                                 double scale, bool causal,
                                                                 const std::optional<at::Tensor>& plan_info) {
  const char* op = "mla_attention_varlen_backward";
  const typename B::Call call(op, grad_out, "grad_out");
  call.on_device(q, "q");
  call.on_device(kv, "kv");
  call.on_device(out, "out");
  call.on_device(lse, "lse");
  check_attention_metadata_host(cu_q, op, "cu_seqlens_q");
  check_attention_metadata_host(cu_k, op, "cu_seqlens_k");
  const auto c = check_mla_varlen<DType>(q, kv, cu_q, cu_k, kv_lora_rank, scale, causal, op);
  check_mla_varlen_backward(grad_out, q, out, lse, kv_lora_rank, op);
  const int64_t D = c.shape.D;
  const at::Tensor kvh = mla_head(kv.to(at::kFloat));
  auto [dq, dk, dv] = attention_varlen_backward_run<B>(op, mla_widen_padded(grad_out, D), q.to(at::kFloat).contiguous(),
                                                       kvh, kvh, mla_widen_padded(out, D), lse, cu_q, cu_k, scale,
                                                       causal, plan_info);
  at::Tensor dkv = dk.squeeze(1);
  dkv.narrow(1, 0, kv_lora_rank).add_(dv.squeeze(1).narrow(1, 0, kv_lora_rank));
  return {dq.to(q.scalar_type()), dkv.to(q.scalar_type())};
}

// The run form (aligned_ops.AttentionPlan.plan_varlen(cu_q, cu_k, H, 1, D)): the call checked against the plan's host
// info and offsets, then only the launches; the same bits as the per-call form.
template <class B>
std::tuple<at::Tensor, at::Tensor> mla_attention_varlen_planned(const at::Tensor& q, const at::Tensor& kv,
                                                                const at::Tensor& cu_q, const at::Tensor& cu_k,
                                                                const at::Tensor& plan, const at::Tensor& plan_info,
                                                                int64_t workspace_floats, int64_t kv_lora_rank,
                                                                double scale, bool causal) {
  const char* op = "mla_attention_varlen_planned";
  const typename B::Call call(op, q, "q");
  call.on_device(kv, "kv");
  check_attention_metadata_host(cu_q, op, "cu_seqlens_q");
  check_attention_metadata_host(cu_k, op, "cu_seqlens_k");
  const auto c = check_mla_varlen<DType>(q, kv, cu_q, cu_k, kv_lora_rank, scale, causal, op);
  const at::Tensor kvh = mla_head(kv);
  const at::Tensor no_table = at::empty({0}, plan.options().dtype(at::kInt));
  auto [out, lse] = attention_run_planned<B>(call, op, c, q, kvh, kvh, kv.size(0), 0, plan, no_table, plan_info,
                                             workspace_floats, scale, &cu_q, &cu_k);
  return {mla_values(out, kv_lora_rank), lse};
}

// One latent row per token, [kv_c || k_pe], into the ONE cache [num_blocks, block_size, D] at slot_mapping (vLLM's
// MLA layout, concat_and_cache_mla's): the attention cache write with the row as the one KV head and no V cache
// (keys and values are the same row: each row is written once).
template <class B>
void mla_reshape_and_cache(const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& kv_cache,
                           const at::Tensor& slot_mapping) {
  const char* op = "mla_reshape_and_cache";
  const typename B::Call call(op, kv_c, "kv_c");
  call.on_device(k_pe, "k_pe");
  call.on_device(kv_cache, "kv_cache");
  const DType dt = check_mla_reshape_and_cache<DType>(kv_c, k_pe, kv_cache, slot_mapping, op);
  const at::Tensor sm = cache_slots(call, slot_mapping, kv_cache.size(0) * kv_cache.size(1), op);
  const at::Tensor row = at::cat({kv_c, k_pe}, 1).unsqueeze(1);  // [T, 1, D]
  B::cache_write(call, dt, row, at::Tensor(), kv_cache.unsqueeze(2), at::Tensor(), sm);  // cache [blocks, bs, 1, D]
}

template <class B>
at::Tensor mla_paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                               const at::Tensor& seq_lens, const at::Tensor& qsl, int64_t kv_lora_rank, double scale) {
  const char* op = "mla_paged_attention";
  const typename B::Call call(op, q, "q");
  call.on_device(kv_cache, "kv_cache");
  check_mla_paged<DType>(q, kv_cache, kv_lora_rank, scale, op);
  const at::Tensor cache = kv_cache.unsqueeze(2);
  return mla_values(paged_attention_run<B>(op, q, cache, cache, block_table, seq_lens, qsl, scale), kv_lora_rank);
}

// The run form: a plan of attention_plan(num_kv_heads = 1, head_dim = D) (aligned_ops.AttentionPlan.plan_paged).
template <class B>
at::Tensor mla_paged_attention_planned(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& plan,
                                       const at::Tensor& table, const at::Tensor& plan_info, int64_t workspace_floats,
                                       int64_t kv_lora_rank, double scale) {
  const char* op = "mla_paged_attention_planned";
  const typename B::Call call(op, q, "q");
  call.on_device(kv_cache, "kv_cache");
  check_mla_paged<DType>(q, kv_cache, kv_lora_rank, scale, op);
  const at::Tensor cache = kv_cache.unsqueeze(2);
  return mla_values(
      paged_attention_planned_run<B>(op, q, cache, cache, plan, table, plan_info, workspace_floats, scale),
      kv_lora_rank);
}

struct Attention {
  template <class B>
  static constexpr std::tuple ops{
      Op{"attention_varlen", &attention_varlen<B>},
      Op{"attention_varlen_backward", &attention_varlen_backward<B>},
      Op{"reshape_and_cache", &reshape_and_cache<B>},
      Op{"paged_attention", &paged_attention<B>},
      Op{"attention_plan", &attention_plan<B>},
      Op{"attention_varlen_planned", &attention_varlen_planned<B>},
      Op{"paged_attention_planned", &paged_attention_planned<B>},
      Op{"mla_attention_varlen", &mla_attention_varlen<B>},
      Op{"mla_attention_varlen_backward", &mla_attention_varlen_backward<B>},
      Op{"mla_attention_varlen_planned", &mla_attention_varlen_planned<B>},
      Op{"mla_reshape_and_cache", &mla_reshape_and_cache<B>},
      Op{"mla_paged_attention", &mla_paged_attention<B>},
      Op{"mla_paged_attention_planned", &mla_paged_attention_planned<B>},
  };
};

// _attention_mma_reference (a test hook): attention_mma.h's scalar reference of the mma profile's forward over a
// packed varlen batch, with the unit's model — under aligned_ops.emulate(arch, mma_model=...) the arch's (the
// emulated backends, backends/emulated.cpp); the CPU and a real GPU refuse by name (no model of the GPU's unit).
template <class B>
std::tuple<at::Tensor, at::Tensor> attention_mma_reference(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, const at::Tensor& cu_q,
                                                           const at::Tensor& cu_k, double scale, bool causal) {
  const char* op = "_attention_mma_reference";
  const typename B::Call call(op, q, "q");
  call.on_device(k, "k");
  call.on_device(v, "v");
  check_attention_metadata_host(cu_q, op, "cu_seqlens_q");
  check_attention_metadata_host(cu_k, op, "cu_seqlens_k");
  const auto c = check_attention_varlen<DType>(q, k, v, cu_q, cu_k, scale, causal, op);
  check_attention_profile<DType>("mma", c.dt, c.shape.D, op);
  const auto cq = cu_q.contiguous(), ck = cu_k.contiguous();
  AttnPlan plan;  // validates the offsets (the reference reads them directly)
  check_plan(plan_varlen(cq.data_ptr<int32_t>(), ck.data_ptr<int32_t>(), cq.size(0), q.size(0), k.size(0), c.shape,
                         false, op, &plan));
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto out = at::empty_like(qc);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  B::attention_mma_reference(call, make_attn_problem(c.dt, c.shape, scale, causal, qc.data_ptr(), kc.data_ptr(),
                                                     vc.data_ptr(), 0, kAttnProfileMma),
                             cq.data_ptr<int32_t>(), ck.data_ptr<int32_t>(), cq.size(0) - 1, out.data_ptr(),
                             lse.data_ptr<float>());
  return {out, lse};
}

// _attention_mma_backward_reference (a test hook): attention_mma.h's attn_mma_backward_reference per (sequence, KV
// head), the unit's model as above; delta from out as the kernels compute it.
template <class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_mma_backward_reference(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_q, const at::Tensor& cu_k, double scale, bool causal) {
  const char* op = "_attention_mma_backward_reference";
  const typename B::Call call(op, grad_out, "grad_out");
  call.on_device(q, "q");
  call.on_device(k, "k");
  call.on_device(v, "v");
  call.on_device(out, "out");
  call.on_device(lse, "lse");
  check_attention_metadata_host(cu_q, op, "cu_seqlens_q");
  check_attention_metadata_host(cu_k, op, "cu_seqlens_k");
  const auto c = check_attention_varlen<DType>(q, k, v, cu_q, cu_k, scale, causal, op);
  check_attention_profile<DType>("mma", c.dt, c.shape.D, op);
  check_attention_varlen_backward(grad_out, q, out, lse, op);
  const auto cq = cu_q.contiguous(), ck = cu_k.contiguous();
  AttnPlan plan;
  check_plan(plan_varlen(cq.data_ptr<int32_t>(), ck.data_ptr<int32_t>(), cq.size(0), q.size(0), k.size(0), c.shape,
                         true, op, &plan));
  AttnBackwardRun r;
  r.q = q.contiguous();
  r.k = k.contiguous();
  r.v = v.contiguous();
  r.problem = make_attn_problem(c.dt, c.shape, scale, causal, r.q.data_ptr(), r.k.data_ptr(), r.v.data_ptr(), 0,
                                kAttnProfileMma);
  r.plan = &plan;
  r.grad_out = grad_out.contiguous();
  r.out = out.contiguous();
  r.lse = lse.contiguous();
  r.dq = at::zeros_like(r.q);
  r.dk = at::zeros_like(r.k);
  r.dv = at::zeros_like(r.v);
  B::attention_mma_backward_reference(call, r, cq.data_ptr<int32_t>(), ck.data_ptr<int32_t>(), cq.size(0) - 1);
  return {r.dq, r.dk, r.dv};
}

struct AttentionMmaReference {
  template <class B>
  static constexpr std::tuple ops{Op{"_attention_mma_reference", &attention_mma_reference<B>},
                                  Op{"_attention_mma_backward_reference", &attention_mma_backward_reference<B>}};
};

struct AttentionSizes {
  template <class B>
  static constexpr std::tuple ops{Op{"attention_plan_size", &attention_plan_size_op<B>}};
};

}  // namespace aligned::glue
