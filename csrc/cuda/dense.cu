// dense.cu — the CUDA build of the dense kernels: torch-free, raw pointers and cudaStream_t. The kernels and
// launchers are shared with HIP (csrc/gpu/); this file only instantiates them under nvcc, which must be
// given the exact-numerics flags (CMakeLists.txt, cmake/gpu_compile_check.cmake):
//   --fmad=false -ftz=false -prec-div=true -prec-sqrt=true, never --use_fast_math.
// nvcc exposes no macro for -ftz / -prec-*, so the compile check (.ci/gpu_compile_check.sh) verifies the
// result instead: the PTX must hold no `.ftz` instruction and no ex2/lg2.approx (vendor exp/log).
#include "../gpu/dense_launch.cuh"
