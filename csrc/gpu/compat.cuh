// compat.cuh — the few differences between CUDA (nvcc) and HIP (hip-clang) that the dense kernels touch.
// A third target, the emulation (csrc/emu, ALIGNED_GPU_EMULATED), compiles this same source for the host in
// either vendor spelling and runs it with our SIMT runtime; it needs nothing from kernels but ALIGNED_LAUNCH.
//
// The kernels in this folder are written once and compiled by both vendors' compilers. Everything
// vendor-specific is here: the runtime header, the stream type, the error query, and the 32-lane
// shuffle. The numerics contract (csrc/common/reduce.h) fixes a 32-lane reduction; a CUDA warp is 32
// lanes, an AMD CDNA wave is 64, so on AMD every wave holds two independent 32-lane groups and the
// shuffles run with width 32 (each group only ever reads its own half). Kernels therefore never use
// warpSize: they use kGroupLanes and the group index threadIdx.x / 32.
#pragma once

#if defined(ALIGNED_GPU_EMULATED)
// The emulation target (csrc/emu): the same source compiled for the host, run by our SIMT runtime. simt.h
// defines ALIGNED_GPU_CUDA or ALIGNED_GPU_HIP for the vendor spelling being emulated, so the branches
// below are the real vendor branches.
#include "../emu/simt.h"
#elif defined(__HIPCC__)
#include <hip/hip_runtime.h>
#define ALIGNED_GPU_HIP 1
#else
#include <cuda_runtime.h>
#define ALIGNED_GPU_CUDA 1
#endif

// The build of csrc/gpu this translation unit compiles, and the namespace its names live in. One library holds
// up to three builds of this source: the device build (nvcc or hip-clang, in a CUDA or ROCm torch) and the
// emulation target's two vendor spellings (csrc/emu: the CUDA spelling with 32-lane warps, the HIP spelling
// with wave64). Their inline functions and kernel templates have the same names but different bodies, so each
// build keeps them in its own namespace, aligned::gpu::<build>, and the linker can never merge one build's
// definition into another's (the CPU kernels do the same per ISA level: aligned::cpu::<level>). What the glue
// and the kernels share (params structs, error codes, the launcher tables) stays in aligned::gpu; each build
// exports its launchers as tables (dense_api.h, attention_api.h, exact_api.h; declared per build in
// csrc/gpu/launchers.h).
#if defined(ALIGNED_GPU_EMULATED) && defined(ALIGNED_GPU_HIP)
#define ALIGNED_GPU_BUILD emulated_hip
#elif defined(ALIGNED_GPU_EMULATED)
#define ALIGNED_GPU_BUILD emulated_cuda
#else
#define ALIGNED_GPU_BUILD device
#endif

// Fast math is outside the numerics contract. The compile check scans the emitted code (cmake/gpu_isa_check.py);
// where the compiler announces fast math with a macro, refuse at once. nvcc defines __USE_FAST_MATH__ for
// --use_fast_math in some releases (13.0 does not: its PTX shows .ftz / .approx instead); clang (HIP and host)
// defines __FAST_MATH__ and __FINITE_MATH_ONLY__ 1 for -ffast-math, __CLANG_GPU_APPROX_TRANSCENDENTALS__ for
// -fgpu-approx-transcendentals.
#if defined(__USE_FAST_MATH__)
#error "aligned_ops: csrc/gpu must not be compiled with --use_fast_math (numerics contract)"
#endif
#if defined(__FAST_MATH__) || (defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__) || \
    defined(__CLANG_GPU_APPROX_TRANSCENDENTALS__)
#error "aligned_ops: csrc/gpu must not be compiled with -ffast-math / -ffinite-math-only / approximate transcendentals"
#endif

// ALIGNED_LAUNCH(grid, block, shared_bytes, stream, kernel<...>)(args...) is `kernel<<<grid, block, shared_bytes,
// stream>>>(args...)`; the emulation target, being plain C++, has no <<< >>> syntax.
#if defined(ALIGNED_GPU_EMULATED)
#define ALIGNED_LAUNCH(grid, block, shared_bytes, stream, ...) ALIGNED_EMU_LAUNCH(grid, block, shared_bytes, stream, __VA_ARGS__)
#else
#define ALIGNED_LAUNCH(grid, block, shared_bytes, stream, ...) __VA_ARGS__<<<grid, block, shared_bytes, stream>>>
#endif

#include <stdint.h>
#include <string.h>

#include "../common/numerics.h"
#include "../common/reduce.h"

namespace aligned::gpu::ALIGNED_GPU_BUILD {

#if defined(ALIGNED_GPU_HIP)
using gpu_stream_t = hipStream_t;
using gpu_error_t = hipError_t;
inline gpu_error_t gpu_last_error() { return hipGetLastError(); }
inline bool gpu_ok(gpu_error_t e) { return e == hipSuccess; }
inline const char* gpu_error_string(gpu_error_t e) { return hipGetErrorString(e); }
#else
using gpu_stream_t = cudaStream_t;
using gpu_error_t = cudaError_t;
inline gpu_error_t gpu_last_error() { return cudaGetLastError(); }
inline bool gpu_ok(gpu_error_t e) { return e == cudaSuccess; }
inline const char* gpu_error_string(gpu_error_t e) { return cudaGetErrorString(e); }
#endif
// What every launcher returns: nullptr, or the runtime's message for the last launch error.
inline const char* last_error() {
  gpu_error_t e = gpu_last_error();
  return gpu_ok(e) ? nullptr : gpu_error_string(e);
}

// ---- dynamic shared memory ------------------------------------------------------------------------------
// The block's dynamic shared memory (the launch's shared_bytes), 16-byte aligned. A launch above 48 KB on CUDA
// needs allow_dynamic_shared(kernel, bytes) first (cudaFuncSetAttribute), up to max_dynamic_shared_bytes();
// the emulator enforces both limits (csrc/emu/simt.h), so a launcher that forgets the opt-in fails in CI.
template <typename T>
__device__ __forceinline__ T* dynamic_shared() {
#if defined(ALIGNED_GPU_EMULATED)
  return reinterpret_cast<T*>(::aligned::emu::dynamic_shared_memory());
#else
  extern __shared__ __attribute__((aligned(16))) unsigned char aligned_dynamic_smem[];
  return reinterpret_cast<T*>(aligned_dynamic_smem);
#endif
}

// Raises `kernel`'s dynamic shared memory limit to `bytes` on the current device: nullptr, or the runtime's error.
// CUDA needs it above 48 KB; HIP accepts it (CDNA has no such step: a workgroup may use the whole LDS).
template <typename K>
inline const char* allow_dynamic_shared(K* kernel, size_t bytes) {
#if defined(ALIGNED_GPU_HIP)
  const gpu_error_t e = hipFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                            hipFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
#else
  const gpu_error_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
#endif
  return gpu_ok(e) ? nullptr : gpu_error_string(e);
}

// The most dynamic shared memory one block of the current device can get after the opt-in (sm_80 163 KB, sm_90 /
// sm_100 227 KB, sm_120 99 KB, gfx942 64 KB, gfx950 160 KB); 0 if the query fails.
inline size_t max_dynamic_shared_bytes() {
  int dev = 0, v = 0;
#if defined(ALIGNED_GPU_HIP)
  if (!gpu_ok(hipGetDevice(&dev)) || !gpu_ok(hipDeviceGetAttribute(&v, hipDeviceAttributeMaxSharedMemoryPerBlock, dev)))
    return 0;
#else
  if (!gpu_ok(cudaGetDevice(&dev)) || !gpu_ok(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)))
    return 0;
#endif
  return v > 0 ? (size_t)v : 0;
}

// The warp's (CUDA) / wave's (HIP) execution barrier: orders the lanes' shared-memory accesses around it.
__device__ __forceinline__ void warp_sync() {
#if defined(ALIGNED_GPU_HIP)
  __builtin_amdgcn_wave_barrier();
#else
  __syncwarp();
#endif
}

// Lanes of one reduction group (reduce.h: kReduceLanes). A CUDA warp, or half an AMD wave64.
constexpr int kGroupLanes = 32;
static_assert(kGroupLanes == kReduceLanes, "a reduction group must be exactly the contract's 32 lanes");
// Lanes of the hardware's warp / wave: a block's threads [0, kWaveLanes) are its first warp (CUDA) or wave (HIP).
#if defined(ALIGNED_GPU_HIP)
constexpr int kWaveLanes = 64;
#else
constexpr int kWaveLanes = 32;
#endif

// ---- 16-byte vector access ---------------------------------------------------------------------------------
// kVecElems<T> elements of T in 16 bytes (8 bf16 / fp16, 4 fp32). A vector access needs a 16-byte aligned address;
// callers test it (is_vec_aligned) and fall back to element accesses: same values, so same bits.
template <typename T>
constexpr int kVecElems = (int)(16 / sizeof(T));
template <typename T>
__device__ __forceinline__ bool is_vec_aligned(const T* p) {
  return ((uintptr_t)p & 15u) == 0;
}
template <typename T>
__device__ __forceinline__ void load_vec_f32(const T* p, float* out) {  // kVecElems<T> elements, widened exactly
  const int4 raw = *reinterpret_cast<const int4*>(p);
  T v[kVecElems<T>];
  memcpy(v, &raw, 16);
#pragma unroll
  for (int i = 0; i < kVecElems<T>; ++i) out[i] = to_f32(v[i]);
}
template <typename T>
__device__ __forceinline__ void store_vec(T* p, const T* v) {  // kVecElems<T> elements
  int4 raw;
  memcpy(&raw, v, 16);
  *reinterpret_cast<int4*>(p) = raw;
}

// v from lane (lane ^ mask) of the same 32-lane group. Every lane of the group must call it.
__device__ __forceinline__ float shfl_xor32(float v, int mask) {
#if defined(ALIGNED_GPU_HIP)
  return __shfl_xor(v, mask, kGroupLanes);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask, kGroupLanes);
#endif
}
__device__ __forceinline__ int shfl_xor32(int v, int mask) {
#if defined(ALIGNED_GPU_HIP)
  return __shfl_xor(v, mask, kGroupLanes);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask, kGroupLanes);
#endif
}

// v from lane src (0..31) of the same 32-lane group (every lane of the group must call it).
__device__ __forceinline__ float shfl_idx32(float v, int src) {
#if defined(ALIGNED_GPU_HIP)
  return __shfl(v, src, kGroupLanes);
#else
  return __shfl_sync(0xffffffffu, v, src, kGroupLanes);
#endif
}

// The halving tree of reduce.h as a butterfly: after the xor steps 16, 8, 4, 2, 1 lane 0 holds
// fold_lanes(lanes) exactly (step `w` adds lane i and lane i+w for i < w, as the tree does). Because fp32
// addition is commutative (a + b == b + a bitwise), lanes i and i^w hold the same bits after step w, so
// after the last step every lane of the group holds the result; no broadcast is needed.
__device__ __forceinline__ float group_sum_tree(float lane_partial) {
  float v = lane_partial;
#pragma unroll
  for (int w = kGroupLanes / 2; w >= 1; w /= 2) v = v + shfl_xor32(v, w);
  return v;
}

// Maximum over the group in the total order (max_total_f32, as contract.h lse_max_merge): exact and order-free for
// non-NaN inputs, the sign of a zero maximum included (the butterfly's order is not the CPU's lane fold; the pair's
// m is an output of token_logprobs_pairs). Rows holding NaN/+inf are flagged separately.
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int w = kGroupLanes / 2; w >= 1; w /= 2) v = max_total_f32(shfl_xor32(v, w), v);
  return v;
}
__device__ __forceinline__ int group_or(int v) {
#pragma unroll
  for (int w = kGroupLanes / 2; w >= 1; w /= 2) v = v | shfl_xor32(v, w);
  return v;
}

// Grid-stride helpers: 64-bit indices everywhere (rows * H can exceed 2^31).
__device__ __forceinline__ int64_t global_thread_index() {
  return (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t global_thread_count() { return (int64_t)gridDim.x * blockDim.x; }

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
