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

namespace aligned::gpu::ALIGNED_GPU_BUILD {

constexpr int kAttnGroups = 8;  // reduction groups per block (256 threads); any value gives the same bits
constexpr int kAttnThreads = kAttnGroups * kGroupLanes;
constexpr int kAttnChunks = (int)(kGpuAttnMaxD / kGroupLanes);  // accumulators per lane
constexpr int kAttnChunksWide = (int)(kGpuAttnMaxDWide / kGroupLanes);  // the wide forward's (kStageK = false)
constexpr int kAttnKStride = (int)kGpuAttnMaxD + 1;              // padded fp32 K row (no bank conflicts)
// The padded fp32 K row of a head_dim: D + 1 floats (lane j reads row j: consecutive lanes, consecutive banks).
__host__ __device__ inline int64_t kAttnKStrideOf(int64_t D) { return D + 1; }
// V row offset when K is staged and V is not: by the time V is read, key_off holds the next tile's offsets (but for
// the split's last tile, whose next is never written), so they are recomputed. The wide variant, which prefetches
// nothing, reads this tile's from key_off.
__device__ __forceinline__ int64_t key_off_v(const KvRows& kv, int64_t j, int64_t g) { return kv.offset(j, g); }

// The K/V row accessor of a work record (attention.h: KvRows, shared with the CPU backend).
__device__ __forceinline__ KvRows work_kv_rows(const AttnFwdParams& p, const int64_t* w) {
  return KvRows{p.Hkv, p.D, p.block_size, w[kWkBegin], w[kWtableRow] >= 0 ? p.block_tables + w[kWtableRow] : nullptr};
}
__device__ __forceinline__ int64_t work_row_keys(const AttnFwdParams& p, const int64_t* w, int64_t r) {
  return attn_row_keys(w[kWnCtx] - w[kWqLen] + w[kWr0] + r, w[kWnCtx], p.causal);
}

// The plan header against the run's tensors (attention_plan.h attn_plan_mismatch, replay form: a graph replays
// its captured run dims over the plan written for this step): the same verdict in every block and thread (the
// header is one buffer). A plan that does not fit sets the error word (block 0) and no
// record is read.
__device__ __forceinline__ bool attn_plan_fits(const AttnFwdParams& p) {
  const bool ok = attn_plan_mismatch(p.plan_header, p.run, /*replay=*/true) == 0;
  if (!ok && blockIdx.x == 0 && threadIdx.x == 0 && p.error_flags) p.error_flags[kErrAttentionPlan] = 1;
  return ok;
}

// The shared memory of attention_split_kernel (dynamic): the K tile as fp32 [kAttnTile][D + 1] (padded: lane j reads
// row j, conflict-free), then — kStageV — the V tile as fp32 [kAttnTile][D] (lane i reads columns i, i + 32, ...).
// Widening to fp32 when staging is exact, so the dot and pv chains see the same values as from global memory.
__host__ __device__ inline size_t attn_split_smem_bytes(int64_t D, bool stage_v) {
  return (size_t)kAttnTile * (size_t)(D + 1) * 4 + (stage_v ? (size_t)kAttnTile * (size_t)D * 4 : 0);
}
// 16-byte vectors of K (and of V) per thread and tile held in registers by the prefetch: D = 256 fp32 is 8.
constexpr int kAttnPrefetchVecs = (int)(kAttnTile * kGpuAttnMaxD * 4 / 16 / kAttnThreads);

// One (row block, split) item: the split's partials of every (row, head) of the block. The grid is the plan
// buffer's capacity; blocks past the header's item count return at once.
// Per tile of 32 keys the block (1) computes the 32 keys' row offsets once (block table lookups: 32 divisions per
// tile instead of one per element), (2) stages K — and with kStageV also V — in shared memory with 16-byte loads
// when the rows allow (every group then reads V from shared memory instead of each re-reading it from L1/L2), and
// (3) keeps the NEXT tile's vectors in flight in registers while the groups compute this one (prefetch). kStageV is
// false only where the K and V tiles do not fit the device's shared memory (fp32, D > 224 on a 64 KB-LDS gfx942):
// then V is read from global memory as before. The arithmetic per (row, head) is the same in both (attention.h).
// The wide variant (kStageK = false, kChunks = kAttnChunksWide; head_dim up to kGpuAttnMaxDWide) stages nothing: lane
// j reads key j's row from global memory for its score, V comes from global memory, both at the tile's row offsets
// (key_off, written per tile instead of one tile ahead); the chains are the same.
template <typename T, bool kStageV, int kChunks = kAttnChunks, bool kStageK = true>
__global__ void __launch_bounds__(kAttnThreads) attention_split_kernel(AttnFwdParams p) {
  static_assert(kStageK || !kStageV, "V is staged only with K");
  float* const ktile = dynamic_shared<float>();
  float* const vtile = ktile + kAttnTile * kAttnKStrideOf(p.D);
  __shared__ int64_t key_off[kAttnTile];  // element offset of key j0 + j's row for KV head g (attention.h KvRows)
  if (!attn_plan_fits(p) || (int64_t)blockIdx.x >= p.plan_header[kPnItems]) return;  // uniform over the block
  const int64_t* w = p.items + (int64_t)blockIdx.x * kAttnWorkFields;
  const int64_t D = p.D, G = p.Hq / p.Hkv, nr = w[kWnr], P = nr * G, sp = w[kWsplit], ns = w[kWnSplits];
  const int64_t key0 = sp * kAttnSplit, stride = D + 2, kstride = kAttnKStrideOf(D);
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
  // 16-byte staging: every key row of K / V starts 16-byte aligned (base, Hkv * D and D multiples of a vector)
  constexpr int kV = kVecElems<T>;
  const bool vec = kStageK && D % kV == 0 && (p.Hkv * D) % kV == 0 && is_vec_aligned(K) && is_vec_aligned(V) &&
                   D / kV * kAttnTile <= (int64_t)kAttnPrefetchVecs * kAttnThreads;
  const int vpr = (int)(D / kV);  // vectors per key row
  int4 kpre[kAttnPrefetchVecs], vpre[kAttnPrefetchVecs];
  // the tile's key offsets (thread j < 32), then its vectors into registers (all threads)
  auto tile_offsets = [&](int64_t j0) {
    if (threadIdx.x < kAttnTile) {
      const int64_t j = j0 + threadIdx.x;
      key_off[threadIdx.x] = j < key_end ? kv.offset(j, w[kWg]) : -1;
    }
  };
  auto fetch = [&](int n_tile) {  // needs key_off of the tile (after a barrier)
#pragma unroll
    for (int u = 0; u < kAttnPrefetchVecs; ++u) {
      const int idx = (int)threadIdx.x + u * kAttnThreads, j = idx / (vpr > 0 ? vpr : 1), c = idx - j * vpr;
      if (vec && idx < kAttnTile * vpr && j < n_tile) {
        kpre[u] = *reinterpret_cast<const int4*>(K + key_off[j] + c * kV);
        if (kStageV) vpre[u] = *reinterpret_cast<const int4*>(V + key_off[j] + c * kV);
      }
    }
  };
  auto stage = [&](int n_tile) {  // registers (vec) or element loads -> shared memory, fp32; rows >= n_tile are 0
    if (vec) {
#pragma unroll
      for (int u = 0; u < kAttnPrefetchVecs; ++u) {
        const int idx = (int)threadIdx.x + u * kAttnThreads, j = idx / (vpr > 0 ? vpr : 1), c = idx - j * vpr;
        if (idx >= kAttnTile * vpr) continue;
        T kt[kV], vt[kV];
        memcpy(kt, &kpre[u], 16);
        if (kStageV) memcpy(vt, &vpre[u], 16);
#pragma unroll
        for (int i = 0; i < kV; ++i) {
          ktile[j * kstride + c * kV + i] = j < n_tile ? to_f32(kt[i]) : 0.0f;
          if (kStageV) vtile[j * D + c * kV + i] = j < n_tile ? to_f32(vt[i]) : 0.0f;
        }
      }
    } else {
      for (int e = (int)threadIdx.x; e < kAttnTile * D; e += kAttnThreads) {
        const int j = e / (int)D, d = e - j * (int)D;
        ktile[j * kstride + d] = j < n_tile ? to_f32(K[key_off[j] + d]) : 0.0f;
        if (kStageV) vtile[j * D + d] = j < n_tile ? to_f32(V[key_off[j] + d]) : 0.0f;
      }
    }
  };
  for (int64_t round0 = 0; round0 < P; round0 += kAttnGroups) {
    const int64_t pr = round0 + grp;
    const int64_t r = pr / G, h = pr % G;
    const int64_t nk = pr < P ? work_row_keys(p, w, r) : 0;
    const bool active = nk > key0;  // uniform over the group
    const int64_t qrow = ((w[kWqBegin] + w[kWr0] + r) * p.Hq + w[kWg] * G + h) * D;
    float m = neg_inf_f32(), l = 0.0f, acc[kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) acc[i] = 0.0f;
    if (kStageK && key0 < key_end) {  // the first tile's offsets and vectors
      __syncthreads();  // key_off / the tiles of the previous round are no longer read
      tile_offsets(key0);
      __syncthreads();
      fetch((int)(key_end - key0 < kAttnTile ? key_end - key0 : kAttnTile));
    }
    for (int64_t j0 = key0; j0 < key_end; j0 += kAttnTile) {
      const int n_tile = (int)(key_end - j0 < kAttnTile ? key_end - j0 : kAttnTile);
      __syncthreads();  // the previous tile's readers are done
      // The wide variant stages nothing and prefetches nothing: key_off holds THIS tile's row offsets, which its score
      // and pv loops read. (They recomputed kv.offset per key and lane — on paged K/V a 64-bit division, inside the
      // unrolled pv loop — and spilled 284-300 B per thread on sm_80/90, 192-196 B on sm_100, ptxas -v; reading
      // key_off: 113-128 registers, no spill, 2 blocks of 256 threads per SM instead of 4 — speed unmeasured.)
      if (kStageK) stage(n_tile);
      else tile_offsets(j0);
      __syncthreads();
      const int64_t j1 = j0 + kAttnTile;
      if (kStageK && j1 < key_end) {  // the next tile: offsets now, its vectors in flight during this tile's work
        tile_offsets(j1);
        __syncthreads();
        fetch((int)(key_end - j1 < kAttnTile ? key_end - j1 : kAttnTile));
      }
      if (!active || nk <= j0) continue;  // uniform over the group; barriers above are reached by all
      const int nv = (int)(nk - j0 < kAttnTile ? nk - j0 : kAttnTile);
      // (wide: lanes past the tile's keys have no row to read and their score is never used, attention.h step 3)
      const float s_lane = kStageK         ? attn_dot((const T*)p.q + qrow, ktile + lane * kstride, D) * p.scale
                           : lane < n_tile ? attn_dot((const T*)p.q + qrow, K + key_off[lane], D) * p.scale
                                           : 0.0f;
      float s[kAttnTile];
#pragma unroll
      for (int j = 0; j < kAttnTile; ++j) s[j] = shfl_idx32(s_lane, j);
      const float m_new = attn_tile_max(s, nv, m);
      const float mu = attn_shift(m_new);
      const float alpha = exp_f32(m - mu);
      const float p_lane = attn_tile_prob(s_lane, lane, nv, mu);
      l = attn_tile_l(l, alpha, group_sum_tree(p_lane));
      float pv[kChunks];
#pragma unroll
      for (int i = 0; i < kChunks; ++i) pv[i] = 0.0f;
#pragma unroll 4
      for (int j = 0; j < kAttnTile; ++j) {
        const float pj = shfl_idx32(p_lane, j);  // every lane shuffles (uniform), only j < nv is used
        if (j >= nv) continue;
        // (V unstaged: the staged-K variant's key_off holds the next tile's offsets by now, the wide one's this tile's;
        // the wide variant's loads are then one row pointer plus constant offsets)
        const T* const vj = kStageK ? nullptr : V + key_off[j] + lane;
#pragma unroll
        for (int i = 0; i < kChunks; ++i) {
          const int64_t d = lane + (int64_t)i * kGroupLanes;
          if (d < D)
            pv[i] = attn_pv_step(pj, kStageV   ? vtile[j * D + d]
                                     : kStageK ? to_f32(V[key_off_v(kv, j0 + j, w[kWg]) + d])
                                               : to_f32(vj[i * kGroupLanes]),
                                 pv[i]);
        }
      }
#pragma unroll
      for (int i = 0; i < kChunks; ++i) acc[i] = attn_acc_step(acc[i], alpha, pv[i]);
      m = m_new;
    }
    if (!active) continue;
    float* st = p.part + w[kWpartOffset] + (pr * ns + sp) * stride;
    if (lane == 0) {
      st[0] = m;
      st[1] = l;
    }
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int64_t d = lane + (int64_t)i * kGroupLanes;
      if (d < D) st[2 + d] = acc[i];
    }
  }
}

// One row block: merge every (row, head)'s splits in split order into out and lse.
template <typename T, int kChunks = kAttnChunks>
__global__ void __launch_bounds__(kAttnThreads) attention_merge_kernel(AttnFwdParams p) {
  if (!attn_plan_fits(p)) {  // a plan for another call: NaN outputs (never stale bits), flag set above
    const float nan = float_of(0x7fc00000u);
    const int64_t n = p.run.q_rows * p.Hq;
    for (int64_t i = global_thread_index(); i < n * p.D; i += global_thread_count()) ((T*)p.out)[i] = from_f32<T>(nan);
    for (int64_t i = global_thread_index(); i < n; i += global_thread_count()) p.lse[i] = nan;
    return;
  }
  if (p.plan_header[kPTq] < p.run.q_rows) {
    // A replayed graph's padding rows (the plan written for this step covers fewer rows than the captured q):
    // NaN, never uninitialised bits. Disjoint from the planned rows; the whole grid strides over them.
    const float nan = float_of(0x7fc00000u);
    const int64_t b = p.plan_header[kPTq] * p.Hq, e = p.run.q_rows * p.Hq;
    for (int64_t i = b * p.D + global_thread_index(); i < e * p.D; i += global_thread_count())
      ((T*)p.out)[i] = from_f32<T>(nan);
    for (int64_t i = b + global_thread_index(); i < e; i += global_thread_count()) p.lse[i] = nan;
  }
  if ((int64_t)blockIdx.x >= p.plan_header[kPnBlocks]) return;
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
    float O[kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) O[i] = 0.0f;
    for (int64_t s = 0; s < ns; ++s) {
      const float ws = attn_merge_weight(part, stride, s, Mu);
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int64_t d = lane + (int64_t)i * kGroupLanes;
        if (d < D) O[i] = attn_merge_step(part[s * stride + 2 + d], ws, O[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int64_t d = lane + (int64_t)i * kGroupLanes;
      if (d < D) ((T*)p.out)[row * D + d] = from_f32<T>(attn_merge_out(O[i], L));
    }
    if (lane == 0) p.lse[row] = attn_merge_lse(M, L);
  }
}

// ---- backward (attention.h "backward"; packed K/V) ---------------------------------------------------------
// delta[i] = fma chain over d of (dO, O), one thread per (row, head).
template <typename T>
__global__ void attention_bwd_delta_kernel(AttnBwdParams p) {
  for (int64_t i = global_thread_index(); i < p.rows; i += global_thread_count())
    p.delta[i] = attn_dot((const T*)p.dout + i * p.f.D, (const T*)p.out + i * p.f.D, p.f.D);
}

// dq of one row block: a group per (row, head) pair; lane j owns key j of each tile (s_j, dp_j, ds_j), lane i
// owns the elements d = i, i + 32, ...: dq[d] = scale * (fma chain over keys ascending of (ds_j, k_j[d])).
// kStageK = false (the wide variant, head_dim up to kGpuAttnMaxDWide): K read from global memory, same chains.
template <typename T, int kChunks = kAttnChunks, bool kStageK = true>
__global__ void __launch_bounds__(kAttnThreads) attention_bwd_dq_kernel(AttnBwdParams p) {
  __shared__ float ktile[kAttnTile * kAttnKStride];
  const AttnFwdParams& f = p.f;
  const int64_t* w = f.blocks + (int64_t)blockIdx.x * kAttnWorkFields;
  const int64_t D = f.D, G = f.Hq / f.Hkv, nr = w[kWnr], P = nr * G;
  const KvRows kv = work_kv_rows(f, w);
  const T* K = (const T*)f.k;
  const T* V = (const T*)f.v;
  const int lane = (int)(threadIdx.x % kGroupLanes), grp = (int)(threadIdx.x / kGroupLanes);
  int64_t nk_max = 0;
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t n = work_row_keys(f, w, r);
    nk_max = n > nk_max ? n : nk_max;
  }
  for (int64_t round0 = 0; round0 < P; round0 += kAttnGroups) {
    const int64_t pr = round0 + grp, r = pr / G, h = pr % G;
    const int64_t nk = pr < P ? work_row_keys(f, w, r) : 0;
    const int64_t row = (w[kWqBegin] + w[kWr0] + r) * f.Hq + w[kWg] * G + h;
    const float l = pr < P ? p.lse[row] : 0.0f, dl = pr < P ? p.delta[row] : 0.0f;
    float acc[kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) acc[i] = 0.0f;
    for (int64_t j0 = 0; j0 < nk_max; j0 += kAttnTile) {
      const int n_tile = (int)(nk_max - j0 < kAttnTile ? nk_max - j0 : kAttnTile);
      if (kStageK) {
        __syncthreads();
        for (int64_t e = threadIdx.x; e < kAttnTile * D; e += kAttnThreads) {
          const int j = (int)(e / D);
          const int64_t d = e % D;
          ktile[j * kAttnKStride + d] = j < n_tile ? to_f32(K[kv.offset(j0 + j, w[kWg]) + d]) : 0.0f;
        }
        __syncthreads();
      }
      if (nk <= j0) continue;  // uniform over the group
      const int nv = (int)(nk - j0 < kAttnTile ? nk - j0 : kAttnTile);
      float ds_lane = 0.0f;
      if (lane < nv) {
        const float s = (kStageK ? attn_dot((const T*)f.q + row * D, ktile + lane * kAttnKStride, D)
                                 : attn_dot((const T*)f.q + row * D, K + kv.offset(j0 + lane, w[kWg]), D)) *
                        f.scale;
        const float dp = attn_dot((const T*)p.dout + row * D, V + kv.offset(j0 + lane, w[kWg]), D);
        ds_lane = attn_bwd_ds(attn_bwd_prob(s, l), dp, dl);
      }
      for (int j = 0; j < kAttnTile; ++j) {
        const float dsj = shfl_idx32(ds_lane, j);
        if (j >= nv) continue;
        const T* kj = kStageK ? nullptr : K + kv.offset(j0 + j, w[kWg]);
#pragma unroll
        for (int i = 0; i < kChunks; ++i) {
          const int64_t d = lane + (int64_t)i * kGroupLanes;
          if (d < D) acc[i] = fma_f32(dsj, kStageK ? ktile[j * kAttnKStride + d] : to_f32(kj[d]), acc[i]);
        }
      }
    }
    if (pr >= P) continue;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int64_t d = lane + (int64_t)i * kGroupLanes;
      if (d < D) ((T*)p.dq)[row * D + d] = from_f32<T>(acc[i] * f.scale);
    }
  }
}

// dk, dv of one key tile (32 keys of one sequence and KV head). Each round, group gi computes p_j and ds_j of
// the round's pair gi (lane j = key j); then every thread adds the round's pairs, in pair order (row
// ascending, then head), to the elements it owns (e = thread + 256 i of the tile's 32 x D): one fma chain per
// element in attention.h's order, whatever the number of groups.
// The wide variant's tile elements may be split over gridDim.y slices (slice s owns i in [s kElems,
// (s + 1) kElems)): each slice's block computes the same p_j, ds_j and runs the same chains for its own elements,
// so the bits do not depend on the split. The wide variant uses up to 2 slices: its 80 elements per thread in one
// block kept dk[80] and dv[80] in local memory (ptxas -v: 1.2-1.5 KB stack frame, 2.9-3.8 KB of spill stores per
// thread on sm_80/90, 1.4-2.4 KB on sm_100/120); 40 per slice stay in registers, for a second pass over the scores.
constexpr int kAttnTileElems = (int)(kAttnTile * kGpuAttnMaxD / kAttnThreads);  // elements per thread
constexpr int kAttnDkdvSlicesWide = 2;
constexpr int kAttnTileElemsWide = (int)(kAttnTile * kGpuAttnMaxDWide / kAttnThreads / kAttnDkdvSlicesWide);
static_assert(kAttnTileElemsWide * kAttnDkdvSlicesWide * kAttnThreads == kAttnTile * kGpuAttnMaxDWide,
              "the wide dk/dv slices must cover the tile");
// The slices a head_dim needs (D <= 320: one; the rest up to 640: two): a slice past the tile would only
// recompute the scores.
inline int64_t attn_dkdv_slices_wide(int64_t D) {
  const int64_t per_slice = (int64_t)kAttnThreads * kAttnTileElemsWide;
  return (kAttnTile * D + per_slice - 1) / per_slice;
}
// kStageK = false: the wide variant (K read from global memory for the scores; the same chains).
template <typename T, int kElems = kAttnTileElems, bool kStageK = true>
__global__ void __launch_bounds__(kAttnThreads) attention_bwd_dkdv_kernel(AttnBwdParams p) {
  __shared__ float ktile[kAttnTile * kAttnKStride];
  __shared__ float pbuf[kAttnGroups][kAttnTile];
  __shared__ float dsbuf[kAttnGroups][kAttnTile];
  __shared__ int nvbuf[kAttnGroups];
  __shared__ int64_t rowbuf[kAttnGroups];
  const AttnFwdParams& f = p.f;
  const int64_t* w = p.tiles + (int64_t)blockIdx.x * kAttnWorkFields;
  const int64_t D = f.D, G = f.Hq / f.Hkv, g = w[kWg], q_len = w[kWqLen], n_ctx = w[kWnCtx];
  const int64_t j0 = w[kWsplit] * kAttnTile;
  const int n = (int)(n_ctx - j0 < kAttnTile ? n_ctx - j0 : kAttnTile);
  const KvRows kv = work_kv_rows(f, w);
  const T* K = (const T*)f.k;
  const T* V = (const T*)f.v;
  const int lane = (int)(threadIdx.x % kGroupLanes), grp = (int)(threadIdx.x / kGroupLanes);
  const int64_t i0 = kStageK ? 0 : (int64_t)blockIdx.y * kElems;  // this slice's first element (only wide slices)
  if (i0 * kAttnThreads >= (int64_t)n * D) return;  // a slice past the tile's last key (uniform; before any barrier)
  if (kStageK) {
    for (int64_t e = threadIdx.x; e < kAttnTile * D; e += kAttnThreads) {
      const int j = (int)(e / D);
      const int64_t d = e % D;
      ktile[j * kAttnKStride + d] = j < n ? to_f32(K[kv.offset(j0 + j, g) + d]) : 0.0f;
    }
  }
  int64_t r_first = 0;
  if (f.causal) r_first = j0 - (n_ctx - q_len) > 0 ? j0 - (n_ctx - q_len) : 0;
  const int64_t P = (q_len - (r_first < q_len ? r_first : q_len)) * G;
  float dk[kElems], dv[kElems];
#pragma unroll
  for (int i = 0; i < kElems; ++i) dk[i] = dv[i] = 0.0f;
  __syncthreads();
  for (int64_t round0 = 0; round0 < P; round0 += kAttnGroups) {
    const int64_t pr = round0 + grp;
    if (pr < P) {  // uniform over the group
      const int64_t r = r_first + pr / G, h = pr % G;
      const int64_t row = (w[kWqBegin] + r) * f.Hq + g * G + h;
      const int64_t nk = attn_row_keys(n_ctx - q_len + r, n_ctx, f.causal) - j0;
      const int nv = (int)(nk < n ? nk : n);
      float pj = 0.0f, dsj = 0.0f;
      if (lane < nv) {
        const float s = (kStageK ? attn_dot((const T*)f.q + row * D, ktile + lane * kAttnKStride, D)
                                 : attn_dot((const T*)f.q + row * D, K + kv.offset(j0 + lane, g), D)) *
                        f.scale;
        const float dp = attn_dot((const T*)p.dout + row * D, V + kv.offset(j0 + lane, g), D);
        pj = attn_bwd_prob(s, p.lse[row]);
        dsj = attn_bwd_ds(pj, dp, p.delta[row]);
      }
      pbuf[grp][lane] = pj;
      dsbuf[grp][lane] = dsj;
      if (lane == 0) {
        nvbuf[grp] = nv;
        rowbuf[grp] = row;
      }
    }
    __syncthreads();
    const int64_t n_round = P - round0 < kAttnGroups ? P - round0 : kAttnGroups;
    for (int64_t gi = 0; gi < n_round; ++gi) {
      const int nv = nvbuf[gi];
      const T* qrow = (const T*)f.q + rowbuf[gi] * D;
      const T* dorow = (const T*)p.dout + rowbuf[gi] * D;
#pragma unroll
      for (int i = 0; i < kElems; ++i) {
        const int64_t e = threadIdx.x + (i0 + i) * kAttnThreads;
        const int j = (int)(e / D);
        const int64_t d = e % D;
        if (j < nv) {
          dk[i] = fma_f32(dsbuf[gi][j], to_f32(qrow[d]), dk[i]);
          dv[i] = fma_f32(pbuf[gi][j], to_f32(dorow[d]), dv[i]);
        }
      }
    }
    __syncthreads();  // the next round overwrites the buffers
  }
#pragma unroll
  for (int i = 0; i < kElems; ++i) {
    const int64_t e = threadIdx.x + (i0 + i) * kAttnThreads;
    const int j = (int)(e / D);
    const int64_t d = e % D;
    if (j < n) {  // (j >= 32 past the tile's end: the last slice's spare elements)
      const int64_t off = kv.offset(j0 + j, g) + d;
      ((T*)p.dk)[off] = from_f32<T>(dk[i] * f.scale);
      ((T*)p.dv)[off] = from_f32<T>(dv[i]);
    }
  }
}

// cache[slot] = k[t] (and v_cache[slot] = v[t] unless v_cache is null: MLA's one latent cache) for every token
// with a slot in [0, n_slots) (-1: padding). The glue validated host
// slot mappings with the planner; the bound test here keeps a device slot mapping memory-safe too.
template <typename T>
__global__ void cache_write_kernel(CacheWriteParams p) {
  const int64_t n = p.T * p.row_elems;
  for (int64_t i = global_thread_index(); i < n; i += global_thread_count()) {
    const int64_t t = i / p.row_elems, e = i % p.row_elems, slot = p.slots[t];
    if (slot < 0 || slot >= p.n_slots) continue;
    ((T*)p.k_cache)[slot * p.row_elems + e] = ((const T*)p.k)[i];
    if (p.v_cache != nullptr) ((T*)p.v_cache)[slot * p.row_elems + e] = ((const T*)p.v)[i];
  }
}

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
