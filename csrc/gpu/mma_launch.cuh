// mma_launch.cuh — the launcher of mma_api.h, defined once for both vendors (and the emulation target); included
// by exactly one TU per vendor: csrc/cuda/linear_mma.cu, csrc/hip/linear_mma.hip.
//
// The M bucket picks the tiling only: M <= 16 the lanes kernel (decode: 8 warps run the 8 K-lanes of one 16 x 16
// tile in parallel, mma_linear_kernels.cuh), 16 < M <= 64 the rows kernel (4 warps, 64 x 16 per block, operands
// straight from global memory: few rows, the weight read dominates), M > 64 the block-tiled kernel
// (mma_tiled_kernels.cuh: 128 x 64 per CTA, operands staged through shared memory, register-blocked warps — the
// compute-bound bucket). Same instruction, same operands, same k-block order in all three: the bucket never
// changes a bit (tests/emulated/test_emulated_linear_mma.py, test_emulated_linear_mma_tiled.py).
#pragma once

#include <type_traits>

#include "compat.cuh"  // first: the vendor runtime before common/
#include "mma_api.h"
#include "mma_linear_kernels.cuh"
#include "mma_tiled_kernels.cuh"
#if defined(ALIGNED_GPU_EMULATED)
#include "../emu/emulation.h"
#endif

namespace aligned::gpu::ALIGNED_GPU_BUILD {

// The tiled kernel (M > kMmaTiledMinM): its staging path, and the negative controls' variants under emulation only.
inline const char* launch_mma_tiled(const GemmParams& p, int control, void* stream) {
  const int64_t gx = (p.N + kMmaTiledN - 1) / kMmaTiledN, gy = (p.M + kMmaTiledM - 1) / kMmaTiledM;
  if (p.K > kMmaTiledMaxK)
    return "aligned mma gemm: K must be at most 2^31 - 32 for the tiled kernel (M > 64): its k indices are 32-bit";
  if (gx > 0x7fffffff || gy > 65535) return "aligned mma gemm: problem too large for one grid";
  const dim3 grid((unsigned)gx, (unsigned)gy, 1);
  const bool vec = mma_tiled_staging(p) == kMmaTiledVector;
  auto run = [&](auto* tag, auto staging, auto ctl) {
    using TC = typename std::remove_pointer<decltype(tag)>::type;
    constexpr int kS = decltype(staging)::value, kC = decltype(ctl)::value;
    if (kMmaTiledSharedBytes > 48 * 1024)  // CUDA's opt-in above the default (the fold stack's bottom)
      if (const char* e = allow_dynamic_shared(mma_linear_tiled_kernel<TC, kS, kC>, kMmaTiledSharedBytes)) return e;
    ALIGNED_LAUNCH(grid, kMmaTiledThreads, kMmaTiledSharedBytes, (gpu_stream_t)stream,
                   mma_linear_tiled_kernel<TC, kS, kC>)(p);
    return (const char*)nullptr;
  };
  auto by_staging = [&](auto* tag, auto ctl) {
    if (vec) return run(tag, std::integral_constant<int, kMmaTiledVector>{}, ctl);
    return run(tag, std::integral_constant<int, kMmaTiledElement>{}, ctl);
  };
  auto by_control = [&](auto* tag) {
#if defined(ALIGNED_GPU_EMULATED)
    if (control == kMmaControlSplitK) return by_staging(tag, std::integral_constant<int, kMmaControlSplitK>{});
    if (control == kMmaControlReverseBlocks)
      return by_staging(tag, std::integral_constant<int, kMmaControlReverseBlocks>{});
    if (control == kMmaControlFoldChain) return by_staging(tag, std::integral_constant<int, kMmaControlFoldChain>{});
#endif
    (void)control;
    return by_staging(tag, std::integral_constant<int, kMmaControlNone>{});
  };
  const char* e = p.cdt == DType::F32 ? by_control((float*)nullptr) : by_control((bf16_t*)nullptr);
  return e ? e : last_error();
}

const char* launch_mma_gemm(const GemmParams& p, void* stream) {
  if (p.M <= 0 || p.N <= 0) return nullptr;
  if (p.adt != DType::BF16 || p.bdt != DType::BF16)
    return "aligned mma gemm: the operands must be bfloat16 (the matrix unit's input type)";
  if (p.cdt != DType::BF16 && p.cdt != DType::F32) return "aligned mma gemm: the output must be bfloat16 or float32";
  if (p.lanes != 1 && p.lanes != 2 && p.lanes != 4 && p.lanes != 8) return "aligned mma gemm: lanes must be 1, 2, 4 or 8";
  int control = kMmaControlNone;
#if defined(ALIGNED_GPU_EMULATED)
  // Negative controls of the tests only: variants whose order depends on M (never built for a GPU).
  if (p.M > kMmaLanesKernelMaxM) {
    const ::aligned::emu::Fault f = ::aligned::emu::active_fault();
    if (f == ::aligned::emu::Fault::kMmaSplitKByM) control = kMmaControlSplitK;
    if (f == ::aligned::emu::Fault::kMmaBlockOrderByM) control = kMmaControlReverseBlocks;
    if (f == ::aligned::emu::Fault::kMmaFoldOrderByM && p.M > kMmaTiledMinM) control = kMmaControlFoldChain;
  }
#endif
  if (p.M > kMmaTiledMinM) return launch_mma_tiled(p, control, stream);
  const int64_t gx = (p.N + kMmaTile - 1) / kMmaTile;
  const bool lanes_kernel = p.M <= kMmaLanesKernelMaxM;
  const int64_t gy = lanes_kernel ? (p.M + kMmaTile - 1) / kMmaTile
                                  : (p.M + kMmaTile * kMmaRowWarps - 1) / (kMmaTile * kMmaRowWarps);
  if (gx > 0x7fffffff || gy > 65535) return "aligned mma gemm: problem too large for one grid";
  const dim3 grid((unsigned)gx, (unsigned)gy, 1);
  auto run = [&](auto* tag) {
    using TC = typename std::remove_pointer<decltype(tag)>::type;
    if (lanes_kernel)
      ALIGNED_LAUNCH(grid, kMmaLaneThreads, kMmaLanesSharedBytes, (gpu_stream_t)stream, mma_linear_lanes_kernel<TC>)(
          p, control);
    else
      ALIGNED_LAUNCH(grid, kMmaRowThreads, 0, (gpu_stream_t)stream, mma_linear_rows_kernel<TC>)(p, control);
  };
  if (p.cdt == DType::F32) run((float*)nullptr);
  else run((bf16_t*)nullptr);
  return last_error();
}

// This build's launcher as the table the glue reads (csrc/gpu/launchers.h).
extern const MmaLaunchers kMmaLaunchers;
const MmaLaunchers kMmaLaunchers = []() constexpr {
  MmaLaunchers t{};
  t.mma_gemm = &launch_mma_gemm;
  return t;
}();

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
