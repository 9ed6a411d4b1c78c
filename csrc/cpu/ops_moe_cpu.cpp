// ops_moe_cpu.cpp — torch glue of the moe family on the CPU: device checks, then the family's argument checks
// (../moe_checks.h, shared with any backend), the grouping of tokens by
// expert, the params structs (csrc/common/params_moe.h, filled by ../op_params.h), and the thread split.
// Arithmetic: csrc/common/moe.h (routing, combine, the shared gate) via moe_kernels.cpp, and the
// expert projections through the linear profile's GEMM — cpu_kernels().gemm (aligned::linear, `fma`) or the mma
// unit's (aligned::linear_mma, `mma`), chosen by the op's linear_profile argument.
//
// moe_experts, how a batch runs (none of it can change a token's bits):
//   1. assignments (token t, rank r) are sorted by expert, tokens in order inside an expert (counting sort);
//   2. per expert (experts side by side on the threads): its tokens' rows are gathered, h = gemm(x_e, w13[e]) rounded to T, a = silu_and_mul(h),
//      y = gemm(a, w2[e]) kept in fp32 (one row per assignment) — every gemm output element is one chain of
//      the linear contract over its own row, so the rows an expert happens to hold do not matter;
//   3. the shared expert (if any) runs the same three steps on all tokens, its gate one gemm column;
//   4. combine per token in rank order (moe.h), rounded once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string.h>

#include <string>
#include <vector>

#include "../common/moe.h"
#include "../moe_checks.h"
#include "../op_params.h"
#include "cpu_backend.h"
#include "gemm_tiles.h"
#include "glue_checks.h"
#include "moe_kernels.h"

namespace aligned::cpu {


namespace {

int64_t grain(int64_t work_per_row) { return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(work_per_row, 1)); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_routing(const at::Tensor& logits, int64_t top_k,
                                                           c10::string_view scoring, bool renormalize) {
  const char* op = "moe_routing";
  check_cpu(logits, op, "router_logits");
  const DType dt = check_moe_routing<DType>(logits, top_k, op);
  const MoeScoring sc = check_moe_scoring(std::string(scoring), op);
  const int64_t T = logits.size(0), E = logits.size(1);
  auto z = logits.contiguous();
  auto f32 = z.options().dtype(at::kFloat);
  auto scores = at::empty({T, E}, f32);
  auto w = at::empty({T, top_k}, f32);
  auto ids = at::empty({T, top_k}, z.options().dtype(at::kLong));
  const auto p = make_moe_routing_params(dt, z, top_k, sc, renormalize, ids, scores, w, {}, {}, {});
  const auto& k = moe_kernels();
  at::parallel_for(0, T, grain(E * 8), [&](int64_t b, int64_t e) { k.routing(p, b, e); });
  return {w, ids, scores};
}

at::Tensor moe_routing_backward(const at::Tensor& grad_w, const std::optional<at::Tensor>& grad_scores,
                                const at::Tensor& logits, const at::Tensor& ids, c10::string_view scoring,
                                bool renormalize) {
  const char* op = "moe_routing_backward";
  check_cpu(logits, op, "router_logits");
  check_cpu(ids, op, "topk_ids");
  check_cpu(grad_w, op, "grad_weights");
  if (grad_scores.has_value() && grad_scores->defined()) check_cpu(*grad_scores, op, "grad_scores");
  const DType dt = check_router_logits<DType>(logits, op);
  const MoeScoring sc = check_moe_scoring(std::string(scoring), op);
  const int64_t T = logits.size(0), E = logits.size(1);
  auto idc = check_topk_ids(ids, T, E, op);
  const int64_t k = idc.size(1);
  auto gw = check_moe_grad_weights(grad_w, T, k, op);
  auto gs = check_moe_grad_scores(grad_scores, logits, op);
  auto z = logits.contiguous();
  auto dz = at::empty_like(z);
  const auto p = make_moe_routing_params(dt, z, k, sc, renormalize, idc, {}, {}, gw, gs, dz);
  const auto& kk = moe_kernels();
  at::parallel_for(0, T, grain(E * 8), [&](int64_t b, int64_t e) { kk.routing_backward(p, b, e); });
  return dz;
}

// The experts' GEMM of the linear profile (moe.h: every projection is the profile's linear): the fma table's
// kernel, or the mma unit's (bf16 only; refused by name without the unit). Both take the same params.
GemmFn experts_gemm(c10::string_view profile, const MoeExpertsArgs<DType>& a, const char* op) {
  if (profile == "fma") return cpu_kernels().gemm;
  TORCH_CHECK(profile == "mma", "aligned::", op, ": linear_profile must be 'fma' or 'mma', got '", std::string(profile),
              "'");
  TORCH_CHECK(a.dt == DType::BF16, "aligned::", op, ": the mma profile's experts take bfloat16 (float32 / float16 "
              "models run ALIGNED_OPS_LINEAR=fma), got x ", a.x.scalar_type());
  const MmaKernels* unit = cpu_backend().mma;
  TORCH_CHECK(unit != nullptr, "aligned::", op, ": mma needs avx512_bf16; use ALIGNED_OPS_LINEAR=fma (this CPU backend "
              "runs the '", cpu_backend().level, "' level without the bf16 dot-product unit)");
  return unit->gemm;
}

// One expert MLP over M gathered rows: y [M, H] fp32 = gemm(silu_and_mul(round_T(gemm(x, w13))), w2).
void expert_mlp(GemmFn gemm, DType dt, const void* x, const void* w13, const void* w2, int64_t M, int64_t H, int64_t I,
                void* h, void* a, float* y) {
  if (M == 0) return;
  run_gemm_tiles(row_major_gemm_params(dt, x, w13, dt, h, M, 2 * I, H, kLinearLanes), gemm);
  const auto act = silu_and_mul_rows_params(dt, h, a, M, I);
  const auto& k = cpu_kernels();
  at::parallel_for(0, M, grain(8 * I), [&](int64_t b, int64_t e) { k.silu_and_mul(act, b, e); });
  run_gemm_tiles(row_major_gemm_params(dt, a, w2, DType::F32, y, M, H, I, kLinearLanes), gemm);
}

using ExpertsArgs = MoeExpertsArgs<DType>;

ExpertsArgs check_experts(const at::Tensor& x, const at::Tensor& tw, const at::Tensor& ids, const at::Tensor& w13,
                          const at::Tensor& w2, const std::optional<at::Tensor>& sw13,
                          const std::optional<at::Tensor>& sw2, const std::optional<at::Tensor>& sgate,
                          const char* op) {
  check_cpu(x, op, "x");
  check_cpu(tw, op, "topk_weights");
  check_cpu(ids, op, "topk_ids");
  check_cpu(w13, op, "w13");
  check_cpu(w2, op, "w2");
  if (sw13.has_value() && sw13->defined()) check_cpu(*sw13, op, "shared_w13");
  if (sw2.has_value() && sw2->defined()) check_cpu(*sw2, op, "shared_w2");
  if (sgate.has_value() && sgate->defined()) check_cpu(*sgate, op, "shared_gate");
  return check_moe_experts<DType>(x, tw, ids, w13, w2, sw13, sw2, sgate, op);
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& tw, const at::Tensor& ids, const at::Tensor& w13,
                       const at::Tensor& w2, const std::optional<at::Tensor>& sw13,
                       const std::optional<at::Tensor>& sw2, const std::optional<at::Tensor>& sgate,
                       c10::string_view linear_profile) {
  const auto a = check_experts(x, tw, ids, w13, w2, sw13, sw2, sgate, "moe_experts");
  const GemmFn gemm = experts_gemm(linear_profile, a, "moe_experts");
  const int64_t T = a.T, H = a.H, k = a.k, E = a.E, I = a.I, N = T * k;
  const size_t es = a.x.element_size();
  auto out = at::empty({T, H}, a.x.options());
  if (T == 0) return out;
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
    at::parallel_for(0, N, 256, [&](int64_t b, int64_t e) {
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
    at::parallel_for(0, (int64_t)busy.size(), 1, [&](int64_t b, int64_t en) {
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
      run_gemm_tiles(row_major_gemm_params(a.dt, a.x.data_ptr(), a.sgate.data_ptr(), DType::F32, g.data_ptr(), T, 1,
                                           H, kLinearLanes),
                     gemm);  // the gate's logit; combine applies moe_shared_gate
    }
  }
  // 4. combine, per token
  const auto cp = make_moe_combine_params(a.dt, y, pos, a.w, ys, g, out);
  const auto& mk = moe_kernels();
  at::parallel_for(0, T, grain(k * H), [&](int64_t b, int64_t e) { mk.combine(cp, b, e); });
  return out;
}

at::Tensor moe_experts_reference(const at::Tensor& x, const at::Tensor& tw, const at::Tensor& ids,
                                 const at::Tensor& w13, const at::Tensor& w2, const std::optional<at::Tensor>& sw13,
                                 const std::optional<at::Tensor>& sw2, const std::optional<at::Tensor>& sgate) {
  const auto a = check_experts(x, tw, ids, w13, w2, sw13, sw2, sgate, "_moe_experts_reference");
  auto out = at::empty({a.T, a.H}, a.x.options());
  const auto p = make_moe_experts_params(a.dt, a.x, a.w, a.ids, a.w13, a.w2, a.sw13, a.sw2, a.sgate, out);
  const auto& mk = moe_kernels();
  at::parallel_for(0, a.T, 1, [&](int64_t b, int64_t e) { mk.experts_reference(p, b, e); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(aligned, CPU, m) {
  m.impl("moe_routing", &moe_routing);
  m.impl("moe_routing_backward", &moe_routing_backward);
  m.impl("moe_experts", &moe_experts);
  m.impl("_moe_experts_reference", &moe_experts_reference);
}

}  // namespace aligned::cpu
