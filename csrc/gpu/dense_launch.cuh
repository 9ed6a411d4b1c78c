// dense_launch.cuh — the launchers declared in dense_api.h, defined once for both vendors.
//
// Included by exactly one translation unit per vendor: csrc/cuda/dense.cu (nvcc) and csrc/hip/dense.hip
// (hip-clang) — and by their emulated builds (csrc/emu), which is why launches are spelled ALIGNED_LAUNCH
// (compat.cuh) instead of <<< >>>. Each launcher maps the runtime dtypes to a kernel instantiation, picks a grid (which never
// changes any result: rows, columns and output tiles are independent), enqueues on the caller's stream and
// reports the launch error, if any. Zero-size problems enqueue nothing.
#pragma once

#include "compat.cuh"  // first: the vendor runtime before common/ (dense_api.h includes common/dtype.h)
#include "dense_api.h"
#include "dense_kernels.cuh"
#include "gemm_fp32.cuh"

namespace aligned::gpu::ALIGNED_GPU_BUILD {
namespace {

template <typename T>
using Elem = typename std::remove_pointer<T>::type;


// Row kernels: 2-group blocks for small batches (decode: spread the rows over the SMs), 8 groups otherwise.
// A row's result never depends on the block size (one group per row, rows independent).
unsigned row_threads(int64_t rows) { return rows < kSmallBatchRows ? kSmallRowBlockThreads : kRowBlockThreads; }
unsigned row_blocks(int64_t rows) {
  const int64_t groups = row_threads(rows) / kGroupLanes;
  int64_t b = (rows + groups - 1) / groups;
  return (unsigned)(b < kMaxBlocks ? b : kMaxBlocks);
}
// Column chains: one block per kColTileCols columns (grid-stride beyond kMaxBlocks groups).
unsigned col_blocks(int64_t cols) {
  int64_t b = (cols + kColTileCols - 1) / kColTileCols;
  return (unsigned)(b < kMaxBlocks ? b : kMaxBlocks);
}
// One block per row (dense_kernels.cuh "wide rows") for small batches of long rows; rows are independent and both
// kernels compute the contract's lane chains, so the choice never changes a bit.
bool use_wide_rows(int64_t rows, int64_t n) { return rows < kWideRowMaxRows && n >= kWideRowMinLength; }
unsigned wide_row_blocks(int64_t rows) { return (unsigned)(rows < kMaxBlocks ? rows : kMaxBlocks); }
unsigned elem_blocks(int64_t n) {
  int64_t b = (n + kElemBlockThreads - 1) / kElemBlockThreads;
  return (unsigned)(b < kMaxBlocks ? b : kMaxBlocks);
}
gpu_stream_t as_stream(void* s) { return (gpu_stream_t)s; }

}  // namespace

const char* launch_rms_norm(const RmsNormParams& p, void* stream) {
  if (p.rows == 0 || p.H == 0) return nullptr;
  with_type(p.dt, [&](auto* tp) {
    using T = Elem<decltype(tp)>;
    auto go = [&](auto* wp) {
      using TW = Elem<decltype(wp)>;
      if (use_wide_rows(p.rows, p.H))
        ALIGNED_LAUNCH(wide_row_blocks(p.rows), kWideRowThreads, 0, as_stream(stream), rms_norm_wide_kernel<T, TW>)(
            (const T*)p.x, (const T*)nullptr, (const TW*)p.w, (T*)p.out, (T*)nullptr, p.rows, p.H, p.eps);
      else
        ALIGNED_LAUNCH(row_blocks(p.rows), row_threads(p.rows), 0, as_stream(stream), rms_norm_kernel<T, TW>)(
            (const T*)p.x, (const TW*)p.w, (T*)p.out, p.rows, p.H, p.eps);
    };
    if (p.wdt == DType::F32) go((float*)nullptr); else go((T*)nullptr);
  });
  return last_error();
}

const char* launch_fused_add_rms_norm(const RmsNormParams& p, void* stream) {
  if (p.rows == 0 || p.H == 0) return nullptr;
  with_type(p.dt, [&](auto* tp) {
    using T = Elem<decltype(tp)>;
    auto go = [&](auto* wp) {
      using TW = Elem<decltype(wp)>;
      if (use_wide_rows(p.rows, p.H))
        ALIGNED_LAUNCH(wide_row_blocks(p.rows), kWideRowThreads, 0, as_stream(stream), rms_norm_wide_kernel<T, TW>)(
            (const T*)p.x, (const T*)p.residual, (const TW*)p.w, (T*)p.out, (T*)p.residual_out, p.rows, p.H, p.eps);
      else
        ALIGNED_LAUNCH(row_blocks(p.rows), row_threads(p.rows), 0, as_stream(stream), fused_add_rms_norm_kernel<T, TW>)(
            (const T*)p.x, (const T*)p.residual, (const TW*)p.w, (T*)p.out, (T*)p.residual_out, p.rows, p.H, p.eps);
    };
    if (p.wdt == DType::F32) go((float*)nullptr); else go((T*)nullptr);
  });
  return last_error();
}

const char* launch_rms_norm_backward(const RmsNormBackwardParams& p, void* stream) {
  if (p.H == 0) return nullptr;
  with_type(p.dt, [&](auto* tp) {
    using T = Elem<decltype(tp)>;
    auto go = [&](auto* wp) {
      using TW = Elem<decltype(wp)>;
      if (p.rows > 0)
        ALIGNED_LAUNCH(row_blocks(p.rows), row_threads(p.rows), 0, as_stream(stream), rms_norm_backward_dx_kernel<T, TW>)(
            (const T*)p.g, (const T*)p.x, (const TW*)p.w, (T*)p.dx, p.inv, p.rows, p.H, p.eps);
    };
    if (p.wdt == DType::F32) go((float*)nullptr); else go((T*)nullptr);
    // dw reads inv[] written above: same stream, so ordered. rows == 0 gives dw = +0 (empty chains).
    ALIGNED_LAUNCH(col_blocks(p.H), kColBlockThreads, 0, as_stream(stream), rms_norm_backward_dw_kernel<T>)(
        (const T*)p.g, (const T*)p.x, p.inv, p.dw, p.rows, p.H);
  });
  return last_error();
}

const char* launch_silu_and_mul(const SiluMulParams& p, void* stream) {
  if (p.rows == 0 || p.d == 0) return nullptr;
  with_type(p.dt, [&](auto* tp) {
    using T = Elem<decltype(tp)>;
    ALIGNED_LAUNCH(elem_blocks(p.rows * p.d), kElemBlockThreads, 0, as_stream(stream), silu_and_mul_kernel<T>)(
        (const T*)p.x, (T*)p.out, p.rows, p.d);
  });
  return last_error();
}

const char* launch_silu_and_mul_backward(const SiluMulParams& p, void* stream) {
  if (p.rows == 0 || p.d == 0) return nullptr;
  with_type(p.dt, [&](auto* tp) {
    using T = Elem<decltype(tp)>;
    ALIGNED_LAUNCH(elem_blocks(p.rows * p.d), kElemBlockThreads, 0, as_stream(stream), silu_and_mul_backward_kernel<T>)(
        (const T*)p.g, (const T*)p.x, (T*)p.out, p.rows, p.d);
  });
  return last_error();
}

const char* launch_rotary(const RotaryParams& p, void* stream) {
  const int64_t W = p.rot / 2 + (p.head_dim - p.rot);
  const int64_t n = p.T * p.heads * W;
  if (n == 0) return nullptr;
  with_type(p.dt, [&](auto* tp) {
    using T = Elem<decltype(tp)>;
    ALIGNED_LAUNCH(elem_blocks(n), kElemBlockThreads, 0, as_stream(stream), rotary_kernel<T>)(
        p.positions, (const T*)p.x, (T*)p.out, p.cache, p.T, p.heads, p.head_dim, p.rot, p.is_neox, p.inverse,
        p.max_pos, p.error_flags);
  });
  return last_error();
}

namespace {
template <LogitsMode kMode>
const char* launch_logits(const LogitsParams& p, void* stream) {
  if (p.T == 0) return nullptr;
  with_type(p.dt, [&](auto* tp) {
    using T = Elem<decltype(tp)>;
    if (use_wide_rows(p.T, p.V))
      ALIGNED_LAUNCH(wide_row_blocks(p.T), kWideRowThreads, 0, as_stream(stream), logits_wide_kernel<T, kMode>)(
          (const T*)p.z, p.T, p.V, p.tau, p.temps, p.ids, p.g, p.lse, p.out_f32, (T*)p.dz, p.error_flags);
    else
      ALIGNED_LAUNCH(row_blocks(p.T), row_threads(p.T), 0, as_stream(stream), logits_row_kernel<T, kMode>)(
          (const T*)p.z, p.T, p.V, p.tau, p.temps, p.ids, p.g, p.lse, p.out_f32, (T*)p.dz, p.error_flags);
  });
  return last_error();
}
}  // namespace

const char* launch_logsumexp(const LogitsParams& p, void* s) { return launch_logits<LogitsMode::kLogsumexp>(p, s); }
const char* launch_log_softmax(const LogitsParams& p, void* s) { return launch_logits<LogitsMode::kLogSoftmax>(p, s); }
const char* launch_token_logprobs(const LogitsParams& p, void* s) {
  return launch_logits<LogitsMode::kTokenLogprobs>(p, s);
}
const char* launch_token_logprobs_backward(const LogitsParams& p, void* s) {
  return launch_logits<LogitsMode::kTokenLogprobsBackward>(p, s);
}
const char* launch_logsumexp_backward(const LogitsParams& p, void* s) {
  return launch_logits<LogitsMode::kLogsumexpBackward>(p, s);
}
const char* launch_log_softmax_backward(const LogitsParams& p, void* s) {
  return launch_logits<LogitsMode::kLogSoftmaxBackward>(p, s);
}

const char* launch_gemm(const GemmParams& p, void* stream) {
  if (p.M == 0 || p.N == 0) return nullptr;
  // One storage type T for A and B; C in T or fp32 (linear_partial): 5 instantiations, not 27.
  if (p.adt != p.bdt || (p.cdt != p.adt && p.cdt != DType::F32))
    return "aligned gemm: A and B must share one dtype, C that dtype or float32";
  if (p.lanes != 1 && p.lanes != 2 && p.lanes != 4 && p.lanes != 8) return "aligned gemm: lanes must be 1, 2, 4 or 8";
  if (p.lanes > 1 && (!p.lane_ws || p.ws_rows <= 0))
    return "aligned gemm: lanes > 1 needs the [lanes, ws_rows, N] fp32 workspace";
  const int64_t gx = (p.N + kTileN - 1) / kTileN, gy = (p.M + kTileM - 1) / kTileM;
  if (gx > 0x7fffffff || gy > 65535) return "aligned gemm: problem too large for one grid (M > 65535 * kTileM)";
  const dim3 grid((unsigned)gx, (unsigned)gy, (unsigned)p.lanes);
  with_type(p.adt, [&](auto* tp) {
    using T = Elem<decltype(tp)>;
    const T* A = (const T*)p.A;
    const T* B = (const T*)p.B;
    if (p.lanes == kLinearLanes && p.cdt == p.adt && p.M <= kSmallM) {  // decode: gemm_small_m_kernel
      const dim3 sgrid((unsigned)((p.N + kSmallCols - 1) / kSmallCols));
      auto small = [&](auto rows) {
        constexpr int kM = decltype(rows)::value;
        ALIGNED_LAUNCH(sgrid, kSmallThreads, 0, as_stream(stream), gemm_small_m_kernel<T, kM>)(
            A, p.a_sm, p.a_sk, B, p.b_sn, p.b_sk, (const T*)p.bias, (T*)p.C, p.c_sm, p.M, p.N, p.K);
      };
      if (p.M <= 1) small(std::integral_constant<int, 1>());
      else if (p.M <= 2) small(std::integral_constant<int, 2>());
      else if (p.M <= 4) small(std::integral_constant<int, 4>());
      else if (p.M <= 8) small(std::integral_constant<int, 8>());
      else small(std::integral_constant<int, 16>());
      return;
    }
    if (p.lanes == 1) {  // one chain per element, written straight to C
      if (p.cdt == p.adt)
        ALIGNED_LAUNCH(grid, kGemmThreads, 0, as_stream(stream), gemm_fp32_kernel<T, T, T>)(
            A, p.a_sm, p.a_sk, B, p.b_sn, p.b_sk, (const T*)p.bias, (T*)p.C, p.c_sm, p.M, p.N, p.K, 1, 0);
      else
        ALIGNED_LAUNCH(grid, kGemmThreads, 0, as_stream(stream), gemm_fp32_kernel<T, T, float>)(
            A, p.a_sm, p.a_sk, B, p.b_sn, p.b_sk, (const float*)p.bias, (float*)p.C, p.c_sm, p.M, p.N, p.K, 1, 0);
      return;
    }
    // lanes > 1: lane sums to the workspace (no bias), then the tree + bias + rounding; M in chunks of ws_rows
    // rows (rows are independent, so the chunking cannot change a bit).
    for (int64_t m0 = 0; m0 < p.M; m0 += p.ws_rows) {
      const int64_t rows = (p.M - m0) < p.ws_rows ? (p.M - m0) : p.ws_rows;
      const dim3 cgrid((unsigned)gx, (unsigned)((rows + kTileM - 1) / kTileM), (unsigned)p.lanes);
      ALIGNED_LAUNCH(cgrid, kGemmThreads, 0, as_stream(stream), gemm_fp32_kernel<T, T, float>)(
          A + m0 * p.a_sm, p.a_sm, p.a_sk, B, p.b_sn, p.b_sk, nullptr, p.lane_ws, p.N, rows, p.N, p.K, p.lanes,
          rows * p.N);
      const unsigned fold_blocks = elem_blocks(rows * p.N);  // grid-stride loop inside
      if (p.cdt == p.adt)
        ALIGNED_LAUNCH(fold_blocks, kElemBlockThreads, 0, as_stream(stream), lane_fold_kernel<T>)(
            p.lane_ws, p.lanes, (const T*)p.bias, (T*)p.C + m0 * p.c_sm, p.c_sm, rows, p.N);
      else
        ALIGNED_LAUNCH(fold_blocks, kElemBlockThreads, 0, as_stream(stream), lane_fold_kernel<float>)(
            p.lane_ws, p.lanes, (const float*)p.bias, (float*)p.C + m0 * p.c_sm, p.c_sm, rows, p.N);
    }
  });
  return last_error();
}

const char* launch_column_sum(const ColumnSumParams& p, void* stream) {
  if (p.cols == 0) return nullptr;
  if (p.out_dt != p.dt) return "aligned column_sum: output dtype must equal input dtype";
  with_type(p.dt, [&](auto* tp) {
    using T = Elem<decltype(tp)>;
    ALIGNED_LAUNCH(col_blocks(p.cols), kColBlockThreads, 0, as_stream(stream), column_sum_kernel<T, T>)((const T*)p.g, (T*)p.out,
                                                                                             p.rows, p.cols);
  });
  return last_error();
}

const char* launch_exp_f32(const ElementwiseParams& p, void* stream) {
  if (p.n == 0) return nullptr;
  ALIGNED_LAUNCH(elem_blocks(p.n), kElemBlockThreads, 0, as_stream(stream), exp_log_kernel<false>)(p.x, p.out, p.n);
  return last_error();
}
const char* launch_log_f32(const ElementwiseParams& p, void* stream) {
  if (p.n == 0) return nullptr;
  ALIGNED_LAUNCH(elem_blocks(p.n), kElemBlockThreads, 0, as_stream(stream), exp_log_kernel<true>)(p.x, p.out, p.n);
  return last_error();
}

// This build's launchers as the table the glue reads (csrc/gpu/launchers.h declares each build's), filled by
// name: nvcc's C++17 dialect has no designated initializers.
extern const DenseLaunchers kDenseLaunchers;
const DenseLaunchers kDenseLaunchers = []() constexpr {
  DenseLaunchers t{};
  t.rms_norm = &launch_rms_norm;
  t.fused_add_rms_norm = &launch_fused_add_rms_norm;
  t.rms_norm_backward = &launch_rms_norm_backward;
  t.silu_and_mul = &launch_silu_and_mul;
  t.silu_and_mul_backward = &launch_silu_and_mul_backward;
  t.rotary = &launch_rotary;
  t.logsumexp = &launch_logsumexp;
  t.log_softmax = &launch_log_softmax;
  t.token_logprobs = &launch_token_logprobs;
  t.token_logprobs_backward = &launch_token_logprobs_backward;
  t.logsumexp_backward = &launch_logsumexp_backward;
  t.log_softmax_backward = &launch_log_softmax_backward;
  t.gemm = &launch_gemm;
  t.column_sum = &launch_column_sum;
  t.exp_f32 = &launch_exp_f32;
  t.log_f32 = &launch_log_f32;
  return t;
}();

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
