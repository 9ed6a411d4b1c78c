// exact_launch.cuh — the launchers of exact_api.h, defined once for both vendors (and the emulation target);
// included by exactly one TU per vendor: csrc/cuda/exact_linear.cu, csrc/hip/exact_linear.hip.
#pragma once

#include <type_traits>

#include "compat.cuh"  // first: the vendor runtime before common/ (via exact_api.h -> dense_api.h)
#include "exact_api.h"
#include "exact_linear_kernels.cuh"

namespace aligned::gpu::ALIGNED_GPU_BUILD {
namespace {


unsigned exact_blocks(int64_t threads_needed, int per_block) {
  const int64_t b = (threads_needed + per_block - 1) / per_block;
  return (unsigned)(b < 65535 ? (b < 1 ? 1 : b) : 65535);  // grid-stride loops inside
}

}  // namespace

const char* launch_exact_row_forms(const ExactFormsParams& p, void* stream) {
  if (p.rows == 0) return nullptr;
  with_type(p.dt, [&](auto* tp) {
    using T = typename std::remove_pointer<decltype(tp)>::type;
    ALIGNED_LAUNCH(exact_blocks(p.rows * kGroupLanes, kExactFormThreads), kExactFormThreads, 0, (gpu_stream_t)stream,
                   exact_row_forms_kernel<T>)((const T*)p.v, p.rows, p.K, p.E, p.S, p.bad);
  });
  return last_error();
}

const char* launch_exact_pack_digits(const ExactPackParams& p, void* stream) {
  if (p.rows == 0 || p.K == 0) return nullptr;
  if (p.weight_layout && (p.fixed_digits < 1 || p.fixed_digits > exact::kMaxDigits))
    return "aligned exact pack: the weight's digit count must be 1..4";
  with_type(p.dt, [&](auto* tp) {
    using T = typename std::remove_pointer<decltype(tp)>::type;
    const unsigned blocks = exact_blocks(p.rows * p.K, kExactPackThreads);
    if (p.weight_layout)
      ALIGNED_LAUNCH(blocks, kExactPackThreads, 0, (gpu_stream_t)stream, exact_pack_digits_kernel<T, true>)(
          (const T*)p.v, p.rows, p.K, p.Kp, p.plane, p.E, p.S, p.fixed_digits, p.out);
    else
      ALIGNED_LAUNCH(blocks, kExactPackThreads, 0, (gpu_stream_t)stream, exact_pack_digits_kernel<T, false>)(
          (const T*)p.v, p.rows, p.K, p.Kp, p.plane, p.E, p.S, p.fixed_digits, p.out);
  });
  return last_error();
}

const char* launch_exact_gemm(const ExactGemmParams& p, void* stream) {
  if (p.M == 0 || p.N == 0) return nullptr;
  if (p.w_digits < 1 || p.w_digits > exact::kMaxDigits) return "aligned exact gemm: weight digits must be 1..4";
  if (p.partial != nullptr)  // the TP partials (linear_exact_partial) have CPU kernels only
    return "aligned exact gemm: unrounded partials (linear_exact_partial, exact TP) are not built for the GPU";
  if (p.chunk_k < 32 || p.chunk_k > kExactMaxChunkK || p.chunk_k % 32 != 0)
    return "aligned exact gemm: chunk_k must be a multiple of 32 in [32, 8192]";
  const int64_t gx = (p.N + kExactTileN - 1) / kExactTileN, gy = (p.M + kExactTileM - 1) / kExactTileM;
  if (gx > 0x7fffffff || gy > 65535) return "aligned exact gemm: problem too large for one grid";
  const dim3 grid((unsigned)gx, (unsigned)gy, 1);
  with_type(p.dt, [&](auto* tp) {
    using T = typename std::remove_pointer<decltype(tp)>::type;
    ALIGNED_LAUNCH(grid, kExactGemmThreads, 0, (gpu_stream_t)stream, exact_gemm_kernel<T>)(
        p.xd, p.x_plane, p.x_exp, p.x_digits, p.x_bad, p.wd, p.w_plane, p.w_exp, p.w_bad, p.w_digits,
        (const T*)p.bias, (T*)p.out, p.M, p.N, p.Kp, p.chunk_k);
  });
  return last_error();
}

// This build's launchers as the table the glue reads (csrc/gpu/launchers.h declares each build's), filled by
// name: nvcc's C++17 dialect has no designated initializers.
extern const ExactLaunchers kExactLaunchers;
const ExactLaunchers kExactLaunchers = []() constexpr {
  ExactLaunchers t{};
  t.exact_row_forms = &launch_exact_row_forms;
  t.exact_pack_digits = &launch_exact_pack_digits;
  t.exact_gemm = &launch_exact_gemm;
  return t;
}();

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
