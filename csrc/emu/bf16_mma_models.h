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

// v = sig * 2^e with 1 <= |sig| < 2 for normal values; below 2^-126 the exponent is -126 and sig < 1 (the
// format's subnormal range: bf16 and fp32 share it); zero: (0, -126). Exact in double.
inline void split_sig_exp(double v, double& sig, int& e) {
  if (v == 0.0) {
    sig = v;
    e = -126;
    return;
  }
  int fe;
  const double fr = frexp(v, &fe);  // v = fr * 2^fe, 0.5 <= |fr| < 1
  sig = fr * 2.0;
  e = fe - 1;
  if (e < -126) {
    sig = ldexp(sig, e + 126);
    e = -126;
  }
}

// trunc(sig * 2^(frac + e - emax)) * 2^-frac, exact (sig has <= 24 significant bits, the result <= 27).
inline double align_trunc(double sig, int e, int emax, int frac) { return ldexp(trunc(ldexp(sig, frac + e - emax)), -frac); }
inline double align_floor(double sig, int e, int emax, int frac) { return ldexp(floor(ldexp(sig, frac + e - emax)), -frac); }

// The NVIDIA fused step over n products + c (see above).
inline float nv_fused(const uint16_t* a, const uint16_t* b, int n, float c, int frac) {
  double check = (double)c;
  for (int k = 0; k < n; ++k) check += bf16_value(a[k]) * bf16_value(b[k]);
  if (check != check) return f32_of(0x7fffffffu);
  if (isinf(check)) return (float)check;
  double sig[kBf16MmaK + 1];
  int ex[kBf16MmaK + 1];
  split_sig_exp((double)c, sig[0], ex[0]);
  int emax = ex[0];
  for (int k = 0; k < n; ++k) {
    double sa, sb;
    int ea, eb;
    split_sig_exp(bf16_value(a[k]), sa, ea);
    split_sig_exp(bf16_value(b[k]), sb, eb);
    sig[k + 1] = sa * sb;
    ex[k + 1] = ea + eb;
    if (ex[k + 1] > emax) emax = ex[k + 1];
  }
  double sum = 0.0;
  for (int k = 0; k <= n; ++k) sum += align_trunc(sig[k], ex[k], emax, frac);  // exact: <= 17 terms of <= 27 bits
  // normalise to fp32, round toward zero (23 fractional bits; fp32 subnormals at 2^-126)
  double s;
  int e;
  split_sig_exp(ldexp(sum, emax), s, e);
  const double r = ldexp(ldexp(trunc(ldexp(s, 23)), -23), e);
  if (fabs(r) >= 0x1p128) return r > 0 ? INFINITY : -INFINITY;
  return (float)r;  // exact: r has <= 24 significant bits in fp32's range
}

// One AMD CDNA3 group of n products onto c (see above).
inline float cdna3_group(const uint16_t* a, const uint16_t* b, int n, float c) {
  double check = (double)c;
  for (int k = 0; k < n; ++k) check += bf16_value(a[k]) * bf16_value(b[k]);
  if (check != check || isinf(check)) return (float)check;
  double sig[kBf16MmaK];
  int ex[kBf16MmaK];
  bool pinf = false, ninf = false;
  int emax = -100000;
  for (int k = 0; k < n; ++k) {
    const double p = bf16_value(a[k]) * bf16_value(b[k]);
    if (p >= 0x1p128) pinf = true;
    if (p <= -0x1p128) ninf = true;
    double sa, sb;
    int ea, eb;
    split_sig_exp(bf16_value(a[k]), sa, ea);
    split_sig_exp(bf16_value(b[k]), sb, eb);
    sig[k] = sa * sb;
    ex[k] = ea + eb;
    if (ex[k] > emax) emax = ex[k];
  }
  if (pinf && ninf) return f32_of(0x7fc00000u);
  if (pinf) return INFINITY;
  if (ninf) return -INFINITY;
  double s = 0.0;
  for (int k = 0; k < n; ++k) s += align_trunc(sig[k], ex[k], emax, 24);
  double sc;
  int ec;
  split_sig_exp((double)c, sc, ec);
  const int m = emax > ec ? emax : ec;
  const double v = align_floor(s, emax, m, 31) + align_floor(sc, ec, m, 24);  // exact in double
  return (float)ldexp(v, m);  // round to nearest even (the default rounding mode; overflow: inf)
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
