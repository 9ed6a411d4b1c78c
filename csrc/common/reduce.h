// reduce.h — the two reduction shapes of the contract:
//  * dot_chain: one sequential fp32 fma chain (a lane of linear, an attention score, every backward chain);
//  * lane_sum: the 32-lane row reduction for sums along a row (norm statistics, softmax denominators, the
//    backward dot products of norms and log-softmax), below.
//
// dot_chain(a, b, n): acc = +0, then acc = fma(a[i], b[i], acc) for i = 0, 1, ..., n-1 in order (a and b
// widened to fp32 exactly). n = 0 gives +0.
//
// Order it fixes, for a row of length n:
//   lane j (j = 0..31) accumulates the elements k = j, j+32, j+64, ... in increasing k, starting from +0;
//   the 32 lane sums are then folded by a halving tree: for width in 16, 8, 4, 2, 1:
//   lane[i] = lane[i] + lane[i + width] for i < width. The result is lane[0].
//
// Why this shape: 32 lanes = one CUDA warp, half an AMD wave (a wave reduces two rows or uses lanes
// 0..31), two AVX-512 or four AVX2 registers on the CPU. The halving tree is exactly what a
// __shfl_xor butterfly computes in lane 0 (fp32 addition is commutative, so a+b == b+a bitwise).
// Missing elements of a short row are +0, which leaves every lane sum unchanged (lane sums start at +0
// and can never be -0), so "skip" and "pad with zero" agree bit for bit.
#pragma once

#include "numerics.h"

namespace aligned {

template <typename TA, typename TB>
ALIGNED_HD float dot_chain(const TA* a, const TB* b, int64_t n) {
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) acc = fma_f32(to_f32(a[i]), to_f32(b[i]), acc);
  return acc;
}

constexpr int kReduceLanes = 32;

// Halving-tree fold of 32 lane partials (modifies `lanes`).
ALIGNED_HD float fold_lanes(float* lanes) {
  for (int width = kReduceLanes / 2; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) lanes[i] = lanes[i] + lanes[i + width];
  }
  return lanes[0];
}

// Reference (scalar) form of the contract for a sum of f(k) over k in [0, n). The CPU kernels
// use vectorised equivalents with the same lane assignment; tests compare them with this.
template <typename F>
ALIGNED_HD float lane_sum(int64_t n, F f) {
  float lanes[kReduceLanes];
  for (int j = 0; j < kReduceLanes; ++j) lanes[j] = 0.0f;
  for (int64_t k = 0; k < n; ++k) lanes[k % kReduceLanes] = lanes[k % kReduceLanes] + f(k);
  return fold_lanes(lanes);
}

}  // namespace aligned
