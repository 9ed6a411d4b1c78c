// model_hip.h — prelude of the emulated HIP build of csrc/gpu (one generated TU per csrc/hip/*.hip, see
// CMakeLists.txt). compat.cuh takes its HIP branch (simt.h defines ALIGNED_GPU_HIP: __shfl_xor & co. without
// masks, 64-bit ballots), and the arch's wave is 64 lanes (gfx942, gfx950). Names land in
// aligned::gpu::emulated_hip (compat.cuh ALIGNED_GPU_BUILD).
#pragma once
#define ALIGNED_GPU_EMULATED 1
#define ALIGNED_EMULATED_HIP 1
#include "model_common.h"
