// linear_mma.hip — the HIP build of the `mma` linear (csrc/gpu/mma_linear_kernels.cuh: v_mfma_f32_16x16x16_bf16
// into fp32 lane chains, gfx942 / gfx950 wave64). Compiled with -ffp-contract=off like dense.hip.
#include "../gpu/mma_launch.cuh"

#if defined(__HIP_DEVICE_COMPILE__) && defined(__FAST_MATH__)
#error "aligned_ops: HIP kernels must not be compiled with -ffast-math"
#endif
