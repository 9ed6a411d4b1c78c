// backends/gpu.h — the GPU backends: Gpu<Device>, the run functions of every family with GPU kernels, written
// once for every build of csrc/gpu. A Device says where the kernels run and which build's launchers they are:
//
//   CudaDevice (backends/cuda.h)        a CUDA or ROCm torch's GPU: its current stream, a device guard, pinned
//                                       stream-ordered uploads; the nvcc / hip-clang build (aligned::gpu::device)
//   EmulatedDevice<V> (emulated.h)      the emulation target: CPU tensors, synchronous launches, memcpy uploads
//                                       (recorded); the emulated build of vendor spelling V
//
// A Device supplies: check_device(t, first, op, name), Guard, stream(first), error_flags(first) and
// error_flags_tensor(first) (the persistent words of the in-kernel value checks, dense_api.h DeviceError),
// upload(...) and copy_into(...) (the only host-to-device copies; a run form of attention makes none),
// selected() (whether it stands in for the CPU now), and its launcher tables dense(), attention(), exact(), mma(),
// moe() (csrc/gpu/launchers.h).
//
// No run function here reads device data on the host (no .item(), no copy back, no synchronisation): the data
// checks run in the kernels (kValueChecks = kInKernel), so every op is asynchronous and graph-capturable. The one
// exception is linear_exact_pack_weight (once per weight version, never per step: its digit count sizes the
// packed buffer). tests/cuda/test_no_host_sync.py scans this file.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "../../common/attention_plan.h"
#include "../../common/exact_linear.h"
#include "../../gpu/launchers.h"
#include "../checks/attention.h"
#include "../checks/common.h"
#include "../families.h"
#include "../make_params.h"
#include "../run_args.h"

namespace aligned::glue {

template <class Device>
struct Gpu {
  static constexpr ValueChecks kValueChecks = ValueChecks::kInKernel;
  static constexpr bool kExactF64Path = false;  // every row takes the integer path (the same bits)
  static bool selected() { return Device::selected(); }

  // One op call: its name, its first tensor (every other must live on the same device), the device guard.
  class Call {
   public:
    Call(const char* op, const at::Tensor& first, const char* first_name)
        : op(op), first(checked(first, op, first_name)), guard_(first) {}
    void on_device(const at::Tensor& t, const char* name) const { Device::check_device(t, first, op, name); }
    void on_device(const std::optional<at::Tensor>& t, const char* name) const {
      if (t.has_value() && t->defined()) on_device(*t, name);
    }
    void* stream() const { return Device::stream(first); }
    // A launcher's result (nullptr or the runtime's error string) as the op's error.
    void launched(const char* err) const {
      TORCH_CHECK(err == nullptr, "aligned::", op, ": kernel launch failed: ", err ? err : "");
    }
    const char* const op;
    const at::Tensor& first;

   private:
    static const at::Tensor& checked(const at::Tensor& t, const char* op, const char* name) {
      Device::check_device(t, t, op, name);
      return t;
    }
    typename Device::Guard guard_;
  };
  static int32_t* error_flags(const Call& c) { return Device::error_flags(c.first); }

  // ---- dense, logits, hooks: one launcher each ---------------------------------------------------------------
  static void rms_norm(const Call& c, const RmsNormParams& p) { c.launched(Device::dense().rms_norm(p, c.stream())); }
  static void fused_add_rms_norm(const Call& c, const RmsNormParams& p) {
    c.launched(Device::dense().fused_add_rms_norm(p, c.stream()));
  }
  static void rms_norm_backward(const Call& c, const RmsNormBackwardParams& p) {
    c.launched(Device::dense().rms_norm_backward(p, c.stream()));
  }
  static void silu_and_mul(const Call& c, const SiluMulParams& p) {
    c.launched(Device::dense().silu_and_mul(p, c.stream()));
  }
  static void silu_and_mul_backward(const Call& c, const SiluMulParams& p) {
    c.launched(Device::dense().silu_and_mul_backward(p, c.stream()));
  }
  static void rotary(const Call& c, const RotaryParams& p) { c.launched(Device::dense().rotary(p, c.stream())); }
  static void logsumexp(const Call& c, const LogitsParams& p) { c.launched(Device::dense().logsumexp(p, c.stream())); }
  static void log_softmax(const Call& c, const LogitsParams& p) {
    c.launched(Device::dense().log_softmax(p, c.stream()));
  }
  static void token_logprobs(const Call& c, const LogitsParams& p) {
    c.launched(Device::dense().token_logprobs(p, c.stream()));
  }
  static void token_logprobs_backward(const Call& c, const LogitsParams& p) {
    c.launched(Device::dense().token_logprobs_backward(p, c.stream()));
  }
  static void logsumexp_backward(const Call& c, const LogitsParams& p) {
    c.launched(Device::dense().logsumexp_backward(p, c.stream()));
  }
  static void log_softmax_backward(const Call& c, const LogitsParams& p) {
    c.launched(Device::dense().log_softmax_backward(p, c.stream()));
  }
  static void exp_f32(const Call& c, const ElementwiseParams& p) { c.launched(Device::dense().exp_f32(p, c.stream())); }
  static void log_f32(const Call& c, const ElementwiseParams& p) { c.launched(Device::dense().log_f32(p, c.stream())); }
  static at::Tensor device_error_flags(const Call& c) { return Device::error_flags_tensor(c.first); }

  // ---- the fma linear ----------------------------------------------------------------------------------------
  // lanes > 1 (linear, linear_partial): the lane sums go through an fp32 workspace [lanes, ws_rows, N]
  // (gemm_fp32.cuh), sized by params_linear.h's gemm_workspace_rows (stream-ordered by the caching allocator).
  static void gemm(const Call& c, GemmParams p) {
    if (p.M <= 0 || p.N <= 0) return;
    at::Tensor ws;
    if (p.lanes > 1) {
      p.ws_rows = gemm_workspace_rows(p.M, p.N, p.lanes);
      ws = at::empty({p.lanes, p.ws_rows, p.N}, c.first.options().dtype(at::kFloat));
      p.lane_ws = ws.data_ptr<float>();
    }
    c.launched(Device::dense().gemm(p, c.stream()));
  }
  static void column_sum(const Call& c, const ColumnSumParams& p) {
    c.launched(Device::dense().column_sum(p, c.stream()));
  }

  // ---- the mma linear (csrc/gpu/mma_linear_kernels.cuh; order: csrc/common/mma.h) ----------------------------
  // No workspace: each output's lane sums stay in registers / shared memory. The backward's GEMMs are the same
  // launcher (strided operands).
  static void mma_gemm(const Call& c, const GemmParams& p) { c.launched(Device::mma().mma_gemm(p, c.stream())); }
  // The scalar model of the unit's chain: the emulated devices run the arch's model on the host
  // (backends/emulated.h); a real GPU has none and refuses by the op's name (backends/cuda.h).
  static void linear_mma_reference(const Call& c, const GemmParams& p) { Device::mma_reference(c.op, p); }

  // ---- the moe routing ops (csrc/gpu/moe_kernels.cuh: one thread per token, csrc/common/moe.h's row functions)
  // Each call's scratch is one fp32 buffer, a slice per thread slot of the capped grid (moe_api.h
  // moe_routing_scratch_floats: bounded by the grid, not by T); the backwards check
  // the ids in the kernel (kValueChecks).
  static void moe_routing(const Call& c, const MoeRoutingParams& p) {
    const at::Tensor s = routing_scratch(c, p, 0);
    c.launched(Device::moe().routing(p, s.data_ptr<float>(), c.stream()));
  }
  static void moe_routing_backward(const Call& c, const MoeRoutingParams& p) {
    const at::Tensor s = routing_scratch(c, p, 0);
    c.launched(Device::moe().routing_backward(p, s.data_ptr<float>(), Device::error_flags(c.first), c.stream()));
  }
  static void moe_grouped_routing(const Call& c, const MoeGroupedRoutingParams& p) {
    const at::Tensor s = routing_scratch(c, p, p.n_group);
    c.launched(Device::moe().grouped_routing(p, s.data_ptr<float>(), c.stream()));
  }
  static void moe_grouped_routing_backward(const Call& c, const MoeGroupedRoutingParams& p) {
    const at::Tensor s = routing_scratch(c, p, p.n_group);
    c.launched(
        Device::moe().grouped_routing_backward(p, s.data_ptr<float>(), Device::error_flags(c.first), c.stream()));
  }

  // ---- moe_experts (csrc/gpu/moe_kernels.cuh; how a call runs: csrc/gpu/moe_api.h; order: csrc/common/moe.h) --
  // Every buffer is sized from the shapes (N = T * k assignments, the tile list's capacity moe_max_tiles), every
  // launch's grid too: no host read of ids, so the call is asynchronous and graph-capturable. The projections
  // are the profile's linear kernels (grouped over the plan's tiles; the shared expert's and the gate's through
  // the plain launchers over all T tokens), silu_and_mul the dense op's.
  static void moe_experts(const Call& c, const MoeExpertsRun& r) {
    const auto& a = r.a;
    const int64_t T = a.T, H = a.H, k = a.k, E = a.E, I = a.I, N = T * k;
    const bool mma = r.linear == ExpertsLinear::kMma;
    const gpu::MoeLaunchers& L = Device::moe();
    const auto opts = a.x.options(), i64 = opts.dtype(at::kLong), f32 = opts.dtype(at::kFloat);
    // 1. the plan
    const int64_t max_tiles = gpu::moe_max_tiles(N, E);
    at::Tensor start = at::empty({E + 1}, i64), pos = at::empty({T, k}, i64), src = at::empty({N}, i64);
    at::Tensor tiles = at::empty({max_tiles, 3}, i64);
    gpu::MoePlanParams pp{};
    pp.ids = a.ids.data_ptr<int64_t>();
    pp.T = T;
    pp.k = k;
    pp.E = E;
    pp.start = start.data_ptr<int64_t>();
    pp.pos = pos.data_ptr<int64_t>();
    pp.src = src.data_ptr<int64_t>();
    pp.tiles = tiles.data_ptr<int64_t>();
    pp.max_tiles = max_tiles;
    pp.error_flags = Device::error_flags(c.first);
    c.launched(L.plan(pp, c.stream()));
    // 2. gather
    at::Tensor xg = at::empty({N, H}, opts);
    gpu::MoeGatherParams gp{};
    gp.dt = a.dt;
    gp.x = a.x.data_ptr();
    gp.src = pp.src;
    gp.out = xg.data_ptr();
    gp.N = N;
    gp.H = H;
    c.launched(L.gather(gp, c.stream()));
    // 3.-5. h = round_T(linear(xg, w13[e])), a = silu_and_mul(h), y = linear(a, w2[e]) (fp32) over the tiles
    auto grouped = [&](const at::Tensor& A, const at::Tensor& B, DType cdt, const at::Tensor& C, int64_t Nout,
                       int64_t K) {
      gpu::MoeGroupedGemmParams g{};
      g.g = row_major_gemm_params(a.dt, A.data_ptr(), B.data_ptr(), cdt, C.data_ptr(), N, Nout, K, kLinearLanes);
      g.b_se = Nout * K;
      g.tiles = pp.tiles;
      g.max_tiles = max_tiles;
      c.launched(mma ? L.grouped_mma_gemm(g, c.stream()) : L.grouped_gemm(g, c.stream()));
    };
    at::Tensor h = at::empty({N, 2 * I}, opts), act = at::empty({N, I}, opts), y = at::empty({N, H}, f32);
    grouped(xg, a.w13, a.dt, h, 2 * I, H);
    silu_and_mul(c, silu_and_mul_rows_params(a.dt, h.data_ptr(), act.data_ptr(), N, I));
    grouped(act, a.w2, DType::F32, y, H, I);
    // 6. the shared expert over all tokens, and its gate's logit (the plain launchers: row-independent chains)
    at::Tensor ys, gl;
    if (a.sw13.defined()) {
      auto linear = [&](const at::Tensor& A, const at::Tensor& B, DType cdt, const at::Tensor& C, int64_t Nout,
                        int64_t K) {
        const GemmParams p =
            row_major_gemm_params(a.dt, A.data_ptr(), B.data_ptr(), cdt, C.data_ptr(), T, Nout, K, kLinearLanes);
        if (mma) mma_gemm(c, p);
        else gemm(c, p);
      };
      at::Tensor hs = at::empty({T, 2 * a.Is}, opts), as = at::empty({T, a.Is}, opts);
      ys = at::empty({T, H}, f32);
      linear(a.x, a.sw13, a.dt, hs, 2 * a.Is, H);
      silu_and_mul(c, silu_and_mul_rows_params(a.dt, hs.data_ptr(), as.data_ptr(), T, a.Is));
      linear(as, a.sw2, DType::F32, ys, H, a.Is);
      if (a.sgate.defined()) {
        gl = at::empty({T}, f32);
        linear(a.x, a.sgate, DType::F32, gl, 1, H);  // the logit; the combine applies moe_shared_gate
      }
    }
    // 7. combine per token in rank order, rounded once
    c.launched(L.combine(make_moe_combine_params(a.dt, y, pos, a.w, ys, gl, r.out), c.stream()));
  }

  // ---- the exact linear (csrc/gpu/exact_linear_kernels.cuh; numbers: csrc/common/exact_linear.h) ------------
  // Same packed form as the CPU (checks/exact.h): (wd int8 [Sw, Np * Kp], w_exp int32 [N + 1] with K at [N],
  // w_bad uint8 [N]), packed here by the row-forms + pack kernels.
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_exact_pack_weight(const Call& c, DType dt,
                                                                                 const at::Tensor& wc) {
    const int64_t N = wc.size(0), K = wc.size(1), Np = ceil_to(N, 16), Kp = ceil_to(K, 64);
    auto opts = wc.options();
    at::Tensor we = at::zeros({N + 1}, opts.dtype(at::kInt));
    at::Tensor ws = at::ones({std::max<int64_t>(N, 1)}, opts.dtype(at::kChar));
    at::Tensor wb = at::zeros({N}, opts.dtype(at::kByte));
    exact_row_forms(c, dt, wc, N, K, we, ws, wb);
    // Sw = the max of the rows' digit counts sizes the buffer: read back once per weight version, at pack time.
    const int sw = N > 0 ? (int)ws.narrow(0, 0, N).max().item<int8_t>() : 1;
    at::Tensor wd = at::zeros({sw, Np * Kp}, opts.dtype(at::kChar));
    exact_pack(c, dt, wc, N, K, Kp, we, nullptr, sw, wd);
    we.narrow(0, N, 1).fill_(K);  // the packed form's in_features
    return {wd, we, wb};
  }

  static void linear_exact_packed(const Call& c, const ExactPackedRun& r) {
    const int64_t M = r.a.M, N = r.a.N, K = r.a.K, Mp = ceil_to(M, 16), Kp = ceil_to(K, 64);
    auto opts = r.x.options();
    at::Tensor xd = at::zeros({exact::kMaxDigits, Mp, Kp}, opts.dtype(at::kChar));
    at::Tensor xe = at::empty({M}, opts.dtype(at::kInt));
    at::Tensor xs = at::empty({M}, opts.dtype(at::kChar));
    at::Tensor xb = at::empty({M}, opts.dtype(at::kByte));
    exact_row_forms(c, r.a.dt, r.x, M, K, xe, xs, xb);
    exact_pack(c, r.a.dt, r.x, M, K, Kp, xe, &xs, 0, xd);
    ExactGemmParams p =
        make_exact_gemm_params(r.a.dt, xd, Mp, xe, xs, xb, r.wd, r.w_exp, r.w_bad, r.a.bias, r.out, M, N, K, Kp);
    // k_parts cuts K into parts summed on their own (exactly combined): here it sets the k per int32 level sum.
    const int64_t parts = std::min<int64_t>(r.k_parts, Kp);
    p.chunk_k = std::max<int64_t>(32, std::min<int64_t>(8192, ceil_to((Kp + parts - 1) / parts, 32)));
    c.launched(Device::exact().exact_gemm(p, c.stream()));
  }

  // ---- attention (csrc/gpu/attention_kernels.cuh): the plan's records, uploaded or already on the device ------
  // The per-call forms: the plan in the plan-buffer format (attention_plan.h), uploaded in one copy (and its
  // table in a second), then the launch with grids = its own counts.
  static void attention_forward(const Call& c, const AttnProblem& problem, const AttnPlan& plan, void* out,
                                float* lse) {
    const AttnPlanInfo& info = plan.info;
    if (info.n_blocks == 0) return;
    const int64_t C = info.capacity();
    std::vector<int64_t> buf = attn_plan_header(info);
    buf.resize((kAttnPlanHeaderRows + 2 * C) * kAttnWorkFields, 0);
    std::copy(plan.items.begin(), plan.items.end(), buf.begin() + attn_plan_items_offset());
    std::copy(plan.blocks.begin(), plan.blocks.end(), buf.begin() + attn_plan_blocks_offset(C));
    const at::Tensor dplan = Device::upload(buf.data(), (int64_t)buf.size(), at::kLong, c.first);
    at::Tensor dtable;
    if (!plan.table.empty())
      dtable = Device::upload(plan.table.data(), (int64_t)plan.table.size(), at::kInt, c.first);
    const at::Tensor part = at::empty({std::max<int64_t>(1, info.part_floats)}, c.first.options().dtype(at::kFloat));
    gpu::AttnFwdParams p = forward_params(problem, out, lse);
    p.run = AttnRunDims{problem.Hq, problem.Hkv, problem.D, problem.causal, info.q_rows, info.n_kv, info.block_size,
                        C, info.table_elems, info.part_floats, info.metadata_hash};
    launch_forward(c, p, dplan.data_ptr<int64_t>(), dtable.defined() ? dtable.data_ptr<int32_t>() : nullptr,
                   part.data_ptr<float>(), info.n_items, info.n_blocks);
    // dplan, dtable, part: stream-ordered frees
  }

  // The run forms: the plan buffers are already on the device; launches only, with grids = their capacity
  // (fixed for every plan of that capacity: a captured graph replays whatever plan was written before). No
  // copy, no host read, no allocation but the capacity-sized partials. The call was checked against the host
  // info; the kernels check the device header against `run` (a buffer holding another plan: NaN rows + the
  // error word, never unwritten rows).
  static void attention_forward_planned(const Call& c, const AttnProblem& problem, const AttnPlanInfo& info,
                                        const at::Tensor& plan, const at::Tensor& table, int64_t workspace_floats,
                                        const AttnRunDims& run, void* out, float* lse) {
    (void)info;
    const int64_t grid = std::max<int64_t>(run.capacity, 1);  // a merge block even then: it writes NaN on a misfit
    gpu::AttnFwdParams p = forward_params(problem, out, lse);
    p.run = run;
    // the split partials: a capacity-sized buffer (stream-ordered caching allocator; inside a graph capture, the
    // graph's pool at a fixed address)
    const at::Tensor part = at::empty({std::max<int64_t>(1, workspace_floats)}, c.first.options().dtype(at::kFloat));
    launch_forward(c, p, plan.data_ptr<int64_t>(), table.numel() ? table.data_ptr<int32_t>() : nullptr,
                   part.data_ptr<float>(), grid, grid);
  }

  // _attention_mma_reference / _attention_mma_backward_reference: the emulated devices' scalar references with the
  // arch's unit model; a GPU refuses.
  static void attention_mma_reference(const Call& c, const AttnProblem& problem, const int32_t* cu_q,
                                      const int32_t* cu_k, int64_t n_seqs, void* out, float* lse) {
    Device::attention_mma_reference(c.op, problem, cu_q, cu_k, n_seqs, out, lse);
  }
  static void attention_mma_backward_reference(const Call& c, const AttnBackwardRun& r, const int32_t* cu_q,
                                               const int32_t* cu_k, int64_t n_seqs) {
    Device::attention_mma_backward_reference(c.op, r, cu_q, cu_k, n_seqs);
  }

  // The backward: delta per row, dq per row block, dk/dv per key tile (the plan's), every gradient element one
  // fma chain in attention.h's order (mma profile: attention_mma.h's chains); the records (row blocks, then key
  // tiles) uploaded in one copy.

  static void attention_backward(const Call& c, const AttnBackwardRun& r) {
    const AttnProblem& f = r.problem;
    const AttnPlan& plan = *r.plan;
    TORCH_CHECK(f.D <= gpu::kGpuAttnMaxDWide, "aligned::", c.op, ": head_dim must be <= ", gpu::kGpuAttnMaxDWide,
                " on the GPU, got ", f.D);
    std::vector<int64_t> work(plan.blocks);
    work.insert(work.end(), plan.key_tiles.begin(), plan.key_tiles.end());
    const at::Tensor dwork = Device::upload(work.data(), (int64_t)work.size(), at::kLong, c.first);
    gpu::AttnBwdParams p{};
    static_cast<AttnProblem&>(p.f) = f;
    p.f.n_blocks = plan.info.n_blocks;
    p.f.blocks = dwork.data_ptr<int64_t>();
    p.tiles = p.f.blocks + p.f.n_blocks * kAttnWorkFields;
    p.n_tiles = (int64_t)plan.key_tiles.size() / kAttnWorkFields;
    p.dout = r.grad_out.data_ptr();
    p.out = r.out.data_ptr();
    p.lse = r.lse.data_ptr<float>();
    p.delta = r.delta.data_ptr<float>();
    p.dq = r.dq.data_ptr();
    p.dk = r.dk.data_ptr();
    p.dv = r.dv.data_ptr();
    p.rows = r.q.size(0) * r.q.size(1);
    c.launched(Device::attention().attention_backward(p, c.stream()));
  }

  // slots: host metadata (already range-checked by the body) is uploaded; a device slot mapping is not read by
  // the host (the kernel skips any slot outside the cache).
  static void cache_write(const Call& c, DType dt, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& slots) {
    const at::Tensor dslots = slots.device().is_cpu()  // host metadata (under emulation too: a recorded copy)
                                  ? Device::upload(slots.data_ptr<int64_t>(), slots.numel(), at::kLong, c.first)
                                  : slots;
    gpu::CacheWriteParams p{};
    p.dt = dt;
    p.k = k.data_ptr();
    p.v = v.defined() ? v.data_ptr() : nullptr;  // undefined v / v_cache: one cache (MLA's latent row)
    p.k_cache = k_cache.data_ptr();
    p.v_cache = v_cache.defined() ? v_cache.data_ptr() : nullptr;
    p.slots = dslots.data_ptr<int64_t>();
    p.T = k.size(0);
    p.row_elems = k.size(1) * k.size(2);
    p.n_slots = k_cache.size(0) * k_cache.size(1);
    c.launched(Device::attention().cache_write(p, c.stream()));
  }

  // attention_plan: the plan written into the device buffers — the header and items in one stream-ordered copy,
  // the blocks in a second, the table in a third; once per step, never in a run.
  static void write_plan(const Call& c, const at::Tensor& plan, const at::Tensor& table, const AttnPlan& p) {
    (void)c;
    std::vector<int64_t> head = attn_plan_header(p.info);
    head.insert(head.end(), p.items.begin(), p.items.end());
    Device::copy_into(plan, 0, head.data(), (int64_t)head.size());
    Device::copy_into(plan, attn_plan_blocks_offset(attn_plan_capacity(plan.size(0))), p.blocks.data(),
                      (int64_t)p.blocks.size());
    Device::copy_into(table, 0, p.table.data(), (int64_t)p.table.size());
  }

 private:
  static constexpr int64_t ceil_to(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

  static at::Tensor routing_scratch(const Call& c, const MoeTopkParams& p, int64_t n_group) {
    const int64_t n = gpu::moe_routing_scratch_floats(p.T, p.E, p.k, n_group);
    return at::empty({std::max<int64_t>(n, 1)}, c.first.options().dtype(at::kFloat));
  }

  static void exact_row_forms(const Call& c, DType dt, const at::Tensor& v, int64_t rows, int64_t K, at::Tensor& E,
                              at::Tensor& S, at::Tensor& bad) {
    gpu::ExactFormsParams f{};
    f.dt = dt;
    f.v = v.data_ptr();
    f.rows = rows;
    f.K = K;
    f.E = E.data_ptr<int32_t>();
    f.S = S.data_ptr<int8_t>();
    f.bad = bad.data_ptr<uint8_t>();
    c.launched(Device::exact().exact_row_forms(f, c.stream()));
  }

  static void exact_pack(const Call& c, DType dt, const at::Tensor& v, int64_t rows, int64_t K, int64_t Kp,
                         const at::Tensor& E, const at::Tensor* S, int fixed_digits, at::Tensor& out) {
    gpu::ExactPackParams p{};
    p.dt = dt;
    p.v = v.data_ptr();
    p.rows = rows;
    p.K = K;
    p.Kp = Kp;
    p.plane = out.size(1) * (out.dim() == 3 ? out.size(2) : 1);
    p.E = E.data_ptr<int32_t>();
    p.S = S ? S->data_ptr<int8_t>() : nullptr;
    p.fixed_digits = fixed_digits;
    p.weight_layout = S == nullptr;
    p.out = out.data_ptr<int8_t>();
    c.launched(Device::exact().exact_pack_digits(p, c.stream()));
  }

  static gpu::AttnFwdParams forward_params(const AttnProblem& problem, void* out, float* lse) {
    gpu::AttnFwdParams p{};
    static_cast<AttnProblem&>(p) = problem;
    p.out = out;
    p.lse = lse;
    return p;
  }

  // A forward over a plan buffer already on the device: out [Tq, Hq, D] (q dtype), lse [Tq, Hq] fp32.
  // grid_items / grid_blocks: the planned form passes the capacity (fixed launches), the per-call form the counts
  // it knows from its own plan.
  static void launch_forward(const Call& c, gpu::AttnFwdParams p, const int64_t* plan, const int32_t* table,
                             float* part, int64_t grid_items, int64_t grid_blocks) {
    TORCH_CHECK(p.D <= gpu::kGpuAttnMaxDWide, "aligned::", c.op, ": head_dim must be <= ", gpu::kGpuAttnMaxDWide,
                " on the GPU, got ", p.D);
    const int64_t C = p.run.capacity;
    p.plan_header = plan;
    p.items = plan + kAttnPlanHeaderRows * kAttnWorkFields;
    p.blocks = plan + (kAttnPlanHeaderRows + C) * kAttnWorkFields;
    p.block_tables = table;
    p.part = part;
    p.n_items = grid_items;
    p.n_blocks = grid_blocks;
    p.error_flags = Device::error_flags(c.first);
    c.launched(Device::attention().attention_forward(p, c.stream()));
  }
};

}  // namespace aligned::glue
