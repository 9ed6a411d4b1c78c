// selftest_kernels.cuh — small kernels that pin down the SIMT runtime's semantics (tests/emulated/
// test_emulation_runtime.py): warp width, votes, shuffle variants, the rules it enforces, async copies.
// Compiled for both vendor spellings (selftest_cuda.cpp, selftest_hip.cpp); not part of csrc/gpu.
#pragma once
#include <string>
#include <vector>

#include "../gpu/compat.cuh"

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace aligned::gpu::ALIGNED_GPU_BUILD {

#if defined(ALIGNED_GPU_HIP)
#define ST_SHFL(v, l, w) __shfl(v, l, w)
#define ST_UP(v, d, w) __shfl_up(v, d, w)
#define ST_DOWN(v, d, w) __shfl_down(v, d, w)
#define ST_XOR(v, m, w) __shfl_xor(v, m, w)
#define ST_BALLOT(p) ((unsigned long long)__ballot(p))
#else
#define ST_SHFL(v, l, w) __shfl_sync(0xffffffffu, v, l, w)
#define ST_UP(v, d, w) __shfl_up_sync(0xffffffffu, v, d, w)
#define ST_DOWN(v, d, w) __shfl_down_sync(0xffffffffu, v, d, w)
#define ST_XOR(v, m, w) __shfl_xor_sync(0xffffffffu, v, m, w)
#define ST_BALLOT(p) ((unsigned long long)__ballot_sync(0xffffffffu, p))
#endif

// out[t*6 + ...]: warpSize, ballot(odd lanes), shfl(v, 3, 16), shfl_up(v, 2, 16), shfl_down(v, 5, 16), xor(v, 9, 16)
__global__ void selftest_warp(long long* out) {
  const int t = threadIdx.x;
  const int v = 1000 + t;
  long long* o = out + t * 6;
  o[0] = warpSize;
  o[1] = (long long)ST_BALLOT(t & 1);
  o[2] = ST_SHFL(v, 3, 16);
  o[3] = ST_UP(v, 2, 16);
  o[4] = ST_DOWN(v, 5, 16);
  o[5] = ST_XOR(v, 9, 16);
}

// Lane 5 exits, then its warp shuffles: the neighbour of lane 5 reads an exited lane.
__global__ void selftest_exited_lane(long long* out) {
  if (threadIdx.x == 5) return;
  out[threadIdx.x] = ST_XOR((int)threadIdx.x, 1, 32);
}

// The first half of the block waits at __syncthreads while the second half waits at a shuffle whose
// partner lane exited: the shuffle can never complete.
__global__ void selftest_barrier_vs_shuffle(long long* out) {
  const int t = threadIdx.x;
  if (t < 64) {
    __syncthreads();
    out[t] = 1;
  } else {
    if (t == 64) return;
    out[t] = ST_XOR(t, 1, 32);
  }
}

// Async copy global -> shared: the destination keeps its old value until the wait retires the group.
__global__ void selftest_async_copy(const int* src, long long* out) {
  __shared__ int4 buf[1];
  if (threadIdx.x == 0) {
    buf[0] = make_int4(-1, -1, -1, -1);
    __pipeline_memcpy_async(&buf[0], src, 16);
    __pipeline_commit();
    out[0] = buf[0].x;
    __pipeline_wait_prior(0);
    out[1] = buf[0].x;
  }
}

// ---- planted races (the schedules of csrc/emu/runtime.cpp must expose them) ---------------------------------
// Thread t publishes t + 1 in shared memory, then reads what thread t - 32 (the previous warp) published — threads
// of the first warp read their own slot. Without the barrier the read races with the write: in index order the
// writer always ran first (no stale read: the order hides the bug), in reverse order never, in a random order
// sometimes. out[t] = the value read (0: stale).
__global__ void selftest_race_syncthreads(long long* out, bool with_barrier) {
  __shared__ int slot[128];
  const int t = threadIdx.x;
  slot[t] = 0;
  __syncthreads();
  slot[t] = t + 1;
  if (with_barrier) __syncthreads();  // uniform: a kernel argument
  out[t] = slot[t >= 32 ? t - 32 : t];
}

// The same within a warp: lane l reads what lane l - 1 of its own warp published (lane 0 its own slot). Without
// warp_sync() (__syncwarp / the wave barrier) the lanes' shared-memory accesses are unordered.
__global__ void selftest_race_syncwarp(long long* out, bool with_barrier) {
  __shared__ int slot[128];
  const int t = threadIdx.x, lane = t % kGroupLanes;
  slot[t] = 0;
  __syncthreads();
  slot[t] = t + 1;
  if (with_barrier) warp_sync();
  out[t] = slot[lane > 0 ? t - 1 : t];
}

// ---- dynamic shared memory --------------------------------------------------------------------------------
// Each thread writes its index into dynamic shared memory and reads its neighbour's; out[t] = the value read.
__global__ void selftest_dynamic_shared(long long* out, int words) {
  int* d = dynamic_shared<int>();
  const int t = threadIdx.x;
  out[t] = d[t] == -1 ? 1 : 0;  // fresh contents are 0xff bytes under emulation (undefined on a GPU)
  for (int i = t; i < words; i += blockDim.x) d[i] = i;
  __syncthreads();
  out[blockDim.x + t] = d[words - 1 - t];
}

// ---- FP environment ----------------------------------------------------------------------------------------
// out[0] = the MXCSR the kernel runs under; out[1] = the bits of a subnormal product (2^-130 * 1.5).
__global__ void selftest_fp_environment(long long* out, const float* in) {
  if (threadIdx.x != 0) return;
#if defined(__x86_64__)
  out[0] = (long long)_mm_getcsr();
#else
  out[0] = -1;
#endif
  const float y = in[0] * in[1];
  unsigned u;
  memcpy(&u, &y, 4);
  out[1] = (long long)u;
}

// Runs the named self-test with 128 threads in one block; returns nullptr or the launch error.
const char* run_selftest(const std::string& name, std::vector<long long>& out) {
  const int threads = 128;
  out.assign(threads * 6, -7);
  static const int src[4] = {42, 43, 44, 45};
  if (name == "warp") ALIGNED_LAUNCH(1, threads, 0, nullptr, selftest_warp)(out.data());
  else if (name == "exited_lane") ALIGNED_LAUNCH(1, threads, 0, nullptr, selftest_exited_lane)(out.data());
  else if (name == "barrier_vs_shuffle") ALIGNED_LAUNCH(1, threads, 0, nullptr, selftest_barrier_vs_shuffle)(out.data());
  else if (name == "async_copy") ALIGNED_LAUNCH(1, 32, 0, nullptr, selftest_async_copy)(src, out.data());
  else if (name == "too_many_threads") ALIGNED_LAUNCH(1, 2048, 0, nullptr, selftest_warp)(out.data());
  else if (name == "race_syncthreads" || name == "race_syncthreads_fixed")
    ALIGNED_LAUNCH(1, threads, 0, nullptr, selftest_race_syncthreads)(out.data(), name != "race_syncthreads");
  else if (name == "race_syncwarp" || name == "race_syncwarp_fixed")
    ALIGNED_LAUNCH(1, threads, 0, nullptr, selftest_race_syncwarp)(out.data(), name != "race_syncwarp");
  else if (name.rfind("dynamic_shared:", 0) == 0) {
    // "dynamic_shared:BYTES" launches with BYTES of dynamic shared memory as it is; "dynamic_shared_optin:BYTES"
    // raises the kernel's limit to BYTES first (allow_dynamic_shared), as a launcher must above 48 KB on CUDA.
    const size_t bytes = std::stoul(name.substr(name.find(':') + 1));
    ALIGNED_LAUNCH(1, threads, bytes, nullptr, selftest_dynamic_shared)(out.data(), (int)(bytes / 4));
  } else if (name.rfind("dynamic_shared_optin:", 0) == 0) {
    const size_t bytes = std::stoul(name.substr(name.find(':') + 1));
    if (const char* e = allow_dynamic_shared(selftest_dynamic_shared, bytes)) return e;
    ALIGNED_LAUNCH(1, threads, bytes, nullptr, selftest_dynamic_shared)(out.data(), (int)(bytes / 4));
    out.push_back((long long)max_dynamic_shared_bytes());
  } else if (name == "fp_environment") {
    // The host thread asks for flush-to-zero, denormals-are-zero and round toward zero (as
    // torch.set_flush_denormal(True) would for the first two); the kernel must not see any of it.
    static const float in[2] = {1.1754944e-38f / 1024.0f /* 2^-136 */ * 64.0f, 1.5f};
#if defined(__x86_64__)
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(saved | 0x8040u | 0x6000u);  // FTZ | DAZ | RC = toward zero
    volatile float a = in[0], b = in[1];
    const float host = a * b;  // the hostile environment itself (negative control): flushed to 0
    ALIGNED_LAUNCH(1, 32, 0, nullptr, selftest_fp_environment)(out.data(), in);
    out[2] = (long long)_mm_getcsr();  // the caller's environment is given back
    _mm_setcsr(saved);
    unsigned hu;
    memcpy(&hu, &host, 4);
    out[3] = (long long)hu;
#else
    ALIGNED_LAUNCH(1, 32, 0, nullptr, selftest_fp_environment)(out.data(), in);
#endif
  } else if (name == "device_call_from_host") {
    // A device function called by host code, not by a kernel under a launch: the runtime must refuse it by name
    // (it aborts the process: there is no kernel to fail) instead of reading memory that is not a fiber's header.
    __syncthreads();
  } else return "unknown self-test";
  gpu_error_t e = gpu_last_error();
  return gpu_ok(e) ? nullptr : gpu_error_string(e);
}

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
