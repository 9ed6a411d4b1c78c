// bf16_mma_models.h — the arithmetic models of the bf16 -> fp32 matrix instructions the emulation target runs
// (csrc/gpu/bf16_mma.cuh under emulation; runtime.cpp applies them per output element after reading the
// fragment layouts), selectable per scope: aligned_ops.emulate(arch, mma_model=...) (emulation.py MMA_MODELS).
//
// A model is a function of ONE output element: d = STEP(c, a[0..15], b[0..15]) for the instruction's K = 16 —
// the row of A, the column of B and the accumulator element. Every model is a pure function of those (the
// vendors' units are: each D element is its own dot product), so the kernel's tiling cannot change a bit; what
// a model can expose is the ORDER and GROUPING of the K steps the kernel issues (the chain over k-blocks).
//
//   kMmaSim   the published characterisation of the arch's unit by MMA-Sim (microsoft/MMA-Sim, arXiv
//             2511.10909; mmasim/simulator/arithmetic.py nv_fused_dot_add / amd_fused_dot_rd_add, nv_ptx.py,
//             amd.py), written here from its description, not its code:
//     NVIDIA (mma.sync m16n8k16 bf16, f32 accumulate). Each product a_k * b_k and c are written as
//       significand x 2^exponent (subnormals at the format's least exponent, zero at -126); every term is aligned
//       to the largest exponent among the products AND c, truncated toward zero to F fractional bits, the terms
//       are summed exactly, and the sum is normalised to fp32 with round-toward-zero (overflow: inf).
//       sm_90 / sm_100 / sm_120 (Hopper, Blackwell, RTX Blackwell): one fused step over K = 16, F = 25.
//       sm_80 (Ampere): k16 is two chained fused steps over k 0..7 then 8..15, F = 24.
//       NaN anywhere (or inf - inf): the canonical NaN 0x7fffffff; an inf product or c: that inf.
//     AMD CDNA3 (v_mfma_f32_16x16x16_bf16 / _1k on gfx942): two chained groups of 8 products (k 0..7, then
//       8..15). In a group the products are aligned to the group's largest product exponent and truncated to 24
//       fractional bits (toward zero) and summed exactly; that sum is then floored (toward -inf) to 31 fractional
//       bits at max(its exponent, c's exponent), c floored to 24 fractional bits at the same exponent, the two
//       added and rounded to nearest-even fp32 — the next group's c. A product >= 2^128 in magnitude is an inf;
//       NaN / inf inputs propagate as the fp64 sum of the group would.
//     gfx950 (CDNA4): MMA-Sim has NO model; the CDNA3 model is used as an ASSUMPTION (unvalidated).
//   kFmaChain deliberately different: c, then fp32 fma(a_k, b_k, acc) for k = 0..15 in order, IEEE, subnormals
//             kept. Rounds after every product, so any change of the order or grouping of the k-steps a kernel
//             issues (a k-block order or a K split that depends on M) changes bits; no GPU computes this.
//
// What is known and what is not: MMA-Sim's authors report bitwise agreement of these models with A100, H100,
// B200, RTX-Blackwell and MI300X hardware on their tests; we have NOT run any of it on hardware (no GPU lease
// yet), and MMA-Sim's NaN payloads, the exact overflow behaviour under round-toward-zero and the CDNA4 unit are
// not characterised. .ci/gpu_check.sh compares the hardware instruction with kMmaSim (aligned_ops.testing
// hooks) on the first lease; until then the GPU bits of the mma profile are the model's, not measured.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

namespace aligned::emu {

// Tests only: tests/emulated/test_mma_model_conformance.py builds its program once with each planted fault to show
// its comparison catches an edge case: 1 = nv_fused without the clamp of the result exponent at -126 (fp32
// subnormals), 2 = cdna3_group truncating toward zero where it floors. The library builds 0: neither.
#ifndef ALIGNED_MMA_MODEL_MUTANT
#define ALIGNED_MMA_MODEL_MUTANT 0
#endif

enum class MmaModel : int { kMmaSim = 0, kFmaChain = 1 };
enum class Bf16MmaUnit : int { kNvFusedF25 = 0, kNvSplitF24 = 1, kCdna3 = 2 };
constexpr int kBf16MmaK = 16;

namespace mma_model_detail {

inline float f32_of(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline uint32_t bits_of_f32(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
inline double bf16_value(uint16_t h) { return (double)f32_of((uint32_t)h << 16); }

// A finite bf16 / fp32 operand as the models split it: v = (neg ? -1 : 1) * m * 2^(e - fb), with e the value's
// exponent (1 <= m / 2^fb < 2 for normal values; the formats' subnormals and zero at e = -126, m < 2^fb) and fb its
// fractional bits, 7 (bf16) or 23 (fp32). Read from the bits, exact.
struct Split {
  bool neg;
  uint32_t m;
  int e;
};
inline Split split_bf16(uint16_t h) {
  const uint32_t E = (h >> 7) & 0xffu, M = h & 0x7fu;
  return {(h >> 15) != 0, E ? 0x80u | M : M, E ? (int)E - 127 : -126};
}
inline Split split_f32(float f) {
  const uint32_t u = bits_of_f32(f), E = (u >> 23) & 0xffu, M = u & 0x7fffffu;
  return {(u >> 31) != 0, E ? 0x800000u | M : M, E ? (int)E - 127 : -126};
}
// 2^k as a double, -1022 <= k <= 1023 (exact).
inline double pow2(int k) {
  const uint64_t bits = (uint64_t)(k + 1023) << 52;
  double d;
  memcpy(&d, &bits, 8);
  return d;
}
// n * 2^sh truncated toward zero (a magnitude: dropped bits are lost), and x * 2^sh rounded toward -inf (signed).
inline uint64_t shift_trunc(uint64_t n, int sh) { return sh >= 0 ? n << sh : (-sh >= 64 ? 0 : n >> -sh); }
// A term of a step, n < 2^24 and sh <= 12, as shift_trunc(n, sh) without a branch on the direction (which the
// alignment distances make unpredictable): n * 2^32 < 2^56, shifted right by 32 - sh (>= 20; at 63 the result is 0).
inline int64_t term(bool neg, uint32_t n, int sh) {
  const int r = 32 - sh;
  const int64_t t = (int64_t)(((uint64_t)n << 32) >> (r < 63 ? r : 63));
  return neg ? -t : t;
}
inline int64_t shift_floor(int64_t x, int sh) {
#if ALIGNED_MMA_MODEL_MUTANT == 2
  if (sh < 0 && x < 0) return -shift_floor(-x, sh);
#endif
  return sh >= 0 ? x * ((int64_t)1 << sh) : (-sh >= 63 ? (x < 0 ? -1 : 0) : x >> -sh);  // (>>: floor, C++20)
}

// No operand is an inf or a NaN (exponent field all ones). Only then can the fp64 sum of c and the products (each
// exact in fp64: < 2^256) be finite, so the models compute it only otherwise, for the NaN / inf result it gives.
inline bool all_finite(const uint16_t* a, const uint16_t* b, int n, float c) {
  bool special = ((bits_of_f32(c) >> 23) & 0xffu) == 0xffu;
  for (int k = 0; k < n; ++k) special |= (a[k] & 0x7f80u) == 0x7f80u || (b[k] & 0x7f80u) == 0x7f80u;
  return !special;
}
// That fp64 sum (c first, then the products in k order): NaN or +-inf when an operand is an inf or a NaN.
inline double fp64_sum(const uint16_t* a, const uint16_t* b, int n, float c) {
  double sum = (double)c;
  for (int k = 0; k < n; ++k) sum += bf16_value(a[k]) * bf16_value(b[k]);
  return sum;
}

// The models in integer arithmetic: each term of a step is an integer count of 2^-frac units at the step's
// alignment exponent, their sum is an exact int64 (<= 17 terms of <= 27 bits), and the one rounding at the end is
// either done on the integer (toward zero) or left to the double -> float conversion (to nearest even). The same
// bits as the fp64 / frexp / ldexp transcription of the description (bf16_mma_models_reference.h; held equal by
// tests/emulated/test_mma_model_conformance.py), without its ~70 libm calls per output element (~3x faster).
// Two passes over the operands (the alignment exponent, then the terms), each splitting them again, instead of
// arrays of their parts: the splits are a few bit operations, and under ASan every local array is a poisoned
// stack frame per call (the models were ~45 % of an emulated mma kernel's time there).

// The NVIDIA fused step over n products + c (see above).
inline float nv_fused(const uint16_t* a, const uint16_t* b, int n, float c, int frac) {
  if (!all_finite(a, b, n, c)) {  // then the fp64 sum is NaN or +-inf (inf * 0, inf - inf, or an inf)
    const double check = fp64_sum(a, b, n, c);
    if (check != check) return f32_of(0x7fffffffu);
    if (isinf(check)) return (float)check;
  }
  const Split sc = split_f32(c);
  int emax = sc.e;
  for (int k = 0; k < n; ++k) {
    const int e = split_bf16(a[k]).e + split_bf16(b[k]).e;
    if (e > emax) emax = e;
  }
  // every term aligned to emax and truncated toward zero to frac fractional bits, summed exactly (units of 2^-frac);
  // c has 23 fractional bits, a product of two bf16 significands 14
  int64_t sum = term(sc.neg, sc.m, frac + sc.e - emax - 23);
  for (int k = 0; k < n; ++k) {
    const Split sa = split_bf16(a[k]), sb = split_bf16(b[k]);
    sum += term(sa.neg != sb.neg, sa.m * sb.m, frac + sa.e + sb.e - emax - 14);
  }
  if (sum == 0) return 0.0f;  // (an exact zero sum is +0, as the fp64 sum's)
  // normalise to fp32 rounding toward zero: 24 significant bits at the sum's exponent, fp32's subnormals below 2^-126
  const bool sneg = sum < 0;
  const uint64_t mag = sneg ? 0 - (uint64_t)sum : (uint64_t)sum;
  const int msb = 63 - __builtin_clzll(mag);
  int e = msb + emax - frac;
  if (e < -126 && ALIGNED_MMA_MODEL_MUTANT != 1) e = -126;
  if (e >= 128) return sneg ? -INFINITY : INFINITY;
  const double r = (double)shift_trunc(mag, emax - frac + 23 - e) * pow2(e - 23);  // exact in fp32 (a zero keeps the sign)
  return (float)(sneg ? -r : r);
}

// One AMD CDNA3 group of n products onto c (see above).
inline float cdna3_group(const uint16_t* a, const uint16_t* b, int n, float c) {
  if (!all_finite(a, b, n, c)) {
    const double check = fp64_sum(a, b, n, c);
    if (check != check || isinf(check)) return (float)check;
  }
  bool pinf = false, ninf = false;
  int emax = -100000;
  for (int k = 0; k < n; ++k) {
    const Split sa = split_bf16(a[k]), sb = split_bf16(b[k]);
    const uint32_t m = sa.m * sb.m;  // the product is m * 2^(e - 14)
    const int e = sa.e + sb.e;
    if (m != 0 && 31 - __builtin_clz(m) + e - 14 >= 128) (sa.neg != sb.neg ? ninf : pinf) = true;  // |p| >= 2^128
    if (e > emax) emax = e;
  }
  if (pinf && ninf) return f32_of(0x7fc00000u);
  if (pinf) return INFINITY;
  if (ninf) return -INFINITY;
  int64_t s = 0;  // the group's products at emax, truncated to 24 fractional bits: units of 2^-24
  for (int k = 0; k < n; ++k) {
    const Split sa = split_bf16(a[k]), sb = split_bf16(b[k]);
    s += term(sa.neg != sb.neg, sa.m * sb.m, 24 + sa.e + sb.e - emax - 14);
  }
  const Split sc = split_f32(c);
  const int mx = emax > sc.e ? emax : sc.e;
  // s floored to 31 fractional bits at mx, c floored to 24 at mx, added exactly (units of 2^-31 at mx) ...
  const int64_t v = shift_floor(s, 7 + emax - mx) + shift_floor(sc.neg ? -(int64_t)sc.m : (int64_t)sc.m, 1 + sc.e - mx) * 128;
  return (float)((double)v * pow2(mx - 31));  // ... and rounded to nearest even fp32 (overflow: inf); exact zero: +0
}

}  // namespace mma_model_detail

// d = STEP(c, a[0..15] . b[0..15]) of `unit` under `model` (one output element of one instruction).
inline float bf16_mma_step(Bf16MmaUnit unit, MmaModel model, const uint16_t* a, const uint16_t* b, float c) {
  using namespace mma_model_detail;
  if (model == MmaModel::kFmaChain) {
    float acc = c;
    for (int k = 0; k < kBf16MmaK; ++k) acc = fmaf(f32_of((uint32_t)a[k] << 16), f32_of((uint32_t)b[k] << 16), acc);
    return acc;
  }
  switch (unit) {
    case Bf16MmaUnit::kNvFusedF25: return nv_fused(a, b, kBf16MmaK, c, 25);
    case Bf16MmaUnit::kNvSplitF24: return nv_fused(a + 8, b + 8, 8, nv_fused(a, b, 8, c, 24), 24);
    case Bf16MmaUnit::kCdna3: return cdna3_group(a + 8, b + 8, 8, cdna3_group(a, b, 8, c));
  }
  return c;
}

}  // namespace aligned::emu
