// mma_model_conformance.cpp — the emulator's integer MMA models (csrc/emu/bf16_mma_models.h) against their fp64 /
// frexp / ldexp transcription (csrc/emu/bf16_mma_models_reference.h), bit for bit, on generated operands: random
// bit patterns (NaN, inf, subnormals included), exponents in a narrow window (alignment and truncation at every
// distance), cancelling pairs (onto signed zeros too: exact zero sums), subnormals and signed zeros, magnitudes at
// the overflow edge. Each of the NVIDIA fused step (K = 16, F = 25; K = 8, F = 24) and the AMD CDNA3 group (K = 8)
// is compared; the controls compare two steps that must differ (F = 25 vs F = 24; CDNA3 vs NVIDIA) through the same
// comparison. Built with -DALIGNED_MMA_MODEL_MUTANT=1 / 2, the integer form carries a planted edge-case fault
// (bf16_mma_models.h) that the comparison must catch.
// Usage: mma_model_conformance CASES_PER_MODE SEED   (prints "<step> <cases> <mismatches>" per step, then controls)
#include <stdio.h>
#include <stdlib.h>

#include <random>

#include "csrc/emu/bf16_mma_models_reference.h"

namespace fast = aligned::emu::mma_model_detail;
namespace ref = aligned::emu::mma_model_reference;

static uint32_t bits(float f) { return fast::bits_of_f32(f); }
static float from_bits(uint32_t u) { return fast::f32_of(u); }

struct Gen {
  std::mt19937_64 rng;
  explicit Gen(uint64_t seed) : rng(seed) {}
  uint32_t u(uint32_t n) { return (uint32_t)(rng() % n); }
  uint16_t bf16(uint32_t sign, uint32_t e, uint32_t m) { return (uint16_t)((sign << 15) | ((e & 0xff) << 7) | (m & 0x7f)); }
  uint16_t near(int center) {  // a finite bf16 with exponent field within 3 of center (clamped to 0..254)
    int e = center + (int)u(7) - 3;
    e = e < 0 ? 0 : (e > 254 ? 254 : e);
    return bf16(u(2), (uint32_t)e, u(128));
  }
  // one case: a[16], b[16], c by mode
  void make(int mode, uint16_t* a, uint16_t* b, float& c) {
    const int ca = 1 + (int)u(253), cb = 1 + (int)u(253);
    for (int k = 0; k < 16; ++k) {
      switch (mode) {
        case 0: a[k] = (uint16_t)rng(); b[k] = (uint16_t)rng(); break;          // any bits
        case 1: a[k] = near(ca); b[k] = near(cb); break;                         // one exponent window each
        case 2: a[k] = bf16(u(2), u(3), u(8) ? u(128) : 0); b[k] = near(cb); break;  // subnormals, signed zeros
        case 3: a[k] = near(250); b[k] = near(u(2) ? 250 : 130); break;         // the overflow edge
        default:                                                                  // cancelling pairs (modes 4, 5)
          if (k & 1) { a[k] = (uint16_t)(a[k - 1] ^ 0x8000 ^ (u(4) == 0)); b[k] = b[k - 1]; }  // 1 in 4: one ulp off
          else { a[k] = near(ca); b[k] = near(cb); }
      }
    }
    // c: any bits, a signed zero, a subnormal, or near the products' scale (2^(ca + cb - 254 +- 8)); mode 5:
    // cancelling pairs onto a signed zero or a subnormal (exact zeros and the sign they keep)
    switch (mode == 5 ? 1 + u(2) : u(5)) {
      case 0: c = from_bits((uint32_t)rng()); break;
      case 1: c = from_bits(u(2) << 31); break;
      case 2: c = from_bits((u(2) << 31) | (u(1u << 23))); break;
      default: {
        int e = ca + cb - 127 + (int)u(17) - 8;
        e = e < 0 ? 0 : (e > 254 ? 254 : e);
        c = from_bits((u(2) << 31) | ((uint32_t)e << 23) | u(1u << 23));
      }
    }
  }
};

// What kind of result a step gave: the test asserts every kind occurred (the generator reaches the edges).
enum Kind { kPosZero, kNegZero, kSubnormal, kNormal, kInf, kNaN, kKinds };
static int kind(float f) {
  const uint32_t u = bits(f), e = (u >> 23) & 0xff, m = u & 0x7fffff;
  if (e == 0xff) return m ? kNaN : kInf;
  if (e == 0) return m ? kSubnormal : ((u >> 31) ? kNegZero : kPosZero);
  return kNormal;
}

int main(int argc, char** argv) {
  const long per_mode = argc > 1 ? atol(argv[1]) : 100000;
  Gen g(argc > 2 ? strtoull(argv[2], nullptr, 10) : 1);
  long cases = 0, mis_nv25 = 0, mis_nv24 = 0, mis_cdna3 = 0, ctl_frac = 0, ctl_unit = 0;
  long seen[3][kKinds] = {};
  uint16_t a[16], b[16];
  float c;
  for (int mode = 0; mode < 6; ++mode)
    for (long i = 0; i < per_mode; ++i, ++cases) {
      g.make(mode, a, b, c);
      const float f25 = fast::nv_fused(a, b, 16, c, 25), r25 = ref::nv_fused(a, b, 16, c, 25);
      const float f24 = fast::nv_fused(a, b, 8, c, 24), r24 = ref::nv_fused(a, b, 8, c, 24);
      const float fc = fast::cdna3_group(a, b, 8, c), rc = ref::cdna3_group(a, b, 8, c);
      if (bits(f25) != bits(r25) && mis_nv25++ < 5)
        fprintf(stderr, "nv_fused K16 F25 mode %d: fast %08x ref %08x (c %08x)\n", mode, bits(f25), bits(r25), bits(c));
      if (bits(f24) != bits(r24) && mis_nv24++ < 5)
        fprintf(stderr, "nv_fused K8 F24 mode %d: fast %08x ref %08x (c %08x)\n", mode, bits(f24), bits(r24), bits(c));
      if (bits(fc) != bits(rc) && mis_cdna3++ < 5)
        fprintf(stderr, "cdna3_group K8 mode %d: fast %08x ref %08x (c %08x)\n", mode, bits(fc), bits(rc), bits(c));
      ++seen[0][kind(r25)], ++seen[1][kind(r24)], ++seen[2][kind(rc)];
      ctl_frac += bits(fast::nv_fused(a, b, 8, c, 25)) != bits(r24);  // controls: steps that must differ
      ctl_unit += bits(fast::nv_fused(a, b, 8, c, 24)) != bits(rc);
    }
  printf("nv_fused_k16_f25 %ld %ld\nnv_fused_k8_f24 %ld %ld\ncdna3_group_k8 %ld %ld\n", cases, mis_nv25, cases, mis_nv24,
         cases, mis_cdna3);
  const char* names[3] = {"nv_fused_k16_f25", "nv_fused_k8_f24", "cdna3_group_k8"};
  for (int i = 0; i < 3; ++i)
    printf("kinds %s +0 %ld -0 %ld subnormal %ld normal %ld inf %ld nan %ld\n", names[i], seen[i][kPosZero],
           seen[i][kNegZero], seen[i][kSubnormal], seen[i][kNormal], seen[i][kInf], seen[i][kNaN]);
  printf("control_f25_vs_f24 %ld %ld\ncontrol_nvidia_vs_cdna3 %ld %ld\n", cases, ctl_frac, cases, ctl_unit);
  return 0;
}
