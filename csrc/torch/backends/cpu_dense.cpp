// cpu_dense.cpp — the CPU backend's runs of the dense, logits, fma-linear and hook families: which rows, columns
// or output tiles each call of the torch-free kernels (csrc/cpu/cpu_kernels.cpp, gemm_kernels.cpp,
// dense_split_kernels.h) computes, spread over torch's intra-op threads. No arithmetic: every formula and fold
// is the kernels'. Also the CPU key's registrations of these families (register_cpu.cpp), instantiated here.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../../common/contract.h"
#include "../../common/reduce.h"
#include "../../cpu/cpu_backend.h"
#include "../glue/dense.h"
#include "../glue/hooks.h"
#include "../glue/linear.h"
#include "../glue/logits.h"
#include "../registration_impl.h"
#include "cpu.h"
#include "emulated.h"
#include "gpu.h"

namespace aligned::glue {

using cpu::cpu_kernels;
using cpu::dense_split_kernels;

namespace {

// Fewer rows than threads: the threads share each row (dense_split_kernels.h says why no bit changes).
bool split_rows(int64_t rows, int64_t row_len, int64_t min_len) {
  return rows < at::get_num_threads() && row_len >= min_len && !at::in_parallel_region();
}

// Rows per task: enough work per task that threading pays, never affects results.
int64_t grain(int64_t work_per_row) { return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(work_per_row, 1)); }

// Rows shorter than this never share threads (the fork/join would cost more than it saves).
constexpr int64_t kSplitMinVocab = 8192;

// The (m, L) pair of row r with all threads on the one row (dense_split_kernels.h): s = z / tau into s_row
// (v ranges in parallel), the parts' maxima folded, then the 32 lane sums of reduce.h in lane groups, folded.
LsePair lse_pair_split(const LogitsParams& p, int64_t r, float* s_row) {
  const auto& sk = dense_split_kernels();
  const int64_t parts = at::get_num_threads();
  const int64_t part = ((p.V + parts - 1) / parts + kReduceLanes - 1) / kReduceLanes * kReduceLanes;
  std::vector<float> mx(parts, -std::numeric_limits<float>::infinity());  // an empty part: the fold's identity
  std::vector<int32_t> flags(parts, 0);
  cpu::ieee_parallel_for(0, parts, 1, [&](int64_t b, int64_t e) {
    for (int64_t q = b; q < e; ++q) {
      const int64_t v0 = q * part, v1 = std::min(p.V, v0 + part);
      if (v0 < v1) sk.scale_max(p, r, s_row, v0, v1, &mx[q], &flags[q]);
    }
  });
  float m;
  LsePair special;
  if (sk.merge_max(mx.data(), flags.data(), parts, &m, &special)) return special;
  float lanes[kReduceLanes];
  const int groups = parts >= 4 ? 4 : 2, width = kReduceLanes / groups;
  cpu::ieee_parallel_for(0, groups, 1, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) sk.lane_exp_sums(s_row, p.V, m, (int)g * width, (int)(g + 1) * width, lanes);
  });
  return sk.pair_of_lanes(m, lanes);
}

// Every row's (m, L) pair into p.pairs (fp32 [T, 2]), and its logsumexp into p.lse when set.
void lse_pairs_of(const LogitsParams& p) {
  if (split_rows(p.T, p.V, kSplitMinVocab)) {
    const auto& sk = dense_split_kernels();
    std::vector<float> s((size_t)p.V);
    for (int64_t r = 0; r < p.T; ++r) sk.store_pair(p, r, lse_pair_split(p, r, s.data()));
    return;
  }
  const auto& k = cpu_kernels();
  cpu::ieee_parallel_for(0, p.T, grain(p.V * 4), [&](int64_t b, int64_t e) { k.logsumexp_pairs(p, b, e); });
}

// p with its pairs pointing at `scratch` ([T, 2] fp32) when the op does not return them.
LogitsParams with_pairs(const LogitsParams& p, std::vector<float>& scratch) {
  LogitsParams q = p;
  if (!q.pairs) {
    scratch.resize((size_t)(2 * std::max<int64_t>(p.T, 1)));
    q.pairs = scratch.data();
  }
  return q;
}

// The three backwards are one kernel switched on p.mode (contract.h: which gradient). Few rows -> the pairs with
// the threads sharing each row first, then the elementwise part per row; otherwise pairs == nullptr: the kernel
// computes each row's pair in the same pass.
void logits_backward(const LogitsParams& p) {
  std::vector<float> scratch;
  const LogitsParams q = split_rows(p.T, p.V, kSplitMinVocab) ? with_pairs(p, scratch) : p;
  if (q.pairs) lse_pairs_of(q);
  const auto& k = cpu_kernels();
  cpu::ieee_parallel_for(0, q.T, grain(q.V * 4), [&](int64_t b, int64_t e) { k.logits_backward(q, b, e); });
}

// Threads take contiguous runs of 32-column output panels over all rows (each thread packs its own part of
// B once per row block); when there are too few panels to keep every thread busy, the rows are split as
// well. Tiles only choose which fma chains a thread runs (contract.h: linear), never how one is summed.
constexpr int64_t kPanelN = 32;

}  // namespace

// ---- dense -------------------------------------------------------------------------------------------------
void Cpu::rms_norm(const Call&, const RmsNormParams& p) {
  const auto& k = cpu_kernels();
  cpu::ieee_parallel_for(0, p.rows, grain(p.H), [&](int64_t b, int64_t e) { k.rms_norm(p, b, e); });
}

void Cpu::fused_add_rms_norm(const Call&, const RmsNormParams& p) {
  const auto& k = cpu_kernels();
  cpu::ieee_parallel_for(0, p.rows, grain(p.H), [&](int64_t b, int64_t e) { k.fused_add_rms_norm(p, b, e); });
}

void Cpu::rms_norm_backward(const Call&, const RmsNormBackwardParams& p) {
  const auto& k = cpu_kernels();
  cpu::ieee_parallel_for(0, p.rows, grain(2 * p.H), [&](int64_t b, int64_t e) {
    k.rms_inv_rows(p, b, e);
    k.rms_norm_backward_dx(p, b, e);
  });
  // dw: columns split across threads, each column sums the rows in order.
  cpu::ieee_parallel_for(0, p.H, 16, [&](int64_t b, int64_t e) { k.rms_norm_backward_dw(p, b, e); });
}

void Cpu::silu_and_mul(const Call&, const SiluMulParams& p) {
  const int64_t d = p.d, rows = p.rows;
  constexpr int64_t kCols = 2048;  // elementwise: any column cut gives the same bits
  if (rows > 0 && split_rows(rows, d, 2 * kCols)) {
    const int64_t chunks = (d + kCols - 1) / kCols;
    const auto& sk = dense_split_kernels();
    cpu::ieee_parallel_for(0, rows * chunks, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const int64_t r = t / chunks, c0 = (t % chunks) * kCols;
        sk.silu_and_mul_cols(p, r, c0, std::min(d, c0 + kCols));
      }
    });
    return;
  }
  const auto& k = cpu_kernels();
  cpu::ieee_parallel_for(0, rows, grain(8 * d), [&](int64_t b, int64_t e) { k.silu_and_mul(p, b, e); });
}

void Cpu::silu_and_mul_backward(const Call&, const SiluMulParams& p) {
  const auto& k = cpu_kernels();
  cpu::ieee_parallel_for(0, p.rows, grain(16 * p.d), [&](int64_t b, int64_t e) { k.silu_and_mul_backward(p, b, e); });
}

void Cpu::rotary(const Call&, const RotaryParams& p) {
  const auto& k = cpu_kernels();
  cpu::ieee_parallel_for(0, p.T, grain(p.heads * p.head_dim * 4), [&](int64_t b, int64_t e) { k.rotary(p, b, e); });
}

// ---- logits ------------------------------------------------------------------------------------------------
void Cpu::logsumexp(const Call&, const LogitsParams& p) {
  std::vector<float> scratch;
  lse_pairs_of(with_pairs(p, scratch));
}

void Cpu::log_softmax(const Call&, const LogitsParams& p) {
  if (split_rows(p.T, p.V, kSplitMinVocab)) {
    const auto& sk = dense_split_kernels();
    for (int64_t r = 0; r < p.T; ++r) {
      const LsePair pair = lse_pair_split(p, r, p.out_f32 + r * p.V);  // leaves s = z / tau in the output row
      cpu::ieee_parallel_for(0, p.V, 8192, [&](int64_t b, int64_t e) { sk.logp_cols(p, r, pair, b, e); });
    }
    return;
  }
  const auto& k = cpu_kernels();
  // pairs == nullptr: the kernel computes each row's pair itself, writing z / tau into the output row first.
  cpu::ieee_parallel_for(0, p.T, grain(p.V * 4), [&](int64_t b, int64_t e) { k.log_softmax(p, b, e); });
}

void Cpu::token_logprobs(const Call&, const LogitsParams& p) {
  std::vector<float> scratch;
  const LogitsParams q = with_pairs(p, scratch);
  lse_pairs_of(q);
  const auto& k = cpu_kernels();
  cpu::ieee_parallel_for(0, q.T, 1024, [&](int64_t b, int64_t e) { k.token_logprobs(q, b, e); });
}

void Cpu::token_logprobs_backward(const Call&, const LogitsParams& p) { logits_backward(p); }
void Cpu::logsumexp_backward(const Call&, const LogitsParams& p) { logits_backward(p); }
void Cpu::log_softmax_backward(const Call&, const LogitsParams& p) { logits_backward(p); }

void Cpu::token_logprobs_backward_cols(const Call&, const LogitsParams& p) {
  const auto& k = cpu_kernels();
  cpu::ieee_parallel_for(0, p.T, grain(p.V * 4),
                         [&](int64_t b, int64_t e) { k.token_logprobs_backward_cols(p, b, e); });
}

// ---- the fma linear ----------------------------------------------------------------------------------------
void Cpu::gemm(const Call&, const GemmParams& p) {
  const int64_t M = p.M, N = p.N, K = p.K;
  if (M <= 0 || N <= 0) return;
  const int64_t panels = (N + kPanelN - 1) / kPanelN;
  const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
  int64_t mchunk = M;
  if (panels < 2 * nt && M > 16) mchunk = std::max<int64_t>(16, ((M + 2 * nt - 1) / (2 * nt) + 7) / 8 * 8);
  const int64_t mt = (M + mchunk - 1) / mchunk;
  const auto& k = cpu_kernels();
  // Enough work per task that threading pays: ~2^18 fma per task at least.
  const int64_t per_panel = std::max<int64_t>(1, std::min(M, mchunk) * kPanelN * std::max<int64_t>(K, 1));
  const int64_t grain_tasks = std::max<int64_t>(1, (1 << 18) / per_panel);
  cpu::ieee_parallel_for(0, mt * panels, grain_tasks, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e;) {
      const int64_t mi = t / panels, p0 = t % panels, p1 = std::min(panels, p0 + (e - t));
      k.gemm(p, mi * mchunk, std::min(M, (mi + 1) * mchunk), p0 * kPanelN, std::min(N, p1 * kPanelN));
      t += p1 - p0;
    }
  });
}

void Cpu::column_sum(const Call&, const ColumnSumParams& p) {
  const auto& k = cpu_kernels();
  cpu::ieee_parallel_for(0, p.cols, 64, [&](int64_t b, int64_t e) { k.column_sum(p, b, e); });
}

// contract.h's scalar linear_partial_dot, one call per output (A, B row-major: the body made them contiguous).
void Cpu::linear_partial_reference(const Call&, const GemmParams& p) {
  float* o = (float*)p.C;
  with_type(p.adt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    const T* xp = (const T*)p.A;
    const T* wp = (const T*)p.B;
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t n = 0; n < p.N; ++n)
        o[m * p.N + n] = linear_partial_dot(xp + m * p.a_sm, wp + n * p.b_sn, p.K, p.lanes);
  });
}

// ---- hooks -------------------------------------------------------------------------------------------------
void Cpu::exp_f32(const Call&, const ElementwiseParams& p) {
  const auto& k = cpu_kernels();
  cpu::ieee_parallel_for(0, p.n, 1 << 14, [&](int64_t b, int64_t e) { k.exp_f32(p, b, e); });
}

void Cpu::log_f32(const Call&, const ElementwiseParams& p) {
  const auto& k = cpu_kernels();
  cpu::ieee_parallel_for(0, p.n, 1 << 14, [&](int64_t b, int64_t e) { k.log_f32(p, b, e); });
}

// The CPU checks data values on the host and raises at once: no error is ever deferred (zeros).
at::Tensor Cpu::device_error_flags(const Call& call) {
  return at::zeros({gpu::kNumDeviceErrors}, call.first.options().dtype(at::kInt));  // as many words as a GPU's
}

// ---- the CPU key's registrations of these families (register_cpu.cpp) ---------------------------------------
template void register_family<Dense, Cpu, EmulatedCuda, EmulatedHip>(torch::Library&);
template void register_family<Logits, Cpu, EmulatedCuda, EmulatedHip>(torch::Library&);
template void register_family<LmHeadPieces, Cpu>(torch::Library&);
template void register_family<Linear, Cpu, EmulatedCuda, EmulatedHip>(torch::Library&);
template void register_family<LinearReference, Cpu>(torch::Library&);
template void register_family<Hooks, Cpu, EmulatedCuda, EmulatedHip>(torch::Library&);

}  // namespace aligned::glue

// The chosen CPU level (csrc/cpu/cpu_backend.h): lets the tests prove that ALIGNED_CPU_ISA really forced a level
// before comparing the levels' bits. No tensor arguments, so a catch-all kernel (schema in bindings.cpp).
TORCH_LIBRARY_IMPL(aligned, CatchAll, m) {
  m.impl("_cpu_isa", +[]() -> std::string { return aligned::cpu::cpu_backend().level; });
}
