// exact_linear_kernels.cuh — the `exact` linear on GPU integer matrix units (CUDA mma.sync s8, HIP MFMA i8),
// one source for both vendors and for the emulation target. The numbers are csrc/common/exact_linear.h (the
// same helpers the CPU kernels call); docs/exact_linear.md explains the representation.
//
// Three kernels, as on the CPU:
//   exact_row_forms_kernel   one 32-lane group per row: the row's canonical form (E, S, non-finite flag) from
//                            row_scan_add per element and an exact max / min / or butterfly (order-free);
//   exact_pack_digits_kernel one thread per element: quantize + split_digits into the packed layouts of
//                            csrc/cpu/exact_kernels.h (x: xd[t][Mp][Kp]; weight: wd[u][Np/16][Kp/4][16][4]),
//                            so a weight packed here equals the CPU's packed weight byte for byte;
//   exact_gemm_kernel        each warp (CUDA, 32 lanes) / wave (HIP, 64 lanes) owns one 16-row x 16-column
//                            output tile. For every 32-wide k step it loads the A fragments of the tile's
//                            digit planes t < Sx (Sx = the largest digit count of the tile's rows) and the B
//                            fragments of the weight's planes u < Sw straight from global memory, and issues one
//                            integer MMA per (t, u) into the accumulator of level t + u (int32: digit pairs of a
//                            level share a weight, so adding them is exact; <= 4 pairs x 2^14 x 8192 < 2^31 for
//                            a chunk of 8192 k). After each chunk the 7 level sums are added exactly into the
//                            split accumulator (add_level: hi * 2^32 + lo, int64), and the epilogue rounds once
//                            (exact_output_f32, then + bias, then the output dtype) — the CPU's epilogue.
// The fragment layouts are those of int_mma.cuh. Nothing depends on the grid, the chunking or the order of
// the MMAs: every sum is an exact integer.
#pragma once

#include <stdint.h>

#include "compat.cuh"  // first: the vendor runtime header defines __host__ / __device__ for exact_linear.h
#include "int_mma.cuh"
#include "../common/exact_linear.h"

namespace aligned::gpu::ALIGNED_GPU_BUILD {

constexpr int kExactFormThreads = 256;                       // 8 row groups of 32 lanes
constexpr int kExactPackThreads = 256;
constexpr int kExactWarpsPerBlock = 4;                      // 4 output tiles of 16 x 16 per block
constexpr int kExactGemmThreads = kExactWarpsPerBlock * kMatrixWarpLanes;  // 128 (CUDA) / 256 (HIP)
constexpr int kExactTileM = 16 * kExactWarpsPerBlock;       // rows per block
constexpr int kExactTileN = 16;                             // columns per block (one weight panel)
constexpr int64_t kExactMaxChunkK = 8192;                   // k per int32 level sum (see the bound above)
constexpr int kExactLevels = 2 * exact::kMaxDigits - 1;     // t + u in 0..6
#if defined(ALIGNED_GPU_HIP)
constexpr int kExactNTiles = 1;  // one 16x16x32 MFMA covers the 16 columns
#else
constexpr int kExactNTiles = 2;  // two m16n8k32 MMAs cover the 16 columns
#endif

template <typename T>
__global__ void __launch_bounds__(kExactFormThreads)
    exact_row_forms_kernel(const T* v, int64_t rows, int64_t K, int32_t* E, int8_t* S, uint8_t* bad) {
  const int lane = (int)(threadIdx.x % kGroupLanes);
  const int64_t group = global_thread_index() / kGroupLanes, groups = global_thread_count() / kGroupLanes;
  for (int64_t r = group; r < rows; r += groups) {  // the 32 lanes of a group share r: uniform loop
    exact::RowScan s = exact::row_scan_init();
    for (int64_t k = lane; k < K; k += kGroupLanes) exact::row_scan_add(s, to_f32(v[r * K + k]));
#pragma unroll
    for (int w = kGroupLanes / 2; w >= 1; w /= 2) {
      exact::RowScan o;
      o.emax = shfl_xor32(s.emax, w);
      o.lmin = shfl_xor32(s.lmin, w);
      o.bad = shfl_xor32((int)s.bad, w) != 0;
      s = exact::row_scan_merge(s, o);
    }
    if (lane == 0) {
      const exact::RowForm f = exact::row_scan_form(s);
      E[r] = f.E;
      S[r] = (int8_t)f.S;
      bad[r] = f.bad ? 1 : 0;
    }
  }
}

// Digits of every finite nonzero element into a zeroed buffer. kWeightLayout: the panel layout with the
// weight's one digit count `fixed_digits`; else the row-major x layout with each row's own S.
template <typename T, bool kWeightLayout>
__global__ void __launch_bounds__(kExactPackThreads)
    exact_pack_digits_kernel(const T* v, int64_t rows, int64_t K, int64_t Kp, int64_t plane, const int32_t* E,
                             const int8_t* S, int fixed_digits, int8_t* out) {
  const int64_t n = rows * K, step = global_thread_count();
  for (int64_t i = global_thread_index(); i < n; i += step) {
    const float f = to_f32(v[i]);
    if (f == 0.0f || !exact::is_finite_bits(f)) continue;
    const int64_t r = i / K, k = i % K;
    const int s = kWeightLayout ? fixed_digits : (int)S[r];
    const int64_t off = kWeightLayout ? (r / 16) * (Kp * 16) + (k / 4) * 64 + (r % 16) * 4 + (k % 4) : r * Kp + k;
    exact::split_digits(exact::quantize(f, s, E[r]), s, out + off, plane);
  }
}

__device__ __forceinline__ uint32_t load_u32(const int8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

template <typename T>
__global__ void __launch_bounds__(kExactGemmThreads)
    exact_gemm_kernel(const int8_t* xd, int64_t x_plane, const int32_t* x_exp, const int8_t* x_digits,
                      const uint8_t* x_bad, const int8_t* wd, int64_t w_plane, const int32_t* w_exp,
                      const uint8_t* w_bad, int w_digits, const T* bias, T* out, int64_t M, int64_t N, int64_t Kp,
                      int64_t chunk_k) {
  const int warp = (int)(threadIdx.x / kMatrixWarpLanes), lane = (int)(threadIdx.x % kMatrixWarpLanes);
  const int64_t m0 = ((int64_t)blockIdx.y * kExactWarpsPerBlock + warp) * 16;
  const int64_t n0 = (int64_t)blockIdx.x * kExactTileN;
  if (m0 >= M) return;  // the whole warp: its tile is past the last row
  int sx = 1;           // digit planes this tile needs (rows past a row's own S hold zeros)
  for (int r = 0; r < 16; ++r)
    if (m0 + r < M && x_digits[m0 + r] > sx) sx = x_digits[m0 + r];
  const int sw = w_digits;
  const int8_t* wpanel = wd + (n0 / 16) * (Kp * 16);
  int64_t hi[kExactNTiles][4], lo[kExactNTiles][4];
  for (int h = 0; h < kExactNTiles; ++h)
    for (int r = 0; r < 4; ++r) hi[h][r] = lo[h][r] = 0;

  for (int64_t kc = 0; kc < Kp; kc += chunk_k) {
    const int64_t kend = kc + chunk_k < Kp ? kc + chunk_k : Kp;
    int32_t lev[kExactLevels][kExactNTiles][4];
    for (int s = 0; s < kExactLevels; ++s)
      for (int h = 0; h < kExactNTiles; ++h)
        for (int r = 0; r < 4; ++r) lev[s][h][r] = 0;
    for (int64_t k = kc; k < kend; k += 32) {
#if defined(ALIGNED_GPU_HIP)
      const int i = lane & 15, hk = lane >> 4;
      int64_t a[exact::kMaxDigits], b[exact::kMaxDigits];
#pragma unroll
      for (int t = 0; t < exact::kMaxDigits; ++t)
        if (t < sx) a[t] = *reinterpret_cast<const int64_t*>(xd + t * x_plane + (m0 + i) * Kp + k + 8 * hk);
#pragma unroll
      for (int u = 0; u < exact::kMaxDigits; ++u)
        if (u < sw) {  // 8 consecutive k of column i: two 4-k quads of the panel layout
          const int8_t* p = wpanel + u * w_plane + (k / 4 + 2 * hk) * 64 + i * 4;
          b[u] = (int64_t)((uint64_t)load_u32(p) | ((uint64_t)load_u32(p + 64) << 32));
        }
#pragma unroll
      for (int t = 0; t < exact::kMaxDigits; ++t)
#pragma unroll
        for (int u = 0; u < exact::kMaxDigits; ++u)
          if (t < sx && u < sw) mfma_i32_16x16x32_i8(lev[t + u][0], a[t], b[u]);
#else
      const int g = lane >> 2, q = lane & 3;
      uint32_t a[exact::kMaxDigits][4], b[exact::kMaxDigits][kExactNTiles][2];
#pragma unroll
      for (int t = 0; t < exact::kMaxDigits; ++t)
        if (t < sx) {
          const int8_t* p = xd + t * x_plane + (m0 + g) * Kp + k + 4 * q;
          a[t][0] = load_u32(p);
          a[t][1] = load_u32(p + 8 * Kp);
          a[t][2] = load_u32(p + 16);
          a[t][3] = load_u32(p + 8 * Kp + 16);
        }
#pragma unroll
      for (int u = 0; u < exact::kMaxDigits; ++u)
        if (u < sw)
#pragma unroll
          for (int h = 0; h < kExactNTiles; ++h) {  // column 8h + g of the panel; k 4q.. and 16 + 4q..
            const int8_t* p = wpanel + u * w_plane + (k / 4 + q) * 64 + (8 * h + g) * 4;
            b[u][h][0] = load_u32(p);
            b[u][h][1] = load_u32(p + 4 * 64);
          }
#pragma unroll
      for (int t = 0; t < exact::kMaxDigits; ++t)
#pragma unroll
        for (int u = 0; u < exact::kMaxDigits; ++u)
          if (t < sx && u < sw)
#pragma unroll
            for (int h = 0; h < kExactNTiles; ++h) mma_s8_m16n8k32(lev[t + u][h], a[t], b[u][h]);
#endif
    }
    for (int s = 0; s < kExactLevels; ++s)
      for (int h = 0; h < kExactNTiles; ++h)
        for (int r = 0; r < 4; ++r) exact::add_level(hi[h][r], lo[h][r], s, lev[s][h][r]);
  }

  for (int h = 0; h < kExactNTiles; ++h)
    for (int r = 0; r < 4; ++r) {
#if defined(ALIGNED_GPU_HIP)
      const int64_t row = m0 + 4 * (lane >> 4) + r, col = n0 + (lane & 15);
#else
      const int64_t row = m0 + (lane >> 2) + 8 * (r >> 1), col = n0 + 8 * h + 2 * (lane & 3) + (r & 1);
#endif
      if (row >= M || col >= N) continue;
      float y = exact::exact_output_f32(hi[h][r], lo[h][r], x_exp[row], w_exp[col], x_bad[row] || w_bad[col]);
      if (bias) y = y + to_f32(bias[col]);
      out[row * N + col] = from_f32<T>(y);
    }
}

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
