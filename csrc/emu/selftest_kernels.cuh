// selftest_kernels.cuh — small kernels that pin down the SIMT runtime's semantics (tests/emulated/
// test_emulation_runtime.py): warp width, votes, shuffle variants, the rules it enforces, async copies.
// Compiled for both vendor spellings (selftest_cuda.cpp, selftest_hip.cpp); not part of csrc/gpu.
#pragma once
#include <string>
#include <vector>

#include "../gpu/compat.cuh"

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
  else return "unknown self-test";
  gpu_error_t e = gpu_last_error();
  return gpu_ok(e) ? nullptr : gpu_error_string(e);
}

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
