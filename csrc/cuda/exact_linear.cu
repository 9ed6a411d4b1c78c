// exact_linear.cu — the CUDA build of the `exact` linear (csrc/gpu/exact_linear_kernels.cuh: int8 mma.sync
// m16n8k32 into exact int32 level sums, sm_80+; compiled for sm_90a / sm_100a by the compile check). Same
// exact-numerics flags as dense.cu: the epilogue's single rounding (exact_linear.h) must not be contracted.
#include "../gpu/exact_launch.cuh"
