// dpbf16_order.c — what exactly does AVX512-BF16 `vdpbf16ps` compute, and how fast is it?
//
// One-off measurement behind the bf16 decision in csrc/common/contract.h (linear, `fma` profile).
//   gcc -O2 -ffp-contract=off -mavx512f -mavx512bw -mavx512bf16 bench/experiments/dpbf16_order.c -o /tmp/dpbf16 -lm
//   /tmp/dpbf16
// Per fp32 lane j, vdpbf16ps(src, a, b) takes the bf16 pair (a[2j], a[2j+1]), (b[2j], b[2j+1]). Candidate
// scalar models, all "odd element first" as Intel's pseudocode writes it:
//   plain      acc = fma(a1, b1, acc); acc = fma(a0, b0, acc)                        (no flushing)
//   daz_ftz    inputs a, b, src subnormal -> zero; each fma result flushed if subnormal AFTER rounding
//   daz_ftzend inputs flushed; only the final result of the pair flushed
//   daz_ftzpre inputs flushed; each step flushed if the EXACT value is below 2^-126 (tininess before rounding)
// Flushing keeps the sign (-tiny -> -0) in every model; the `+0` variant of daz_ftz tests that too.
// Test sets: (1) N(0,1) chains at K = 2048 (the earlier measurement), (2) single instructions on random
// bit patterns whose exponents sit around the subnormal boundary, (3) hand-built adversarial cases.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static float f_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t u_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bf(uint16_t h) { return f_of((uint32_t)h << 16); }
static int is_sub(float x) { return x != 0.0f && fabsf(x) < 0x1p-126f; }
static float flush(float x) { return is_sub(x) ? copysignf(0.0f, x) : x; }
static float flush_pos(float x) { return is_sub(x) ? 0.0f : x; }

// exact-value tininess: is |a*b + c| < 2^-126 (exactly)? a*b exact in double; TwoSum gives the exact error.
static int exact_tiny(float a, float b, float c) {
  double p = (double)a * (double)b, cc = c;
  double s = p + cc, bv = s - p, e = (p - (s - bv)) + (cc - bv);
  double t = 0x1p-126;
  if (fabs(s) < t) return s != 0.0 || e != 0.0;
  if (fabs(s) == t) return (s > 0 && e < 0) || (s < 0 && e > 0);
  return 0;
}

enum { PLAIN, DAZ_FTZ, DAZ_FTZ_POS, DAZ_FTZEND, DAZ_FTZPRE, NMODELS };
static const char* kNames[NMODELS] = {"plain", "daz_ftz", "daz_ftz(+0)", "daz_ftzend", "daz_ftzpre"};

static float model(int m, float acc, uint16_t a0, uint16_t a1, uint16_t b0, uint16_t b1) {
  float x0 = bf(a0), x1 = bf(a1), y0 = bf(b0), y1 = bf(b1);
  if (m == PLAIN) return fmaf(x0, y0, fmaf(x1, y1, acc));
  float (*fl)(float) = m == DAZ_FTZ_POS ? flush_pos : flush;
  x0 = fl(x0); x1 = fl(x1); y0 = fl(y0); y1 = fl(y1); acc = fl(acc);
  if (m == DAZ_FTZPRE) {
    float t = exact_tiny(x1, y1, acc) ? copysignf(0.0f, fmaf(x1, y1, acc)) : fmaf(x1, y1, acc);
    return exact_tiny(x0, y0, t) ? copysignf(0.0f, fmaf(x0, y0, t)) : fmaf(x0, y0, t);
  }
  if (m == DAZ_FTZEND) return fl(fmaf(x0, y0, fmaf(x1, y1, acc)));
  return fl(fmaf(x0, y0, fl(fmaf(x1, y1, acc))));
}

static uint64_t rs = 88172645463325252ull;
static uint64_t rnd(void) { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return rs; }
static double gauss(void) {
  double u = ((rnd() >> 11) + 0.5) * 0x1p-53, v = ((rnd() >> 11) + 0.5) * 0x1p-53;
  return sqrt(-2 * log(u)) * cos(6.283185307179586 * v);
}
static uint16_t to_bf(float f) {  // round to nearest even
  uint32_t u = u_of(f);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// random bf16 with exponent field in [e_lo, e_hi] (0 = subnormal/zero), random sign and mantissa
static uint16_t rnd_bf_exp(int e_lo, int e_hi) {
  int e = e_lo + (int)(rnd() % (uint64_t)(e_hi - e_lo + 1));
  return (uint16_t)(((rnd() & 1) << 15) | ((uint32_t)e << 7) | (rnd() & 0x7f));
}
static float rnd_f32_exp(int e_lo, int e_hi) {
  int e = e_lo + (int)(rnd() % (uint64_t)(e_hi - e_lo + 1));
  return f_of((uint32_t)((rnd() & 1) << 31) | ((uint32_t)e << 23) | (uint32_t)(rnd() & 0x7fffff));
}

// one instruction on 16 lanes
static void hw(const float* src, const uint16_t* a, const uint16_t* b, float* out) {
  __m512 s = _mm512_loadu_ps(src);
  __m512bh va = (__m512bh)_mm512_loadu_si512(a), vb = (__m512bh)_mm512_loadu_si512(b);
  _mm512_storeu_ps(out, _mm512_dpbf16_ps(s, va, vb));
}

static long mism[NMODELS];
static long n_cases;
static void check(const float* src, const uint16_t* a, const uint16_t* b, const float* out, int print) {
  for (int j = 0; j < 16; ++j) {
    ++n_cases;
    for (int m = 0; m < NMODELS; ++m) {
      float want = model(m, src[j], a[2 * j], a[2 * j + 1], b[2 * j], b[2 * j + 1]);
      if (u_of(want) != u_of(out[j])) {
        ++mism[m];
        if (print && m == DAZ_FTZ)
          printf("  daz_ftz mismatch: src %a a (%a,%a) b (%a,%a): hw %a model %a\n", src[j], bf(a[2 * j]),
                 bf(a[2 * j + 1]), bf(b[2 * j]), bf(b[2 * j + 1]), out[j], want);
      }
    }
  }
}
static void report(const char* what) {
  printf("%-44s %8ld lanes:", what, n_cases);
  for (int m = 0; m < NMODELS; ++m) printf("  %s %ld", kNames[m], mism[m]);
  printf("  (mismatches)\n");
  memset(mism, 0, sizeof mism);
  n_cases = 0;
}

int main(void) {
  // (1) K = 2048 chains, N(0,1) activations with x30 outliers, N(0, 0.05^2) weights: whole-chain equality.
  {
    enum { K = 2048, OUT = 256 };
    static uint16_t a[OUT][K], b[OUT][K];
    long eq_swapped = 0, eq_natural = 0, eq_daz = 0;
    for (int o = 0; o < OUT; ++o) {
      for (int k = 0; k < K; ++k) {
        a[o][k] = to_bf((float)(gauss() * ((rnd() % 64) == 0 ? 30 : 1)));
        b[o][k] = to_bf((float)(gauss() * 0.05));
      }
    }
    for (int o = 0; o < OUT; o += 16) {
      __m512 acc = _mm512_setzero_ps();
      for (int i = 0; i < K / 2; ++i) {
        uint16_t pa[32], pb[32];
        for (int j = 0; j < 16; ++j) {
          pa[2 * j] = a[o + j][2 * i]; pa[2 * j + 1] = a[o + j][2 * i + 1];
          pb[2 * j] = b[o + j][2 * i]; pb[2 * j + 1] = b[o + j][2 * i + 1];
        }
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(pa), (__m512bh)_mm512_loadu_si512(pb));
      }
      float hwv[16];
      _mm512_storeu_ps(hwv, acc);
      for (int j = 0; j < 16; ++j) {
        float sw = 0, nat = 0, dz = 0;
        for (int i = 0; i < K / 2; ++i) {
          sw = fmaf(bf(a[o + j][2 * i]), bf(b[o + j][2 * i]), fmaf(bf(a[o + j][2 * i + 1]), bf(b[o + j][2 * i + 1]), sw));
          nat = fmaf(bf(a[o + j][2 * i + 1]), bf(b[o + j][2 * i + 1]), fmaf(bf(a[o + j][2 * i]), bf(b[o + j][2 * i]), nat));
          dz = model(DAZ_FTZ, dz, a[o + j][2 * i], a[o + j][2 * i + 1], b[o + j][2 * i], b[o + j][2 * i + 1]);
        }
        eq_swapped += u_of(sw) == u_of(hwv[j]);
        eq_natural += u_of(nat) == u_of(hwv[j]);
        eq_daz += u_of(dz) == u_of(hwv[j]);
      }
    }
    printf("K=2048 chains, %d outputs: equal to odd-first chain %ld, natural order %ld, daz_ftz model %ld\n", OUT,
           eq_swapped, eq_natural, eq_daz);
  }
  // (2) single instructions, random bit patterns around the subnormal boundary (and the full range)
  {
    float src[16], out[16];
    uint16_t a[32], b[32];
    struct { const char* name; int ae_lo, ae_hi; int se_lo, se_hi; } sets[] = {
        {"products ~2^-126, src ~2^-126", 50, 78, 0, 4},
        {"products ~2^-126, src subnormal/zero", 50, 78, 0, 0},
        {"inputs incl. subnormal bf16, src ~1", 0, 3, 120, 130},
        {"inputs subnormal..small normal, src tiny", 0, 70, 0, 3},
        {"full exponent range (incl. inf/nan)", 0, 255, 0, 255},
        {"normal values, src normal", 100, 140, 100, 140},
    };
    for (unsigned s = 0; s < sizeof sets / sizeof *sets; ++s) {
      for (int it = 0; it < 200000; ++it) {
        for (int j = 0; j < 16; ++j) src[j] = rnd_f32_exp(sets[s].se_lo, sets[s].se_hi);
        for (int j = 0; j < 32; ++j) { a[j] = rnd_bf_exp(sets[s].ae_lo, sets[s].ae_hi); b[j] = rnd_bf_exp(sets[s].ae_lo, sets[s].ae_hi); }
        // NaN payloads differ by model trivia; keep NaN out of the bitwise count except in the full-range set
        hw(src, a, b, out);
        if (s == 4) {
          for (int j = 0; j < 16; ++j)
            if (isnan(out[j])) { out[j] = 0; src[j] = 0; a[2 * j] = a[2 * j + 1] = b[2 * j] = b[2 * j + 1] = 0; }
        }
        check(src, a, b, out, 0);
      }
      report(sets[s].name);
    }
  }
  // (3) hand-built cases
  {
    struct { const char* what; float src; float a0, a1, b0, b1; } cs[] = {
        {"intermediate subnormal, final normal", 0x1.8p-126f, 0x1p-63f, -0x1p-63f, 0x1p-63f, 0x1p-63f},
        {"exact 2^-126 - 2^-151 (rounds up to normal)", 0x1p-126f, 0.0f, 0x1p-75f, 0.0f, -0x1p-76f},
        {"exact just below 2^-126, rounds to subnormal", 0x1p-125f, 0.0f, -0x1.02p-126f, 0.0f, 1.0f},
        {"product underflows, src 0", 0.0f, 0x1p-70f, 0x1p-70f, 0x1p-70f, 0x1p-70f},
        {"negative subnormal result sign", 0.0f, 0.0f, -0x1p-64f, 0.0f, 0x1p-64f},
        {"-0 src + -0 product stays -0", -0.0f, -0.0f, -0.0f, 1.0f, 1.0f},
        {"-0 src + (+0*+0)", -0.0f, 0.0f, 0.0f, 1.0f, 1.0f},
        {"-0 src + (-0 odd, +0 even)", -0.0f, 0.0f, -0.0f, 1.0f, 1.0f},
        {"subnormal src", 0x1p-130f, 0.0f, 0.0f, 0.0f, 0.0f},
        {"subnormal src, -0 products", 0x1p-130f, -0.0f, -0.0f, 1.0f, 1.0f},
        {"subnormal bf16 input x 2^100", 1.0f, 0x1p-130f, 0x1p-130f, 0x1p100f, 0x1p100f},
        {"order: odd first (1 + 2^-24) - 1", 0.0f, 0x1p-24f, 1.0f, 1.0f, 1.0f},
    };
    int n = sizeof cs / sizeof *cs;
    for (int c = 0; c < n; ++c) {
      float src[16], out[16];
      uint16_t a[32], b[32];
      for (int j = 0; j < 16; ++j) {
        src[j] = cs[c].src;
        a[2 * j] = (uint16_t)(u_of(cs[c].a0) >> 16); a[2 * j + 1] = (uint16_t)(u_of(cs[c].a1) >> 16);
        b[2 * j] = (uint16_t)(u_of(cs[c].b0) >> 16); b[2 * j + 1] = (uint16_t)(u_of(cs[c].b1) >> 16);
      }
      hw(src, a, b, out);
      printf("  %-46s hw %-14a", cs[c].what, out[0]);
      for (int m = 0; m < NMODELS; ++m) printf(" %s%s", kNames[m], u_of(model(m, src[0], a[0], a[1], b[0], b[1])) == u_of(out[0]) ? "=" : "!");
      printf("\n");
      check(src, a, b, out, 0);
    }
    report("hand-built cases");
  }
  // (4) throughput: 12 independent accumulators held in registers, products per ns (each accumulator is a
  // dependent chain: latency 4 cycles, so 12 chains cover 2 ports x 4 cycles + slack).
  {
    const long iters = 20000000;
    struct timespec t0, t1;
    __m512 x = _mm512_set1_ps(1e-8f), y = _mm512_set1_ps(1e-8f);
    __m512bh xb = (__m512bh)_mm512_set1_epi32(0x3f803f80), yb = (__m512bh)_mm512_set1_epi32(0x00010001);
#define ACC12(init) __m512 c0 = init, c1 = init, c2 = init, c3 = init, c4 = init, c5 = init, c6 = init, \
    c7 = init, c8 = init, c9 = init, c10 = init, c11 = init
#define EACH12(OP) OP(c0); OP(c1); OP(c2); OP(c3); OP(c4); OP(c5); OP(c6); OP(c7); OP(c8); OP(c9); OP(c10); OP(c11)
#define SUM12 (_mm512_reduce_add_ps(c0) + _mm512_reduce_add_ps(c1) + _mm512_reduce_add_ps(c2) + \
    _mm512_reduce_add_ps(c3) + _mm512_reduce_add_ps(c4) + _mm512_reduce_add_ps(c5) + _mm512_reduce_add_ps(c6) + \
    _mm512_reduce_add_ps(c7) + _mm512_reduce_add_ps(c8) + _mm512_reduce_add_ps(c9) + _mm512_reduce_add_ps(c10) + \
    _mm512_reduce_add_ps(c11))
    double fma_s, dp_s;
    float sink = 0;
    {
      ACC12(_mm512_setzero_ps());
      clock_gettime(CLOCK_MONOTONIC, &t0);
#define FMA(c) c = _mm512_fmadd_ps(x, y, c)
      for (long i = 0; i < iters; ++i) { EACH12(FMA); __asm__ volatile("" : "+v"(x)); }
      clock_gettime(CLOCK_MONOTONIC, &t1);
      fma_s = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
      sink += SUM12;
    }
    {
      ACC12(_mm512_setzero_ps());
      __m512 d0 = c0, d1 = c0, d2 = c0, d3 = c0, d4 = c0, d5 = c0;  // 18 chains: covers a longer latency
      clock_gettime(CLOCK_MONOTONIC, &t0);
#define DP(c) c = _mm512_dpbf16_ps(c, xb, yb)
      for (long i = 0; i < iters; ++i) {
        EACH12(DP); DP(d0); DP(d1); DP(d2); DP(d3); DP(d4); DP(d5);
        __asm__ volatile("" : "+v"(xb));
      }
      clock_gettime(CLOCK_MONOTONIC, &t1);
      dp_s = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec) ;
      dp_s = dp_s * 12.0 / 18.0;  // per 12 instructions, like the fma loop
      sink += SUM12 + _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(d0, d1), _mm512_add_ps(_mm512_add_ps(d2, d3), _mm512_add_ps(d4, d5))));
    }
    double n_ins = 12.0 * iters;
    printf("throughput: vfmadd231ps zmm %.1f Gproducts/s, vdpbf16ps zmm %.1f Gproducts/s, ratio %.2f (sink %g)\n",
           n_ins * 16 / fma_s * 1e-9, n_ins * 32 / dp_s * 1e-9, (n_ins * 32 / dp_s) / (n_ins * 16 / fma_s), sink);
  }
  return 0;
}
