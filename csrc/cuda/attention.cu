// attention.cu — the CUDA build of the attention kernels (csrc/gpu/attention_*.cuh): torch-free, raw
// pointers and cudaStream_t, compiled with the exact-numerics flags of dense.cu (no fast math, no -ftz,
// no contraction). The glue: csrc/torch/glue/attention.h, csrc/torch/backends/gpu.h.
#include "../gpu/attention_launch.cuh"
