// cpu_attention.cpp — the CPU backend's runs of the attention family: the plan's work items spread over torch's
// intra-op threads (kernels: csrc/cpu/attention_kernels.cpp; their order: csrc/common/attention.h). Also the CPU
// key's registrations of the attention families (register_cpu.cpp), instantiated here.
//
// Threading: with enough row blocks each thread takes whole blocks (all their splits, then the merge); with few
// blocks (decode, short chunks) the plan's (block, split) items are spread over threads and the merges run
// afterwards. Both modes run the same per-split and merge functions on the same plan, so the choice never changes
// a bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "../../cpu/attention_kernels.h"
#include "../glue/attention.h"
#include "../registration_impl.h"
#include "cpu.h"
#include "emulated.h"
#include "gpu.h"

namespace aligned::glue {

using cpu::AttnArgs;
using cpu::attention_kernels;

namespace {

// The kernels' arguments for one record: the problem, the record's sequence (its table entries in the plan's
// table) as sequence 0, and its block. Built on the stack per record: the plan's records are read in place.
struct RecordArgs {
  AttnSeq seq;
  AttnArgs args;
  AttnBlock block;
  RecordArgs(const AttnProblem& problem, const int64_t* w, const int32_t* table)
      : seq(attn_record_seq(w, table)), args{problem, &seq}, block(attn_record_block(w)) {}
};

// Forward of a plan; out [Tq, Hq, D] (q dtype), lse [Tq, Hq] fp32.
void run_forward(const AttnProblem& problem, const AttnPlanView& plan, void* out, float* lse) {
  const auto& kern = attention_kernels();
  const int64_t nb = plan.info.n_blocks, ni = plan.info.n_items;
  if (nb == 0) return;
  const int64_t G = problem.Hq / problem.Hkv, stride = problem.D + 2;
  auto block = [&](int64_t i) { return RecordArgs(problem, plan.blocks + i * kAttnWorkFields, plan.table); };
  const int64_t threads = at::get_num_threads();
  if (nb >= 4 * threads) {
    // Whole blocks, handed out one at a time from the last (a work counter, no data through it): a thread that drew
    // short blocks takes more, and within a sequence the later row blocks — causal prefill's longest — go first.
    // The even split of at::parallel_for left a thread idle for ~1/3 of a prefill. A block is computed whole by the
    // thread that takes it, so the bits do not depend on the schedule.
    std::atomic<int64_t> taken{0};
    cpu::ieee_parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      std::vector<float> part;
      for (int64_t k = taken.fetch_add(1, std::memory_order_relaxed); k < nb;
           k = taken.fetch_add(1, std::memory_order_relaxed)) {
        const RecordArgs r = block(nb - 1 - k);
        part.resize(std::max<int64_t>(1, r.block.nr * G * r.block.n_splits * stride));
        kern.fwd_block(r.args, r.block, 0, r.block.n_splits, part.data());
        kern.merge_block(r.args, r.block, part.data(), out, lse);
      }
    });
    return;
  }
  std::vector<float> part(std::max<int64_t>(1, plan.info.part_floats));
  cpu::ieee_parallel_for(0, ni, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t* w = plan.items + i * kAttnWorkFields;
      const RecordArgs r(problem, w, plan.table);
      kern.fwd_block(r.args, r.block, w[kWsplit], w[kWsplit] + 1, part.data() + r.block.part_offset);
    }
  });
  cpu::ieee_parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) {
      const RecordArgs r = block(i);
      kern.merge_block(r.args, r.block, part.data() + r.block.part_offset, out, lse);
    }
  });
}

}  // namespace

// The CPU runs the `fma` attention only: its mma profile covers linear, the LM head and MoE experts (mma.h); the
// mma attention is a GPU kernel (attention_mma.h), run here under aligned_ops.emulate(arch).
static void refuse_mma_attention(const char* op, const AttnProblem& problem) {
  TORCH_CHECK(problem.profile != kAttnProfileMma, "aligned::", op, ": profile='mma' attention runs on a GPU (or "
              "under aligned_ops.emulate(arch)); the CPU's mma profile covers linear, the LM head and MoE experts "
              "only — use profile='fma' on the CPU");
}

void Cpu::attention_forward(const Call& call, const AttnProblem& problem, const AttnPlan& plan, void* out,
                            float* lse) {
  refuse_mma_attention(call.op, problem);
  run_forward(problem, attn_plan_view(plan), out, lse);
}

void Cpu::attention_mma_backward_reference(const Call& call, const AttnBackwardRun&, const int32_t*,
                                           const int32_t*, int64_t) {
  TORCH_CHECK(false, "aligned::", call.op, ": needs aligned_ops.emulate(arch): the reference applies the emulator's "
              "model of that arch's matrix unit");
}

void Cpu::attention_mma_reference(const Call& call, const AttnProblem&, const int32_t*, const int32_t*, int64_t,
                                  void*, float*) {
  TORCH_CHECK(false, "aligned::", call.op, ": needs aligned_ops.emulate(arch): the reference applies the emulator's "
              "model of that arch's matrix unit");
}

// The host plan buffer: its header checked against the call (the GPU kernels' check, here as a clear error — the
// call was already checked against the host info, so what can fail here is a buffer holding another plan), then
// its records read in place. workspace_floats: the GPU run's partial capacity; the CPU run sizes its own.
void Cpu::attention_forward_planned(const Call& call, const AttnProblem& problem, const AttnPlanInfo&,
                                    const at::Tensor& plan, const at::Tensor& table, int64_t, const AttnRunDims& run,
                                    void* out, float* lse) {
  refuse_mma_attention(call.op, problem);
  const int64_t* header = plan.data_ptr<int64_t>();
  const int bad = attn_plan_mismatch(header, run);
  TORCH_CHECK(bad == 0, "aligned::", call.op, ": ", attn_plan_mismatch_text(bad));
  AttnPlanInfo buffer_info;
  AttnPlanInfo::from_vector(header, &buffer_info);
  run_forward(problem, attn_plan_buffer_view(buffer_info, header, run.capacity, table.data_ptr<int32_t>()), out, lse);
}

void Cpu::attention_backward(const Call& call, const AttnBackwardRun& r) {
  refuse_mma_attention(call.op, r.problem);
  const auto& kern = attention_kernels();
  const AttnPlan& plan = *r.plan;
  const int64_t rows = r.q.size(0) * r.q.size(1);
  cpu::ieee_parallel_for(0, rows, std::max<int64_t>(1, 4096 / r.problem.D), [&](int64_t i0, int64_t i1) {
    kern.bwd_delta(r.problem.dt, r.grad_out.data_ptr(), r.out.data_ptr(), r.delta.data_ptr<float>(), r.problem.D,
                   i0, i1);
  });
  const float* lp = r.lse.data_ptr<float>();
  const float* dp = r.delta.data_ptr<float>();
  cpu::ieee_parallel_for(0, plan.info.n_blocks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const RecordArgs a(r.problem, plan.blocks.data() + i * kAttnWorkFields, plan.table.data());
      kern.bwd_dq_block(a.args, a.block, r.grad_out.data_ptr(), lp, dp, r.dq.data_ptr());
    }
  });
  const int64_t n_tiles = (int64_t)plan.key_tiles.size() / kAttnWorkFields;
  cpu::ieee_parallel_for(0, n_tiles, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t* w = plan.key_tiles.data() + i * kAttnWorkFields;
      const RecordArgs a(r.problem, w, plan.table.data());
      kern.bwd_dkdv_tile(a.args, 0, w[kWg], w[kWsplit], r.grad_out.data_ptr(), lp, dp, r.dk.data_ptr(),
                         r.dv.data_ptr());
    }
  });
}

void Cpu::cache_write(const Call&, DType dt, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& slots) {
  const int64_t row = k.size(1) * k.size(2);
  const int64_t* s = slots.data_ptr<int64_t>();
  const auto& kern = attention_kernels();
  cpu::ieee_parallel_for(0, k.size(0), 64, [&](int64_t t0, int64_t t1) {
    kern.cache_write(dt, k.data_ptr(), v.defined() ? v.data_ptr() : nullptr, k_cache.data_ptr(),
                     v_cache.defined() ? v_cache.data_ptr() : nullptr, s, row, t0, t1);
  });
}

// The buffers are host tensors: the plan is copied in (the same format as on a device, so the same checks apply).
void Cpu::write_plan(const Call&, const at::Tensor& plan, const at::Tensor& table, const AttnPlan& p) {
  int64_t* w = plan.data_ptr<int64_t>();
  const std::vector<int64_t> header = attn_plan_header(p.info);
  std::copy(header.begin(), header.end(), w);
  std::copy(p.items.begin(), p.items.end(), w + attn_plan_items_offset());
  std::copy(p.blocks.begin(), p.blocks.end(), w + attn_plan_blocks_offset(attn_plan_capacity(plan.size(0))));
  std::copy(p.table.begin(), p.table.end(), table.data_ptr<int32_t>());
}

// ---- the CPU key's registrations of these families (register_cpu.cpp) ---------------------------------------
template void register_family<Attention, Cpu, EmulatedCuda, EmulatedHip>(torch::Library&);
template void register_family<AttentionSizes, Cpu>(torch::Library&);
template void register_family<AttentionMmaReference, Cpu, EmulatedCuda, EmulatedHip>(torch::Library&);

}  // namespace aligned::glue

// The buffers a plan of `capacity` records takes (aligned_ops.AttentionPlan allocates them from this: the format
// is known only here). No tensor arguments: a catch-all kernel.
TORCH_LIBRARY_IMPL(aligned, CatchAll, m) { m.impl("attention_plan_layout", &aligned::attention_plan_layout); }
