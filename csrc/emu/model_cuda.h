// model_cuda.h — prelude of the emulated CUDA build of csrc/gpu: a generated TU (CMakeLists.txt, one per
// csrc/cuda/*.cu) includes this, then the .cu file itself, exactly as nvcc would compile it. compat.cuh then
// takes its CUDA branch (simt.h defines ALIGNED_GPU_CUDA) and the warp is 32 lanes.
//
// Every csrc/gpu name lands in aligned::gpu_emu_cuda instead of aligned::gpu (the macro below), so the
// emulated kernels and launchers never collide with the real ones of a CUDA build, nor with the HIP model.
#pragma once
#define ALIGNED_GPU_EMULATED 1
#include "model_common.h"
#define gpu gpu_emu_cuda
