// ops_cpu.cpp — torch glue for the dense, logits and linear families on the CPU: device checks, then the
// shared argument checks (../op_checks.h), output allocation, the params struct (../op_params.h, the same
// struct the GPU glue fills), and the split of row / column ranges (or output tiles) across torch's intra-op
// threads. No arithmetic: the kernels (cpu_kernels.cpp, gemm_kernels.cpp) hold every formula and fold.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string.h>

#include <limits>
#include <vector>

#include "../common/contract.h"
#include "../common/reduce.h"
#include "cpu_backend.h"
#include "../op_params.h"
#include "glue_checks.h"
#include "dense_split_kernels.h"
#include "emulation_hook.h"

namespace aligned::cpu {


namespace {

// Fewer rows than threads: the threads share each row (dense_split_kernels.h says why no bit changes).
bool split_rows(int64_t rows, int64_t row_len, int64_t min_len) {
  return rows < at::get_num_threads() && row_len >= min_len && !at::in_parallel_region();
}

// Rows per task: enough work per task that threading pays, never affects results.
int64_t grain(int64_t work_per_row) { return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(work_per_row, 1)); }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const char* op = "rms_norm";
  check_cpu(x, op, "x");
  check_cpu(weight, op, "weight");
  const auto a = check_rms_norm<DType>(x, weight, eps);
  auto xc = x.contiguous(), wc = weight.contiguous();
  auto out = at::empty_like(xc);
  const auto p = make_rms_norm_params(a, xc, wc, out, eps);
  const auto& k = cpu_kernels();
  at::parallel_for(0, a.rows, grain(a.H), [&](int64_t b, int64_t e) { k.rms_norm(p, b, e); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  const char* op = "fused_add_rms_norm";
  check_cpu(x, op, "x");
  check_cpu(residual, op, "residual");
  check_cpu(weight, op, "weight");
  const auto a = check_fused_add_rms_norm<DType>(x, residual, weight, eps);
  auto xc = x.contiguous(), rc = residual.contiguous(), wc = weight.contiguous();
  auto out = at::empty_like(xc), res_out = at::empty_like(xc);
  const auto p = make_rms_norm_params(a, xc, wc, out, eps, rc, res_out);
  const auto& k = cpu_kernels();
  at::parallel_for(0, a.rows, grain(a.H), [&](int64_t b, int64_t e) { k.fused_add_rms_norm(p, b, e); });
  return {out, res_out};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad, const at::Tensor& x,
                                                     const at::Tensor& weight, double eps) {
  const char* op = "rms_norm_backward";
  check_cpu(grad, op, "grad_out");
  check_cpu(x, op, "x");
  check_cpu(weight, op, "weight");
  const auto a = check_rms_norm_backward<DType>(grad, x, weight, eps);
  auto gc = grad.contiguous(), xc = x.contiguous(), wc = weight.contiguous();
  auto dx = at::empty_like(xc);
  auto inv = at::empty({a.rows}, x.options().dtype(at::kFloat));
  auto dw = at::empty({a.H}, x.options().dtype(at::kFloat));
  const auto p = make_rms_norm_backward_params(a, gc, xc, wc, dx, inv, dw, eps);
  const auto& k = cpu_kernels();
  at::parallel_for(0, a.rows, grain(2 * a.H), [&](int64_t b, int64_t e) {
    k.rms_inv_rows(p, b, e);
    k.rms_norm_backward_dx(p, b, e);
  });
  // dw: columns split across threads, each column sums the rows in order.
  at::parallel_for(0, a.H, 16, [&](int64_t b, int64_t e) { k.rms_norm_backward_dw(p, b, e); });
  return {dx, dw.to(weight.scalar_type())};
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  const char* op = "silu_and_mul";
  check_cpu(x, op, "x");
  const auto a = check_silu_and_mul<DType>(x);
  const int64_t d = a.d, rows = a.rows;
  auto xc = x.contiguous();
  auto sizes = xc.sizes().vec();
  sizes.back() = d;
  auto out = at::empty(sizes, xc.options());
  const auto p = make_silu_and_mul_params(a, xc, out);
  constexpr int64_t kCols = 2048;  // elementwise: any column cut gives the same bits
  if (rows > 0 && split_rows(rows, d, 2 * kCols)) {
    const int64_t chunks = (d + kCols - 1) / kCols;
    const auto& sk = dense_split_kernels();
    at::parallel_for(0, rows * chunks, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const int64_t r = t / chunks, c0 = (t % chunks) * kCols;
        sk.silu_and_mul_cols(p, r, c0, std::min(d, c0 + kCols));
      }
    });
    return out;
  }
  const auto& k = cpu_kernels();
  at::parallel_for(0, rows, grain(8 * d), [&](int64_t b, int64_t e) { k.silu_and_mul(p, b, e); });
  return out;
}

at::Tensor silu_and_mul_backward(const at::Tensor& grad, const at::Tensor& x) {
  const char* op = "silu_and_mul_backward";
  check_cpu(grad, op, "grad_out");
  check_cpu(x, op, "x");
  const auto a = check_silu_and_mul_backward<DType>(grad, x);
  auto gc = grad.contiguous(), xc = x.contiguous();
  auto dx = at::empty_like(xc);
  const auto p = make_silu_and_mul_params(a, xc, dx, gc);
  const auto& k = cpu_kernels();
  at::parallel_for(0, a.rows, grain(16 * a.d), [&](int64_t b, int64_t e) { k.silu_and_mul_backward(p, b, e); });
  return dx;
}

at::Tensor rotary_impl(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cache, int64_t rot,
                       bool is_neox, bool inverse, const char* op) {
  check_cpu(x, op, "x");
  check_cpu(positions, op, "positions");
  check_cpu(cache, op, "cos_sin_cache");
  const auto a = check_rotary<DType>(positions, x, cache, rot, op);
  auto xc = x.contiguous(), cc = cache.contiguous();
  auto out = at::empty_like(xc);
  const auto p = make_rotary_params(a, xc, cc, out, rot, is_neox, inverse, nullptr);  // positions checked on the host
  const auto& k = cpu_kernels();
  at::parallel_for(0, a.T, grain(a.heads * a.head_dim * 4), [&](int64_t b, int64_t e) { k.rotary(p, b, e); });
  return out;
}

at::Tensor rotary_embedding(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cache, int64_t rot,
                            bool is_neox) {
  return rotary_impl(positions, x, cache, rot, is_neox, false, "rotary_embedding");
}
at::Tensor rotary_embedding_backward(const at::Tensor& positions, const at::Tensor& grad, const at::Tensor& cache,
                                     int64_t rot, bool is_neox) {
  return rotary_impl(positions, grad, cache, rot, is_neox, true, "rotary_embedding_backward");
}

// The log-prob family's arguments (op_checks.h), after the device checks of this glue.
using LogitsArgs = aligned::LogitsArgs<DType>;

LogitsArgs check_logits(const at::Tensor& logits, double temperature, const std::optional<at::Tensor>& temperatures,
                        const char* op) {
  check_cpu(logits, op, "logits");
  if (temperatures.has_value() && temperatures->defined()) check_cpu(*temperatures, op, "temperatures");
  return aligned::check_logits<DType>(logits, temperature, temperatures, op);
}

at::Tensor check_ids(const at::Tensor& ids, const LogitsArgs& a, const char* op) {
  check_cpu(ids, op, "token_ids");
  return check_token_ids(ids, a.T, a.V, op);
}

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
  at::parallel_for(0, parts, 1, [&](int64_t b, int64_t e) {
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
  at::parallel_for(0, groups, 1, [&](int64_t b, int64_t e) {
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
  at::parallel_for(0, p.T, grain(p.V * 4), [&](int64_t b, int64_t e) { k.logsumexp_pairs(p, b, e); });
}

at::Tensor new_pairs(const LogitsArgs& a) { return at::empty({a.T, 2}, a.z.options().dtype(at::kFloat)); }

at::Tensor logsumexp(const at::Tensor& logits, double temperature, const std::optional<at::Tensor>& temperatures) {
  auto a = check_logits(logits, temperature, temperatures, "logsumexp");
  LogitsTensors t;
  t.pairs = new_pairs(a);
  t.lse = at::empty({a.T}, t.pairs.options());
  lse_pairs_of(make_logits_params(a, t));
  return t.lse;
}

at::Tensor log_softmax(const at::Tensor& logits, double temperature, const std::optional<at::Tensor>& temperatures) {
  auto a = check_logits(logits, temperature, temperatures, "log_softmax");
  LogitsTensors t;
  t.out_f32 = at::empty({a.T, a.V}, a.z.options().dtype(at::kFloat));
  const auto p = make_logits_params(a, t);
  if (split_rows(a.T, a.V, kSplitMinVocab)) {
    const auto& sk = dense_split_kernels();
    for (int64_t r = 0; r < a.T; ++r) {
      const LsePair pair = lse_pair_split(p, r, p.out_f32 + r * a.V);  // leaves s = z / tau in the output row
      at::parallel_for(0, a.V, 8192, [&](int64_t b, int64_t e) { sk.logp_cols(p, r, pair, b, e); });
    }
    return t.out_f32;
  }
  const auto& k = cpu_kernels();
  // pairs == nullptr: the kernel computes each row's pair itself, writing z / tau into the output row first.
  at::parallel_for(0, a.T, grain(a.V * 4), [&](int64_t b, int64_t e) { k.log_softmax(p, b, e); });
  return t.out_f32;
}

// token_logprobs and the rows' (m, L) pairs [T, 2] (the fused LM head keeps the pairs for its backward).
std::tuple<at::Tensor, at::Tensor> token_logprobs_and_pairs(const at::Tensor& logits, const at::Tensor& ids,
                                                            double temperature,
                                                            const std::optional<at::Tensor>& temperatures,
                                                            const char* op) {
  auto a = check_logits(logits, temperature, temperatures, op);
  LogitsTensors t;
  t.ids = check_ids(ids, a, op);
  t.pairs = new_pairs(a);
  t.out_f32 = at::empty({a.T}, t.pairs.options());
  const auto p = make_logits_params(a, t);
  lse_pairs_of(p);
  const auto& k = cpu_kernels();
  at::parallel_for(0, a.T, 1024, [&](int64_t b, int64_t e) { k.token_logprobs(p, b, e); });
  return {t.out_f32, t.pairs};
}

at::Tensor token_logprobs(const at::Tensor& logits, const at::Tensor& ids, double temperature,
                          const std::optional<at::Tensor>& temperatures) {
  return std::get<0>(token_logprobs_and_pairs(logits, ids, temperature, temperatures, "token_logprobs"));
}

std::tuple<at::Tensor, at::Tensor> token_logprobs_pairs(const at::Tensor& logits, const at::Tensor& ids,
                                                        double temperature,
                                                        const std::optional<at::Tensor>& temperatures) {
  return token_logprobs_and_pairs(logits, ids, temperature, temperatures, "token_logprobs_pairs");
}

// The three backward ops are one path that differs only in the mode (contract.h: which gradient), whether
// token ids are read, and the grad's shape ([T, V] for log_softmax, [T] otherwise). Few rows -> the pairs with
// the threads sharing each row, then the elementwise part per row; otherwise pairs == nullptr: the kernel
// computes each row's pair in the same pass.
at::Tensor logits_backward(LogitsGrad mode, const char* op, const at::Tensor& grad, const at::Tensor& logits,
                           const at::Tensor* ids, double temperature, const std::optional<at::Tensor>& temperatures) {
  check_cpu(grad, op, "grad");
  auto a = check_logits(logits, temperature, temperatures, op);
  LogitsTensors t;
  if (ids) t.ids = check_ids(*ids, a, op);
  t.g = check_logits_grad(grad, a.T, a.V, mode == LogitsGrad::kLogSoftmax, op);
  t.dz = at::empty({a.T, a.V}, a.z.options());
  if (split_rows(a.T, a.V, kSplitMinVocab)) t.pairs = new_pairs(a);
  const auto p = make_logits_params(a, t, mode);
  if (p.pairs) lse_pairs_of(p);
  const auto& k = cpu_kernels();
  at::parallel_for(0, a.T, grain(a.V * 4), [&](int64_t b, int64_t e) { k.logits_backward(p, b, e); });
  return t.dz;
}

at::Tensor token_logprobs_backward(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& ids,
                                   double temperature, const std::optional<at::Tensor>& temperatures) {
  return logits_backward(LogitsGrad::kTokenLogprobs, "token_logprobs_backward", grad, logits, &ids, temperature,
                         temperatures);
}

// token_logprobs_backward on the column tile [vocab_start, vocab_start + n) of the rows (logits is that tile,
// [T, n]), given the rows' pairs from token_logprobs_pairs: the same elements token_logprobs_backward writes
// for those columns of the full [T, vocab_size] logits.
at::Tensor token_logprobs_backward_cols(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& ids,
                                        const at::Tensor& lse_pairs, int64_t vocab_start, int64_t vocab_size,
                                        double temperature, const std::optional<at::Tensor>& temperatures) {
  const char* op = "token_logprobs_backward_cols";
  check_cpu(grad, op, "grad");
  check_cpu(lse_pairs, op, "lse_pairs");
  auto a = check_logits(logits, temperature, temperatures, op);
  TORCH_CHECK(vocab_start >= 0 && vocab_start + a.V <= vocab_size, "aligned::", op, ": the tile [", vocab_start,
              ", ", vocab_start + a.V, ") must lie in the vocabulary [0, ", vocab_size, ")");
  check_cpu(ids, op, "token_ids");
  LogitsTensors t;
  t.ids = check_token_ids(ids, a.T, vocab_size, op);
  TORCH_CHECK(lse_pairs.scalar_type() == at::kFloat && lse_pairs.dim() == 2 && lse_pairs.size(0) == a.T &&
                  lse_pairs.size(1) == 2,
              "aligned::", op, ": lse_pairs must be float32 [", a.T, ", 2], got ", lse_pairs.scalar_type(), " ",
              lse_pairs.sizes());
  t.pairs = lse_pairs.contiguous();
  t.g = check_logits_grad(grad, a.T, a.V, false, op);
  t.dz = at::empty({a.T, a.V}, a.z.options());
  const auto p = make_logits_params(a, t, LogitsGrad::kTokenLogprobs, vocab_start);
  const auto& k = cpu_kernels();
  at::parallel_for(0, a.T, grain(a.V * 4), [&](int64_t b, int64_t e) { k.token_logprobs_backward_cols(p, b, e); });
  return t.dz;
}

at::Tensor logsumexp_backward(const at::Tensor& grad, const at::Tensor& logits, double temperature,
                              const std::optional<at::Tensor>& temperatures) {
  return logits_backward(LogitsGrad::kLogsumexp, "logsumexp_backward", grad, logits, nullptr, temperature,
                         temperatures);
}

at::Tensor log_softmax_backward(const at::Tensor& grad, const at::Tensor& logits, double temperature,
                                const std::optional<at::Tensor>& temperatures) {
  return logits_backward(LogitsGrad::kLogSoftmax, "log_softmax_backward", grad, logits, nullptr, temperature,
                         temperatures);
}

// ---- linear --------------------------------------------------------------------------------------------
// Threads take contiguous runs of 32-column output panels over all rows (each thread packs its own part of
// B once per row block); when there are too few panels to keep every thread busy, the rows are split as
// well. Tiles only choose which fma chains a thread runs (contract.h: linear), never how one is summed.
constexpr int64_t kPanelN = 32;

void run_gemm(const GemmParams& p) {
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
  at::parallel_for(0, mt * panels, grain_tasks, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e;) {
      const int64_t mi = t / panels, p0 = t % panels, p1 = std::min(panels, p0 + (e - t));
      k.gemm(p, mi * mchunk, std::min(M, (mi + 1) * mchunk), p0 * kPanelN, std::min(N, p1 * kPanelN));
      t += p1 - p0;
    }
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const char* op = "linear";
  check_cpu(x, op, "x");
  check_cpu(weight, op, "weight");
  if (bias.has_value() && bias->defined()) check_cpu(*bias, op, "bias");
  const auto a = check_linear<DType>(x, weight, bias);
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  auto out = at::empty({a.M, a.N}, x.options());
  run_gemm(make_linear_params(a, xc, weight, out, a.dt, kLinearLanes));
  return out.view(sizes);
}

// linear_partial: the sub-tree over `lanes` lanes of the local K, fp32, no bias (contract.h).
at::Tensor linear_partial(const at::Tensor& x, const at::Tensor& weight, int64_t lanes) {
  const char* op = "linear_partial";
  check_cpu(x, op, "x");
  check_cpu(weight, op, "weight");
  const auto a = check_linear_partial<DType>(x, weight, lanes);
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  auto out = at::empty({a.M, a.N}, x.options().dtype(at::kFloat));
  run_gemm(make_linear_params(a, xc, weight, out, DType::F32, (int)lanes));
  return out.view(sizes);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward(const at::Tensor& grad, const at::Tensor& x,
                                                               const at::Tensor& weight, bool needs_x, bool needs_w,
                                                               bool needs_b) {
  const char* op = "linear_backward";
  check_cpu(grad, op, "grad_out");
  check_cpu(x, op, "x");
  check_cpu(weight, op, "weight");
  const auto a = check_linear_backward<DType>(grad, x, weight);
  const int64_t M = a.M, K = a.K, N = a.N;  // K or N may be 0
  auto g = grad.reshape({M, N}).contiguous();
  auto xc = x.reshape({M, K}).contiguous();
  auto wc = weight.contiguous();
  at::Tensor dx, dw, db;
  if (needs_x) {  // dx[m, k] = chain over n of g[m, n] * w[n, k]
    dx = at::empty({M, K}, x.options());
    run_gemm(make_linear_dx_params(a, g, wc, dx));
    dx = dx.view(x.sizes());
  }
  if (needs_w) {  // dw[n, k] = chain over m (token order) of g[m, n] * x[m, k]
    dw = at::empty({N, K}, weight.options());
    run_gemm(make_linear_dw_params(a, g, xc, dw));
  }
  if (needs_b) {
    db = at::empty({N}, x.options());
    const auto p = make_column_sum_params(a, g, db);
    const auto& k = cpu_kernels();
    at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) { k.column_sum(p, b, e); });
  }
  return {dx, dw, db};
}

at::Tensor elementwise_f32(const at::Tensor& x, bool is_log, const char* op) {
  check_cpu(x, op, "x");
  check_elementwise_f32(x, op);
  auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  const auto p = make_elementwise_params(xc, out);
  const auto& k = cpu_kernels();
  at::parallel_for(0, p.n, 1 << 14, [&](int64_t b, int64_t e) { (is_log ? k.log_f32 : k.exp_f32)(p, b, e); });
  return out;
}
// _linear_partial_reference: contract.h's scalar linear_partial_dot, one call per output, for the conformance
// test that holds the GEMM kernels (every ISA level) to the helper itself. Slow by design; test hook only.
at::Tensor linear_partial_reference(const at::Tensor& x, const at::Tensor& weight, int64_t lanes) {
  const char* op = "_linear_partial_reference";
  check_cpu(x, op, "x");
  check_cpu(weight, op, "weight");
  const auto a = check_linear_partial<DType>(x, weight, lanes);
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty({a.M, a.N}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  with_type(a.dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    const T* xp = (const T*)xc.data_ptr();
    const T* wp = (const T*)wc.data_ptr();
    for (int64_t m = 0; m < a.M; ++m)
      for (int64_t n = 0; n < a.N; ++n) o[m * a.N + n] = linear_partial_dot(xp + m * a.K, wp + n * a.K, a.K, (int)lanes);
  });
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  return out.view(sizes);
}

at::Tensor exp_f32(const at::Tensor& x) { return elementwise_f32(x, false, "_exp_f32"); }
at::Tensor log_f32(const at::Tensor& x) { return elementwise_f32(x, true, "_log_f32"); }

// The CPU glue checks data values on the host and raises at once: no error is ever deferred (zeros).
// Under aligned_ops.emulate the GPU glue's own persistent words are returned instead (emulation_hook.h).
at::Tensor device_error_flags(const at::Tensor& like) { return at::zeros({4}, like.options().dtype(at::kInt)); }  // dense_api.h kNumDeviceErrors

}  // namespace

// The chosen CPU level (cpu_backend.h): lets the tests prove that ALIGNED_CPU_ISA really forced a level before
// comparing the levels' bits. No tensor arguments, so a catch-all kernel (schema in torch_bindings.cpp).
std::string cpu_isa() { return cpu_backend().level; }

TORCH_LIBRARY_IMPL(aligned, CatchAll, m) { m.impl("_cpu_isa", &cpu_isa); }

TORCH_LIBRARY_IMPL(aligned, CPU, lib) {
  EmulationAwareLibrary m(lib);  // under aligned_ops.emulate(arch): the GPU source runs (emulation_hook.h)
  m.impl("linear", &linear);
  m.impl("linear_backward", &linear_backward);
  m.impl("linear_partial", &linear_partial);
  m.impl("rms_norm", &rms_norm);
  m.impl("rms_norm_backward", &rms_norm_backward);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("silu_and_mul_backward", &silu_and_mul_backward);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("rotary_embedding_backward", &rotary_embedding_backward);
  m.impl("logsumexp", &logsumexp);
  m.impl("log_softmax", &log_softmax);
  m.impl("token_logprobs", &token_logprobs);
  m.impl("token_logprobs_backward", &token_logprobs_backward);
  m.impl("token_logprobs_pairs", &token_logprobs_pairs);
  m.impl("token_logprobs_backward_cols", &token_logprobs_backward_cols);
  m.impl("logsumexp_backward", &logsumexp_backward);
  m.impl("log_softmax_backward", &log_softmax_backward);
  m.impl("_exp_f32", &exp_f32);
  m.impl("_linear_partial_reference", &linear_partial_reference);
  m.impl("_log_f32", &log_f32);
  m.impl("_device_error_flags", &device_error_flags);
}

}  // namespace aligned::cpu
