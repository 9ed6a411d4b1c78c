// moe_kernels.cuh — the GPU kernels of moe_experts (CUDA and HIP, one source; the emulation target runs the same
// source): the plan (grouping by expert), the gather, the grouped projections over the plan's tiles, and the
// combine. The order of every token's numbers is csrc/common/moe.h's; the grouping only decides which rows run
// side by side (moe_api.h says how a call runs).
#pragma once

#include <stdint.h>

#include "compat.cuh"  // first: the vendor runtime header defines __host__ / __device__ for common/
#include "../common/moe.h"
#include "../common/params_moe.h"
#include "dense_api.h"
#include "gemm_fp32.cuh"
#include "mma_linear_kernels.cuh"
#include "moe_api.h"

namespace aligned::gpu::ALIGNED_GPU_BUILD {

constexpr int kMoePlanThreads = 256;

// Negative controls of the tests only (emulation.h Faults, built by the emulated launcher on request), 0
// everywhere else: kMoeControlCombineByExpert (kMoeCombineByExpert) — the combine adds the ranks in the order
// of their grouped rows, by expert id, instead of the token's rank order; kMoeControlFmaChainByM
// (kMoeFmaChainByM) — a grouped `fma` tile holding more than one row runs each output as one sequential chain
// instead of the 8-lane tree: a tile whose order follows how many tokens share the expert.
enum MoeControl : int { kMoeControlNone = 0, kMoeControlCombineByExpert = 1, kMoeControlFmaChainByM = 2 };

// Step 1 (moe_api.h), one block: no atomics — thread e counts and then places its own expert's assignments in
// batch order, so every position is the same for every schedule and grid. One block on purpose (not in scope of
// the merge's fixes, a known perf item): each thread scans the N = T * k ids twice per expert it owns, ~2 * N *
// ceil(E / 256) cached loads — about 10 us at a decode step (N <= 4K), a few ms at T = 64K, k = 8 (N = 512K,
// E = 256), small next to the grouped GEMMs there; a multi-block plan (per-block histograms, then a scan) would
// need a second launch or a grid-wide sync to stay atomic-free.
__global__ void __launch_bounds__(kMoePlanThreads) moe_plan_kernel(MoePlanParams p) {
  const int tid = (int)threadIdx.x, nt = (int)blockDim.x;
  const int64_t N = p.T * p.k, E = p.E;
  for (int64_t i = tid; i < N; i += nt) {
    p.src[i] = -1;
    const int64_t e = p.ids[i];
    if (e < 0 || e >= E) {
      p.pos[i] = -1;
      if (p.error_flags) p.error_flags[kErrExpertId] = 1;  // a flag, not a reduction
    }
  }
  for (int64_t e = tid; e < E; e += nt) {
    int64_t c = 0;
    for (int64_t i = 0; i < N; ++i) c += p.ids[i] == e ? 1 : 0;
    p.start[e + 1] = c;
  }
  __syncthreads();
  if (tid == 0) {  // prefix sum and the tile list (E + tiles steps)
    p.start[0] = 0;
    for (int64_t e = 0; e < E; ++e) p.start[e + 1] += p.start[e];
    int64_t n = 0;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r0 = p.start[e]; r0 < p.start[e + 1]; r0 += kMoeTileRows, ++n) {
        const int64_t left = p.start[e + 1] - r0;
        p.tiles[3 * n] = e;
        p.tiles[3 * n + 1] = r0;
        p.tiles[3 * n + 2] = left < kMoeTileRows ? left : kMoeTileRows;
      }
    for (; n < p.max_tiles; ++n) p.tiles[3 * n] = p.tiles[3 * n + 1] = p.tiles[3 * n + 2] = 0;
  }
  __syncthreads();
  for (int64_t e = tid; e < E; e += nt) {
    int64_t fill = p.start[e];
    for (int64_t i = 0; i < N; ++i)
      if (p.ids[i] == e) {
        p.pos[i] = fill;
        p.src[fill] = i / p.k;
        ++fill;
      }
  }
}

// Step 2: one thread per element of the grouped rows.
template <typename T>
__global__ void moe_gather_kernel(const T* __restrict__ x, const int64_t* __restrict__ src, T* __restrict__ out,
                                  int64_t N, int64_t H) {
  for (int64_t i = global_thread_index(); i < N * H; i += global_thread_count()) {
    const int64_t s = src[i / H];
    // rows past start[E] (their ids were bad): zeros, so silu_and_mul over all N rows never reads garbage
    out[i] = s >= 0 ? x[s * H + i % H] : from_f32<T>(0.0f);
  }
}

// The tile of block `tile` as the GemmParams of its rows and expert (M <= 16); false for an unused tile.
// T: the A and B element type, TC: C's.
template <typename T, typename TC>
__device__ __forceinline__ bool moe_tile_params(const MoeGroupedGemmParams& p, int64_t tile, GemmParams& g) {
  const int64_t e = p.tiles[3 * tile], r0 = p.tiles[3 * tile + 1], m = p.tiles[3 * tile + 2];
  if (m <= 0) return false;
  g = p.g;
  g.A = (const T*)p.g.A + r0 * p.g.a_sm;
  g.B = (const T*)p.g.B + e * p.b_se;
  g.C = (TC*)p.g.C + r0 * p.g.c_sm;
  g.M = m;
  return true;
}

// Steps 3 and 5, `fma`: block (x = column block, y = tile) runs aligned::linear's decode kernel body on the tile's rows.
template <typename T, typename TC>
__global__ void __launch_bounds__(kSmallThreads) moe_grouped_gemm_kernel(MoeGroupedGemmParams p, int64_t tile0,
                                                                         int control) {
  const int64_t tile = tile0 + (int64_t)blockIdx.y, cb = (int64_t)blockIdx.x;  // moe_launch.cuh: the 2-D grid
  GemmParams g;
  if (!moe_tile_params<T, TC>(p, tile, g)) return;  // the whole block
  if (control == kMoeControlFmaChainByM && g.M > 1) {  // NEGATIVE CONTROL: one chain per output, not 8 lanes
    const int64_t n = cb * kSmallCols + (int64_t)threadIdx.x;
    if (threadIdx.x < kSmallCols && n < g.N)
      for (int64_t m = 0; m < g.M; ++m) {
        float acc = 0.0f;
        for (int64_t kk = 0; kk < g.K; ++kk)
          acc = fma_f32(to_f32(((const T*)g.A)[m * g.a_sm + kk * g.a_sk]),
                        to_f32(((const T*)g.B)[n * g.b_sn + kk * g.b_sk]), acc);
        ((TC*)g.C)[m * g.c_sm + n] = linear_epilogue(acc, (const TC*)nullptr, n);
      }
    return;
  }
  gemm_small_m_cols<T, TC, (int)kMoeTileRows>((const T*)g.A, g.a_sm, g.a_sk, (const T*)g.B, g.b_sn, g.b_sk,
                                             (const TC*)nullptr, (TC*)g.C, g.c_sm, g.M, g.N, g.K, cb);
}

// Steps 3 and 5, `mma`: block (x = column block, y = tile) runs aligned::linear_mma's M <= 16 kernel body on the tile.
// control (emulated negative controls only, mma_linear_kernels.cuh MmaControl): applied to tiles of more than one
// row — a kernel whose order follows how many tokens share the expert, which the batch-invariance test must catch.
template <typename TC>
__global__ void __launch_bounds__(kMmaLaneThreads) moe_grouped_mma_kernel(MoeGroupedGemmParams p, int64_t tile0,
                                                                         int control) {
  float* sums = dynamic_shared<float>();
  const int64_t tile = tile0 + (int64_t)blockIdx.y, cb = (int64_t)blockIdx.x;  // moe_launch.cuh: the 2-D grid
  GemmParams g;
  if (!moe_tile_params<bf16_t, TC>(p, tile, g)) return;  // the whole block
  mma_lanes_tile<TC>(g, 0, cb * kMmaTile, g.M > 1 ? control : (int)kMmaControlNone, sums);
}

// Step 7: one thread per output element; the tree of moe.h moe_combine_row (acc = +0, + w_r * y_r in rank order,
// + g * y_s, one rounding). A token with a bad id is NaN.
template <typename T>
__global__ void moe_combine_kernel(MoeCombineParams p, int control) {
  const float* y = p.y;
  const int64_t k = p.k, H = p.H;
  for (int64_t i = global_thread_index(); i < p.T * H; i += global_thread_count()) {
    const int64_t t = i / H, n = i % H;
    const int64_t* pos = p.pos + t * k;
    const float* w = p.w + t * k;
    bool bad = false;
    float acc = 0.0f;
    if (control == kMoeControlCombineByExpert) {  // NEGATIVE CONTROL: ranks in grouped-row (expert) order
      int64_t last = -1;
      for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        for (int64_t r = 0; r < k; ++r)
          if (pos[r] > last && (best < 0 || pos[r] < pos[best])) best = r;
        if (best < 0) break;
        last = pos[best];
        acc = moe_combine_step(acc, w[best], y[pos[best] * H + n]);
      }
      for (int64_t r = 0; r < k; ++r) bad = bad || pos[r] < 0;
    } else {
      for (int64_t r = 0; r < k; ++r) {
        const int64_t s = pos[r];
        if (s < 0) {
          bad = true;
          continue;
        }
        acc = moe_combine_step(acc, w[r], y[s * H + n]);
      }
    }
    if (p.ys) acc = moe_combine_step(acc, p.gate_logit ? moe_shared_gate(p.gate_logit[t]) : 1.0f, p.ys[t * H + n]);
    ((T*)p.out)[i] = from_f32<T>(bad ? moe_nan_f32() : acc);
  }
}

// ---- routing: one thread per token, moe.h's row functions (the CPU kernels call the same) --------------------
// The calling thread's scratch slice: moe_route_scratch_floats(E, k, G) floats at its global thread slot (the
// grid is capped, moe_api.h moe_route_blocks, and the kernels loop over tokens, so the buffer is bounded by the
// grid, not by T), the byte flags (taken [E], kept [n_group]) packed into its floats.
__device__ __forceinline__ float* moe_route_scratch(float* scratch, int64_t E, int64_t k, int64_t G) {
  return scratch + global_thread_index() * moe_route_scratch_floats(E, k, G);
}

// The backwards' in-kernel id check: false (and error_flags[kErrExpertId] = 1, the token's dz row NaN) unless
// every id of the token lies in [0, E).
template <typename T>
__device__ __forceinline__ bool moe_route_ids_ok_or_nan(const int64_t* ids, int64_t k, int64_t E,
                                                        int32_t* error_flags, T* dz_row) {
  bool ok = true;
  for (int64_t r = 0; r < k; ++r) ok = ok && ids[r] >= 0 && ids[r] < E;
  if (ok) return true;
  if (error_flags) error_flags[kErrExpertId] = 1;
  for (int64_t i = 0; i < E; ++i) dz_row[i] = from_f32<T>(moe_nan_f32());
  return false;
}

template <typename T>
__global__ void __launch_bounds__(kMoeRouteThreads) moe_routing_kernel(MoeRoutingParams p, float* scratch) {
  for (int64_t t = global_thread_index(); t < p.T; t += global_thread_count()) {
    const T* z = (const T*)p.z + t * p.E;
    float* s = moe_route_scratch(scratch, p.E, p.k, 0);
    moe_scores_row(z, p.E, p.scoring, p.scores + t * p.E);
    moe_topk_row(z, p.scores + t * p.E, p.E, p.k, p.scoring, p.renormalize, (unsigned char*)s, p.ids + t * p.k,
                 p.w + t * p.k);
  }
}

template <typename T>
__global__ void __launch_bounds__(kMoeRouteThreads) moe_routing_backward_kernel(MoeRoutingParams p, float* scratch,
                                                                               int32_t* error_flags) {
  for (int64_t t = global_thread_index(); t < p.T; t += global_thread_count()) {
    const int64_t E = p.E, k = p.k;
    float* s = moe_route_scratch(scratch, E, k, 0);
    T* out = (T*)p.dz + t * E;
    if (!moe_route_ids_ok_or_nan(p.ids + t * k, k, E, error_flags, out)) continue;
    moe_routing_backward_row(p.gw + t * k, p.gs ? p.gs + t * E : nullptr, (const T*)p.z + t * E, p.ids + t * k, E,
                             k, p.scoring, p.renormalize, s, s + E, s + 2 * E);
    for (int64_t i = 0; i < E; ++i) out[i] = from_f32<T>(s[2 * E + i]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kMoeRouteThreads) moe_grouped_routing_kernel(MoeGroupedRoutingParams p,
                                                                              float* scratch) {
  for (int64_t t = global_thread_index(); t < p.T; t += global_thread_count()) {
    const int64_t E = p.E, G = p.n_group;
    float* s = moe_route_scratch(scratch, E, p.k, G);
    // key [E], gscore [G], then the byte flags taken [E] and kept [G] in the floats after them
    unsigned char* flags = (unsigned char*)(s + E + G);
    moe_grouped_routing_row((const T*)p.z + t * E, p.bias, E, p.k, G, p.topk_group, p.renormalize, p.scale, s,
                            s + E, flags, flags + E, p.scores + t * E, p.ids + t * p.k, p.w + t * p.k);
  }
}

template <typename T>
__global__ void __launch_bounds__(kMoeRouteThreads) moe_grouped_routing_backward_kernel(MoeGroupedRoutingParams p,
                                                                                       float* scratch,
                                                                                       int32_t* error_flags) {
  for (int64_t t = global_thread_index(); t < p.T; t += global_thread_count()) {
    const int64_t E = p.E, k = p.k;
    float* s = moe_route_scratch(scratch, E, k, p.n_group);
    T* out = (T*)p.dz + t * E;
    if (!moe_route_ids_ok_or_nan(p.ids + t * k, k, E, error_flags, out)) continue;
    moe_grouped_routing_backward_row(p.gw + t * k, p.gs ? p.gs + t * E : nullptr, (const T*)p.z + t * E,
                                     p.ids + t * k, E, k, p.renormalize, p.scale, s, s + E, s + 3 * E, s + 2 * E);
    for (int64_t i = 0; i < E; ++i) out[i] = from_f32<T>(s[2 * E + i]);
  }
}

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
