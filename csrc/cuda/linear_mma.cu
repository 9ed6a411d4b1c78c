// linear_mma.cu — the CUDA build of the `mma` linear (csrc/gpu/mma_linear_kernels.cuh: bf16 mma.sync m16n8k16
// into fp32 lane chains, sm_80+; compiled for sm_90a / sm_100a / sm_120a by the compile check). Same numerics
// flags as dense.cu: the lane fold and the epilogue (contract.h) must not be contracted.
#include "../gpu/mma_launch.cuh"
