// f16_conversion.cpp — numerics.h's f16 conversions (to_f32(f16_t), from_f32<f16_t>) held bit for bit to the
// branching form they replaced (written out below as the reference): every f16 input, and every f32 input ("all")
// or, by default, every sign x exponent x low 14 mantissa bits (the bits a normal result's rounding reads; a subnormal
// result's reads higher ones: the "all" run covers them) x 4 high mantissa patterns; and a table of known answers.
// Driven by tests/common/test_f16_conversion.py with a copy of the extension's numerics flags. A negative control
// (the reference with round-half-up instead of half-to-even) must mismatch through the same comparison.
// Output: "<check> <checked> <mismatches>" per line; exit status 1 on a mismatch outside negative_*.
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "csrc/common/numerics.h"

namespace ref {
using aligned::bits_of;
using aligned::float_of;

uint16_t from_f32_f16(float x, bool half_up) {
  uint32_t u = bits_of(x);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u));  // inf or NaN
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to >= 65520 -> inf
  if (a < 0x38800000u) {  // subnormal result: round x * 2^24 to an integer (magic number, exact RNE)
    float v = float_of(a) * 16777216.0f;
    float rounded = (v + 8388608.0f) - 8388608.0f;
    return (uint16_t)(sign | (uint32_t)rounded);
  }
  uint32_t m = a + 0xfffu + (half_up ? 1u : ((a >> 13) & 1u));  // normal: RNE of the 13 dropped bits
  return (uint16_t)(sign | ((m - 0x38000000u) >> 13));
}

uint32_t to_f32_f16(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0u);  // inf / NaN (quiet)
  if (exp == 0) return bits_of((float)man * 5.9604644775390625e-8f) | sign;  // zero or subnormal
  return sign | ((exp + 112u) << 23) | (man << 13);
}
}  // namespace ref

int main(int argc, char** argv) {
  const bool all = argc > 1 && strcmp(argv[1], "all") == 0;
  int bad = 0;
  uint64_t n = 0, mis = 0;
  for (uint32_t h = 0; h < 0x10000u; ++h, ++n) {
    aligned::f16_t x;
    x.bits = (uint16_t)h;
    mis += aligned::bits_of(aligned::to_f32(x)) != ref::to_f32_f16((uint16_t)h);
  }
  printf("to_f32 %llu %llu\n", (unsigned long long)n, (unsigned long long)mis);
  bad |= mis != 0;
  // negative control: a widening that keeps a signalling NaN signalling is caught by the same comparison
  uint64_t kept = 0;
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    aligned::f16_t x;
    x.bits = (uint16_t)h;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    const uint32_t keep = e == 0x1f ? (((h & 0x8000u) << 16) | 0x7f800000u | (m << 13)) : aligned::bits_of(aligned::to_f32(x));
    kept += keep != ref::to_f32_f16((uint16_t)h);
  }
  printf("negative_to_f32_signalling_kept 65536 %llu\n", (unsigned long long)kept);
  bad |= kept == 0;

  uint64_t neg = 0;
  n = mis = 0;
  auto check = [&](uint32_t u) {
    const float x = aligned::float_of(u);
    const uint16_t got = aligned::from_f32<aligned::f16_t>(x).bits;
    mis += got != ref::from_f32_f16(x, false);
    neg += got != ref::from_f32_f16(x, true);
    ++n;
  };
  if (all) {
    uint32_t u = 0;
    do check(u); while (++u != 0);
  } else {
    const uint32_t high[4] = {0u, 0x0aau, 0x155u, 0x1ffu};  // mantissa bits 14..22
    for (uint32_t se = 0; se < 512; ++se)
      for (uint32_t hi : high)
        for (uint32_t lo = 0; lo < (1u << 14); ++lo) check((se << 23) | (hi << 14) | lo);
  }
  printf("from_f32 %llu %llu\n", (unsigned long long)n, (unsigned long long)mis);
  printf("negative_from_f32_half_up %llu %llu\n", (unsigned long long)n, (unsigned long long)neg);
  bad |= mis != 0 || neg == 0;

  // Known answers (IEEE binary16, round to nearest even), independent of the reference above: a build whose flags
  // broke the magic-number rounding or the subnormal product would break the reference the same way.
  struct Known {
    uint32_t f32;
    uint16_t f16;
    bool exact;  // f32 is the f16's value: to_f32 gives it back
  };
  const Known known[] = {
      {0x00000000u, 0x0000u, true}, {0x80000000u, 0x8000u, true},  // +-0
      {0x33000000u, 0x0000u, false},  // 2^-25: halfway to the smallest subnormal, to even (0)
      {0x33000001u, 0x0001u, false},  // just above it
      {0xb3400000u, 0x8001u, false},  // -1.5 * 2^-25
      {0x33800000u, 0x0001u, true},   // 2^-24, the smallest subnormal
      {0x387fc000u, 0x03ffu, true},   // the largest subnormal
      {0x38800000u, 0x0400u, true},   // 2^-14, the smallest normal
      {0x3f800000u, 0x3c00u, true}, {0xbf800000u, 0xbc00u, true},  // +-1
      {0x3f801000u, 0x3c00u, false},  // 1 + 2^-11: halfway, to even (1)
      {0x3f803000u, 0x3c02u, false},  // 1 + 3 * 2^-11: halfway, to even (1 + 2^-9)
      {0x477fe000u, 0x7bffu, true},   // 65504, the largest finite
      {0x477fefffu, 0x7bffu, false},  // just below the rounding boundary
      {0x477ff000u, 0x7c00u, false},  // 65520: rounds to inf
      {0x7f800000u, 0x7c00u, true}, {0xff800000u, 0xfc00u, true},  // +-inf
      {0x7fc00000u, 0x7e00u, true},   // the quiet NaN
      {0xffc00001u, 0xfe00u, false},  // a NaN's payload is not kept, its sign is
      {0x7f800001u, 0x7e00u, false},  // a signalling NaN: quiet
  };
  uint64_t known_bad = 0;
  for (const Known& k : known) {
    known_bad += aligned::from_f32<aligned::f16_t>(aligned::float_of(k.f32)).bits != k.f16;
    aligned::f16_t h;
    h.bits = k.f16;
    if (k.exact) known_bad += aligned::bits_of(aligned::to_f32(h)) != k.f32;
  }
  // NaNs widen quiet (IEEE 754 conversions; F16C vcvtph2ps): sign and payload kept, the quiet bit set
  const uint32_t nan_widened[][2] = {
      {0x7e00u, 0x7fc00000u},  // the quiet NaN
      {0x7c01u, 0x7fc02000u},  // the smallest signalling NaN: quiet
      {0xfd00u, 0xffe00000u},  // a negative signalling NaN: quiet, sign and payload kept
      {0x7fffu, 0x7fffe000u},  // all payload bits
  };
  for (const auto& k : nan_widened) {
    aligned::f16_t h;
    h.bits = (uint16_t)k[0];
    known_bad += aligned::bits_of(aligned::to_f32(h)) != k[1];
  }
  printf("known_answers %llu %llu\n",
         (unsigned long long)(sizeof(known) / sizeof(known[0]) + sizeof(nan_widened) / sizeof(nan_widened[0])),
         (unsigned long long)known_bad);
  bad |= known_bad != 0;
  return bad;
}
