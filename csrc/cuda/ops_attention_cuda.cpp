// ops_attention_cuda.cpp — torch glue of the attention family on the GPU (CUDA and ROCm torch, and the
// emulation target: csrc/emu/ops_emulated_{cuda,hip}.cpp include this file after ops_cuda.cpp).
//
// Order of work, the same as the CPU glue (csrc/cpu/ops_attention_cpu.cpp): device checks, the family's
// metadata checks (csrc/attention_checks.h), the host planner (csrc/common/attention_plan.h), then the run —
// here: pack the plan into the plan-buffer format (attention_plan.h), upload it with one host-to-device copy
// from pinned memory (stream-ordered, no synchronisation), launch (csrc/gpu/attention_launch.cuh).
//
// Plan/run form (CUDA-graph safe; FlashInfer's plan()/run() at the op level): attention_plan does the
// planning and that one upload into caller-owned persistent buffers, once per step (its metadata are the
// same for every layer); attention_varlen_planned / paged_attention_planned then only launch: no copy, no
// host read, no allocation but the outputs (sized by q), and a grid set by the plan buffer's capacity, so
// a captured graph replays whatever plan was written into the same buffers before the replay.
//
// Host metadata: the planner needs the values of the offsets, sequence lengths and block table, so on the
// GPU these arguments are host (CPU) tensors — the copies the engine already keeps (vLLM: the *_cpu
// buffers; a trainer builds cu_seqlens on the host). The glue never reads device memory back: a device
// tensor there is refused with a message naming the argument, rather than silently synchronising.
// slot_mapping of reshape_and_cache may be either: a host slot mapping is range-checked by the planner
// (clear error); a device one is not read by the host, and the kernel skips any slot outside the cache.
// The backward (attention_varlen_backward) runs on the GPU too: delta per row, dq per row block, dk/dv per
// key tile (the planner's key tiles), each gradient element one fma chain in attention.h's order.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>

#include "../attention_checks.h"
#include "../gpu/attention_api.h"
#include "glue_common.h"

namespace aligned::cuda_attn {
namespace {

using gpu::DType;

// stream, launch-error and device checks: glue_common.h (shared with ops_cuda.cpp)
using cuda_glue::check_launch;
inline void* stream_of(const at::Tensor& t) { return cuda_glue::current_stream(t); }
inline void check_device(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name) {
  cuda_glue::check_cuda(t, ref, op, name);
}

// Planner metadata: a host tensor (attention_checks.h, the CPU glue's refusal too).
void check_host(const at::Tensor& t, const char* op, const char* name) { check_attention_metadata_host(t, op, name); }

// The device's persistent error words (ops_cuda.cpp's buffer, reached through the dispatcher: that glue is
// another translation unit). The pointer never changes, so it is cached per device: no dispatch per call.
int32_t* device_error_words(const at::Tensor& ref) {
  static std::atomic<int32_t*> cached[64];
  const int idx = ref.device().is_cpu() ? 0 : ref.device().index();
  TORCH_CHECK(idx >= 0 && idx < 64, "aligned: device index ", idx, " out of range for the error flags");
  int32_t* w = cached[idx].load(std::memory_order_acquire);
  if (!w) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("aligned::_device_error_flags", "")
                               .typed<at::Tensor(const at::Tensor&)>();
    w = op.call(ref).data_ptr<int32_t>();
    cached[idx].store(w, std::memory_order_release);
  }
  return w;
}

// Every host-to-device copy of the attention glue goes through here (upload, copy_into); under emulation it
// is recorded beside the launches, so a test can prove the run form makes none.
void note_host_copy(int64_t bytes) {
#if defined(ALIGNED_EMULATED_GLUE)
  emu::record_host_copy((size_t)bytes);
#else
  (void)bytes;
#endif
}

// A host buffer on ref's device: one asynchronous copy from pinned memory (the caching host allocator keeps
// the pinned block alive until the copy has run). Under emulation the host buffer is the device buffer.
at::Tensor upload(const void* data, int64_t n, at::ScalarType st, const at::Tensor& ref) {
  const int64_t es = (int64_t)c10::elementSize(st);
  note_host_copy(n * es);
#if defined(ALIGNED_EMULATED_GLUE)
  auto h = at::empty({n}, at::TensorOptions().dtype(st));
  if (n > 0) memcpy(h.data_ptr(), data, (size_t)(n * es));
  (void)ref;
  return h;
#else
  auto h = at::empty({n}, at::TensorOptions().dtype(st).pinned_memory(true));
  if (n > 0) memcpy(h.data_ptr(), data, (size_t)(n * es));
  return h.to(ref.device(), st, /*non_blocking=*/true);
#endif
}

// n host values into dst's first n elements (dst on the device): one stream-ordered copy from pinned memory.
template <class E>
void copy_into(const at::Tensor& dst, int64_t offset, const std::vector<E>& src) {
  if (src.empty()) return;
  note_host_copy((int64_t)(src.size() * sizeof(E)));
  auto slice = dst.view({-1}).narrow(0, offset, (int64_t)src.size());
#if defined(ALIGNED_EMULATED_GLUE)
  memcpy(slice.data_ptr(), src.data(), src.size() * sizeof(E));
#else
  auto h = at::empty({(int64_t)src.size()}, at::TensorOptions().dtype(slice.scalar_type()).pinned_memory(true));
  memcpy(h.data_ptr(), src.data(), src.size() * sizeof(E));
  slice.copy_(h, /*non_blocking=*/true);
#endif
}

// Launches a forward over a plan buffer already on the device: out [Tq, Hq, D] (q dtype), lse [Tq, Hq] fp32.
// grid_items / grid_blocks: the planned form passes the capacity (fixed launches), the per-call form the
// counts it knows from its own plan.
void launch_forward(gpu::AttnFwdParams p, const int64_t* plan, const int32_t* table, float* part,
                    int64_t grid_items, int64_t grid_blocks, const at::Tensor& ref, const char* op) {
  TORCH_CHECK(p.D <= gpu::kGpuAttnMaxD, "aligned::", op, ": head_dim must be <= ", gpu::kGpuAttnMaxD,
              " on the GPU, got ", p.D);
  const int64_t C = p.run.capacity;
  p.plan_header = plan;
  p.items = plan + kAttnPlanHeaderRows * kAttnWorkFields;
  p.blocks = plan + (kAttnPlanHeaderRows + C) * kAttnWorkFields;
  p.block_tables = table;
  p.part = part;
  p.n_items = grid_items;
  p.n_blocks = grid_blocks;
  p.error_flags = device_error_words(ref);
  check_launch(gpu::launch_attention_forward(p, stream_of(ref)), op);
}

// The per-call form: plan here, upload the plan buffer (and the paged table), launch. One or two copies.
void run_forward_per_call(gpu::AttnFwdParams p, const AttnPlan& plan, const AttnPlanDims& dims,
                          const at::Tensor& ref, const char* op) {
  if (plan.blocks.empty()) return;
  const AttnShape sh{p.Hq, p.Hkv, p.D, p.causal};
  const int64_t C = std::max(plan.items.size(), plan.blocks.size());
  AttnPackedPlan packed;
  check_plan(attn_pack_plan(plan, sh, dims, C, std::numeric_limits<int64_t>::max(), plan.part_floats, op, &packed));
  std::vector<int64_t> buf((kAttnPlanHeaderRows + 2 * C) * kAttnWorkFields, 0);
  std::copy(packed.head.begin(), packed.head.end(), buf.begin());
  std::copy(packed.blocks.begin(), packed.blocks.end(), buf.begin() + (kAttnPlanHeaderRows + C) * kAttnWorkFields);
  auto dplan = upload(buf.data(), (int64_t)buf.size(), at::kLong, ref);
  at::Tensor dtable;
  if (!packed.table.empty()) dtable = upload(packed.table.data(), (int64_t)packed.table.size(), at::kInt, ref);
  auto part = at::empty({std::max<int64_t>(1, plan.part_floats)}, ref.options().dtype(at::kFloat));
  p.run.capacity = C;
  p.run.table_elems = (int64_t)packed.table.size();
  p.run.workspace_floats = plan.part_floats;
  launch_forward(p, dplan.data_ptr<int64_t>(), dtable.defined() ? dtable.data_ptr<int32_t>() : nullptr,
                 part.data_ptr<float>(), (int64_t)plan.items.size(), (int64_t)plan.blocks.size(), ref, op);
  // dplan, dtable, part: stream-ordered frees
}

gpu::AttnFwdParams forward_params(DType dt, const AttnShape& sh, double scale, const void* q, const void* k,
                                  const void* v, int64_t block_size, void* out, float* lse) {
  gpu::AttnFwdParams p{};
  static_cast<AttnProblem&>(p) = make_attn_problem(dt, sh, scale, sh.causal, q, k, v, block_size);
  p.out = out;
  p.lse = lse;
  return p;
}

std::tuple<at::Tensor, at::Tensor> attention_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& cu_q, const at::Tensor& cu_k, double scale,
                                                    bool causal) {
  const char* op = "attention_varlen";
  check_device(q, q, op, "q");
  check_device(k, q, op, "k");
  check_device(v, q, op, "v");
  check_host(cu_q, op, "cu_seqlens_q");
  check_host(cu_k, op, "cu_seqlens_k");
  const auto c = check_attention_varlen<DType>(q, k, v, cu_q, cu_k, scale, causal, op);
  c10::DeviceGuard guard(q.device());
  const auto cq = cu_q.contiguous(), ck = cu_k.contiguous();
  AttnPlan plan;
  check_plan(plan_varlen(cq.data_ptr<int32_t>(), ck.data_ptr<int32_t>(), cq.size(0), q.size(0), k.size(0), c.shape,
                         false, op, &plan));
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto out = at::empty_like(qc);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  auto p = forward_params(c.dt, c.shape, scale, qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), 0, out.data_ptr(),
                          lse.data_ptr<float>());
  p.run = AttnRunDims{c.shape.Hq, c.shape.Hkv, c.shape.D, causal, q.size(0), k.size(0), 0, 0, 0, 0};
  run_forward_per_call(p, plan, AttnPlanDims{q.size(0), k.size(0), 0}, q, op);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_q, const at::Tensor& cu_k, double scale, bool causal) {
  const char* op = "attention_varlen_backward";
  check_device(q, q, op, "q");
  check_device(k, q, op, "k");
  check_device(v, q, op, "v");
  check_device(grad_out, q, op, "grad_out");
  check_device(out, q, op, "out");
  check_device(lse, q, op, "lse");
  check_host(cu_q, op, "cu_seqlens_q");
  check_host(cu_k, op, "cu_seqlens_k");
  const auto c = check_attention_varlen<DType>(q, k, v, cu_q, cu_k, scale, causal, op);
  check_attention_varlen_backward(grad_out, q, out, lse, op);
  c10::DeviceGuard guard(q.device());
  const auto cq = cu_q.contiguous(), ck = cu_k.contiguous();
  AttnPlan plan;
  check_plan(plan_varlen(cq.data_ptr<int32_t>(), ck.data_ptr<int32_t>(), cq.size(0), q.size(0), k.size(0), c.shape,
                         true, op, &plan));
  TORCH_CHECK(c.shape.D <= gpu::kGpuAttnMaxD, "aligned::", op, ": head_dim must be <= ", gpu::kGpuAttnMaxD,
              " on the GPU, got ", c.shape.D);
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto go = grad_out.contiguous(), oc = out.contiguous(), lc = lse.contiguous();
  auto dq = at::empty_like(qc), dk = at::zeros_like(kc), dv = at::zeros_like(vc);
  auto delta = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  const std::vector<int64_t> work = gpu::attn_pack_backward(plan);
  auto dwork = upload(work.data(), (int64_t)work.size(), at::kLong, q);
  gpu::AttnBwdParams p{};
  p.f.dt = c.dt;
  p.f.Hq = c.shape.Hq;
  p.f.Hkv = c.shape.Hkv;
  p.f.D = c.shape.D;
  p.f.scale = (float)scale;
  p.f.causal = causal;
  p.f.q = qc.data_ptr();
  p.f.k = kc.data_ptr();
  p.f.v = vc.data_ptr();
  p.f.n_blocks = (int64_t)plan.blocks.size();
  p.f.blocks = dwork.data_ptr<int64_t>();
  p.tiles = p.f.blocks + p.f.n_blocks * kAttnWorkFields;
  p.n_tiles = (int64_t)plan.key_tiles.size();
  p.dout = go.data_ptr();
  p.out = oc.data_ptr();
  p.lse = lc.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.rows = q.size(0) * q.size(1);
  check_launch(gpu::launch_attention_backward(p, stream_of(q)), op);
  return {dq, dk, dv};
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& qsl,
                           double scale) {
  const char* op = "paged_attention";
  check_device(q, q, op, "q");
  check_device(k_cache, q, op, "k_cache");
  check_device(v_cache, q, op, "v_cache");
  check_host(block_table, op, "block_table");
  check_host(seq_lens, op, "seq_lens");
  check_host(qsl, op, "query_start_loc");
  const auto c = check_paged_attention<DType>(q, k_cache, v_cache, block_table, seq_lens, qsl, scale);
  c10::DeviceGuard guard(q.device());
  auto bt = block_table.contiguous(), sl = seq_lens.contiguous(), ql = qsl.contiguous();
  AttnPlan plan;
  check_plan(plan_paged(ql.data_ptr<int32_t>(), sl.data_ptr<int32_t>(), bt.data_ptr<int32_t>(), sl.size(0),
                        bt.size(1), k_cache.size(0), k_cache.size(1), q.size(0), c.shape, op, &plan));
  auto qc = q.contiguous();
  auto out = at::empty_like(qc);
  auto lse = at::empty({q.size(0), c.shape.Hq}, q.options().dtype(at::kFloat));
  auto p = forward_params(c.dt, c.shape, scale, qc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                          k_cache.size(1), out.data_ptr(), lse.data_ptr<float>());
  p.run = AttnRunDims{c.shape.Hq, c.shape.Hkv, c.shape.D, true, q.size(0), k_cache.size(0), k_cache.size(1), 0, 0, 0};
  run_forward_per_call(p, plan, AttnPlanDims{q.size(0), k_cache.size(0), k_cache.size(1)}, q, op);
  return out;
}

// ---- plan/run form -----------------------------------------------------------------------------------------
// attention_plan: host metadata in, the plan written into the device buffers (plan, plan_table), checked
// against workspace_floats (the run's partial capacity). Two or three stream-ordered copies from pinned
// memory, once per step — never in the run.
void attention_plan(const at::Tensor& plan, const at::Tensor& table, const at::Tensor& qsl, const at::Tensor& kv_lens,
                    const std::optional<at::Tensor>& block_table, int64_t Hq, int64_t Hkv, int64_t D, bool causal,
                    int64_t num_cache_blocks, int64_t block_size, int64_t workspace_floats) {
  const char* op = "attention_plan";
  check_device(plan, plan, op, "plan");
  check_device(table, plan, op, "plan_table");
  const AttnPackedPlan packed = plan_attention_host(plan, table, workspace_floats, qsl, kv_lens, block_table, Hq, Hkv, D,
                                                    causal, num_cache_blocks, block_size);
  c10::DeviceGuard guard(plan.device());
  copy_into(plan, 0, packed.head);
  copy_into(plan, (kAttnPlanHeaderRows + attn_plan_capacity(plan.size(0))) * kAttnWorkFields, packed.blocks);
  copy_into(table, 0, packed.table);
}

void check_planned_buffers(const at::Tensor& ref, const at::Tensor& plan, const at::Tensor& table,
                           int64_t workspace_floats, const char* op) {
  check_device(plan, ref, op, "plan");
  check_device(table, ref, op, "plan_table");
  check_plan_buffers(plan, table, workspace_floats, op);
}

// The run forms: metadata checks only, then the launches over the plan buffers (grids = their capacity).
std::tuple<at::Tensor, at::Tensor> attention_varlen_planned(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, const at::Tensor& cu_q,
                                                            const at::Tensor& cu_k, const at::Tensor& plan,
                                                            int64_t workspace_floats, double scale, bool causal) {
  const char* op = "attention_varlen_planned";
  check_device(q, q, op, "q");
  check_device(k, q, op, "k");
  check_device(v, q, op, "v");
  check_host(cu_q, op, "cu_seqlens_q");  // not read here: the backward's metadata (it replans from them)
  check_host(cu_k, op, "cu_seqlens_k");
  const auto c = check_attention_varlen<DType>(q, k, v, cu_q, cu_k, scale, causal, op);
  const at::Tensor no_table = at::empty({0}, plan.options().dtype(at::kInt));
  check_planned_buffers(q, plan, no_table, workspace_floats, op);
  c10::DeviceGuard guard(q.device());
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto out = at::empty_like(qc);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  const int64_t C = attn_plan_capacity(plan.size(0));
  if (C == 0) return {out, lse};
  auto p = forward_params(c.dt, c.shape, scale, qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), 0, out.data_ptr(),
                          lse.data_ptr<float>());
  p.run = planned_run_dims(c.shape, q.size(0), k.size(0), 0, plan, no_table, workspace_floats);
  // the split partials: a capacity-sized buffer (stream-ordered caching allocator; inside a graph capture, the
  // graph's pool at a fixed address)
  auto part = at::empty({std::max<int64_t>(1, workspace_floats)}, q.options().dtype(at::kFloat));
  launch_forward(p, plan.data_ptr<int64_t>(), nullptr, part.data_ptr<float>(), C, C, q, op);
  return {out, lse};
}

at::Tensor paged_attention_planned(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& plan, const at::Tensor& table, int64_t workspace_floats,
                                   double scale) {
  const char* op = "paged_attention_planned";
  check_device(q, q, op, "q");
  check_device(k_cache, q, op, "k_cache");
  check_device(v_cache, q, op, "v_cache");
  const auto c = check_paged_q_cache<DType>(q, k_cache, v_cache, scale, op);
  check_planned_buffers(q, plan, table, workspace_floats, op);
  c10::DeviceGuard guard(q.device());
  auto qc = q.contiguous();
  auto out = at::empty_like(qc);
  const int64_t C = attn_plan_capacity(plan.size(0));
  if (C == 0) return out;
  auto lse = at::empty({q.size(0), c.shape.Hq}, q.options().dtype(at::kFloat));
  auto p = forward_params(c.dt, c.shape, scale, qc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                          k_cache.size(1), out.data_ptr(), lse.data_ptr<float>());
  p.run = planned_run_dims(c.shape, q.size(0), k_cache.size(0), k_cache.size(1), plan, table, workspace_floats);
  auto part = at::empty({std::max<int64_t>(1, workspace_floats)}, q.options().dtype(at::kFloat));  // capacity-sized
  launch_forward(p, plan.data_ptr<int64_t>(), table.data_ptr<int32_t>(), part.data_ptr<float>(), C, C, q, op);
  return out;
}

void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& slot_mapping) {
  const char* op = "reshape_and_cache";
  check_device(k, k, op, "k");
  check_device(v, k, op, "v");
  check_device(k_cache, k, op, "k_cache");
  check_device(v_cache, k, op, "v_cache");
  const DType dt = check_reshape_and_cache<DType>(k, v, k_cache, v_cache, slot_mapping);
  c10::DeviceGuard guard(k.device());
  const int64_t n_slots = k_cache.size(0) * k_cache.size(1);
  at::Tensor dslots;
  if (slot_mapping.device().is_cpu()) {  // host metadata: validated by the planner, then uploaded
    auto sm = slot_mapping.contiguous();
    check_plan(check_slots(sm.data_ptr<int64_t>(), sm.size(0), n_slots, op));
    dslots = upload(sm.data_ptr<int64_t>(), sm.numel(), at::kLong, k);
  } else {
    check_device(slot_mapping, k, op, "slot_mapping");
    dslots = slot_mapping.contiguous();
  }
  auto kc = k.contiguous(), vc = v.contiguous();
  gpu::CacheWriteParams p{};
  p.dt = dt;
  p.k = kc.data_ptr();
  p.v = vc.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.slots = dslots.data_ptr<int64_t>();
  p.T = k.size(0);
  p.row_elems = k.size(1) * k.size(2);
  p.n_slots = n_slots;
  check_launch(gpu::launch_cache_write(p, stream_of(k)), op);
}

}  // namespace
}  // namespace aligned::cuda_attn

#if defined(ALIGNED_EMULATED_GLUE)
// Same registry as ops_cuda.cpp's block (that block's static names are taken in this TU).
namespace {
void aligned_emulated_attention_glue_init(::aligned::emu::GlueRegistry& m) {
  m.impl("attention_varlen", &aligned::cuda_attn::attention_varlen);
  m.impl("attention_varlen_backward", &aligned::cuda_attn::attention_varlen_backward);
  m.impl("paged_attention", &aligned::cuda_attn::paged_attention);
  m.impl("reshape_and_cache", &aligned::cuda_attn::reshape_and_cache);
  m.impl("attention_plan", &aligned::cuda_attn::attention_plan);
  m.impl("attention_varlen_planned", &aligned::cuda_attn::attention_varlen_planned);
  m.impl("paged_attention_planned", &aligned::cuda_attn::paged_attention_planned);
}
const bool aligned_emulated_attention_glue_registered =
    (aligned_emulated_attention_glue_init(::aligned::emu::glue_registry(ALIGNED_EMULATED_VENDOR)), true);
}  // namespace
#else
TORCH_LIBRARY_IMPL(aligned, CUDA, m) {
  m.impl("attention_varlen", &aligned::cuda_attn::attention_varlen);
  m.impl("attention_varlen_backward", &aligned::cuda_attn::attention_varlen_backward);
  m.impl("paged_attention", &aligned::cuda_attn::paged_attention);
  m.impl("reshape_and_cache", &aligned::cuda_attn::reshape_and_cache);
  m.impl("attention_plan", &aligned::cuda_attn::attention_plan);
  m.impl("attention_varlen_planned", &aligned::cuda_attn::attention_varlen_planned);
  m.impl("paged_attention_planned", &aligned::cuda_attn::paged_attention_planned);
}
#endif
