// gemm_tiles.h — how the CPU glue spreads one GEMM (GemmParams, csrc/common/params_linear.h) over torch's
// intra-op threads: contiguous runs of 32-column output panels over all rows, and when there are too few panels
// to keep every thread busy, row chunks as well. Tiles only choose which chains a thread runs, never how one is
// summed (contract.h `fma`, mma.h `mma`: every output element is one lane tree over all of K), so the split
// cannot change a bit. `gemm` is the profile's kernel entry (KernelTable::gemm, MmaKernels::gemm).
// (csrc/torch/backends: the mma family and the moe experts run it; cpu_dense.cpp keeps the same split for the fma table.)
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>

#include "../common/params_linear.h"
#include "ieee_env.h"

namespace aligned::cpu {

using GemmFn = void (*)(const GemmParams& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1);

inline void run_gemm_tiles(const GemmParams& p, GemmFn gemm) {
  constexpr int64_t kPanelN = 32;
  const int64_t M = p.M, N = p.N, K = p.K;
  if (M <= 0 || N <= 0) return;
  const int64_t panels = (N + kPanelN - 1) / kPanelN;
  const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
  int64_t mchunk = M;
  if (panels < 2 * nt && M > 16) mchunk = std::max<int64_t>(16, ((M + 2 * nt - 1) / (2 * nt) + 7) / 8 * 8);
  const int64_t mt = (M + mchunk - 1) / mchunk;
  // Enough work per task that threading pays: ~2^18 multiply-adds per task at least.
  const int64_t per_panel = std::max<int64_t>(1, std::min(M, mchunk) * kPanelN * std::max<int64_t>(K, 1));
  const int64_t grain_tasks = std::max<int64_t>(1, (1 << 18) / per_panel);
  ieee_parallel_for(0, mt * panels, grain_tasks, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e;) {
      const int64_t mi = t / panels, p0 = t % panels, p1 = std::min(panels, p0 + (e - t));
      gemm(p, mi * mchunk, std::min(M, (mi + 1) * mchunk), p0 * kPanelN, std::min(N, p1 * kPanelN));
      t += p1 - p0;
    }
  });
}

}  // namespace aligned::cpu
