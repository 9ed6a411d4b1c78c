// moe_api.h — the torch-free host interface of the GPU moe_experts (csrc/gpu/moe_kernels.cuh), used by the torch
// glue's GPU backends (csrc/torch/backends/gpu.h) and built by csrc/cuda/moe.cu (nvcc), csrc/hip/moe.hip
// (hip-clang) and their emulated builds (csrc/emu).
//
// How one moe_experts call runs on a GPU (every step a fixed launch sized from the shapes alone: no host read
// of device data, graph-capturable):
//   1. plan     ids [T, k] -> the assignments (token t, rank r) grouped by expert (counting sort: experts in
//               increasing id, inside an expert tokens then ranks in batch order; no atomics), pos [T, k] (the
//               grouped row of each assignment), src [N] (each grouped row's token) and the tile list: every
//               expert's rows cut in tiles of kMoeTileRows, (expert, first row, rows), at most
//               moe_max_tiles(N, E) of them (the rest hold rows = 0 and launch blocks that return at once);
//   2. gather   xg [N, H] = x[src];
//   3. grouped gemm over the tiles: h = linear(xg, w13[e]) rounded to T — the `fma` profile's chains
//               (gemm_fp32.cuh gemm_small_m_cols, aligned::linear's decode kernel) or the `mma` profile's
//               (mma_linear_kernels.cuh mma_lanes_tile, aligned::linear_mma's M <= 16 kernel); every output is one
//               row's chain, so the rows a tile holds never change a bit;
//   4. silu_and_mul over the N rows (the dense launcher);
//   5. grouped gemm: y = linear(a, w2[e]) unrounded fp32 (the 8-lane tree);
//   6. (shared expert: the dense launchers over all T tokens, in the glue);
//   7. combine per token in rank order (csrc/common/moe.h moe_combine_row), rounded once.
#pragma once

#include <stdint.h>

#include "../common/params_linear.h"
#include "../common/moe.h"  // moe_route_scratch_floats
#include "../common/params_moe.h"

namespace aligned::gpu {

constexpr int64_t kMoeTileRows = 16;  // rows of one grouped tile (the M <= 16 kernels of both profiles)

// The most tiles N assignments over E experts can need: sum_e ceil(c_e / 16) <= N / 16 + E, and <= N (every tile
// holds a row): a decode step (N = k) launches k tiles, not E.
inline int64_t moe_max_tiles(int64_t N, int64_t E) {
  const int64_t bound = (N + kMoeTileRows - 1) / kMoeTileRows + E;
  return bound < N ? bound : N;
}

// Step 1. A bad id (outside [0, E)) joins no expert: its pos is -1, the combine writes NaN for its token and
// error_flags[kErrExpertId] = 1 (dense_api.h DeviceError).
struct MoePlanParams {
  const int64_t* ids;    // [T, k]
  int64_t T, k, E;
  int64_t* start;        // [E + 1] out: first grouped row of each expert (start[E]: the valid assignments)
  int64_t* pos;          // [T, k] out
  int64_t* src;          // [N] out: token of each grouped row (-1 past start[E])
  int64_t* tiles;        // [max_tiles, 3] out: (expert, first row, rows)
  int64_t max_tiles;
  int32_t* error_flags;  // [kNumDeviceErrors] or nullptr
};

// Step 2: out[s] = x[src[s]] for the rows with src[s] >= 0.
struct MoeGatherParams {
  DType dt;
  const void* x;      // [T, H]
  const int64_t* src; // [N]
  void* out;          // [N, H]
  int64_t N, H;
};

// Steps 3 and 5: for every tile (e, r0, m), C[r0 .. r0 + m) = the profile's linear of A[r0 .. r0 + m) and
// B + e * b_se. g describes the whole grouped problem: A [N, K], B [Nout, K] of expert 0, C [N, Nout] (cdt: the
// model dtype, rounded, or F32: the unrounded 8-lane tree); g.M = N, lanes = 8, no bias.
struct MoeGroupedGemmParams {
  GemmParams g;
  int64_t b_se;          // element stride between experts' B
  const int64_t* tiles;  // [max_tiles, 3]
  int64_t max_tiles;
};

// Step 7: MoeCombineParams (params_moe.h) with pos == -1 marking a bad id (the token's row is NaN).

// The routing ops: one thread per token runs moe.h's row functions (moe_scores_row / moe_topk_row,
// moe_routing_backward_row, moe_grouped_routing_row, moe_grouped_routing_backward_row) — the CPU kernels' very
// functions, so every backend computes the same bits. The grid is capped (moe_route_blocks: at most
// kMoeMaxRouteBlocks x kMoeRouteThreads threads, each looping over tokens), and scratch is one slice per thread
// slot: moe_routing_scratch_floats(T, E, k, n_group) fp32 per call, bounded by the grid, not by T (at E = 256,
// k = 8, n_group = 8: 16384 slots x 794 floats = 52 MB at most, where one slice per token took 208 MB at
// T = 64K). A token's bits do not depend on which slot runs it (the row functions set what they read). The
// backwards check the ids in the kernel: a token with an id outside [0, E) gets a NaN row of dz and
// error_flags[kErrExpertId] = 1.
constexpr int kMoeRouteThreads = 128;
constexpr int64_t kMoeMaxRouteBlocks = 128;  // 16384 threads: one or more per SM / CU of an H200 or MI300X

// Blocks of n work items at `threads` per block, at least 1 and at most cap (the kernels loop grid-stride).
inline unsigned moe_capped_blocks(int64_t n, int64_t threads, int64_t cap) {
  const int64_t b = (n + threads - 1) / threads;
  return (unsigned)(b < cap ? (b > 0 ? b : 1) : cap);
}
inline unsigned moe_route_blocks(int64_t T) { return moe_capped_blocks(T, kMoeRouteThreads, kMoeMaxRouteBlocks); }

inline int64_t moe_routing_scratch_floats(int64_t T, int64_t E, int64_t k, int64_t n_group) {
  const int64_t slots = (int64_t)moe_route_blocks(T) * kMoeRouteThreads;
  return (T < slots ? T : slots) * moe_route_scratch_floats(E, k, n_group);
}

struct MoeLaunchers {
  const char* (*plan)(const MoePlanParams& p, void* stream);
  const char* (*gather)(const MoeGatherParams& p, void* stream);
  const char* (*grouped_gemm)(const MoeGroupedGemmParams& p, void* stream);      // `fma`
  const char* (*grouped_mma_gemm)(const MoeGroupedGemmParams& p, void* stream);  // `mma` (bf16)
  const char* (*combine)(const MoeCombineParams& p, void* stream);
  const char* (*routing)(const MoeRoutingParams& p, float* scratch, void* stream);
  const char* (*routing_backward)(const MoeRoutingParams& p, float* scratch, int32_t* error_flags, void* stream);
  const char* (*grouped_routing)(const MoeGroupedRoutingParams& p, float* scratch, void* stream);
  const char* (*grouped_routing_backward)(const MoeGroupedRoutingParams& p, float* scratch, int32_t* error_flags,
                                          void* stream);
};

}  // namespace aligned::gpu
