// exact_linear.h — the `exact` numerics profile of linear, written down once (docs/exact_linear.md).
//
//   out[m, n] = round_T( round_f32( sum_k X[m, k] * W[n, k] * 2^(qx[m] + qw[n]) ) (+ bias[n]) )
//
// X and W are integers: the canonical fixed-point form of each input row (below). The sum over k is an
// exact integer (every backend computes it without rounding: int8 x int8 -> int32 digit products, an exact
// int128 combine), so it has one value whatever the order, tiling, split of K, thread count, ISA level or
// device; it is rounded once to fp32 (round to nearest even, subnormals kept), the bias is one fp32 add,
// and the result is rounded once to T. Nothing here depends on other rows.
//
// Canonical form of a row v[0..K) (x rows, and each weight row n):
//   E   = floor(log2 max_k |v_k|)                       (0 for an all-zero row)
//   lsb = min_k (exponent of the lowest set bit of v_k)  (over nonzero v_k)
//   S   = clamp(ceil((E - lsb + 3) / 8), 1, 4)           digits: the fewest 8-bit digits holding every
//                                                        element exactly; 4 at most (then rounded, below)
//   V_k = RNE(v_k * 2^(8S - 3 - E))                      |V_k| < 2^(8S-2); exact unless the row spans
//                                                        more than 8S-3 bits from its max to its lowest bit
//   q   = E + 3 - 8S                                     v_k == V_k * 2^q when exact
// A weight matrix uses one digit count Sw = max over its rows (its rows stay exact); a row of x uses its own
// Sx (rows with a small range cost fewer digit products; the bits do not depend on it: the sum is exact).
// V is split into S balanced base-256 digits, top digit first: V = sum_t D_t * 256^(S-1-t), D_t in
// [-128, 127]; digit t of any row weighs 2^(E - 5 - 8t), whatever its S, so rows with different S share a
// tile (missing digits are zero).
//
// Non-finite inputs: a NaN or +-inf anywhere in a row of x makes that output row NaN; in weight row n, output
// column n NaN (inf does not propagate as inf). K <= 131072 (int32 digit sums cannot overflow).
#pragma once

#include <stdint.h>

#include "numerics.h"

namespace aligned::exact {

// Every helper below is host + device (ALIGNED_HD): the CPU kernels, the CUDA / HIP kernels of
// csrc/gpu/exact_linear_kernels.cuh and their emulated builds call these same functions.
ALIGNED_HD int clz64(uint64_t v) {  // v != 0
#if defined(__CUDA_ARCH__)
  return __clzll((long long)v);
#else
  return __builtin_clzll(v);
#endif
}
ALIGNED_HD int ctz64(uint64_t v) {  // v != 0
#if defined(__CUDA_ARCH__)
  return __ffsll((long long)v) - 1;
#else
  return __builtin_ctzll(v);
#endif
}

constexpr int kMaxDigits = 4;
constexpr int64_t kMaxK = 131072;

// f == mant * 2^exp exactly, mant odd (or 0). Any finite fp32 (so every bf16 / fp16 value).
struct Decomp {
  int64_t mant;
  int exp;
};
ALIGNED_HD Decomp decompose(float f) {
  const uint32_t u = bits_of(f);
  const int be = (int)((u >> 23) & 0xff);
  int64_t m = (int64_t)(u & 0x7fffff);
  int e;
  if (be == 0) {
    e = -149;
  } else {
    m |= 0x800000;
    e = be - 150;
  }
  if (m == 0) return {0, 0};
  const int tz = ctz64((uint64_t)m);
  m >>= tz;
  e += tz;
  return {(u >> 31) ? -m : m, e};
}

ALIGNED_HD bool is_finite_bits(float f) { return ((bits_of(f) >> 23) & 0xff) != 0xff; }

// floor(log2 |f|) for f != 0 (f finite).
ALIGNED_HD int ilog2_abs(float f) {
  const Decomp d = decompose(f);
  const uint64_t a = (uint64_t)(d.mant < 0 ? -d.mant : d.mant);
  return d.exp + 63 - clz64(a);
}

struct RowForm {
  int E;       // floor(log2 max |v|)
  int S;       // digits, 1..4
  bool bad;    // NaN or inf present
  bool zero;   // every element is zero
};

// row_form in pieces, for kernels that scan a row in parallel (GPU lanes): the per-element scan, an exact
// order-free merge (max / min / or of integers) and the final form. row_form is exactly these pieces.
struct RowScan {
  int emax;  // max floor(log2 |v|) over finite nonzero v (-100000: none)
  int lmin;  // min lowest-set-bit exponent over finite nonzero v (100000: none)
  bool bad;  // NaN or inf seen
};
ALIGNED_HD RowScan row_scan_init() { return RowScan{-100000, 100000, false}; }
ALIGNED_HD void row_scan_add(RowScan& s, float f) {
  if (!is_finite_bits(f)) {
    s.bad = true;
    return;
  }
  if (f == 0.0f) return;
  const Decomp d = decompose(f);
  const uint64_t a = (uint64_t)(d.mant < 0 ? -d.mant : d.mant);
  const int e = d.exp + 63 - clz64(a);
  s.emax = e > s.emax ? e : s.emax;
  s.lmin = d.exp < s.lmin ? d.exp : s.lmin;
}
ALIGNED_HD RowScan row_scan_merge(RowScan a, const RowScan& b) {
  a.emax = b.emax > a.emax ? b.emax : a.emax;
  a.lmin = b.lmin < a.lmin ? b.lmin : a.lmin;
  a.bad = a.bad || b.bad;
  return a;
}
ALIGNED_HD RowForm row_scan_form(const RowScan& s) {
  RowForm r{0, 1, s.bad, true};
  if (s.lmin == 100000) return r;  // no finite nonzero element
  r.zero = false;
  r.E = s.emax;
  const int need = s.emax - s.lmin + 3;  // 8S >= need
  const int S = (need + 7) / 8;
  r.S = S < 1 ? 1 : (S > kMaxDigits ? kMaxDigits : S);
  return r;
}

template <typename T>
ALIGNED_HD RowForm row_form(const T* v, int64_t K) {
  RowScan s = row_scan_init();
  for (int64_t k = 0; k < K; ++k) row_scan_add(s, to_f32(v[k]));
  return row_scan_form(s);
}

// V = RNE(f * 2^(8S - 3 - E)) as an integer (|V| < 2^(8S-2) <= 2^30). f finite.
ALIGNED_HD int32_t quantize(float f, int S, int E) {
  const Decomp d = decompose(f);
  if (d.mant == 0) return 0;
  const int sh = d.exp + 8 * S - 3 - E;  // V = mant * 2^sh
  if (sh >= 0) return (int32_t)(d.mant << sh);
  if (sh > 62) return 0;
  const int s = -sh;
  if (s >= 63) return 0;
  const int64_t a = d.mant < 0 ? -d.mant : d.mant;
  int64_t q = a >> s;
  const int64_t rem = a - (q << s);
  const int64_t half = (int64_t)1 << (s - 1);
  if (rem > half || (rem == half && (q & 1))) ++q;
  return (int32_t)(d.mant < 0 ? -q : q);
}

// Balanced base-256 digits of V, top first: out[t * stride] for t < S.
ALIGNED_HD void split_digits(int32_t V, int S, int8_t* out, int64_t stride) {
  int64_t v = V;
  for (int t = S - 1; t >= 1; --t) {
    const int64_t d = ((v + 128) & 255) - 128;
    out[t * stride] = (int8_t)d;
    v = (v - d) >> 8;
  }
  out[0] = (int8_t)v;
}

// round_f32(acc * 2^q): round to nearest even, subnormals and overflow to inf as IEEE.
ALIGNED_HD float round_i128_f32(__int128 acc, int q) {
  if (acc == 0) return 0.0f;
  const bool neg = acc < 0;
  unsigned __int128 a = neg ? (unsigned __int128)(-acc) : (unsigned __int128)acc;
  const uint64_t hi = (uint64_t)(a >> 64), lo = (uint64_t)a;
  const int p = hi ? 127 - clz64(hi) : 63 - clz64(lo);  // msb position
  int e = p + q;                                                             // value in [2^e, 2^(e+1))
  // keep bits down to 2^(e - 23), or to 2^-149 for subnormal results
  int lsb = e - 23;
  if (lsb < -149) lsb = -149;
  const int shift = lsb - q;  // drop `shift` low bits of a
  uint64_t m;
  if (shift <= 0) {
    m = (uint64_t)a << (-shift);
  } else if (shift > 128) {
    m = 0;  // below half the smallest subnormal
  } else {
    const unsigned __int128 qv = shift == 128 ? 0 : a >> shift;
    const unsigned __int128 rem = shift == 128 ? a : a - (qv << shift);
    const unsigned __int128 half = (unsigned __int128)1 << (shift - 1);
    m = (uint64_t)qv;
    if (rem > half || (rem == half && (m & 1))) ++m;
  }
  if (m == 0) return neg ? -0.0f : 0.0f;
  // m * 2^lsb, m <= 2^24: exact in fp32 unless it overflows
  float r;
  if (lsb + (63 - clz64(m | 1)) > 127) {
    r = float_of(0x7f800000u);
  } else {
    // build m * 2^lsb exactly: m < 2^25, scale in two exact steps (both powers of two are normal)
    const int s1 = lsb < -126 ? -126 : (lsb > 127 ? 127 : lsb);
    const int s2 = lsb - s1;
    r = (float)m * float_of((uint32_t)(s1 + 127) << 23);
    if (s2 != 0) r = r * float_of((uint32_t)(s2 + 127) << 23);
  }
  return neg ? -r : r;
}

// The same rounding for acc = hi * 2^32 + lo (the split form the kernels accumulate, see combine_split).
// Fast path when |hi|, |lo| < 2^53: both are exact doubles; their sum is formed exactly as a two-sum and
// rounded to odd in double (53 >= 24 + 2 bits, so the following round to fp32 is the correct rounding of the
// exact value); scaling by 2^q is exact in double for every q the canonical forms produce. Otherwise int128.
ALIGNED_HD float round_split_f32(int64_t hi, int64_t lo, int q) {
  constexpr int64_t lim = (int64_t)1 << 53;
  if (hi > -lim && hi < lim && lo > -lim && lo < lim && q > -900 && q < 900) {
    const double a = (double)hi * 4294967296.0, b = (double)lo;
    double s = a + b;
    const double bb = s - a;
    const double err = (a - (s - bb)) + (b - bb);
    if (err != 0.0) {
      uint64_t u;
      __builtin_memcpy(&u, &s, 8);
      if ((u & 1) == 0) {  // step to the odd neighbour on err's side (|s| grows iff err has s's sign)
        const bool away = (err > 0) == (s > 0);
        u = away ? u + 1 : u - 1;
        __builtin_memcpy(&s, &u, 8);
      }
    }
    // s * 2^q exactly: two power-of-two factors, each a normal double
    const int q1 = q / 2, q2 = q - q1;
    uint64_t p1 = (uint64_t)(q1 + 1023) << 52, p2 = (uint64_t)(q2 + 1023) << 52;
    double f1, f2;
    __builtin_memcpy(&f1, &p1, 8);
    __builtin_memcpy(&f2, &p2, 8);
    return (float)((s * f1) * f2);
  }
  return round_i128_f32(((__int128)hi << 32) + lo, q);
}

// Weight of digit pair (t, u) in the int128 combine: acc = sum_tu C_tu << (8 * (6 - t - u)), value
// acc * 2^(Ex + Ew - 10 - 48).
constexpr int kCombineTop = 2 * (kMaxDigits - 1);
ALIGNED_HD int combine_q(int Ex, int Ew) { return Ex + Ew - 10 - 8 * kCombineTop; }

// The split accumulator of the kernels: acc = hi * 2^32 + lo. An exact digit-pair (or same-level) sum c of
// level s = t + u weighs 2^(8 (6 - s)); levels 0..2 go to hi, 3..6 to lo (bounds: see the CPU combine).
ALIGNED_HD void add_level(int64_t& hi, int64_t& lo, int s, int64_t c) {
  if (s <= 2) {
    hi += c * ((int64_t)1 << (8 * (2 - s)));
  } else {
    lo += c * ((int64_t)1 << (8 * (6 - s)));
  }
}

// One output before the bias: NaN when its x row or weight row holds a NaN / inf, else the single rounding.
ALIGNED_HD float exact_output_f32(int64_t hi, int64_t lo, int Ex, int Ew, bool bad) {
  return bad ? float_of(0x7fc00000u) : round_split_f32(hi, lo, combine_q(Ex, Ew));
}

// The scalar definition: one output from the canonical integers (no digits), for tests and the generic path.
inline __int128 exact_dot_ref(const int32_t* X, const int32_t* W, int64_t K) {
  __int128 acc = 0;
  for (int64_t k = 0; k < K; ++k) acc += (__int128)((int64_t)X[k] * (int64_t)W[k]);
  return acc;
}

}  // namespace aligned::exact
