// ops_attention_cuda.cpp — torch glue of the attention family on the GPU (CUDA and ROCm torch, and the
// emulation target: csrc/emu/ops_emulated_{cuda,hip}.cpp include this file after ops_cuda.cpp).
//
// Order of work, the same as the CPU glue (csrc/cpu/ops_attention_cpu.cpp): device checks, the family's
// metadata checks (csrc/attention_checks.h), the host planner (csrc/common/attention_plan.h), then the run —
// here: pack the plan's work list (csrc/gpu/attention_api.h), upload it with one host-to-device copy from
// pinned memory (stream-ordered, no synchronisation), launch (csrc/gpu/attention_launch.cuh).
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

#if defined(ALIGNED_EMULATED_GLUE)
#include "../emu/emulation.h"
#elif defined(ALIGNED_ROCM)
#include <c10/hip/HIPStream.h>
#else
#include <c10/cuda/CUDAStream.h>
#endif

#include <tuple>
#include <vector>

#include "../attention_checks.h"
#include "../gpu/attention_api.h"

namespace aligned::cuda_attn {
namespace {

using gpu::DType;

void* stream_of(const at::Tensor& t) {
#if defined(ALIGNED_EMULATED_GLUE)
  (void)t;
  return nullptr;  // emulated launches are synchronous
#elif defined(ALIGNED_ROCM)
  return (void*)c10::hip::getCurrentHIPStream(t.device().index()).stream();
#else
  return (void*)c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#endif
}

void check_launch(const char* err, const char* op) {
  TORCH_CHECK(err == nullptr, "aligned::", op, ": kernel launch failed: ", err ? err : "");
}

// A data tensor: on the device of ref (a CPU tensor under emulation).
void check_device(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name) {
#if defined(ALIGNED_EMULATED_GLUE)
  TORCH_CHECK(t.device().is_cpu(), "aligned::", op, ": ", name,
              " must be a CPU tensor under aligned_ops.emulate, got device ", t.device());
  (void)ref;
#else
  TORCH_CHECK(t.device().is_cuda(), "aligned::", op, ": ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == ref.device(), "aligned::", op, ": ", name, " is on ", t.device(), " but the inputs are on ",
              ref.device(), " (all tensors must be on the same device)");
#endif
}

// Planner metadata: a host tensor (see the header comment).
void check_host(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "aligned::", op, ": ", name,
              " must be a CPU (host) tensor on the GPU path: the planner validates it on the host and the glue "
              "never reads device memory back (pass the engine's host copy), got device ",
              t.device());
}

// A host buffer on ref's device: one asynchronous copy from pinned memory (the caching host allocator keeps
// the pinned block alive until the copy has run). Under emulation the host buffer is the device buffer.
at::Tensor upload(const void* data, int64_t n, at::ScalarType st, const at::Tensor& ref) {
  const int64_t es = (int64_t)c10::elementSize(st);
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

// Runs a plan's forward: out [Tq, Hq, D] (q dtype), lse [Tq, Hq] fp32.
void run_forward(gpu::AttnFwdParams p, const AttnPlan& plan, const at::Tensor& ref, int64_t table_stride,
                 const char* op) {
  p.n_items = (int64_t)plan.items.size();
  p.n_blocks = (int64_t)plan.blocks.size();
  if (p.n_blocks == 0) return;
  TORCH_CHECK(p.D <= gpu::kGpuAttnMaxD, "aligned::", op, ": head_dim must be <= ", gpu::kGpuAttnMaxD,
              " on the GPU, got ", p.D);
  const std::vector<int64_t> work = gpu::attn_pack_work(plan, table_stride);
  auto dwork = upload(work.data(), (int64_t)work.size(), at::kLong, ref);
  auto part = at::empty({std::max<int64_t>(1, plan.part_floats)}, ref.options().dtype(at::kFloat));
  p.items = dwork.data_ptr<int64_t>();
  p.blocks = p.items + p.n_items * gpu::kAttnWorkFields;
  p.part = part.data_ptr<float>();
  check_launch(gpu::launch_attention_forward(p, stream_of(ref)), op);  // part, dwork: stream-ordered frees
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
  gpu::AttnFwdParams p{};
  p.dt = c.dt;
  p.Hq = c.shape.Hq;
  p.Hkv = c.shape.Hkv;
  p.D = c.shape.D;
  p.scale = (float)scale;
  p.causal = causal;
  p.q = qc.data_ptr();
  p.k = kc.data_ptr();
  p.v = vc.data_ptr();
  p.block_size = 0;
  p.block_tables = nullptr;
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  run_forward(p, plan, q, 0, op);
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
  p.tiles = p.f.blocks + p.f.n_blocks * gpu::kAttnWorkFields;
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
  auto dtable = upload(bt.data_ptr<int32_t>(), bt.numel(), at::kInt, q);
  gpu::AttnFwdParams p{};
  p.dt = c.dt;
  p.Hq = c.shape.Hq;
  p.Hkv = c.shape.Hkv;
  p.D = c.shape.D;
  p.scale = (float)scale;
  p.causal = true;
  p.q = qc.data_ptr();
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.block_size = k_cache.size(1);
  p.block_tables = dtable.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  run_forward(p, plan, q, bt.size(1), op);
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
}
#endif
