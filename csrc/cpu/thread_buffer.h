// thread_buffer.h — per-thread scratch memory for the CPU kernels.
#pragma once

#include <stddef.h>
#include <stdlib.h>

#include <algorithm>
#include <memory>

// In the kernel level's namespace (ALIGNED_ISA): each level's objects are built with their own -m flags, so an
// inline function shared across levels could be linked from a TU whose instructions the CPU lacks.
namespace aligned::cpu::ALIGNED_ISA {

struct FreeBuf {
  void operator()(void* p) const { free(p); }
};

// Thread-local scratch of at least `bytes` (64-byte aligned), grown on demand and kept: the kernels run on torch's
// thread pool, so a buffer serves every later call of its thread instead of a malloc per call or block (decode
// attention made six per (sequence, KV head) block). Freed at thread exit. One buffer per slot and thread, shared
// by every kernel that names the slot, so kernels that may hold buffers at the same time take different slots:
// 0-2 the AMX mma GEMM (gemm_amx_mma_kernels.cpp), 3-4 the attention forward (attention_kernels.cpp). The contents
// are not kept between calls.
template <int kSlot>
inline void* thread_buffer(size_t bytes) {
  thread_local std::unique_ptr<void, FreeBuf> buf;
  thread_local size_t cap = 0;
  if (bytes > cap) {
    buf.reset();
    cap = std::max(bytes, 2 * cap);
    buf.reset(aligned_alloc(64, (cap + 63) / 64 * 64));
    if (!buf) abort();
  }
  return buf.get();
}

}  // namespace aligned::cpu::ALIGNED_ISA
