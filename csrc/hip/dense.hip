// dense.hip — the HIP build of the dense kernels: torch-free, raw pointers and hipStream_t. The kernels and
// launchers are shared with CUDA (csrc/gpu/); this file only instantiates them under hip-clang, which must
// be given -ffp-contract=off (and never -ffast-math / -fgpu-flush-denormals-to-zero).
// On wave64 (gfx942, gfx950) each wave runs two independent 32-lane reduction groups (compat.cuh).
#include "../gpu/dense_launch.cuh"

#if defined(__HIP_DEVICE_COMPILE__) && defined(__FAST_MATH__)
#error "aligned_ops: HIP kernels must not be compiled with -ffast-math"
#endif
