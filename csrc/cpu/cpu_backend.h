// cpu_backend.h — the CPU backend: one object per ISA level, chosen once per process.
//
// Every CPU kernel family is compiled once per ISA level (generic x86-64, AVX2+FMA, AVX-512) into a
// namespace of the same shape, each exporting its table (dense, dense split, attention, MoE, exact linear).
// A CpuBackend gathers one level's tables; cpu_backend() picks the level once (the widest the CPU runs, or
// ALIGNED_CPU_ISA) and every glue TU reads its tables from it — no family chooses a level by itself, so
// all families always run the same level. Every level computes identical bits; only speed differs.
//
// Levels (ALIGNED_CPU_ISA): generic, avx2, avx512, amx. `amx` is the avx512 tables plus AMX-INT8 tiles for
// the exact linear (the only family with a matrix-unit kernel); unset picks amx where the CPU and the
// kernel grant the tile state, so forcing `avx512` is how a test runs the same tables without AMX.
//
// The `mma` profile's unit (mma_kernels.h) is not a level: its kernels are compiled once, for AVX512-BF16
// vdpbf16ps, and `mma` points at them on a CPU with avx512_bf16 whose chosen level is avx512 or amx (one
// semantics on Intel and AMD, csrc/common/mma.h); nullptr elsewhere — including under ALIGNED_CPU_ISA=generic /
// avx2, which make the process behave as a CPU without AVX-512 (how the tests see the refusal). AMX-BF16 is
// not used (mma.h says why).
#pragma once

#include "attention_kernels.h"
#include "cpu_kernels.h"
#include "dense_split_kernels.h"
#include "exact_kernels.h"
#include "mma_kernels.h"
#include "moe_kernels.h"

namespace aligned::cpu {

struct CpuBackend {
  const char* level;   // generic | avx2 | avx512 | amx
  bool amx_int8;       // the exact linear may use AMX-INT8 tiles
  const KernelTable* dense;
  const DenseSplitKernels* dense_split;
  const AttentionTable* attention;
  const MoeKernels* moe;
  const ExactKernels* exact;
  const MmaKernels* mma;  // the mma profile's unit, or nullptr (this CPU has none: the mma ops refuse by name)
};

// Throws std::runtime_error (a RuntimeError at the first op call) for an ALIGNED_CPU_ISA that names no level
// or a level this CPU cannot run — never silently another level.
const CpuBackend& cpu_backend();

}  // namespace aligned::cpu
