// attention_launch.cuh — the launchers declared in attention_api.h, defined once for both vendors (and the
// emulation target). Included by exactly one translation unit per vendor: csrc/cuda/attention.cu and
// csrc/hip/attention.hip. The grid is the host plan's work list (one block per item; the backward dk/dv kernels
// above a head_dim bucket: gridDim.y slices per item, set by head_dim alone), so no launch shape depends on the
// batch beyond the list itself, and no launch shape can change a bit.
#pragma once

#include "attention_kernels.cuh"  // includes compat.cuh first, then attention_api.h
#include "attention_mma_kernels.cuh"
#if defined(ALIGNED_GPU_EMULATED)
#include "../emu/emulation.h"
#endif

namespace aligned::gpu::ALIGNED_GPU_BUILD {

// The `mma` profile (attention_mma.h): the split kernel on the matrix instruction, then the fma profile's merge.
const char* launch_attention_forward_mma(const AttnFwdParams& p, void* stream) {
  if (p.dt != DType::BF16) return "aligned attention: the mma profile takes bfloat16 (the matrix unit's input type)";
  if (p.D > kAttnMmaMaxD) return "aligned attention: head_dim above the mma forward's maximum (256)";
  int control = kAttnMmaControlNone;
#if defined(ALIGNED_GPU_EMULATED)
  // Negative control of the tests only: a score order that depends on prefill vs decode (never built for a GPU).
  if (::aligned::emu::active_fault() == ::aligned::emu::Fault::kMmaAttnBlockOrderByQLen)
    control = kAttnMmaControlReverseDByQLen;
  if (::aligned::emu::active_fault() == ::aligned::emu::Fault::kMmaAttnSharedV) control = kAttnMmaControlSharedV;
#endif
  if (p.n_items > 0) {  // the head_dim bucket (registers only: attn_mma_d_instr)
    const int d_instr = attn_mma_d_instr(p.D);
    if (d_instr == kAttnMmaDInstr64)
      ALIGNED_LAUNCH((unsigned)p.n_items, kAttnMmaThreads, 0, (gpu_stream_t)stream,
                     attention_mma_split_kernel<bf16_t, kAttnMmaDInstr64>)(p, control);
    else if (d_instr == kAttnMmaDInstr128)
      ALIGNED_LAUNCH((unsigned)p.n_items, kAttnMmaThreads, 0, (gpu_stream_t)stream,
                     attention_mma_split_kernel<bf16_t, kAttnMmaDInstr128>)(p, control);
    else
      ALIGNED_LAUNCH((unsigned)p.n_items, kAttnMmaThreads, 0, (gpu_stream_t)stream,
                     attention_mma_split_kernel<bf16_t, kAttnMmaDInstr>)(p, control);
  }
  ALIGNED_LAUNCH((unsigned)p.n_blocks, kAttnThreads, 0, (gpu_stream_t)stream, attention_merge_kernel<bf16_t>)(p);
  return last_error();
}

const char* launch_attention_forward(const AttnFwdParams& p, void* stream) {
  if (p.n_blocks == 0) return nullptr;
  const char* err = nullptr;
  if (p.n_items > 0x7fffffff || p.n_blocks > 0x7fffffff) return "aligned attention: work list too long for one grid";
  if (p.profile == kAttnProfileMma) return launch_attention_forward_mma(p, stream);
  if (p.D > kGpuAttnMaxDWide) return "aligned attention: head_dim above the GPU forward's maximum (640)";
  with_type(p.dt, [&](auto* tp) {
    using T = typename std::remove_pointer<decltype(tp)>::type;
    if (p.D > kGpuAttnMaxD) {  // the wide variant: nothing staged (attention_split_kernel), the same bits
      if (p.n_items > 0)
        ALIGNED_LAUNCH((unsigned)p.n_items, kAttnThreads, 0, (gpu_stream_t)stream,
                       attention_split_kernel<T, false, kAttnChunksWide, false>)(p);
      ALIGNED_LAUNCH((unsigned)p.n_blocks, kAttnThreads, 0, (gpu_stream_t)stream,
                     attention_merge_kernel<T, kAttnChunksWide>)(p);
      return;
    }
    // splits first, then the merge: same stream, so the merge sees every partial
    if (p.n_items > 0) {
      // K and V tiles staged in shared memory when both fit the device (all CUDA archs; gfx942's 64 KB LDS holds
      // them up to D = 224 in fp32, every D in bf16/fp16); else K only, V from global memory. Above 48 KB the
      // CUDA opt-in (allow_dynamic_shared) comes first. The variant never changes a bit (attention_kernels.cuh).
      const size_t both = attn_split_smem_bytes(p.D, true), k_only = attn_split_smem_bytes(p.D, false);
      const size_t limit = max_dynamic_shared_bytes();
      if (both <= limit) {
        if (both > 48 * 1024) {
          if (const char* e = allow_dynamic_shared(attention_split_kernel<T, true>, both)) {
            err = e;
            return;
          }
        }
        ALIGNED_LAUNCH((unsigned)p.n_items, kAttnThreads, both, (gpu_stream_t)stream, attention_split_kernel<T, true>)(p);
      } else {
        ALIGNED_LAUNCH((unsigned)p.n_items, kAttnThreads, k_only, (gpu_stream_t)stream, attention_split_kernel<T, false>)(p);
      }
    }
    ALIGNED_LAUNCH((unsigned)p.n_blocks, kAttnThreads, 0, (gpu_stream_t)stream, attention_merge_kernel<T>)(p);
  });
  return err ? err : last_error();
}

// The `mma` profile's backward (attention_mma.h): delta (an fma chain), then dq per row block and dk / dv per key
// tile on the matrix instruction.
const char* launch_attention_backward_mma(const AttnBwdParams& p, void* stream) {
  if (p.f.dt != DType::BF16) return "aligned attention: the mma profile takes bfloat16 (the matrix unit's input type)";
  if (p.f.D > kAttnMmaMaxD) return "aligned attention: head_dim above the mma backward's maximum (256)";
  if (p.rows > 0) {
    int64_t blocks = (p.rows + 255) / 256;
    if (blocks > 65535) blocks = 65535;  // grid-stride loop inside
    ALIGNED_LAUNCH((unsigned)blocks, 256, 0, (gpu_stream_t)stream, attention_bwd_delta_kernel<bf16_t>)(p);
  }
  int control = kAttnMmaControlNone;  // the tests' negative controls (never built for a GPU)
#if defined(ALIGNED_GPU_EMULATED)
  if (::aligned::emu::active_fault() == ::aligned::emu::Fault::kMmaAttnBlockOrderByQLen)
    control = kAttnMmaControlReverseDByQLen;
  if (::aligned::emu::active_fault() == ::aligned::emu::Fault::kMmaAttnSharedV) control = kAttnMmaControlSharedV;
  if (::aligned::emu::active_fault() == ::aligned::emu::Fault::kMmaAttnPairBlocksGlobal)
    control = kAttnMmaControlPairBlocksGlobal;
#endif
  // the dq kernel has no pair-blocks nor a d-block order of its own to fault: only the shared operand reaches it
  const int dq_control = control == kAttnMmaControlSharedV ? control : kAttnMmaControlNone;
  const int d_instr = attn_mma_d_instr(p.f.D);
  const unsigned nb = (unsigned)p.f.n_blocks, nt = (unsigned)p.n_tiles;
  const gpu_stream_t st = (gpu_stream_t)stream;
  if (d_instr == kAttnMmaDInstr64) {
    if (nb > 0) ALIGNED_LAUNCH(nb, kAttnMmaThreads, 0, st, attention_mma_bwd_dq_kernel<kAttnMmaDInstr64>)(p, dq_control);
    if (nt > 0) ALIGNED_LAUNCH(nt, kAttnMmaBwdKeyThreads, 0, st, attention_mma_bwd_dkdv_kernel<kAttnMmaDInstr64>)(p, control);
  } else if (d_instr == kAttnMmaDInstr128) {
    if (nb > 0) ALIGNED_LAUNCH(nb, kAttnMmaThreads, 0, st, attention_mma_bwd_dq_kernel<kAttnMmaDInstr128>)(p, dq_control);
    if (nt > 0) ALIGNED_LAUNCH(nt, kAttnMmaBwdKeyThreads, 0, st, attention_mma_bwd_dkdv_kernel<kAttnMmaDInstr128>)(p, control);
  } else {  // dk/dv: 128 columns per block, the column slices over gridDim.y
    if (nb > 0) ALIGNED_LAUNCH(nb, kAttnMmaThreads, 0, st, attention_mma_bwd_dq_kernel<kAttnMmaDInstr>)(p, dq_control);
    if (nt > 0)
      ALIGNED_LAUNCH(dim3(nt, (unsigned)attn_mma_dkdv_slices(p.f.D)), kAttnMmaBwdKeyThreads, 0, st,
                     attention_mma_bwd_dkdv_kernel<kAttnMmaDInstr128, true>)(p, control);
  }
  return last_error();
}

const char* launch_attention_backward(const AttnBwdParams& p, void* stream) {
  // before either profile's launches: both cast the work lists' lengths to a grid size
  if (p.f.n_blocks > 0x7fffffff || p.n_tiles > 0x7fffffff) return "aligned attention: work list too long for one grid";
  if (p.f.profile == kAttnProfileMma) return launch_attention_backward_mma(p, stream);
  if (p.f.D > kGpuAttnMaxDWide) return "aligned attention: head_dim above the GPU kernels' maximum (640)";
  const bool wide = p.f.D > kGpuAttnMaxD;  // the unstaged variants (attention_bwd_dq_kernel), the same bits
  with_type(p.f.dt, [&](auto* tp) {
    using T = typename std::remove_pointer<decltype(tp)>::type;
    if (p.rows > 0) {
      int64_t blocks = (p.rows + 255) / 256;
      if (blocks > 65535) blocks = 65535;  // grid-stride loop inside
      ALIGNED_LAUNCH((unsigned)blocks, 256, 0, (gpu_stream_t)stream, attention_bwd_delta_kernel<T>)(p);
    }
    // delta first (same stream), then dq per row block and dk/dv per key tile: independent outputs
    if (p.f.n_blocks > 0) {
      if (wide)
        ALIGNED_LAUNCH((unsigned)p.f.n_blocks, kAttnThreads, 0, (gpu_stream_t)stream,
                       attention_bwd_dq_kernel<T, kAttnChunksWide, false>)(p);
      else
        ALIGNED_LAUNCH((unsigned)p.f.n_blocks, kAttnThreads, 0, (gpu_stream_t)stream, attention_bwd_dq_kernel<T>)(p);
    }
    if (p.n_tiles > 0) {
      if (wide)
        ALIGNED_LAUNCH(dim3((unsigned)p.n_tiles, (unsigned)attn_dkdv_slices_wide(p.f.D)), kAttnThreads, 0,
                       (gpu_stream_t)stream, attention_bwd_dkdv_kernel<T, kAttnTileElemsWide, false>)(p);
      else
        ALIGNED_LAUNCH((unsigned)p.n_tiles, kAttnThreads, 0, (gpu_stream_t)stream, attention_bwd_dkdv_kernel<T>)(p);
    }
  });
  return last_error();
}

const char* launch_cache_write(const CacheWriteParams& p, void* stream) {
  const int64_t n = p.T * p.row_elems;
  if (n == 0) return nullptr;
  int64_t blocks = (n + 255) / 256;
  if (blocks > 65535) blocks = 65535;  // grid-stride loop inside
  with_type(p.dt, [&](auto* tp) {
    using T = typename std::remove_pointer<decltype(tp)>::type;
    ALIGNED_LAUNCH((unsigned)blocks, 256, 0, (gpu_stream_t)stream, cache_write_kernel<T>)(p);
  });
  return last_error();
}

// This build's launchers as the table the glue reads (csrc/gpu/launchers.h declares each build's), filled by
// name: nvcc's C++17 dialect has no designated initializers.
extern const AttentionLaunchers kAttentionLaunchers;
const AttentionLaunchers kAttentionLaunchers = []() constexpr {
  AttentionLaunchers t{};
  t.attention_forward = &launch_attention_forward;
  t.attention_backward = &launch_attention_backward;
  t.cache_write = &launch_cache_write;
  return t;
}();

}  // namespace aligned::gpu::ALIGNED_GPU_BUILD
