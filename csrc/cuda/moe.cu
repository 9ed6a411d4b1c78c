// moe.cu — the CUDA build of moe_experts (csrc/gpu/moe_kernels.cuh: the plan, gather, grouped projections of both
// profiles and the combine). Same numerics flags as dense.cu: the lane folds, the combine and the epilogues
// (contract.h, moe.h) must not be contracted.
#include "../gpu/moe_launch.cuh"
