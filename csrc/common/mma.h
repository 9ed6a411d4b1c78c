// mma.h — the `mma` linear numerics profile: the matrix unit's own bf16 arithmetic in a fixed order.
//
// The `fma` profile (contract.h) writes every product as a portable fp32 fma; `exact` (exact_linear.h) as exact
// integers. `mma` is the profile users run for speed: each chain step is ONE instruction of the machine's bf16
// matrix / dot-product unit, whose rounding is the unit's own. The ORDER is fixed here, once, for every backend;
// the ARITHMETIC of a step is the unit's. So the bits are a function of (inputs, weights, unit) — never of the
// batch, the tiling, the threads or the run — and two machines with the same unit give the same bits.
//
// ---- the profile (aligned::linear_mma, linear_mma_partial; every backend) --------------------------------
// Inputs: x [M, K], weight [N, K] and bias [N] in bfloat16 (the units' input type). float32 and float16 are
// refused by name: converting them to bf16 would be a second, hidden rounding of the model — use `fma`.
// For out[m, n]:
//   lane l = 0..7 covers k in [lo(l), lo(l + 1)), lo(l) = floor(l * K / 8)   (linear_lane_begin, as `fma`)
//   s_l    = the unit's CHAIN over the lane: acc = +0, then acc = STEP(acc, next k-block) for the lane's
//            k-blocks in ascending k order, the first block starting at lo(l); a lane whose length is not a
//            multiple of the block is padded at its end with elements x = +0, w = +0 (a block never spans
//            two lanes). An empty lane (K < 8) is +0.
//   acc    = linear_lane_fold(s_0 .. s_7) = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
//            (IEEE fp32 adds, subnormals kept: the tree is not the unit's)
//   out    = round_bf16(acc + bias[n])   (one fp32 add; without bias round_bf16(acc)) — contract.h
//            linear_epilogue.
// Why 8 lanes and the fma profile's tree, not one chain over K: the row-parallel TP route is then the fma
// profile's unchanged — rank r of t ∈ {1, 2, 4, 8} holds whole lanes (aligned_ops.linear_tp_slices), computes
// linear_mma_partial over them and aligned_ops.tree_all_reduce finishes the same tree, so the bits do not depend
// on the TP degree either; and a GPU kernel may run the 8 lanes as 8 fixed K splits (decode parallelism at
// M = 1) without the split ever depending on M.
//
// What may differ per backend is only the unit, i.e. the STEP and its block:
//   * CPU, AVX512-BF16 `vdpbf16ps` (MmaUnit::kAvx512Bf16, block = one pair (k, k+1); below, with its scalar
//     model), the unit of the `avx512` kernel level: every CPU with avx512_bf16 can run it — Intel and AMD alike
//     (the model below was measured on an AMX Xeon and on an AMD Zen 4 with 0 mismatches in 19.2M lanes each,
//     bench/experiments/dpbf16_order.c), so those CPUs agree bit for bit. A CPU without avx512_bf16 refuses
//     the profile ("mma needs avx512_bf16; use ALIGNED_OPS_LINEAR=fma").
//   * CPU, AMX-BF16 `tdpbf16ps` (MmaUnit::kAmxBf16, block = kMmaAmxBlock = 32 k-elements, 16 pairs, per STEP),
//     the unit of the `amx` kernel level (chosen where Linux grants the AMX tiles and the CPU has amx_bf16;
//     csrc/cpu/gemm_amx_mma_kernels.cpp). STEP is the instruction's dot of 32 products onto the accumulator; its
//     internal order has NO model (measured: 14/256 K = 2048 chains equal to any order tried), so the kernels are
//     held to the instruction itself, one element per instruction on 1 x 1 tiles (MmaKernels::reference), and
//     by invariance: one element's instruction sees only its own 32 products and accumulator, whatever else
//     shares the tile. Bits: one AMX CPU model; they differ from the vdpbf16ps unit's, so an AMX CPU and a
//     non-AMX one agree only when both run `avx512` (ALIGNED_CPU_ISA=avx512 selects that unit on an AMX CPU).
//   * GPU (csrc/gpu/mma_linear_kernels.cuh): the arch's pinned matrix instruction — CUDA mma.sync
//     m16n8k16.row.col.f32.bf16.bf16.f32 (sm_80+), HIP v_mfma_f32_16x16x16_bf16 (gfx942 / gfx950) — block =
//     kMmaGpuKBlock = 16 k-elements per STEP, the fp32 accumulator carried in C from block to block, no K split
//     beyond the 8 lanes, one instruction shape and operand order for every M. STEP is the unit's fused dot of
//     16 products onto C (NOT an fma chain); its models (MMA-Sim's characterisation per arch, and a deliberately
//     order-sensitive one) are the emulator's, csrc/emu/bf16_mma_models.h; mma_block_chain below is the chain
//     they are applied in (the emulated reference, _linear_mma_reference under aligned_ops.emulate). Bits: one
//     GPU model and build; NOT across vendors or generations (A100's step differs from H100's, CDNA3's from both).
//
// INVARIANT (on one unit): batch size M, the row's position, other rows, M/N tiling, thread count, prompt
// chunking, prefill vs decode, run, TP degree t ∈ {1, 2, 4, 8} (whole lanes per rank, tree all-reduce); across
// CPUs running the vdpbf16ps unit (one instruction semantics on Intel and AMD, measured); on a GPU: the thread-block
// schedule and the kernel's tiling too, on ONE GPU model and build.
// NOT INVARIANT: across profiles (fma / exact give other bits), across units (CPU vs a GPU, GPU vendors and
// generations: A100 vs H100 vs MI300X differ in MMA-Sim's models; a CPU's AMX unit vs its vdpbf16ps), other lane counts or TP
// splits that cut a lane.
//
// Backward (aligned::linear_mma_backward) — on the unit, every GEMM of it the profile's linear above:
//   dx[m, k] = round_bf16(lane tree of the unit's chains over n of (g[m, n], w[n, k]))   8 lanes of N
//   dw[n, k] = round_bf16(lane tree of the unit's chains over m of (g[m, n], x[m, k]))   8 lanes of the M tokens:
//              fixed token blocks [floor(l*M/8), floor((l+1)*M/8)), tokens in batch order in each
//   db[n]    = round_bf16(chain over m = 0..M-1 of (. + g[m, n]))    fp32 adds (the fma profile's column sum:
//              no product to take to the unit)
// dx is batch-invariant (row by row); dw and db depend on the batch's tokens and their order by design (fixed
// blocks and chains: run-to-run and thread-count invariant). g is the bf16 upstream gradient.
//
// NaN / inf: propagate as the unit's fma steps propagate them; a NaN's payload is the unit's (the scalar model
// below does not define payloads: tests compare NaN positions, never NaN bits).
#pragma once

#include "contract.h"

namespace aligned {

// The matrix units a backend can run the profile on. The enum names the STEP of the chain above.
// (The GPU units are the arch's instruction, chosen at compile time: csrc/gpu/bf16_mma.cuh.)
enum class MmaUnit : int { kNone = 0, kAvx512Bf16 = 1, kAmxBf16 = 2 };
constexpr int kMmaAmxBlock = 32;  // k-elements per step of the AMX unit (one tdpbf16ps: 16 pairs)

// Blocks of kMmaAmxBlock over the 8 lanes of K (each lane's last block padded): the k-tiles of a weight row in the
// AMX unit's packed layout (linear_mma_pack_weight: ceil(N / 16) * this * 512 bf16 elements).
ALIGNED_HD int64_t mma_amx_lane_blocks(int64_t K) {
  int64_t q = 0;
  for (int64_t l = 0; l < kLinearLanes; ++l)
    q += (linear_lane_begin(l + 1, K, kLinearLanes) - linear_lane_begin(l, K, kLinearLanes) + kMmaAmxBlock - 1) /
         kMmaAmxBlock;
  return q;
}

// ---- the CPU unit: AVX512-BF16 vdpbf16ps ----------------------------------------------------------------
// One fp32 lane of vdpbf16ps(acc, x, w) takes the bf16 pair (x0, x1) = (x[k], x[k+1]) and (w0, w1):
//   x0, x1, w0, w1, acc: a subnormal value is taken as a zero of the same sign (DAZ; bf16 widens exactly)
//   t   = ftz(fma(x1, w1, acc))      the ODD element first
//   acc = ftz(fma(x0, w0, t))        ftz: a result that is subnormal after rounding becomes a zero of its sign
// (MXCSR is ignored by the instruction: this holds whatever the thread's FTZ/DAZ bits are.) Measured equal on
// 19.2M random and adversarial lanes and 192 hand-built cases on an AMX Xeon and on an AMD Zen 4; the plain
// fma chain in natural order matched 14/256 K = 2048 chains.
constexpr int kMmaBf16PairBlock = 2;  // k-elements per step of the CPU unit

ALIGNED_HD float mma_flush_subnormal(float v) {
  const uint32_t u = bits_of(v);
  return (u & 0x7f800000u) == 0 ? float_of(u & 0x80000000u) : v;  // exponent field 0: zero or subnormal
}

ALIGNED_HD float mma_bf16_pair_step(float acc, bf16_t x0, bf16_t x1, bf16_t w0, bf16_t w1) {
  const float a0 = mma_flush_subnormal(to_f32(x0)), a1 = mma_flush_subnormal(to_f32(x1));
  const float b0 = mma_flush_subnormal(to_f32(w0)), b1 = mma_flush_subnormal(to_f32(w1));
  const float t = mma_flush_subnormal(fma_f32(a1, b1, mma_flush_subnormal(acc)));
  return mma_flush_subnormal(fma_f32(a0, b0, t));
}

// The CPU unit's chain over k in [k0, k1): pairs (k0, k0+1), (k0+2, k0+3), ...; an odd-length range ends in
// the pair (x[k1-1], +0) x (w[k1-1], +0). Strided operands (the backward's transposed views use them).
ALIGNED_HD float mma_bf16_chain(const bf16_t* x, int64_t x_sk, const bf16_t* w, int64_t w_sk, int64_t k0,
                                int64_t k1) {
  const bf16_t zero = {0};
  float acc = 0.0f;
  for (int64_t k = k0; k < k1; k += kMmaBf16PairBlock) {
    const bool full = k + 1 < k1;
    acc = mma_bf16_pair_step(acc, x[k * x_sk], full ? x[(k + 1) * x_sk] : zero, w[k * w_sk],
                             full ? w[(k + 1) * w_sk] : zero);
  }
  return acc;
}

// ---- the GPU units: one instruction per block of 16 k ------------------------------------------------------
constexpr int kMmaGpuKBlock = 16;  // k-elements per step of the GPU units (mma.sync m16n8k16, MFMA 16x16x16)

// A GPU unit's chain over k in [k0, k1) for one output: acc = +0, then acc = step(acc, xb, wb) for the blocks
// (k0 .. k0+15), (k0+16 ..), ... in ascending order, xb / wb the block's 16 bf16 bit patterns, k >= k1 padded
// with +0. `step` is the unit's instruction for one output element (a model: csrc/emu/bf16_mma_models.h).
template <class Step>
ALIGNED_HD float mma_block_chain(const bf16_t* x, int64_t x_sk, const bf16_t* w, int64_t w_sk, int64_t k0,
                                 int64_t k1, const Step& step) {
  float acc = 0.0f;
  for (int64_t kb = k0; kb < k1; kb += kMmaGpuKBlock) {
    uint16_t xb[kMmaGpuKBlock], wb[kMmaGpuKBlock];
    for (int e = 0; e < kMmaGpuKBlock; ++e) {
      const int64_t k = kb + e;
      xb[e] = k < k1 ? x[k * x_sk].bits : (uint16_t)0;
      wb[e] = k < k1 ? w[k * w_sk].bits : (uint16_t)0;
    }
    acc = step(acc, xb, wb);
  }
  return acc;
}

// aligned::linear_mma_partial for one output on the CPU unit: the sub-tree over `lanes` (1, 2, 4, 8) lanes of
// the local K, fp32, no bias. lanes = 8 on the full K is linear_mma before its epilogue.
ALIGNED_HD float linear_mma_partial_dot(const bf16_t* x_row, int64_t x_sk, const bf16_t* w_row, int64_t w_sk,
                                        int64_t K, int lanes) {
  float s[kLinearLanes];
  for (int l = 0; l < lanes; ++l)
    s[l] = mma_bf16_chain(x_row, x_sk, w_row, w_sk, linear_lane_begin(l, K, lanes), linear_lane_begin(l + 1, K, lanes));
  return linear_lane_fold(s, lanes);
}

// aligned::linear_mma for one output: the 8-lane tree, then contract.h's linear_epilogue (bias, one rounding).
ALIGNED_HD bf16_t linear_mma_out(const bf16_t* x_row, const bf16_t* w_row, int64_t K, const bf16_t* bias, int64_t n) {
  return linear_epilogue(linear_mma_partial_dot(x_row, 1, w_row, 1, K, kLinearLanes), bias, n);
}

}  // namespace aligned
