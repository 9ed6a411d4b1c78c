// dense_kernels.cuh — CUDA/HIP kernels of the non-matrix dense ops, one source for both vendors.
//
// Design (FlashInfer-style): templated __global__ kernels over the storage types, instantiated by the
// launchers in dense_launch.cuh; no torch here. Every kernel evaluates exactly the per-row / per-element
// expression trees of csrc/common/contract.h with the helpers of numerics.h, so its bits equal the CPU
// backend's:
//   * Row reductions (rms statistics, the log-sum-exp pair, the backward sums) run on one 32-lane group
//     per row. Lane j accumulates elements j, j+32, j+64, ... in increasing order from +0 — the lane
//     assignment of reduce.h — and group_sum_tree() folds the 32 partials with the halving tree.
//     A CUDA warp is one group; an AMD wave64 holds two groups (two rows), see compat.cuh.
//   * Rows are independent: a group's result depends only on its row, never on which group/block ran
//     it, on the grid size or on the number of rows, so batch size cannot change any bit.
//   * Column chains (rms_norm dw, linear db) run one thread per column over the rows in order: no split
//     of the row axis, no atomics. The contract fixes a sequential chain per column, so a column's adds
//     cannot be parallelised; what is parallel is the loading: a block owns 32 columns, 7 warps stage the
//     next tile of rows (terms computed, coalesced) into shared memory while warp 0's 32 lanes run the
//     chains over the current tile (double buffer). Same terms, same order: same bits.
//   * Latency (decode): a lane's chain is sequential by the contract (32 lanes per row, no more), so the
//     row kernels issue kPrefetch loads of a lane's next elements before adding them in order, and small
//     batches launch 2-group blocks (more blocks -> more SMs busy); neither changes any bit.
//   * Elementwise ops (silu_and_mul, rotary, exp/log) are one thread per element (or pair).
// Numerics flags (part of the contract): nvcc --fmad=false -ftz=false -prec-div=true -prec-sqrt=true,
// hip-clang -ffp-contract=off; exp/log are exp_f32/log_f32, never __expf / v_exp_f32.
#pragma once

#include "compat.cuh"  // first: the vendor runtime header defines __host__/__device__/__forceinline__
#include "../common/contract.h"

namespace aligned::gpu::ALIGNED_GPU_BUILD {

// Threads per block of the row kernels: 8 groups of 32 lanes (CUDA: 8 warps; AMD: 4 waves); batches of
// fewer than kSmallBatchRows rows use kSmallRowBlockThreads (2 groups: one AMD wave) so the rows spread over
// more SMs. The kernels read the group count from blockDim, never from these constants.
constexpr int kRowBlockThreads = 256;
constexpr int kSmallRowBlockThreads = 64;
constexpr int64_t kSmallBatchRows = 2048;
constexpr int kGroupsPerBlock = kRowBlockThreads / kGroupLanes;
// Elements of one lane's chain loaded ahead of their (in-order) adds.
constexpr int kPrefetch = 8;
// Threads per block of the elementwise and column kernels.
constexpr int kElemBlockThreads = 256;
// Grid cap for grid-stride loops (results never depend on it: every row/element is computed alike).
constexpr int64_t kMaxBlocks = 1 << 20;

struct GroupCoord {
  int lane;          // 0..31 within the group
  int64_t group;     // global group index
  int64_t n_groups;  // groups in the grid
};
__device__ __forceinline__ GroupCoord group_coord() {
  GroupCoord c;
  c.lane = (int)(threadIdx.x % kGroupLanes);
  const int64_t groups_per_block = blockDim.x / kGroupLanes;
  c.group = (int64_t)blockIdx.x * groups_per_block + threadIdx.x / kGroupLanes;
  c.n_groups = (int64_t)gridDim.x * groups_per_block;
  return c;
}

// One lane's chain of reduce.h: acc = step(step(0, x[lane]), x[lane + 32]) ... in increasing index order, step
// being the contract.h helper of the op (rms_sq_step, lse_sum_step). The loads of kPrefetch consecutive chain
// elements are issued before their steps (latency hiding only: the steps and their order are those of the plain
// loop `for (k = lane; k < n; k += 32) acc = step(acc, x[k])`).
template <typename T, typename F>
__device__ __forceinline__ float lane_chain(const T* x, int64_t n, int lane, F step) {
  float acc = 0.0f;
  int64_t k = lane;
  for (; k + (kPrefetch - 1) * kGroupLanes < n; k += kPrefetch * kGroupLanes) {
    float v[kPrefetch];
#pragma unroll
    for (int u = 0; u < kPrefetch; ++u) v[u] = to_f32(x[k + u * kGroupLanes]);
#pragma unroll
    for (int u = 0; u < kPrefetch; ++u) acc = step(acc, v[u]);
  }
  for (; k < n; k += kGroupLanes) acc = step(acc, to_f32(x[k]));
  return acc;
}

// ---- rms_norm -------------------------------------------------------------------------------------------
// contract.h rms_inv: lanes[j] += x_k * x_k for k = j, j+32, ...; ss = fold; inv = 1/sqrt(ss/H + eps).
template <typename T>
__device__ __forceinline__ float group_rms_inv(const T* x, int64_t H, float eps, int lane) {
  const float acc = lane_chain(x, H, lane, [](float a, float v) { return rms_sq_step(a, v); });
  return rms_inv_of_sum(group_sum_tree(acc), H, eps);
}

// One row of rms_norm by one 32-lane group: out_k = round_T((x_k * inv) * w_k) (contract.h rms_norm_row).
template <typename T, typename TW>
__device__ __forceinline__ void group_rms_norm_row(const T* xr, const TW* w, T* orow, int64_t H, float eps, int lane) {
  const float inv = group_rms_inv<T>(xr, H, eps, lane);
  for (int64_t k = lane; k < H; k += kGroupLanes) orow[k] = from_f32<T>(rms_scale(to_f32(xr[k]), inv, to_f32(w[k])));
}

// One group per row (grid-stride over rows). Every lane of a group runs the same iterations, so the
// shuffles in group_rms_inv never diverge.
template <typename T, typename TW>
__global__ void rms_norm_kernel(const T* __restrict__ x, const TW* __restrict__ w, T* __restrict__ out, int64_t rows,
                                int64_t H, float eps) {
  const GroupCoord c = group_coord();
  for (int64_t r = c.group; r < rows; r += c.n_groups) group_rms_norm_row(x + r * H, w, out + r * H, H, eps, c.lane);
}

// fused_add_rms_norm: res_out = round_T(x + res), then rms_norm of the rounded residual (contract.h).
// Each lane writes the residual elements it later reads back, so no synchronisation is needed.
template <typename T, typename TW>
__global__ void fused_add_rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ res, const TW* __restrict__ w,
                                          T* __restrict__ out, T* __restrict__ res_out, int64_t rows, int64_t H,
                                          float eps) {
  const GroupCoord c = group_coord();
  for (int64_t r = c.group; r < rows; r += c.n_groups) {
    const T* xr = x + r * H;
    const T* rr = res + r * H;
    T* ro = res_out + r * H;
    T* orow = out + r * H;
    for (int64_t k = c.lane; k < H; k += kGroupLanes) ro[k] = from_f32<T>(to_f32(xr[k]) + to_f32(rr[k]));
    group_rms_norm_row<T, TW>(ro, w, orow, H, eps, c.lane);
  }
}

// rms_norm backward, dx part (contract.h rms_norm_backward_row) and inv[row] for the dw pass.
template <typename T, typename TW>
__global__ void rms_norm_backward_dx_kernel(const T* __restrict__ g, const T* __restrict__ x, const TW* __restrict__ w,
                                            T* __restrict__ dx, float* __restrict__ inv_out, int64_t rows, int64_t H,
                                            float eps) {
  const GroupCoord c = group_coord();
  for (int64_t r = c.group; r < rows; r += c.n_groups) {
    const T* gr = g + r * H;
    const T* xr = x + r * H;
    T* dxr = dx + r * H;
    const float inv = group_rms_inv(xr, H, eps, c.lane);
    float acc = 0.0f;
    for (int64_t k = c.lane; k < H; k += kGroupLanes)
      acc = rms_grad_dot_step(acc, to_f32(gr[k]), to_f32(w[k]), to_f32(xr[k]));
    const float cc = rms_grad_coef(group_sum_tree(acc), H, inv);
    for (int64_t k = c.lane; k < H; k += kGroupLanes)
      dxr[k] = from_f32<T>(rms_grad_dx(to_f32(gr[k]), to_f32(w[k]), to_f32(xr[k]), cc, inv));
    if (c.lane == 0) inv_out[r] = inv;
  }
}

// ---- column chains: out[c] = chain over r = 0..rows-1 of (. + term(r, c)), in row order -----------------
// A block owns kColTileCols columns (threads 0..31 run their chains); the other kColLoaders warps stage
// tiles of kColTileRows rows of terms in shared memory, one tile ahead (double buffer). Blocks grid-stride
// over column groups. Every thread of the block runs the same number of iterations (uniform barriers).
constexpr int kColTileCols = 32;
constexpr int kColTileRows = 64;
constexpr int kColBlockThreads = 256;
constexpr int kColLoaders = kColBlockThreads / kColTileCols - 1;  // warps 1..7 (rows of 32 threads)

template <typename Term, typename Out>
__device__ __forceinline__ void column_chain_block(int64_t rows, int64_t cols, Term term, Out store) {
  __shared__ float tile[2][kColTileRows][kColTileCols];
  const int tc = (int)(threadIdx.x % kColTileCols), tr = (int)(threadIdx.x / kColTileCols);
  const int64_t n_tiles = (rows + kColTileRows - 1) / kColTileRows;
  for (int64_t c0 = (int64_t)blockIdx.x * kColTileCols; c0 < cols; c0 += (int64_t)gridDim.x * kColTileCols) {
    const int64_t c = c0 + tc;
    auto stage = [&](int64_t t, int buf) {  // loaders only: rows t*R + i for i = tr-1, tr-1+7, ...
      for (int i = tr - 1; i < kColTileRows; i += kColLoaders) {
        const int64_t r = t * kColTileRows + i;
        tile[buf][i][tc] = (r < rows && c < cols) ? term(r, c) : 0.0f;
      }
    };
    if (tr > 0 && n_tiles > 0) stage(0, 0);
    __syncthreads();
    float acc = 0.0f;
    for (int64_t t = 0; t < n_tiles; ++t) {
      const int buf = (int)(t & 1);
      if (tr == 0) {
        const int n = (int)(rows - t * kColTileRows < kColTileRows ? rows - t * kColTileRows : kColTileRows);
        for (int i = 0; i < n; ++i) acc = acc + tile[buf][i][tc];
      } else if (t + 1 < n_tiles) {
        stage(t + 1, buf ^ 1);
      }
      __syncthreads();
    }
    if (tr == 0 && c < cols) store(c, acc);
  }
}

// dw[k] = chain over rows r = 0..rows-1 of (. + g[r,k] * (x[r,k] * inv[r])) (contract.h).
template <typename T>
__global__ void rms_norm_backward_dw_kernel(const T* __restrict__ g, const T* __restrict__ x,
                                            const float* __restrict__ inv, float* __restrict__ dw, int64_t rows,
                                            int64_t H) {
  // acc + term is contract.h rms_grad_dw_step: acc + g * (x * inv)
  column_chain_block(
      rows, H, [&](int64_t r, int64_t k) { return to_f32(g[r * H + k]) * (to_f32(x[r * H + k]) * inv[r]); },
      [&](int64_t k, float acc) { dw[k] = acc; });
}

// ---- silu_and_mul ---------------------------------------------------------------------------------------
template <typename T>
__global__ void silu_and_mul_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t rows, int64_t d) {
  const int64_t n = rows * d;
  for (int64_t i = global_thread_index(); i < n; i += global_thread_count()) {
    const int64_t r = i / d, col = i - r * d;
    const T* a = x + r * 2 * d;
    out[i] = from_f32<T>(silu_mul(to_f32(a[col]), to_f32(a[d + col])));
  }
}

template <typename T>
__global__ void silu_and_mul_backward_kernel(const T* __restrict__ g, const T* __restrict__ x, T* __restrict__ dx,
                                             int64_t rows, int64_t d) {
  const int64_t n = rows * d;
  for (int64_t i = global_thread_index(); i < n; i += global_thread_count()) {
    const int64_t r = i / d, col = i - r * d;
    const T* a = x + r * 2 * d;
    T* da = dx + r * 2 * d;
    float fa, fb;
    silu_mul_backward(to_f32(g[i]), to_f32(a[col]), to_f32(a[d + col]), &fa, &fb);
    da[col] = from_f32<T>(fa);
    da[d + col] = from_f32<T>(fb);
  }
}

// ---- rotary_embedding -----------------------------------------------------------------------------------
// Work item (t, h, w): w < rot/2 rotates pair w (contract.h rotate_pair); w >= rot/2 copies dimension
// rot + (w - rot/2), which passes through unchanged.
// A position outside [0, max_pos) reads nothing from the table: the token's outputs are NaN and
// error_flags[kErrRotaryPosition] is set (dense_api.h: value checks of device data run here, not on the host).
template <typename T>
__global__ void rotary_kernel(const int64_t* __restrict__ positions, const T* __restrict__ x, T* __restrict__ out,
                              const float* __restrict__ cache, int64_t T_, int64_t heads, int64_t head_dim,
                              int64_t rot, bool is_neox, bool inverse, int64_t max_pos, int32_t* error_flags) {
  const int64_t half = rot / 2;
  const int64_t W = half + (head_dim - rot);
  const int64_t n = T_ * heads * W;
  for (int64_t i = global_thread_index(); i < n; i += global_thread_count()) {
    const int64_t th = i / W, wi = i - th * W;
    const int64_t t = th / heads;
    const T* xr = x + th * head_dim;
    T* o = out + th * head_dim;
    const int64_t pos = positions[t];
    if (pos < 0 || pos >= max_pos) {
      if (error_flags) error_flags[kErrRotaryPosition] = 1;
      const T nan = from_f32<T>(float_of(0x7fc00000u));
      if (wi < half) {
        o[is_neox ? wi : 2 * wi] = nan;
        o[is_neox ? wi + half : 2 * wi + 1] = nan;
      } else {
        o[rot + (wi - half)] = nan;
      }
      continue;
    }
    if (wi < half) {
      const float* cs = cache + pos * rot;
      const int64_t i1 = is_neox ? wi : 2 * wi;
      const int64_t i2 = is_neox ? wi + half : 2 * wi + 1;
      float o1, o2;
      rotate_pair(to_f32(xr[i1]), to_f32(xr[i2]), cs[wi], cs[half + wi], inverse, &o1, &o2);
      o[i1] = from_f32<T>(o1);
      o[i2] = from_f32<T>(o2);
    } else {
      const int64_t k = rot + (wi - half);
      o[k] = xr[k];
    }
  }
}

// ---- log_softmax / logsumexp / token_logprobs (+ backward) ------------------------------------------------
// contract.h lse_pair_row on one group: the max pass is order-free (group_max) and gathers logit_flags
// (group_or); the sum pass is lane j over v = j, j+32, ... in order, then the halving tree. The special rows
// (NaN, +inf, all -inf) are decided by lse_special_row, as on the CPU. Every lane returns the same pair
// (uniform branches: `flags` and `m` are group-reduced).
template <typename T>
__device__ __forceinline__ LsePair group_lse_pair(const T* z, int64_t V, float tau, int lane) {
  float m = -float_of(0x7f800000u);
  int flags = 0;
  for (int64_t v = lane; v < V; v += kGroupLanes) {
    const float s = logit_scale(to_f32(z[v]), tau);
    lse_max_merge(s, logit_flags(s), &m, &flags);
  }
  flags = group_or(flags);
  m = group_max(m);
  LsePair p;
  if (lse_special_row(m, flags, &p)) return p;
  const float acc =
      lane_chain(z, V, lane, [tau, m](float a, float zv) { return lse_sum_step(a, logit_scale(zv, tau), m); });
  return lse_pair_of_sum(m, group_sum_tree(acc));
}

enum class LogitsMode : int {
  kLogsumexp = 0,
  kLogSoftmax = 1,
  kTokenLogprobs = 2,
  kTokenLogprobsBackward = 3,
  kLogsumexpBackward = 4,
  kLogSoftmaxBackward = 5,
};

// One group per row; every mode first computes the row's (m, L) pair, then (contract.h):
//   kLogsumexp             lse[t] = m + L (lse_value)
//   kLogSoftmax            out[t, v] = (z_v / tau - m) - L
//   kTokenLogprobs         out[t] = (z_id / tau - m) - L            (== log_softmax[t, id] bit for bit)
//   kTokenLogprobsBackward dz[t, v] = round_T(((v == id) - p_v) * g[t] / tau)
//   kLogsumexpBackward     dz[t, v] = round_T((p_v * g[t]) / tau)
//   kLogSoftmaxBackward    G = group lane sum of g[t, v]; dz[t, v] = round_T((g[t, v] - p_v * G) / tau)
// A row whose temperature is not a finite fp32 >= FLT_MIN, or whose token id is outside [0, V), writes NaN
// for every output of the row and sets error_flags[kErrTemperature / kErrTokenId] (uniform per group: every
// lane reads the same temps[t] / ids[t]).
template <typename T, LogitsMode kMode>
__device__ __forceinline__ void logits_bad_row(int64_t t, int64_t V, int lane, float* __restrict__ lse_out,
                                               float* __restrict__ out, T* __restrict__ dz) {
  const float nan = float_of(0x7fc00000u);
  if constexpr (kMode == LogitsMode::kLogsumexp || kMode == LogitsMode::kTokenLogprobs) {
    if (lane == 0) (kMode == LogitsMode::kLogsumexp ? lse_out : out)[t] = nan;
  } else if constexpr (kMode == LogitsMode::kLogSoftmax) {
    for (int64_t v = lane; v < V; v += kGroupLanes) out[t * V + v] = nan;
  } else {
    for (int64_t v = lane; v < V; v += kGroupLanes) dz[t * V + v] = from_f32<T>(nan);
  }
}

template <typename T, LogitsMode kMode>
__global__ void logits_row_kernel(const T* __restrict__ z, int64_t T_, int64_t V, float tau,
                                  const float* __restrict__ temps, const int64_t* __restrict__ ids,
                                  const float* __restrict__ g, float* __restrict__ lse_out, float* __restrict__ out,
                                  T* __restrict__ dz, int32_t* error_flags) {
  constexpr bool kHasId = kMode == LogitsMode::kTokenLogprobs || kMode == LogitsMode::kTokenLogprobsBackward;
  const GroupCoord c = group_coord();
  for (int64_t t = c.group; t < T_; t += c.n_groups) {
    const T* zr = z + t * V;
    const float tt = temps ? temps[t] : tau;
    // !(a <= b) is true for NaN too; FLT_MAX bounds +inf.
    const bool bad_temp = temps && !(tt >= float_of(0x00800000u) && tt <= float_of(0x7f7fffffu));
    const bool bad_id = kHasId && (ids[t] < 0 || ids[t] >= V);
    if (bad_temp || bad_id) {
      if (c.lane == 0 && error_flags) {
        if (bad_temp) error_flags[kErrTemperature] = 1;
        if (bad_id) error_flags[kErrTokenId] = 1;
      }
      logits_bad_row<T, kMode>(t, V, c.lane, lse_out, out, dz);
      continue;
    }
    const LsePair p = group_lse_pair(zr, V, tt, c.lane);
    if constexpr (kMode == LogitsMode::kLogsumexp) {
      if (c.lane == 0) lse_out[t] = lse_value(p);
    } else if constexpr (kMode == LogitsMode::kLogSoftmax) {
      float* o = out + t * V;
      for (int64_t v = c.lane; v < V; v += kGroupLanes) o[v] = logp_value(div_f32(to_f32(zr[v]), tt), p);
    } else if constexpr (kMode == LogitsMode::kTokenLogprobs) {
      if (c.lane == 0) out[t] = logp_value(div_f32(to_f32(zr[ids[t]]), tt), p);
    } else if constexpr (kMode == LogitsMode::kTokenLogprobsBackward) {
      const int64_t id = ids[t];
      const float gr = g[t];
      T* o = dz + t * V;
      for (int64_t v = c.lane; v < V; v += kGroupLanes)
        o[v] = from_f32<T>(token_logprobs_grad(div_f32(to_f32(zr[v]), tt), p, v == id, gr, tt));
    } else if constexpr (kMode == LogitsMode::kLogsumexpBackward) {
      const float gr = g[t];
      T* o = dz + t * V;
      for (int64_t v = c.lane; v < V; v += kGroupLanes)
        o[v] = from_f32<T>(logsumexp_grad(div_f32(to_f32(zr[v]), tt), p, gr, tt));
    } else {
      const float* gr = g + t * V;
      float acc = 0.0f;
      for (int64_t v = c.lane; v < V; v += kGroupLanes) acc = acc + gr[v];
      const float gsum = group_sum_tree(acc);
      T* o = dz + t * V;
      for (int64_t v = c.lane; v < V; v += kGroupLanes)
        o[v] = from_f32<T>(log_softmax_grad(div_f32(to_f32(zr[v]), tt), p, gr[v], gsum, tt));
    }
  }
}

// ---- wide rows: one block per row (small batches, long rows) --------------------------------------------
// The contract fixes 32 lane chains per row (reduce.h): lane j adds the terms of k = j, j + 32, ... in increasing k
// from +0, then the halving tree. A chain's adds are sequential, but its TERMS (x_k * x_k; exp(z_k / tau - m)) are
// functions of one element each. So a block of kWideRowThreads threads runs one row: the first warp / wave is the
// consumer — its first 32 lanes are the row's 32 chains, adding staged terms in their order — while every other
// thread is a producer, computing the terms of the next chunk of kWideChunk elements (16-byte loads where the
// address allows) into shared memory, one chunk ahead (double buffer). The consumer adds exactly the terms, in
// exactly the order, of the one-group kernel above: same bits, checked in tests/emulated against the CPU backend
// and against the one-group kernel (test_emulated_row_kernels.py). Elementwise passes (the max, the outputs) use
// every thread with 16-byte accesses. At V = 151,936 one row costs ~4.7k dependent adds per lane (the contract's
// floor, ~10 us) instead of ~150k instructions on one warp.
constexpr int kWideRowThreads = 256;         // CUDA: consumer warp + 7 producer warps; HIP: 1 + 3 waves
constexpr int kWideChunk = 32 * 64;          // terms per chunk: 64 per lane
constexpr int64_t kWideRowMaxRows = 1024;    // the launcher uses one block per row below this many rows ...
constexpr int64_t kWideRowMinLength = 2048;  // ... for rows at least this long (dense_launch.cuh)

// Terms of elements [k0 + e) of a chunk into buf[e], e < n_elems; the producer threads (threadIdx.x >= kWaveLanes)
// take 16-byte vectors in turn. elems(k, cnt, out): out[0..cnt) = the terms of elements k .. k + cnt - 1, where
// cnt == kVecElems<T> only for a 16-byte aligned, complete vector (the functor may load it as one).
template <typename T, typename Terms>
__device__ __forceinline__ void wide_produce(int64_t k0, int n_elems, float* buf, const T* row, Terms elems) {
  constexpr int kV = kVecElems<T>;
  const int p = (int)threadIdx.x - kWaveLanes, P = (int)blockDim.x - kWaveLanes;
  for (int e = p * kV; e < n_elems; e += P * kV) {
    float t[kV];
    const int cnt = n_elems - e < kV ? n_elems - e : kV;
    if (cnt == kV && is_vec_aligned(row + k0 + e)) {
      elems(k0 + e, kV, t);
#pragma unroll
      for (int i = 0; i < kV; ++i) buf[e + i] = t[i];
    } else {
      for (int i = 0; i < cnt; ++i) {
        elems(k0 + e + i, 1, t);
        buf[e + i] = t[0];
      }
    }
  }
}

// The fold of the row's 32 lane chains over the terms of elements [0, n) (reduce.h lane_sum), returned to every
// thread of the block. Every thread must call it (it has barriers); buf: 2 * kWideChunk floats of shared memory.
template <typename T, typename Terms>
__device__ __forceinline__ float wide_row_lane_sum(int64_t n, const T* row, float* buf, float* result, Terms elems) {
  const bool consumer = threadIdx.x < kGroupLanes, producer = threadIdx.x >= kWaveLanes;
  const int lane = (int)(threadIdx.x % kGroupLanes);
  const int64_t n_chunks = (n + kWideChunk - 1) / kWideChunk;
  auto chunk_len = [&](int64_t c) { return (int)(n - c * kWideChunk < kWideChunk ? n - c * kWideChunk : kWideChunk); };
  if (producer && n_chunks > 0) wide_produce(0, chunk_len(0), buf, row, elems);
  __syncthreads();
  float acc = 0.0f;
  for (int64_t c = 0; c < n_chunks; ++c) {
    const float* b = buf + (c & 1) * kWideChunk;
    if (consumer) {  // lane j: terms j, j + 32, ... of the chunk, in order (k0 is a multiple of 32)
      const int len = chunk_len(c);
      if (len == kWideChunk) {
#pragma unroll 16
        for (int i = 0; i < kWideChunk / kGroupLanes; ++i) acc = acc + b[i * kGroupLanes + lane];
      } else {
        for (int e = lane; e < len; e += kGroupLanes) acc = acc + b[e];
      }
    } else if (producer && c + 1 < n_chunks) {
      wide_produce((c + 1) * kWideChunk, chunk_len(c + 1), buf + ((c + 1) & 1) * kWideChunk, row, elems);
    }
    __syncthreads();
  }
  if (consumer) {
    const float s = group_sum_tree(acc);
    if (lane == 0) *result = s;
  }
  __syncthreads();
  const float r = *result;
  __syncthreads();  // *result is reused by the next call
  return r;
}

// out-of-place elementwise pass over a row with 16-byte accesses where aligned: f(k, cnt, ...) handles elements
// k .. k + cnt - 1 (cnt == kVecElems<T> for an aligned complete vector of `row`, else 1). Every thread takes part.
template <typename T, typename F>
__device__ __forceinline__ void wide_row_elementwise(int64_t n, const T* row, F f) {
  constexpr int kV = kVecElems<T>;
  for (int64_t e = (int64_t)threadIdx.x * kV; e < n; e += (int64_t)blockDim.x * kV) {
    if (n - e >= kV && is_vec_aligned(row + e)) {
      f(e, kV);
    } else {
      for (int64_t k = e; k < n && k < e + kV; ++k) f(k, 1);
    }
  }
}

// Elements k .. k + cnt - 1 of row as fp32 (one 16-byte load when cnt == kVecElems<T>).
template <typename T>
__device__ __forceinline__ void load_elems(const T* row, int64_t k, int cnt, float* v) {
  if (cnt == kVecElems<T>) {
    load_vec_f32(row + k, v);
  } else {
    for (int i = 0; i < cnt; ++i) v[i] = to_f32(row[k + i]);
  }
}
// Stores cnt outputs (one 16-byte store when cnt == kVecElems<TO> and the address is aligned).
template <typename TO>
__device__ __forceinline__ void store_elems(TO* row, int64_t k, int cnt, const float* v) {
  TO o[kVecElems<TO> > 8 ? kVecElems<TO> : 8];
  for (int i = 0; i < cnt; ++i) o[i] = from_f32<TO>(v[i]);
  if (cnt == kVecElems<TO> && is_vec_aligned(row + k)) {
    store_vec(row + k, o);
  } else {
    for (int i = 0; i < cnt; ++i) row[k + i] = o[i];
  }
}

template <typename T, typename TW>
__global__ void __launch_bounds__(kWideRowThreads)
    rms_norm_wide_kernel(const T* __restrict__ x, const T* __restrict__ res, const TW* __restrict__ w,
                         T* __restrict__ out, T* __restrict__ res_out, int64_t rows, int64_t H, float eps) {
  __shared__ float buf[2 * kWideChunk];
  __shared__ float result;
  constexpr int kV = kVecElems<T>;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * H;
    T* orow = out + r * H;
    float inv;
    if (res == nullptr) {  // rms_norm: the terms of x
      inv = rms_inv_of_sum(wide_row_lane_sum(H, xr, buf, &result, [&](int64_t k, int cnt, float* t) {
                             float v[kV];
                             load_elems(xr, k, cnt, v);
                             for (int i = 0; i < cnt; ++i) t[i] = rms_sq_term(v[i]);
                           }), H, eps);
    } else {  // fused_add_rms_norm: the producers also write the rounded residual r = round_T(x + res)
      const T* rr = res + r * H;
      T* ro = res_out + r * H;
      inv = rms_inv_of_sum(wide_row_lane_sum(H, xr, buf, &result, [&](int64_t k, int cnt, float* t) {
                             float a[kV], b[kV], s[kV];
                             load_elems(xr, k, cnt, a);
                             if (cnt == kV && is_vec_aligned(rr + k)) load_vec_f32(rr + k, b);
                             else for (int i = 0; i < cnt; ++i) b[i] = to_f32(rr[k + i]);
                             for (int i = 0; i < cnt; ++i) s[i] = to_f32(from_f32<T>(a[i] + b[i]));
                             store_elems(ro, k, cnt, s);
                             for (int i = 0; i < cnt; ++i) t[i] = rms_sq_term(s[i]);
                           }), H, eps);
      xr = ro;  // the norm is of the rounded residual, written above (visible to the block after its barriers)
    }
    wide_row_elementwise(H, xr, [&](int64_t k, int cnt) {
      float v[kV], o[kV];
      load_elems(xr, k, cnt, v);
      for (int i = 0; i < cnt; ++i) o[i] = rms_scale(v[i], inv, to_f32(w[k + i]));
      store_elems(orow, k, cnt, o);
    });
  }
}

// The logits row kernel of one block per row: the same modes and special rows as logits_row_kernel.
template <typename T, LogitsMode kMode>
__global__ void __launch_bounds__(kWideRowThreads)
    logits_wide_kernel(const T* __restrict__ z, int64_t T_, int64_t V, float tau, const float* __restrict__ temps,
                       const int64_t* __restrict__ ids, const float* __restrict__ g, float* __restrict__ lse_out,
                       float* __restrict__ out, T* __restrict__ dz, int32_t* error_flags) {
  constexpr bool kHasId = kMode == LogitsMode::kTokenLogprobs || kMode == LogitsMode::kTokenLogprobsBackward;
  constexpr int kV = kVecElems<T>;
  constexpr int kGroups = kWideRowThreads / kGroupLanes;
  __shared__ float buf[2 * kWideChunk];
  __shared__ float result;
  __shared__ float group_m[kGroups];
  __shared__ int group_flags[kGroups];
  const int lane = (int)(threadIdx.x % kGroupLanes), grp = (int)(threadIdx.x / kGroupLanes);
  const float nan = float_of(0x7fc00000u);
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
    const T* zr = z + t * V;
    const float tt = temps ? temps[t] : tau;
    const bool bad_temp = temps && !(tt >= float_of(0x00800000u) && tt <= float_of(0x7f7fffffu));
    const bool bad_id = kHasId && (ids[t] < 0 || ids[t] >= V);
    if (bad_temp || bad_id) {  // uniform over the block (every thread reads the same temps[t] / ids[t])
      if (threadIdx.x == 0 && error_flags) {
        if (bad_temp) error_flags[kErrTemperature] = 1;
        if (bad_id) error_flags[kErrTokenId] = 1;
      }
      if constexpr (kMode == LogitsMode::kLogsumexp || kMode == LogitsMode::kTokenLogprobs) {
        if (threadIdx.x == 0) (kMode == LogitsMode::kLogsumexp ? lse_out : out)[t] = nan;
      } else if constexpr (kMode == LogitsMode::kLogSoftmax) {
        for (int64_t v = threadIdx.x; v < V; v += blockDim.x) out[t * V + v] = nan;
      } else {
        for (int64_t v = threadIdx.x; v < V; v += blockDim.x) dz[t * V + v] = from_f32<T>(nan);
      }
      continue;
    }
    // max pass (order-free, see group_max): every thread, then the groups, then the block
    float m = -float_of(0x7f800000u);
    int flags = 0;
    wide_row_elementwise(V, zr, [&](int64_t k, int cnt) {
      float v[kV];
      load_elems(zr, k, cnt, v);
      for (int i = 0; i < cnt; ++i) {
        const float s = logit_scale(v[i], tt);
        lse_max_merge(s, logit_flags(s), &m, &flags);
      }
    });
    flags = group_or(flags);
    m = group_max(m);
    if (lane == 0) {
      group_m[grp] = m;
      group_flags[grp] = flags;
    }
    __syncthreads();
    m = -float_of(0x7f800000u);
    flags = 0;
    for (int i = 0; i < kGroups; ++i) lse_max_merge(group_m[i], group_flags[i], &m, &flags);
    LsePair p;
    if (!lse_special_row(m, flags, &p)) {  // uniform
      const float sum = wide_row_lane_sum(V, zr, buf, &result, [&](int64_t k, int cnt, float* term) {
        float v[kV];
        load_elems(zr, k, cnt, v);
        for (int i = 0; i < cnt; ++i) term[i] = lse_sum_term(logit_scale(v[i], tt), m);
      });
      p = lse_pair_of_sum(m, sum);
    }
    if constexpr (kMode == LogitsMode::kLogsumexp) {
      if (threadIdx.x == 0) lse_out[t] = lse_value(p);
    } else if constexpr (kMode == LogitsMode::kTokenLogprobs) {
      if (threadIdx.x == 0) out[t] = logp_value(div_f32(to_f32(zr[ids[t]]), tt), p);
    } else if constexpr (kMode == LogitsMode::kLogSoftmax) {
      float* o = out + t * V;
      wide_row_elementwise(V, zr, [&](int64_t k, int cnt) {
        float v[kV], r[kV];
        load_elems(zr, k, cnt, v);
        for (int i = 0; i < cnt; ++i) r[i] = logp_value(div_f32(v[i], tt), p);
        store_elems(o, k, cnt, r);
      });
    } else {
      float gsum = 0.0f;
      if constexpr (kMode == LogitsMode::kLogSoftmaxBackward) {
        const float* gr = g + t * V;
        gsum = wide_row_lane_sum(V, gr, buf, &result, [&](int64_t k, int cnt, float* term) {
          load_elems(gr, k, cnt, term);  // the terms are g_v themselves (fp32)
        });
      }
      const int64_t id = kHasId ? ids[t] : -1;
      const float gt = kMode == LogitsMode::kLogSoftmaxBackward ? 0.0f : g[t];
      T* o = dz + t * V;
      wide_row_elementwise(V, zr, [&](int64_t k, int cnt) {
        float v[kV], r[kV];
        load_elems(zr, k, cnt, v);
        for (int i = 0; i < cnt; ++i) {
          const float s = div_f32(v[i], tt);
          if constexpr (kMode == LogitsMode::kTokenLogprobsBackward) r[i] = token_logprobs_grad(s, p, k + i == id, gt, tt);
          else if constexpr (kMode == LogitsMode::kLogsumexpBackward) r[i] = logsumexp_grad(s, p, gt, tt);
          else r[i] = log_softmax_grad(s, p, g[t * V + k + i], gsum, tt);
        }
        store_elems(o, k, cnt, r);
      });
    }
    __syncthreads();  // group_m / group_flags are rewritten by the next row
  }
}

// ---- column chains ----------------------------------------------------------------------------------------
// out[n] = round_TO(chain over m = 0..rows-1 of (. + g[m, n])) — linear's bias gradient (contract.h).
template <typename T, typename TO>
__global__ void column_sum_kernel(const T* __restrict__ g, TO* __restrict__ out, int64_t rows, int64_t cols) {
  column_chain_block(
      rows, cols, [&](int64_t m, int64_t n) { return to_f32(g[m * cols + n]); },
      [&](int64_t n, float acc) { out[n] = from_f32<TO>(acc); });
}

// ---- the contract's scalar exp/log, elementwise (tests compare backends with these) -----------------------
template <bool kLog>
__global__ void exp_log_kernel(const float* __restrict__ x, float* __restrict__ out, int64_t n) {
  for (int64_t i = global_thread_index(); i < n; i += global_thread_count()) out[i] = kLog ? log_f32(x[i]) : exp_f32(x[i]);
}

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
