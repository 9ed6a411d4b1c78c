// bf16_mma_models_reference.h — the MMA-Sim models of bf16_mma_models.h in their first form: fp64 arithmetic with
// frexp / ldexp / trunc / floor, a line-by-line transcription of the description there. The emulator runs the
// integer form (bf16_mma_models.h): per output element 100 vs 320 ns for the NVIDIA K = 16 step, 119 vs 348 ns for
// the two CDNA3 groups (g++ -O2, the AMX Xeon VM of session 40); tests/emulated/test_mma_model_conformance.py holds
// the two to the same bits on random and edge-case operands (every step). Test-only: the library never includes it.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16_mma_models.h"

namespace aligned::emu::mma_model_reference {

using mma_model_detail::bf16_value;
using mma_model_detail::f32_of;

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

}  // namespace aligned::emu::mma_model_reference
