// attention.hip — the HIP build of the attention kernels (csrc/gpu/attention_*.cuh): torch-free, raw
// pointers and hipStream_t, compiled by hip-clang with -ffp-contract=off (never -ffast-math). On wave64
// each wave holds two of the kernels' 32-lane groups (compat.cuh).
#include "../gpu/attention_launch.cuh"

#if defined(__HIP_DEVICE_COMPILE__) && defined(__FAST_MATH__)
#error "aligned_ops: HIP kernels must not be compiled with -ffast-math"
#endif
