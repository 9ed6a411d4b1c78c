// attention_api.h — the torch-free host interface of the GPU attention kernels (CUDA and HIP): the forward
// over packed or paged K/V (attention_varlen, paged_attention) and the KV-cache write (reshape_and_cache).
//
// The host planner (csrc/common/attention_plan.h) validates the metadata and builds the plan on the host: its
// work records are flat int64 rows that the glue uploads with one host-to-device copy (or that attention_plan
// wrote into the plan buffer once per step). The kernels read nothing else of the metadata, so no launcher ever
// reads device memory back and no kernel can see an unchecked block id or offset. Launchers are defined once in
// attention_launch.cuh and compiled by nvcc (csrc/cuda/attention.cu) or hip-clang (csrc/hip/attention.hip), and
// for the emulation target (csrc/emu). Each returns nullptr or the runtime's launch error string.
#pragma once

#include <stdint.h>

#include "../common/attention_plan.h"
#include "../common/params_attention.h"
#include "dense_api.h"

namespace aligned::gpu {

// Largest head_dim of the GPU kernels: a K tile is staged in shared memory as fp32 [32][D + 1] (33 KB at
// D = 256) and every lane holds ceil(D / 32) <= 8 accumulators in registers.
constexpr int64_t kGpuAttnMaxD = 256;
// Largest head_dim of the GPU kernels' wide variants (above kGpuAttnMaxD: MLA's latent row, 512 + 64): K and V are
// read from global memory (no tile staging: a 576-wide fp32 K tile is 74 KB, above gfx942's 64 KB LDS) and every
// lane holds ceil(D / 32) <= 20 accumulators (the backward's dk/dv: 80 elements per thread). Same arithmetic, same
// bits; correct first — their speed on a real GPU (uncoalesced key-row reads, register pressure) is unmeasured.
constexpr int64_t kGpuAttnMaxDWide = 640;

// The problem (common/params_attention.h, shared with the CPU backend) plus the work list and the outputs.
struct AttnFwdParams : AttnProblem {
  const int32_t* block_tables;  // paged: the plan's table (its compacted entries, on the device); else nullptr
  const int64_t* items;         // [n_items, kAttnWorkFields] forward items
  int64_t n_items;
  const int64_t* blocks;        // [n_blocks, kAttnWorkFields] row blocks (merge)
  int64_t n_blocks;
  float* part;                  // the plan's partial buffer (part_floats)
  void* out;                    // [Tq, Hq, D], dtype dt
  float* lse;                   // [Tq, Hq]
  // The plan buffer's header (both forms: the per-call form uploads a buffer of capacity = its own size).
  // n_items / n_blocks above are the grids (the capacity in the planned form); the kernels take the real
  // counts from the header and return at once in the blocks beyond them.
  const int64_t* plan_header;
  AttnRunDims run;              // what the header is checked against
  int32_t* error_flags;         // [kNumDeviceErrors] device words (kErrAttentionPlan), or nullptr
};

struct CacheWriteParams {
  DType dt;
  const void* k;        // [T, Hkv, D]
  const void* v;
  void* k_cache;        // [num_blocks, block_size, Hkv, D]
  void* v_cache;        // nullptr: no V cache (MLA: the latent row is keys and values; written once)
  const int64_t* slots; // [T], -1 = padding
  int64_t T, row_elems, n_slots;
};

// Backward (deterministic: every gradient element is one fma chain in attention.h's order, no atomics).
struct AttnBwdParams {
  AttnFwdParams f;       // shapes, q/k/v, scale, causal (packed K/V only); f.out, f.lse, f.part unused
  const void* dout;      // [Tq, Hq, D]
  const void* out;       // the forward output [Tq, Hq, D]
  const float* lse;      // [Tq, Hq]
  float* delta;          // [Tq, Hq] scratch
  void* dq;              // [Tq, Hq, D]
  void* dk;              // [Tk, Hkv, D]
  void* dv;
  const int64_t* tiles;  // [n_tiles, kAttnWorkFields] key tiles: kWg = KV head, kWsplit = tile index
  int64_t n_tiles;
  int64_t rows;          // Tq * Hq
};

// The launchers of one build of csrc/gpu (compat.cuh ALIGNED_GPU_BUILD), as a table: each build defines one
// (attention_launch.cuh), and the glue's GPU backends call the table of theirs (csrc/torch/backends/gpu.h). Every
// launcher enqueues on `stream` and returns nullptr or the runtime's launch error.
struct AttentionLaunchers {
  const char* (*attention_forward)(const AttnFwdParams& p, void* stream);
  const char* (*attention_backward)(const AttnBwdParams& p, void* stream);
  const char* (*cache_write)(const CacheWriteParams& p, void* stream);
};

}  // namespace aligned::gpu
