// exact_linear.hip — the HIP build of the `exact` linear (csrc/gpu/exact_linear_kernels.cuh: v_mfma_i32_16x16x32_i8
// into exact int32 level sums, gfx942 / gfx950 wave64). Compiled with -ffp-contract=off like dense.hip.
#include "../gpu/exact_launch.cuh"

#if defined(__HIP_DEVICE_COMPILE__) && defined(__FAST_MATH__)
#error "aligned_ops: HIP kernels must not be compiled with -ffast-math"
#endif
