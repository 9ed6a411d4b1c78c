// attention_kernels.cuh — GPU attention (forward over packed or paged K/V, KV-cache write), one source for
// CUDA, HIP and the emulation target. The arithmetic per (query row, head) is csrc/common/attention.h's,
// called piece by piece; this file only decides which thread computes which piece.
//
// Design (fma profile: fp32 fma on CUDA cores / VALU, so GPU == CPU bit for bit):
//   * one block per work item of the host plan = (sequence, KV head g, row block of <= 16 rows, KV split of
//     512 keys). Decode therefore runs one block per (sequence, KV head, split): a 32k context is 64 blocks
//     per KV head, each streaming its 512 keys once — memory-bound by design. No block-count heuristic:
//     the grid is the plan, and the plan is a function of the metadata only.
//   * a block is kAttnGroups reduction groups of 32 lanes (a CUDA warp, half an AMD wave64). The (row, head)
//     pairs of the block (nr rows x G query heads of the KV head) are taken kAttnGroups at a time, one per
//     group; for each round the block stages each K tile (32 keys) once in shared memory as fp32 (exact
//     widening) and every group uses it;
//   * within a group, lane j owns key j of the tile: s_j = attn_dot(q, k_j) * scale (one sequential fma
//     chain over d, as on the CPU) and p_j = attn_tile_prob(...). m_new is the sequential max of
//     attention.h over the gathered scores (every lane gathers them by shuffles and computes the same
//     bits), the tile sum is group_sum_tree (== fold_lanes, compat.cuh). Lane i then owns the elements
//     d = i, i + 32, ... : pv[d] is the fma chain over j ascending of (p_j, v_j[d]) with p_j shuffled from
//     lane j and v_j[d] read straight from global memory (coalesced across lanes), acc[d] in registers;
//   * the split's state (m, l, acc) is written to the plan's partial slot; a second kernel merges a row's
//     splits in split order with attention.h's merge pieces, one output element per lane. No atomics;
//     every sum has one fixed order, whatever the grid or the number of blocks in flight.
// A tile lane beyond a row's valid keys computes a score from a zero-padded or foreign key, which is never
// used: attn_tile_max reads j < nv, attn_tile_prob gives 0 for j >= nv, and pv runs over j < nv.
#pragma once

#include "compat.cuh"  // first: the vendor runtime header before numerics.h (ALIGNED_HD)

#include "../common/attention.h"
#include "attention_api.h"

namespace aligned::gpu {

constexpr int kAttnGroups = 8;  // reduction groups per block (256 threads); any value gives the same bits
constexpr int kAttnThreads = kAttnGroups * kGroupLanes;
constexpr int kAttnChunks = (int)(kGpuAttnMaxD / kGroupLanes);  // accumulators per lane
constexpr int kAttnKStride = (int)kGpuAttnMaxD + 1;              // padded fp32 K row (no bank conflicts)

// v from lane src of the same 32-lane group (every lane of the group must call it).
__device__ __forceinline__ float shfl_idx32(float v, int src) {
#if defined(ALIGNED_GPU_HIP)
  return __shfl(v, src, kGroupLanes);
#else
  return __shfl_sync(0xffffffffu, v, src, kGroupLanes);
#endif
}

// The K/V row accessor of a work record (attention.h: KvRows, shared with the CPU backend).
__device__ __forceinline__ KvRows work_kv_rows(const AttnFwdParams& p, const int64_t* w) {
  return KvRows{p.Hkv, p.D, p.block_size, w[kWkBegin], w[kWtableRow] >= 0 ? p.block_tables + w[kWtableRow] : nullptr};
}
__device__ __forceinline__ int64_t work_row_keys(const AttnFwdParams& p, const int64_t* w, int64_t r) {
  return attn_row_keys(w[kWnCtx] - w[kWqLen] + w[kWr0] + r, w[kWnCtx], p.causal);
}

// One (row block, split) item: the split's partials of every (row, head) of the block.
template <typename T>
__global__ void __launch_bounds__(kAttnThreads) attention_split_kernel(AttnFwdParams p) {
  __shared__ float ktile[kAttnTile * kAttnKStride];
  const int64_t* w = p.items + (int64_t)blockIdx.x * kAttnWorkFields;
  const int64_t D = p.D, G = p.Hq / p.Hkv, nr = w[kWnr], P = nr * G, sp = w[kWsplit], ns = w[kWnSplits];
  const int64_t key0 = sp * kAttnSplit, stride = D + 2;
  const KvRows kv = work_kv_rows(p, w);
  const T* K = (const T*)p.k;
  const T* V = (const T*)p.v;
  const int lane = (int)(threadIdx.x % kGroupLanes), grp = (int)(threadIdx.x / kGroupLanes);
  int64_t nk_max = 0;  // the block's longest row (uniform over the block: every thread computes it)
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t n = work_row_keys(p, w, r);
    nk_max = n > nk_max ? n : nk_max;
  }
  const int64_t key_end = nk_max < key0 + kAttnSplit ? nk_max : key0 + kAttnSplit;
  for (int64_t round0 = 0; round0 < P; round0 += kAttnGroups) {
    const int64_t pr = round0 + grp;
    const int64_t r = pr / G, h = pr % G;
    const int64_t nk = pr < P ? work_row_keys(p, w, r) : 0;
    const bool active = nk > key0;  // uniform over the group
    const int64_t qrow = ((w[kWqBegin] + w[kWr0] + r) * p.Hq + w[kWg] * G + h) * D;
    float m = neg_inf_f32(), l = 0.0f, acc[kAttnChunks];
#pragma unroll
    for (int i = 0; i < kAttnChunks; ++i) acc[i] = 0.0f;
    for (int64_t j0 = key0; j0 < key_end; j0 += kAttnTile) {
      const int n_tile = (int)(key_end - j0 < kAttnTile ? key_end - j0 : kAttnTile);
      __syncthreads();  // the previous tile's readers are done
      for (int64_t e = threadIdx.x; e < kAttnTile * D; e += kAttnThreads) {
        const int j = (int)(e / D);
        const int64_t d = e % D;
        ktile[j * kAttnKStride + d] = j < n_tile ? to_f32(K[kv.offset(j0 + j, w[kWg]) + d]) : 0.0f;
      }
      __syncthreads();
      if (!active || nk <= j0) continue;  // uniform over the group; barriers above are reached by all
      const int nv = (int)(nk - j0 < kAttnTile ? nk - j0 : kAttnTile);
      const float s_lane = attn_dot((const T*)p.q + qrow, ktile + lane * kAttnKStride, D) * p.scale;
      float s[kAttnTile];
#pragma unroll
      for (int j = 0; j < kAttnTile; ++j) s[j] = shfl_idx32(s_lane, j);
      const float m_new = attn_tile_max(s, nv, m);
      const float mu = attn_shift(m_new);
      const float alpha = exp_f32(m - mu);
      const float p_lane = attn_tile_prob(s_lane, lane, nv, mu);
      l = attn_tile_l(l, alpha, group_sum_tree(p_lane));
      float pv[kAttnChunks];
#pragma unroll
      for (int i = 0; i < kAttnChunks; ++i) pv[i] = 0.0f;
      for (int j = 0; j < kAttnTile; ++j) {
        const float pj = shfl_idx32(p_lane, j);  // every lane shuffles (uniform), only j < nv is used
        if (j >= nv) continue;
        const T* vj = V + kv.offset(j0 + j, w[kWg]);
#pragma unroll
        for (int i = 0; i < kAttnChunks; ++i) {
          const int64_t d = lane + (int64_t)i * kGroupLanes;
          if (d < D) pv[i] = attn_pv_step(pj, to_f32(vj[d]), pv[i]);
        }
      }
#pragma unroll
      for (int i = 0; i < kAttnChunks; ++i) acc[i] = attn_acc_step(acc[i], alpha, pv[i]);
      m = m_new;
    }
    if (!active) continue;
    float* st = p.part + w[kWpartOffset] + (pr * ns + sp) * stride;
    if (lane == 0) {
      st[0] = m;
      st[1] = l;
    }
#pragma unroll
    for (int i = 0; i < kAttnChunks; ++i) {
      const int64_t d = lane + (int64_t)i * kGroupLanes;
      if (d < D) st[2 + d] = acc[i];
    }
  }
}

// One row block: merge every (row, head)'s splits in split order into out and lse.
template <typename T>
__global__ void __launch_bounds__(kAttnThreads) attention_merge_kernel(AttnFwdParams p) {
  const int64_t* w = p.blocks + (int64_t)blockIdx.x * kAttnWorkFields;
  const int64_t D = p.D, G = p.Hq / p.Hkv, P = w[kWnr] * G, ns_block = w[kWnSplits], stride = D + 2;
  const int lane = (int)(threadIdx.x % kGroupLanes), grp = (int)(threadIdx.x / kGroupLanes);
  for (int64_t pr = grp; pr < P; pr += kAttnGroups) {
    const int64_t r = pr / G, h = pr % G;
    const int64_t ns = attn_num_splits(work_row_keys(p, w, r));
    const float* part = p.part + w[kWpartOffset] + pr * ns_block * stride;
    const int64_t row = (w[kWqBegin] + w[kWr0] + r) * p.Hq + w[kWg] * G + h;
    float M, Mu, L;
    attn_merge_stats(part, stride, ns, &M, &Mu, &L);
    float O[kAttnChunks];
#pragma unroll
    for (int i = 0; i < kAttnChunks; ++i) O[i] = 0.0f;
    for (int64_t s = 0; s < ns; ++s) {
      const float ws = attn_merge_weight(part, stride, s, Mu);
#pragma unroll
      for (int i = 0; i < kAttnChunks; ++i) {
        const int64_t d = lane + (int64_t)i * kGroupLanes;
        if (d < D) O[i] = attn_merge_step(part[s * stride + 2 + d], ws, O[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kAttnChunks; ++i) {
      const int64_t d = lane + (int64_t)i * kGroupLanes;
      if (d < D) ((T*)p.out)[row * D + d] = from_f32<T>(attn_merge_out(O[i], L));
    }
    if (lane == 0) p.lse[row] = attn_merge_lse(M, L);
  }
}

// cache[slot] = k[t] for every token with a slot in [0, n_slots) (-1: padding). The glue validated host
// slot mappings with the planner; the bound test here keeps a device slot mapping memory-safe too.
template <typename T>
__global__ void cache_write_kernel(CacheWriteParams p) {
  const int64_t n = p.T * p.row_elems;
  for (int64_t i = global_thread_index(); i < n; i += global_thread_count()) {
    const int64_t t = i / p.row_elems, e = i % p.row_elems, slot = p.slots[t];
    if (slot < 0 || slot >= p.n_slots) continue;
    ((T*)p.k_cache)[slot * p.row_elems + e] = ((const T*)p.k)[i];
    ((T*)p.v_cache)[slot * p.row_elems + e] = ((const T*)p.v)[i];
  }
}

}  // namespace aligned::gpu
