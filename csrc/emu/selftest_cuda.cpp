// selftest_cuda.cpp — the runtime self-test kernels (selftest_kernels.cuh) in the CUDA spelling.
#include "model_cuda.h"
#include "selftest_kernels.cuh"
