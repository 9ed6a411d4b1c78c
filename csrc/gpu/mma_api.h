// mma_api.h — the torch-free host interface of the GPU `mma` linear (csrc/gpu/mma_linear_kernels.cuh), used by
// the torch glue's GPU backends (csrc/torch/backends/gpu.h) and built by csrc/cuda/linear_mma.cu (nvcc),
// csrc/hip/linear_mma.hip (hip-clang) and their emulated builds (csrc/emu).
#pragma once

#include "../common/params_linear.h"

namespace aligned::gpu {

// The launchers of one build of csrc/gpu (compat.cuh ALIGNED_GPU_BUILD): each build defines one (mma_launch.cuh).
// mma_gemm: C = the mma profile's linear (csrc/common/mma.h) of A [M, K] and B [N, K] (bf16, element strides),
// `lanes` in {1, 2, 4, 8}; cdt BF16 (+ bias, one rounding) or F32 (linear_mma_partial: the unrounded sub-tree).
// Enqueues on `stream`; returns nullptr or the runtime's launch error / why the params are refused.
struct MmaLaunchers {
  const char* (*mma_gemm)(const GemmParams& p, void* stream);
};

}  // namespace aligned::gpu
