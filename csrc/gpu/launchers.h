// launchers.h — the launcher tables of every build of csrc/gpu one library can hold (compat.cuh,
// ALIGNED_GPU_BUILD), declared for the torch glue's GPU backends (csrc/torch/backends/gpu.h):
//   device          the nvcc / hip-clang build (linked into a CUDA or ROCm torch's extension only);
//   emulated_cuda   the emulation target's CUDA spelling (32-lane warps; sm_80, sm_90, sm_100, sm_120);
//   emulated_hip    the emulation target's HIP spelling (wave64; gfx942, gfx950).
// Each build defines its tables in its own namespace (dense_launch.cuh, attention_launch.cuh, exact_launch.cuh, mma_launch.cuh, moe_launch.cuh),
// exactly as each CPU ISA level defines its kernel tables (csrc/cpu/cpu_dispatch.cpp). Torch-free.
#pragma once

#include <string>
#include <vector>

#include "attention_api.h"
#include "dense_api.h"
#include "exact_api.h"
#include "mma_api.h"
#include "moe_api.h"

namespace aligned::gpu {

namespace device {
extern const DenseLaunchers kDenseLaunchers;
extern const AttentionLaunchers kAttentionLaunchers;
extern const ExactLaunchers kExactLaunchers;
extern const MmaLaunchers kMmaLaunchers;
extern const MoeLaunchers kMoeLaunchers;
}  // namespace device

namespace emulated_cuda {
extern const DenseLaunchers kDenseLaunchers;
extern const AttentionLaunchers kAttentionLaunchers;
extern const ExactLaunchers kExactLaunchers;
extern const MmaLaunchers kMmaLaunchers;
extern const MoeLaunchers kMoeLaunchers;
// The SIMT runtime's self-test kernels (csrc/emu/selftest_kernels.cuh) in this spelling.
const char* run_selftest(const std::string& name, std::vector<long long>& out);
}  // namespace emulated_cuda

namespace emulated_hip {
extern const DenseLaunchers kDenseLaunchers;
extern const AttentionLaunchers kAttentionLaunchers;
extern const ExactLaunchers kExactLaunchers;
extern const MmaLaunchers kMmaLaunchers;
extern const MoeLaunchers kMoeLaunchers;
const char* run_selftest(const std::string& name, std::vector<long long>& out);
}  // namespace emulated_hip

}  // namespace aligned::gpu
