// ops_attention_cpu.cpp — CPU glue of the attention family: device checks, then the family's shared
// metadata checks (csrc/attention_checks.h), then the host planner (csrc/common/attention_plan.h) that
// validates the data-dependent metadata and builds the work list, then the run: work items spread over
// torch's intra-op threads. Schemas live in csrc/torch_bindings.cpp; the arithmetic in attention_kernels.cpp,
// its order in csrc/common/attention.h.
//
// Threading: with enough row blocks each thread takes whole blocks (all their splits, then the merge);
// with few blocks (decode, short chunks) the plan's (block, split) items are spread over threads and the
// merges run afterwards. Both modes run the same per-split and merge functions on the same plan, so the
// choice never changes a bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <string.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "../attention_checks.h"
#include "attention_kernels.h"
#include "emulation_hook.h"
#include "glue_checks.h"

namespace aligned::cpu {

namespace {

// Forward of a plan; out [Tq, Hq, D] (q dtype), lse [Tq, Hq] fp32.
void run_forward(const AttnArgs& a, const AttnPlan& plan, void* out, float* lse) {
  const auto& kern = attention_kernels();
  const auto& blocks = plan.blocks;
  const int64_t nb = (int64_t)blocks.size();
  if (nb == 0) return;
  const int64_t G = a.Hq / a.Hkv, stride = a.D + 2;
  if (nb >= 4 * (int64_t)at::get_num_threads()) {
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
  std::vector<float> part(std::max<int64_t>(1, plan.part_floats));
  const auto& items = plan.items;
  at::parallel_for(0, (int64_t)items.size(), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const AttnBlock& blk = blocks[items[i].block];
      kern.fwd_block(a, blk, items[i].split, items[i].split + 1, part.data() + blk.part_offset);
    }
  });
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) kern.merge_block(a, blocks[i], part.data() + blocks[i].part_offset, out, lse);
  });
}

struct VarlenInputs {
  at::Tensor q, k, v;
  AttnPlan plan;
  AttnArgs args;
};

VarlenInputs prepare_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                            const at::Tensor& cu_k, double scale, bool causal, bool backward, const char* op) {
  check_cpu(q, op, "q");
  check_cpu(k, op, "k");
  check_cpu(v, op, "v");
  check_attention_metadata_host(cu_q, op, "cu_seqlens_q");
  check_attention_metadata_host(cu_k, op, "cu_seqlens_k");
  const auto c = check_attention_varlen<DType>(q, k, v, cu_q, cu_k, scale, causal, op);
  const auto cq = cu_q.contiguous(), ck = cu_k.contiguous();
  VarlenInputs in;
  check_plan(plan_varlen(cq.data_ptr<int32_t>(), ck.data_ptr<int32_t>(), cq.size(0), q.size(0), k.size(0), c.shape,
                         backward, op, &in.plan));
  in.q = q.contiguous();
  in.k = k.contiguous();
  in.v = v.contiguous();
  in.args = AttnArgs{make_attn_problem(c.dt, c.shape, scale, causal, in.q.data_ptr(), in.k.data_ptr(),
                                       in.v.data_ptr(), 0),
                     in.plan.seqs.data()};
  return in;
}

std::tuple<at::Tensor, at::Tensor> attention_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& cu_q, const at::Tensor& cu_k, double scale,
                                                    bool causal) {
  auto in = prepare_varlen(q, k, v, cu_q, cu_k, scale, causal, false, "attention_varlen");
  auto out = at::empty_like(in.q);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  run_forward(in.args, in.plan, out.data_ptr(), lse.data_ptr<float>());
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_q, const at::Tensor& cu_k, double scale, bool causal) {
  const char* op = "attention_varlen_backward";
  check_cpu(grad_out, op, "grad_out");
  check_cpu(out, op, "out");
  check_cpu(lse, op, "lse");
  auto in = prepare_varlen(q, k, v, cu_q, cu_k, scale, causal, true, op);
  check_attention_varlen_backward(grad_out, q, out, lse, op);
  auto go = grad_out.contiguous(), oc = out.contiguous(), lc = lse.contiguous();
  const auto& a = in.args;
  const auto& kern = attention_kernels();
  auto delta = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  const int64_t rows = q.size(0) * q.size(1);
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / a.D), [&](int64_t i0, int64_t i1) {
    kern.bwd_delta(a.dt, go.data_ptr(), oc.data_ptr(), delta.data_ptr<float>(), a.D, i0, i1);
  });
  auto dq = at::empty_like(in.q), dk = at::zeros_like(in.k), dv = at::zeros_like(in.v);
  const auto& blocks = in.plan.blocks;
  const auto& tiles = in.plan.key_tiles;
  const float* lp = lc.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  at::parallel_for(0, (int64_t)blocks.size(), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) kern.bwd_dq_block(a, blocks[i], go.data_ptr(), lp, dp, dq.data_ptr());
  });
  at::parallel_for(0, (int64_t)tiles.size(), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      kern.bwd_dkdv_tile(a, tiles[i].seq, tiles[i].g, tiles[i].t, go.data_ptr(), lp, dp, dk.data_ptr(), dv.data_ptr());
  });
  return {dq, dk, dv};
}

void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& slot_mapping) {
  const char* op = "reshape_and_cache";
  check_cpu(k, op, "k");
  check_cpu(v, op, "v");
  check_cpu(k_cache, op, "k_cache");
  check_cpu(v_cache, op, "v_cache");
  check_cpu(slot_mapping, op, "slot_mapping");
  const DType dt = check_reshape_and_cache<DType>(k, v, k_cache, v_cache, slot_mapping);
  auto sm = slot_mapping.contiguous();
  const int64_t* slots = sm.data_ptr<int64_t>();
  check_plan(check_slots(slots, sm.size(0), k_cache.size(0) * k_cache.size(1), op));
  auto kc = k.contiguous(), vc = v.contiguous();
  const int64_t row = k.size(1) * k.size(2);
  const auto& kern = attention_kernels();
  at::parallel_for(0, k.size(0), 64, [&](int64_t t0, int64_t t1) {
    kern.cache_write(dt, kc.data_ptr(), vc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots, row, t0, t1);
  });
}

// The run of both paged forms (per call and planned): one plan, the same run_forward, the same bits.
at::Tensor paged_forward(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const AttnCheck<DType>& c, double scale, const AttnPlan& plan) {
  auto qc = q.contiguous();
  auto out = at::empty_like(qc);
  auto lse = at::empty({q.size(0), c.shape.Hq}, q.options().dtype(at::kFloat));
  AttnArgs a{make_attn_problem(c.dt, c.shape, scale, true, qc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                               k_cache.size(1)),
             plan.seqs.data()};
  run_forward(a, plan, out.data_ptr(), lse.data_ptr<float>());
  return out;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& qsl,
                           double scale) {
  const char* op = "paged_attention";
  check_cpu(q, op, "q");
  check_cpu(k_cache, op, "k_cache");
  check_cpu(v_cache, op, "v_cache");
  check_attention_metadata_host(block_table, op, "block_table");
  check_attention_metadata_host(seq_lens, op, "seq_lens");
  check_attention_metadata_host(qsl, op, "query_start_loc");
  const auto c = check_paged_attention<DType>(q, k_cache, v_cache, block_table, seq_lens, qsl, scale);
  auto bt = block_table.contiguous(), sl = seq_lens.contiguous(), ql = qsl.contiguous();
  AttnPlan plan;
  check_plan(plan_paged(ql.data_ptr<int32_t>(), sl.data_ptr<int32_t>(), bt.data_ptr<int32_t>(), sl.size(0),
                        bt.size(1), k_cache.size(0), k_cache.size(1), q.size(0), c.shape, op, &plan));
  return paged_forward(q, k_cache, v_cache, c, scale, plan);
}

// ---- plan/run form (CPU: the buffers are host tensors; same plan, same run_forward, same bits) ----------
void attention_plan(const at::Tensor& plan, const at::Tensor& table, const at::Tensor& qsl, const at::Tensor& kv_lens,
                    const std::optional<at::Tensor>& block_table, int64_t Hq, int64_t Hkv, int64_t D, bool causal,
                    int64_t num_cache_blocks, int64_t block_size, int64_t workspace_floats) {
  const char* op = "attention_plan";
  check_cpu(plan, op, "plan");
  check_cpu(table, op, "plan_table");
  const AttnPackedPlan packed = plan_attention_host(plan, table, workspace_floats, qsl, kv_lens, block_table, Hq, Hkv, D,
                                                    causal, num_cache_blocks, block_size);
  int64_t* w = plan.data_ptr<int64_t>();
  std::copy(packed.head.begin(), packed.head.end(), w);
  std::copy(packed.blocks.begin(), packed.blocks.end(),
            w + (kAttnPlanHeaderRows + attn_plan_capacity(plan.size(0))) * kAttnWorkFields);
  std::copy(packed.table.begin(), packed.table.end(), table.data_ptr<int32_t>());
}

// The host plan buffer checked against the call (the GPU kernels' check, here as a clear error) and unpacked.
AttnPlan unpack_checked(const at::Tensor& plan, const at::Tensor& table, int64_t workspace_floats,
                        const AttnRunDims& dims, const char* op) {
  check_cpu(plan, op, "plan");
  check_cpu(table, op, "plan_table");
  check_plan_buffers(plan, table, workspace_floats, op);
  const int bad = attn_plan_mismatch(plan.data_ptr<int64_t>(), dims);
  TORCH_CHECK(bad == 0, "aligned::", op, ": ", attn_plan_mismatch_text(bad));
  AttnPlan out;
  attn_unpack_plan(plan.data_ptr<int64_t>(), dims.capacity, table.data_ptr<int32_t>(), &out);
  return out;
}

// workspace_floats: the GPU run's partial capacity; the CPU run sizes its own (run_forward), it is only checked.
std::tuple<at::Tensor, at::Tensor> attention_varlen_planned(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, const at::Tensor& cu_q,
                                                            const at::Tensor& cu_k, const at::Tensor& plan,
                                                            int64_t workspace_floats, double scale, bool causal) {
  const char* op = "attention_varlen_planned";
  check_cpu(q, op, "q");
  check_cpu(k, op, "k");
  check_cpu(v, op, "v");
  check_attention_metadata_host(cu_q, op, "cu_seqlens_q");
  check_attention_metadata_host(cu_k, op, "cu_seqlens_k");
  const auto c = check_attention_varlen<DType>(q, k, v, cu_q, cu_k, scale, causal, op);
  const at::Tensor no_table = at::empty({0}, plan.options().dtype(at::kInt));
  const AttnPlan pl = unpack_checked(plan, no_table, workspace_floats,
                                     planned_run_dims(c.shape, q.size(0), k.size(0), 0, plan, no_table, workspace_floats), op);
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto out = at::empty_like(qc);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  AttnArgs a{make_attn_problem(c.dt, c.shape, scale, causal, qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), 0),
             pl.seqs.data()};
  run_forward(a, pl, out.data_ptr(), lse.data_ptr<float>());
  return {out, lse};
}

at::Tensor paged_attention_planned(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& plan, const at::Tensor& table, int64_t workspace_floats,
                                   double scale) {
  const char* op = "paged_attention_planned";
  check_cpu(q, op, "q");
  check_cpu(k_cache, op, "k_cache");
  check_cpu(v_cache, op, "v_cache");
  const auto c = check_paged_q_cache<DType>(q, k_cache, v_cache, scale, op);
  const AttnPlan pl = unpack_checked(
      plan, table, workspace_floats,
      planned_run_dims(c.shape, q.size(0), k_cache.size(0), k_cache.size(1), plan, table, workspace_floats), op);
  return paged_forward(q, k_cache, v_cache, c, scale, pl);
}

}  // namespace
}  // namespace aligned::cpu

TORCH_LIBRARY_IMPL(aligned, CPU, lib) {
  aligned::cpu::EmulationAwareLibrary m(lib);  // under aligned_ops.emulate(arch): the GPU source runs
  m.impl("attention_varlen", &aligned::cpu::attention_varlen);
  m.impl("attention_varlen_backward", &aligned::cpu::attention_varlen_backward);
  m.impl("reshape_and_cache", &aligned::cpu::reshape_and_cache);
  m.impl("paged_attention", &aligned::cpu::paged_attention);
  m.impl("attention_plan", &aligned::cpu::attention_plan);
  lib.impl("attention_plan_size", &aligned::attention_plan_size);  // host metadata only: same on every target
  m.impl("attention_varlen_planned", &aligned::cpu::attention_varlen_planned);
  m.impl("paged_attention_planned", &aligned::cpu::paged_attention_planned);
}
