// cpu_moe.cpp — the CPU backend's runs of the moe family: the thread split of routing, the grouping of tokens by
// expert, and the expert projections through the linear profile's GEMM kernel — the `fma` table's
// (cpu_kernels().gemm, aligned::linear's) or the mma unit's (aligned::linear_mma's), by the op's linear_profile. Arithmetic: csrc/common/moe.h (routing, combine, the shared gate) via csrc/cpu/moe_kernels.cpp.
// Also the CPU key's registration of the families (register_cpu.cpp; Moe with the emulated GPUs, whose runs are
// backends/gpu.h's).
//
// moe_experts, how a batch runs (none of it can change a token's bits):
//   1. assignments (token t, rank r) are sorted by expert, tokens in order inside an expert (counting sort);
//   2. per expert (experts side by side on the threads): its tokens' rows are gathered, h = gemm(x_e, w13[e])
//      rounded to T, a = silu_and_mul(h), y = gemm(a, w2[e]) kept in fp32 (one row per assignment) — every gemm
//      output element is one chain of the linear contract over its own row, so the rows an expert happens to
//      hold do not matter;
//   3. the shared expert (if any) runs the same three steps on all tokens, its gate one gemm column;
//   4. combine per token in rank order (moe.h), rounded once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string.h>

#include <algorithm>
#include <vector>

#include "../../common/moe.h"
#include "../../cpu/cpu_backend.h"
#include "../../cpu/cpu_kernels.h"
#include "../../cpu/gemm_tiles.h"
#include "../../cpu/moe_kernels.h"
#include "../glue/moe.h"
#include "../make_params.h"
#include "../registration_impl.h"
#include "cpu.h"
#include "emulated.h"
#include "gpu.h"

namespace aligned::glue {

using cpu::cpu_kernels;
using cpu::moe_kernels;

namespace {

int64_t grain(int64_t work_per_row) { return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(work_per_row, 1)); }

// The experts' GEMM of the linear profile (moe.h: every projection is the profile's linear): the fma table's
// kernel, or the mma unit's (refused by name without the unit). Both take the same params; gemm_tiles.h spreads
// one over threads (tiles only choose which chains a thread runs).
cpu::GemmFn experts_gemm(ExpertsLinear linear, const char* op) {
  if (linear == ExpertsLinear::kFma) return cpu_kernels().gemm;
  const cpu::CpuBackend& b = cpu::cpu_backend();
  TORCH_CHECK(b.mma != nullptr, "aligned::", op, ": mma needs avx512_bf16; use ALIGNED_OPS_LINEAR=fma (this CPU ",
              "backend runs the '", b.level, "' level without the bf16 dot-product unit)");
  return b.mma->gemm;
}

// One expert MLP over M gathered rows: y [M, H] fp32 = gemm(silu_and_mul(round_T(gemm(x, w13))), w2).
void expert_mlp(cpu::GemmFn gemm, DType dt, const void* x, const void* w13, const void* w2, int64_t M, int64_t H,
                int64_t I, void* h, void* a, float* y) {
  if (M == 0) return;
  cpu::run_gemm_tiles(row_major_gemm_params(dt, x, w13, dt, h, M, 2 * I, H, kLinearLanes), gemm);
  const auto act = silu_and_mul_rows_params(dt, h, a, M, I);
  const auto& k = cpu_kernels();
  cpu::ieee_parallel_for(0, M, grain(8 * I), [&](int64_t b, int64_t e) { k.silu_and_mul(act, b, e); });
  cpu::run_gemm_tiles(row_major_gemm_params(dt, a, w2, DType::F32, y, M, H, I, kLinearLanes), gemm);
}

}  // namespace

void Cpu::moe_routing(const Call&, const MoeRoutingParams& p) {
  const auto& k = moe_kernels();
  cpu::ieee_parallel_for(0, p.T, grain(p.E * 8), [&](int64_t b, int64_t e) { k.routing(p, b, e); });
}

void Cpu::moe_routing_backward(const Call&, const MoeRoutingParams& p) {
  const auto& kk = moe_kernels();
  cpu::ieee_parallel_for(0, p.T, grain(p.E * 8), [&](int64_t b, int64_t e) { kk.routing_backward(p, b, e); });
}

void Cpu::moe_grouped_routing(const Call&, const MoeGroupedRoutingParams& p) {
  const auto& kk = moe_kernels();
  cpu::ieee_parallel_for(0, p.T, grain(p.E * 16), [&](int64_t b, int64_t e) { kk.grouped_routing(p, b, e); });
}

void Cpu::moe_grouped_routing_backward(const Call&, const MoeGroupedRoutingParams& p) {
  const auto& kk = moe_kernels();
  cpu::ieee_parallel_for(0, p.T, grain(p.E * 8), [&](int64_t b, int64_t e) { kk.grouped_routing_backward(p, b, e); });
}

void Cpu::moe_experts(const Call& call, const MoeExpertsRun& r) {
  const auto& a = r.a;
  const cpu::GemmFn gemm = experts_gemm(r.linear, call.op);
  const at::Tensor& out = r.out;
  const int64_t T = a.T, H = a.H, k = a.k, E = a.E, I = a.I, N = T * k;
  const size_t es = a.x.element_size();
  // 1. counting sort of the assignments by expert (token order, then rank order, inside an expert)
  const int64_t* id = a.ids.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t i = 0; i < N; ++i) start[id[i] + 1]++;
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1), src_token(N);
  auto pos = at::empty({T, k}, a.ids.options());
  int64_t* ps = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) {
    const int64_t slot = fill[id[i]]++;
    src_token[slot] = i / k;
    ps[i] = slot;
  }
  // 2. gather rows, then per expert (only experts with tokens) the MLP
  auto opts = a.x.options();
  auto xg = at::empty({N, H}, opts);
  {
    const char* xs = (const char*)a.x.data_ptr();
    char* xd = (char*)xg.data_ptr();
    cpu::ieee_parallel_for(0, N, 256, [&](int64_t b, int64_t e) {
      for (int64_t s = b; s < e; ++s) memcpy(xd + s * H * es, xs + src_token[s] * H * es, H * es);
    });
  }
  // Experts run side by side (one task per expert with tokens, each its two gemms + silu_and_mul on one thread):
  // decode and small prefill batches give an expert a few rows only, too little to split one gemm across threads.
  auto hbuf = at::empty({N, 2 * I}, opts), abuf = at::empty({N, I}, opts);
  auto y = at::empty({N, H}, opts.dtype(at::kFloat));
  const char* w13p = (const char*)a.w13.data_ptr();
  const char* w2p = (const char*)a.w2.data_ptr();
  std::vector<int64_t> busy;
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) busy.push_back(e);  // an expert with no tokens costs nothing
  {
    const auto& ck = cpu_kernels();  // silu_and_mul; the projections: `gemm`, the profile's
    char* xg0 = (char*)xg.data_ptr();
    char* h0 = (char*)hbuf.data_ptr();
    char* a0 = (char*)abuf.data_ptr();
    float* y0 = y.data_ptr<float>();
    cpu::ieee_parallel_for(0, (int64_t)busy.size(), 1, [&](int64_t b, int64_t en) {
      for (int64_t i = b; i < en; ++i) {
        const int64_t e = busy[i], r0 = start[e], m = start[e + 1] - start[e];
        char* xe = xg0 + r0 * H * es;
        char* he = h0 + r0 * 2 * I * es;
        char* ae = a0 + r0 * I * es;
        gemm(row_major_gemm_params(a.dt, xe, w13p + e * 2 * I * H * es, a.dt, he, m, 2 * I, H, kLinearLanes), 0, m, 0,
             2 * I);
        ck.silu_and_mul(silu_and_mul_rows_params(a.dt, he, ae, m, I), 0, m);
        gemm(row_major_gemm_params(a.dt, ae, w2p + e * H * I * es, DType::F32, y0 + r0 * H, m, H, I, kLinearLanes), 0,
             m, 0, H);
      }
    });
  }
  // 3. shared expert on every token, and its gate
  at::Tensor ys, g;
  if (a.sw13.defined()) {
    ys = at::empty({T, H}, opts.dtype(at::kFloat));
    auto hs = at::empty({T, 2 * a.Is}, opts), as = at::empty({T, a.Is}, opts);
    expert_mlp(gemm, a.dt, a.x.data_ptr(), a.sw13.data_ptr(), a.sw2.data_ptr(), T, H, a.Is, hs.data_ptr(), as.data_ptr(),
               ys.data_ptr<float>());
    if (a.sgate.defined()) {
      g = at::empty({T}, opts.dtype(at::kFloat));
      cpu::run_gemm_tiles(row_major_gemm_params(a.dt, a.x.data_ptr(), a.sgate.data_ptr(), DType::F32, g.data_ptr(), T,
                                                1, H, kLinearLanes),
                          gemm);  // the gate's logit; combine applies moe_shared_gate
    }
  }
  // 4. combine, per token
  const auto cp = make_moe_combine_params(a.dt, y, pos, a.w, ys, g, out);
  const auto& mk = moe_kernels();
  cpu::ieee_parallel_for(0, T, grain(k * H), [&](int64_t b, int64_t e) { mk.combine(cp, b, e); });
}

void Cpu::moe_experts_reference(const Call&, const MoeExpertsParams& p) {
  const auto& mk = moe_kernels();
  cpu::ieee_parallel_for(0, p.T, 1, [&](int64_t b, int64_t e) { mk.experts_reference(p, b, e); });
}

// ---- the CPU key's registration of the family (register_cpu.cpp) --------------------------------------------
template void register_family<Moe, Cpu, EmulatedCuda, EmulatedHip>(torch::Library&);
template void register_family<MoeReference, Cpu>(torch::Library&);

}  // namespace aligned::glue
