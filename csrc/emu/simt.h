// simt.h — the device side of the emulation target: what csrc/gpu kernels see when compiled for the host.
//
// The third target of the GPU compatibility layer (csrc/gpu/compat.cuh) beside CUDA and HIP. A kernel
// source in csrc/gpu is compiled unchanged by g++ and run by the SIMT runtime of csrc/emu/runtime.cpp:
// every GPU thread of a block is a fiber; a block's fibers run one at a time, each until it reaches a
// barrier, a warp collective (shuffle, vote, __syncwarp) or its end, so the run is deterministic, needs no
// locks between a block's threads, and runs under ASan (the runtime tells ASan about every stack switch).
//
// This header supplies, with the semantics of the vendor it models (one TU per vendor spelling, see
// csrc/emu/model_cuda.h and model_hip.h):
//   * the execution-space keywords (__global__, __device__, __host__, __forceinline__, __launch_bounds__);
//   * threadIdx / blockIdx / blockDim / gridDim / warpSize of the running fiber (warpSize: 32 for the sm_*
//     archs, 64 for gfx942 / gfx950 wave64);
//   * __shared__: one copy per block. Blocks of one worker OS thread run one after another, so a
//     function-local `static thread_local` is exactly "one array shared by the block's threads"; as on a
//     GPU its contents are undefined when a block starts (it keeps the previous block's values). (General-dynamic
//     TLS in the shipped library; initial-exec in the ASan build, where each __tls_get_addr call is intercepted:
//     CMakeLists.txt, scripts/asan_tests.sh);
//   * __syncthreads (every live thread of the block must arrive; exited threads do not count, as on sm_70+
//     and CDNA), __syncwarp, shuffles (xor / idx / up / down, any width that is a power of two <= warpSize;
//     a lane reading outside its width segment gets its own value, as both vendors document), votes
//     (ballot / any / all: 32-bit masks on CUDA, 64-bit on HIP);
//   * dynamic shared memory (compat.cuh dynamic_shared<T>()) with the vendor's launch limits: 48 KB on CUDA until
//     cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, n) raises the kernel's limit (at
//     most the arch's opt-in maximum, cudaDeviceGetAttribute(cudaDevAttrMaxSharedMemoryPerBlockOptin)); the whole
//     LDS on HIP (hipFuncSetAttribute / hipDeviceGetAttribute(hipDeviceAttributeMaxSharedMemoryPerBlock));
//   * async copies (__pipeline_memcpy_async / __pipeline_commit / __pipeline_wait_prior): the copy is
//     performed, synchronously, when a wait retires its group — never earlier — so a kernel that reads
//     the destination before waiting reads stale data here too;
//   * the correctly rounded fp32 intrinsics (__fadd_rn, __fmul_rn, __fmaf_rn, __fdiv_rn, __fsqrt_rn, __frcp_rn),
//     evaluated with the host's IEEE binary32 operations (bit-identical by IEEE-754).
// Vendor approximations (__expf, __fdividef, rcp/sqrt.approx, ...) and the matrix instructions are not
// defined here, so a kernel using one fails to compile for the emulation target instead of running with a
// made-up model. Matrix units: the integer MMAs of the exact linear (mma.sync m16n8k32 s8, v_mfma_i32_16x16x32_i8)
// are emulated through warp_matrix (simt_api.h; csrc/gpu/int_mma.cuh calls it): integer MMA is exact, the model
// is its definition with the vendors' fragment layouts. A bf16/fp16 MMA needs the MMA-Sim model of its arch
// (DESIGN.md, shared/notes/gpu-kernels.md) — added with the first kernel that uses one.
//
// Rules a kernel must follow, which the runtime checks (a violation fails the launch with a message; the
// torch glue raises it): every lane named in a _sync mask arrives at the same collective; no lane reads a
// shuffle value from a lane that is not at that collective (exited or diverged); __syncthreads is reached by
// every live thread; at most 1024 threads per block; grid.y, grid.z <= 65535.
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

#if !defined(ALIGNED_GPU_EMULATED)
#error "simt.h is the emulation target of csrc/gpu/compat.cuh: include a csrc/emu/model_*.h prelude first"
#endif

#include "simt_api.h"

#define ALIGNED_EMU_LAUNCH(grid, block, shared, stream, ...) \
  ::aligned::emu::Launch<&__VA_ARGS__> { {dim3(grid), dim3(block), (size_t)(shared), (void*)(stream)} }

// ---- execution spaces and built-ins ---------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __shared__ static thread_local
#define threadIdx (::aligned::emu::fiber_coords()->thread_idx)
#define blockIdx (::aligned::emu::fiber_coords()->block_idx)
#define blockDim (::aligned::emu::fiber_coords()->block_dim)
#define gridDim (::aligned::emu::fiber_coords()->grid_dim)
#define warpSize (::aligned::emu::fiber_coords()->warp_size)

inline void __syncthreads() { ::aligned::emu::sync_threads(); }

// ---- vector types (the ones kernels use for 16-byte accesses) -----------------------------------------
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

// ---- correctly rounded fp32 intrinsics (IEEE binary32 on the host; built with -ffp-contract=off) --------
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return __builtin_sqrtf(a); }

// ---- async copies (cuda_pipeline_primitives.h spelling) ---------------------------------------------------
inline void __pipeline_memcpy_async(void* dst, const void* src, size_t bytes, size_t zero_fill = 0) {
  ::aligned::emu::async_copy(dst, src, bytes, zero_fill);
}
inline void __pipeline_commit() { ::aligned::emu::async_commit(); }
inline void __pipeline_wait_prior(size_t n) { ::aligned::emu::async_wait_prior(n); }

#if defined(ALIGNED_EMULATED_HIP)
// ---- HIP spelling (wave64: masks are 64-bit, no _sync variants needed) ---------------------------------
#define ALIGNED_GPU_HIP 1
using hipStream_t = void*;
enum hipError_t { hipSuccess = 0, hipErrorInvalidValue = 1, hipErrorLaunchFailure = 719 };
inline hipError_t hipGetLastError() {
  return ::aligned::emu::take_last_error() ? hipErrorLaunchFailure : hipSuccess;
}
inline const char* hipGetErrorString(hipError_t e) {
  return e == hipSuccess ? "no error" : e == hipErrorInvalidValue ? "invalid argument" : ::aligned::emu::last_error_message();
}
enum hipFuncAttribute { hipFuncAttributeMaxDynamicSharedMemorySize = 8 };
inline hipError_t hipFuncSetAttribute(const void* kernel, hipFuncAttribute, int value) {
  return ::aligned::emu::set_max_dynamic_shared(kernel, value) ? hipErrorInvalidValue : hipSuccess;
}
enum hipDeviceAttribute_t { hipDeviceAttributeMaxSharedMemoryPerBlock = 74 };
inline hipError_t hipGetDevice(int* device) {
  *device = 0;
  return hipSuccess;
}
inline hipError_t hipDeviceGetAttribute(int* value, hipDeviceAttribute_t, int) {
  *value = (int)::aligned::emu::max_dynamic_shared_optin();
  return hipSuccess;
}
// The wave's execution barrier (lanes of a CDNA wave run in lockstep on the hardware; the emulator's lanes do
// not, so code that exchanges data through LDS within a wave needs it here as __syncwarp on CUDA).
inline void __builtin_amdgcn_wave_barrier() {
  ::aligned::emu::warp_collective(::aligned::emu::WarpOp::kSyncWarp, 0, 0, warpSize, ~0ull, false);
}
template <class T>
inline T __shfl_xor(T v, int lane_mask, int width = warpSize) {
  return ::aligned::emu::shuffle(::aligned::emu::WarpOp::kShflXor, v, lane_mask, width, ~0ull, false);
}
template <class T>
inline T __shfl(T v, int src_lane, int width = warpSize) {
  return ::aligned::emu::shuffle(::aligned::emu::WarpOp::kShflIdx, v, src_lane, width, ~0ull, false);
}
template <class T>
inline T __shfl_up(T v, unsigned delta, int width = warpSize) {
  return ::aligned::emu::shuffle(::aligned::emu::WarpOp::kShflUp, v, (int)delta, width, ~0ull, false);
}
template <class T>
inline T __shfl_down(T v, unsigned delta, int width = warpSize) {
  return ::aligned::emu::shuffle(::aligned::emu::WarpOp::kShflDown, v, (int)delta, width, ~0ull, false);
}
inline unsigned long long __ballot(int pred) {
  return ::aligned::emu::warp_collective(::aligned::emu::WarpOp::kBallot, pred != 0, 0, warpSize, ~0ull, false);
}
inline int __any(int pred) {
  return (int)::aligned::emu::warp_collective(::aligned::emu::WarpOp::kAny, pred != 0, 0, warpSize, ~0ull, false);
}
inline int __all(int pred) {
  return (int)::aligned::emu::warp_collective(::aligned::emu::WarpOp::kAll, pred != 0, 0, warpSize, ~0ull, false);
}
#else
// ---- CUDA spelling (warp of 32: masks are 32-bit) ---------------------------------------------------------
#define ALIGNED_GPU_CUDA 1
using cudaStream_t = void*;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorLaunchFailure = 719 };
inline cudaError_t cudaGetLastError() {
  return ::aligned::emu::take_last_error() ? cudaErrorLaunchFailure : cudaSuccess;
}
inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : e == cudaErrorInvalidValue ? "invalid argument" : ::aligned::emu::last_error_message();
}
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
template <class F>
inline cudaError_t cudaFuncSetAttribute(F* kernel, cudaFuncAttribute, int value) {
  return ::aligned::emu::set_max_dynamic_shared(reinterpret_cast<const void*>(kernel), value) ? cudaErrorInvalidValue
                                                                                              : cudaSuccess;
}
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr, int) {
  *value = (int)::aligned::emu::max_dynamic_shared_optin();
  return cudaSuccess;
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = warpSize) {
  return ::aligned::emu::shuffle(::aligned::emu::WarpOp::kShflXor, v, lane_mask, width, mask, true);
}
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = warpSize) {
  return ::aligned::emu::shuffle(::aligned::emu::WarpOp::kShflIdx, v, src_lane, width, mask, true);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
  return ::aligned::emu::shuffle(::aligned::emu::WarpOp::kShflUp, v, (int)delta, width, mask, true);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
  return ::aligned::emu::shuffle(::aligned::emu::WarpOp::kShflDown, v, (int)delta, width, mask, true);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return (unsigned)::aligned::emu::warp_collective(::aligned::emu::WarpOp::kBallot, pred != 0, 0, warpSize, mask, true);
}
inline int __any_sync(unsigned mask, int pred) {
  return (int)::aligned::emu::warp_collective(::aligned::emu::WarpOp::kAny, pred != 0, 0, warpSize, mask, true);
}
inline int __all_sync(unsigned mask, int pred) {
  return (int)::aligned::emu::warp_collective(::aligned::emu::WarpOp::kAll, pred != 0, 0, warpSize, mask, true);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::aligned::emu::warp_collective(::aligned::emu::WarpOp::kSyncWarp, 0, 0, warpSize, mask, true);
}
#endif
