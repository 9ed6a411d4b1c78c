// moe_launch.cuh — the launchers of moe_api.h, defined once for both vendors (and the emulation target); included
// by exactly one TU per vendor: csrc/cuda/moe.cu, csrc/hip/moe.hip. Every grid is sized from the shapes (the
// tile list's capacity, moe_max_tiles), never from device data.
#pragma once

#include <type_traits>

#include "compat.cuh"  // first: the vendor runtime before common/
#include "moe_api.h"
#include "moe_kernels.cuh"
#if defined(ALIGNED_GPU_EMULATED)
#include "../emu/emulation.h"
#endif

namespace aligned::gpu::ALIGNED_GPU_BUILD {

namespace {

constexpr int kMoeElemThreads = 256;
constexpr int64_t kMoeMaxElemBlocks = 65535;

unsigned moe_elem_blocks(int64_t n) { return moe_capped_blocks(n, kMoeElemThreads, kMoeMaxElemBlocks); }

template <class T>
using MoeElem = typename std::remove_pointer<T>::type;

// The grouped GEMMs' grid is 2-D: x = the column block (cb of them), y = the tile, in launches of at most
// kMoeMaxTilesPerLaunch tiles (gridDim.y's limit on both vendors) starting at tile0. Each output is still one
// row's chain inside one block, so how the tiles are split over launches changes no bit. A 1-D grid of
// max_tiles * cb blocks broke HIP's gridDim.x * blockDim.x < 2^32 at DeepSeek-V3 sizes (T ~ 40K, k = 8: the mma
// kernel runs 512 threads a block on wave64); the x extent left, cb * threads, is the only limit, checked here.
constexpr int64_t kMoeMaxTilesPerLaunch = 65535;

const char* check_grouped(const MoeGroupedGemmParams& p, int64_t col_blocks, int64_t threads) {
  if (p.g.lanes != kLinearLanes) return "aligned moe grouped gemm: the experts' projections run 8 lanes";
  if (p.g.bias != nullptr) return "aligned moe grouped gemm: no bias";
  if (col_blocks * threads > 0xffffffffll || col_blocks > 0x7fffffffll)
    return "aligned moe grouped gemm: too many output columns for one grid row (column blocks x threads >= 2^32)";
  return nullptr;
}

// Runs launch(grid, tile0) over the tile list in chunks of at most kMoeMaxTilesPerLaunch tiles.
template <class Launch>
void for_tile_chunks(const MoeGroupedGemmParams& p, int64_t col_blocks, Launch&& launch) {
  for (int64_t tile0 = 0; tile0 < p.max_tiles; tile0 += kMoeMaxTilesPerLaunch) {
    const int64_t n = p.max_tiles - tile0 < kMoeMaxTilesPerLaunch ? p.max_tiles - tile0 : kMoeMaxTilesPerLaunch;
    launch(dim3((unsigned)col_blocks, (unsigned)n, 1), tile0);
  }
}

}  // namespace

const char* launch_moe_plan(const MoePlanParams& p, void* stream) {
  if (p.T * p.k == 0) return nullptr;
  ALIGNED_LAUNCH(1, kMoePlanThreads, 0, (gpu_stream_t)stream, moe_plan_kernel)(p);
  return last_error();
}

const char* launch_moe_gather(const MoeGatherParams& p, void* stream) {
  if (p.N * p.H == 0) return nullptr;
  with_type(p.dt, [&](auto* tp) {
    using T = MoeElem<decltype(tp)>;
    ALIGNED_LAUNCH(moe_elem_blocks(p.N * p.H), kMoeElemThreads, 0, (gpu_stream_t)stream, moe_gather_kernel<T>)(
        (const T*)p.x, p.src, (T*)p.out, p.N, p.H);
  });
  return last_error();
}

const char* launch_moe_grouped_gemm(const MoeGroupedGemmParams& p, void* stream) {
  if (p.g.M == 0 || p.g.N == 0) return nullptr;
  if (p.g.adt != p.g.bdt || (p.g.cdt != p.g.adt && p.g.cdt != DType::F32))
    return "aligned moe grouped gemm: A and B must share one dtype, C that dtype or float32";
  const int64_t cb = (p.g.N + kSmallCols - 1) / kSmallCols;
  if (const char* e = check_grouped(p, cb, kSmallThreads)) return e;
  int control = kMoeControlNone;
#if defined(ALIGNED_GPU_EMULATED)
  // Negative control of the tests only: tiles of more than one row as one chain per output (moe_kernels.cuh).
  if (::aligned::emu::active_fault() == ::aligned::emu::Fault::kMoeFmaChainByM) control = kMoeControlFmaChainByM;
#endif
  with_type(p.g.adt, [&](auto* tp) {
    using T = MoeElem<decltype(tp)>;
    for_tile_chunks(p, cb, [&](dim3 grid, int64_t tile0) {
      if (p.g.cdt == p.g.adt)
        ALIGNED_LAUNCH(grid, kSmallThreads, 0, (gpu_stream_t)stream, moe_grouped_gemm_kernel<T, T>)(p, tile0, control);
      else
        ALIGNED_LAUNCH(grid, kSmallThreads, 0, (gpu_stream_t)stream, moe_grouped_gemm_kernel<T, float>)(p, tile0, control);
    });
  });
  return last_error();
}

const char* launch_moe_grouped_mma_gemm(const MoeGroupedGemmParams& p, void* stream) {
  if (p.g.M == 0 || p.g.N == 0) return nullptr;
  if (p.g.adt != DType::BF16 || p.g.bdt != DType::BF16)
    return "aligned moe grouped mma gemm: the operands must be bfloat16 (the matrix unit's input type)";
  if (p.g.cdt != DType::BF16 && p.g.cdt != DType::F32)
    return "aligned moe grouped mma gemm: the output must be bfloat16 or float32";
  const int64_t cb = (p.g.N + kMmaTile - 1) / kMmaTile;
  if (const char* e = check_grouped(p, cb, kMmaLaneThreads)) return e;
  int control = kMmaControlNone;
#if defined(ALIGNED_GPU_EMULATED)
  // Negative control of the tests only: the k-block order reversed in tiles holding more than one token.
  if (::aligned::emu::active_fault() == ::aligned::emu::Fault::kMmaBlockOrderByM) control = kMmaControlReverseBlocks;
#endif
  for_tile_chunks(p, cb, [&](dim3 grid, int64_t tile0) {
    if (p.g.cdt == DType::F32)
      ALIGNED_LAUNCH(grid, kMmaLaneThreads, kMmaLanesSharedBytes, (gpu_stream_t)stream, moe_grouped_mma_kernel<float>)(
          p, tile0, control);
    else
      ALIGNED_LAUNCH(grid, kMmaLaneThreads, kMmaLanesSharedBytes, (gpu_stream_t)stream,
                     moe_grouped_mma_kernel<bf16_t>)(p, tile0, control);
  });
  return last_error();
}

const char* launch_moe_combine(const MoeCombineParams& p, void* stream) {
  if (p.T * p.H == 0) return nullptr;
  int control = kMoeControlNone;
#if defined(ALIGNED_GPU_EMULATED)
  // Negative control of the tests only: a combine in expert order (never built for a GPU).
  if (::aligned::emu::active_fault() == ::aligned::emu::Fault::kMoeCombineByExpert)
    control = kMoeControlCombineByExpert;
#endif
  with_type(p.dt, [&](auto* tp) {
    using T = MoeElem<decltype(tp)>;
    ALIGNED_LAUNCH(moe_elem_blocks(p.T * p.H), kMoeElemThreads, 0, (gpu_stream_t)stream, moe_combine_kernel<T>)(
        p, control);
  });
  return last_error();
}

const char* launch_moe_routing(const MoeRoutingParams& p, float* scratch, void* stream) {
  if (p.T == 0) return nullptr;
  with_type(p.dt, [&](auto* tp) {
    using T = MoeElem<decltype(tp)>;
    ALIGNED_LAUNCH(moe_route_blocks(p.T), kMoeRouteThreads, 0, (gpu_stream_t)stream, moe_routing_kernel<T>)(p, scratch);
  });
  return last_error();
}

const char* launch_moe_routing_backward(const MoeRoutingParams& p, float* scratch, int32_t* error_flags,
                                        void* stream) {
  if (p.T == 0) return nullptr;
  with_type(p.dt, [&](auto* tp) {
    using T = MoeElem<decltype(tp)>;
    ALIGNED_LAUNCH(moe_route_blocks(p.T), kMoeRouteThreads, 0, (gpu_stream_t)stream, moe_routing_backward_kernel<T>)(
        p, scratch, error_flags);
  });
  return last_error();
}

const char* launch_moe_grouped_routing(const MoeGroupedRoutingParams& p, float* scratch, void* stream) {
  if (p.T == 0) return nullptr;
  with_type(p.dt, [&](auto* tp) {
    using T = MoeElem<decltype(tp)>;
    ALIGNED_LAUNCH(moe_route_blocks(p.T), kMoeRouteThreads, 0, (gpu_stream_t)stream, moe_grouped_routing_kernel<T>)(
        p, scratch);
  });
  return last_error();
}

const char* launch_moe_grouped_routing_backward(const MoeGroupedRoutingParams& p, float* scratch,
                                                int32_t* error_flags, void* stream) {
  if (p.T == 0) return nullptr;
  with_type(p.dt, [&](auto* tp) {
    using T = MoeElem<decltype(tp)>;
    ALIGNED_LAUNCH(moe_route_blocks(p.T), kMoeRouteThreads, 0, (gpu_stream_t)stream,
                   moe_grouped_routing_backward_kernel<T>)(p, scratch, error_flags);
  });
  return last_error();
}

// This build's launchers as the table the glue reads (csrc/gpu/launchers.h).
extern const MoeLaunchers kMoeLaunchers;
const MoeLaunchers kMoeLaunchers = []() constexpr {
  MoeLaunchers t{};
  t.plan = &launch_moe_plan;
  t.gather = &launch_moe_gather;
  t.grouped_gemm = &launch_moe_grouped_gemm;
  t.grouped_mma_gemm = &launch_moe_grouped_mma_gemm;
  t.combine = &launch_moe_combine;
  t.routing = &launch_moe_routing;
  t.routing_backward = &launch_moe_routing_backward;
  t.grouped_routing = &launch_moe_grouped_routing;
  t.grouped_routing_backward = &launch_moe_grouped_routing_backward;
  return t;
}();

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
