// moe.hip — the HIP build of moe_experts (csrc/gpu/moe_kernels.cuh), gfx942 / gfx950 wave64. Compiled with
// -ffp-contract=off like dense.hip.
#include "../gpu/moe_launch.cuh"

#if defined(__HIP_DEVICE_COMPILE__) && defined(__FAST_MATH__)
#error "aligned_ops: HIP kernels must not be compiled with -ffast-math"
#endif
