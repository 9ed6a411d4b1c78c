// selftest_hip.cpp — the runtime self-test kernels (selftest_kernels.cuh) in the HIP spelling.
#include "model_hip.h"
#include "selftest_kernels.cuh"
