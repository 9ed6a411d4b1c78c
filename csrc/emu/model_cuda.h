// model_cuda.h — prelude of the emulated CUDA build of csrc/gpu: a generated TU (CMakeLists.txt, one per
// csrc/cuda/*.cu) includes this, then the .cu file itself, exactly as nvcc would compile it. compat.cuh then
// takes its CUDA branch (simt.h defines ALIGNED_GPU_CUDA), the warp is 32 lanes, and every csrc/gpu name lands
// in aligned::gpu::emulated_cuda (compat.cuh ALIGNED_GPU_BUILD), beside the real build and the HIP model.
#pragma once
#define ALIGNED_GPU_EMULATED 1
#include "model_common.h"
