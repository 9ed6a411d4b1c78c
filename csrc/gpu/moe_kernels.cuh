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

// Negative control of the tests only (emulation.h Fault kMoeCombineByExpert, built by the emulated launcher on
// request): the combine adds the ranks in the order of their grouped rows — by expert id — instead of the
// token's rank order. 0 everywhere else.
enum MoeControl : int { kMoeControlNone = 0, kMoeControlCombineByExpert = 1 };

// Step 1 (moe_api.h), one block: no atomics — thread e counts and then places its own expert's assignments in
// batch order, so every position is the same for every schedule and grid.
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
    if (s >= 0) out[i] = x[s * H + i % H];
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

// Steps 3 and 5, `fma`: block (tile, column block) runs aligned::linear's decode kernel body on the tile's rows.
template <typename T, typename TC>
__global__ void __launch_bounds__(kSmallThreads) moe_grouped_gemm_kernel(MoeGroupedGemmParams p, int64_t col_blocks) {
  const int64_t tile = (int64_t)blockIdx.x / col_blocks, cb = (int64_t)blockIdx.x % col_blocks;
  GemmParams g;
  if (!moe_tile_params<T, TC>(p, tile, g)) return;  // the whole block
  gemm_small_m_cols<T, TC, (int)kMoeTileRows>((const T*)g.A, g.a_sm, g.a_sk, (const T*)g.B, g.b_sn, g.b_sk,
                                             (const TC*)nullptr, (TC*)g.C, g.c_sm, g.M, g.N, g.K, cb);
}

// Steps 3 and 5, `mma`: block (tile, column block) runs aligned::linear_mma's M <= 16 kernel body on the tile.
// control (emulated negative controls only, mma_linear_kernels.cuh MmaControl): applied to tiles of more than one
// row — a kernel whose order follows how many tokens share the expert, which the batch-invariance test must catch.
template <typename TC>
__global__ void __launch_bounds__(kMmaLaneThreads) moe_grouped_mma_kernel(MoeGroupedGemmParams p, int64_t col_blocks,
                                                                         int control) {
  float* sums = dynamic_shared<float>();
  const int64_t tile = (int64_t)blockIdx.x / col_blocks, cb = (int64_t)blockIdx.x % col_blocks;
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
        acc = acc + w[best] * y[pos[best] * H + n];
      }
      for (int64_t r = 0; r < k; ++r) bad = bad || pos[r] < 0;
    } else {
      for (int64_t r = 0; r < k; ++r) {
        const int64_t s = pos[r];
        if (s < 0) {
          bad = true;
          continue;
        }
        acc = acc + w[r] * y[s * H + n];
      }
    }
    if (p.ys) acc = acc + (p.gate_logit ? moe_shared_gate(p.gate_logit[t]) : 1.0f) * p.ys[t * H + n];
    ((T*)p.out)[i] = from_f32<T>(bad ? float_of(0x7fc00000u) : acc);
  }
}

// ---- routing: one thread per token, moe.h's row functions (the CPU kernels call the same) --------------------
constexpr int kMoeRouteThreads = 128;

// Token t's scratch slice: S = 3E + k + 2 * n_group + 2 floats (moe_routing_scratch_floats), the byte flags
// (taken [E], kept [n_group]) packed into its first floats.
__device__ __forceinline__ float* moe_route_scratch(float* scratch, int64_t t, int64_t E, int64_t k, int64_t G) {
  return scratch + t * (3 * E + k + 2 * G + 2);
}

// Whether every id of the token lies in [0, E) (the backwards' in-kernel check).
__device__ __forceinline__ bool moe_ids_ok(const int64_t* ids, int64_t k, int64_t E) {
  bool ok = true;
  for (int64_t r = 0; r < k; ++r) ok = ok && ids[r] >= 0 && ids[r] < E;
  return ok;
}

template <typename T>
__global__ void __launch_bounds__(kMoeRouteThreads) moe_routing_kernel(MoeRoutingParams p, float* scratch) {
  for (int64_t t = global_thread_index(); t < p.T; t += global_thread_count()) {
    const T* z = (const T*)p.z + t * p.E;
    float* s = moe_route_scratch(scratch, t, p.E, p.k, 0);
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
    float* s = moe_route_scratch(scratch, t, E, k, 0);
    T* out = (T*)p.dz + t * E;
    if (!moe_ids_ok(p.ids + t * k, k, E)) {
      if (error_flags) error_flags[kErrExpertId] = 1;
      for (int64_t i = 0; i < E; ++i) out[i] = from_f32<T>(float_of(0x7fc00000u));
      continue;
    }
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
    float* s = moe_route_scratch(scratch, t, E, p.k, G);
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
    float* s = moe_route_scratch(scratch, t, E, k, p.n_group);
    T* out = (T*)p.dz + t * E;
    if (!moe_ids_ok(p.ids + t * k, k, E)) {
      if (error_flags) error_flags[kErrExpertId] = 1;
      for (int64_t i = 0; i < E; ++i) out[i] = from_f32<T>(float_of(0x7fc00000u));
      continue;
    }
    moe_grouped_routing_backward_row(p.gw + t * k, p.gs ? p.gs + t * E : nullptr, (const T*)p.z + t * E,
                                     p.ids + t * k, E, k, p.renormalize, p.scale, s, s + E, s + 3 * E, s + 2 * E);
    for (int64_t i = 0; i < E; ++i) out[i] = from_f32<T>(s[2 * E + i]);
  }
}

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
