// families.h — the names the registration lines use: every op family (defined with its glue bodies in
// csrc/torch/glue/<family>.h) and every backend (csrc/torch/backends/). Declarations only, so a backend's
// registration file (register_cpu.cpp, register_cuda.cpp) reads as a list and compiles in seconds: the
// families' glue bodies are instantiated for each backend in the backend's own translation units
// (csrc/torch/registration.h says how).
#pragma once

#include "../emu/emulation.h"

namespace aligned::glue {

// ---- op families (csrc/torch/glue/<family>.h); each holds `ops<B>`, its list of (schema name, glue body) ----
struct Dense;            // rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding (+ backwards)
struct Logits;           // logsumexp, log_softmax, token_logprobs (+ backwards)
struct LmHeadPieces;     // token_logprobs_pairs, token_logprobs_backward_cols (the fused LM head's pieces)
struct Linear;           // linear, linear_partial, linear_backward (`fma` profile)
struct LinearReference;  // _linear_partial_reference (contract.h's scalar dot; a test hook)
struct LinearMma;        // linear_mma, linear_mma_partial, linear_mma_backward (`mma` profile, mma.h)
struct LinearMmaPacked;   // linear_mma_pack_weight, linear_mma_packed (the CPU AMX unit's packed weights)
struct LinearMmaReference;  // _linear_mma_reference (mma.h's scalar model of the unit; a test hook)
struct Hooks;            // _exp_f32, _log_f32, _device_error_flags
struct ExactLinear;      // linear_exact, linear_exact_pack_weight, linear_exact_packed
struct ExactF64;         // linear_exact_f64_bounds and its test hooks (the CPU's fp64 routes)
struct ExactTp;          // linear_exact_row_scan, _pack_weight_scanned, _partial, _finish (exact TP)
struct ExactReference;   // _linear_exact_reference (the scalar int128 model; a test hook)
struct Attention;        // attention_varlen (+ backward), reshape_and_cache, paged_attention, the plan and its runs
struct AttentionSizes;   // attention_plan_size, attention_plan_layout (host metadata only)
struct Moe;              // moe_routing, moe_grouped_routing (+ backwards), moe_experts
struct MoeReference;     // _moe_experts_reference (the plain per-token reference; a test hook)
struct AttentionMmaReference;  // _attention_mma_reference (attention_mma.h's scalar reference; a test hook)

// ---- backends (csrc/torch/backends/) ---------------------------------------------------------------------
struct Cpu;                                   // the CPU kernels, one ISA level per process (csrc/cpu)
template <class Device> struct Gpu;           // the csrc/gpu kernels on one build's device (backends/gpu.h)
struct CudaDevice;                            // a CUDA or ROCm torch's GPU (backends/cuda.h)
template <emu::Vendor V> struct EmulatedDevice;  // the emulation target's vendor spelling (backends/emulated.h)

using Cuda = Gpu<CudaDevice>;  // serves ROCm torch too (HIP kernels register under the CUDA key)
using EmulatedCuda = Gpu<EmulatedDevice<emu::Vendor::kCuda>>;  // aligned_ops.emulate("sm_80" | "sm_90" | "sm_100" | "sm_120")
using EmulatedHip = Gpu<EmulatedDevice<emu::Vendor::kHip>>;    // aligned_ops.emulate("gfx942" | "gfx950")

}  // namespace aligned::glue
