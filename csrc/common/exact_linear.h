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
// column n NaN (inf does not propagate as inf). K <= 131072. Kernels sum digit pairs in int32 over at most 2^16 k
// (|C| <= 2^14 per k, so 2^30; one sum over 2^17 k could reach 2^31) and add the parts exactly in int64.
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
// a + b (exact doubles) rounded to odd: the double nearest below or above whose last bit is 1 unless a + b is
// itself a double. TwoSum gives the exact error (IEEE round to nearest, no contraction, no overflow); rounding
// the result to fp32 (24 bits <= 53 - 2) is then the correct rounding of the exact a + b.
ALIGNED_HD double sum_round_odd(double a, double b) {
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
  return s;
}

ALIGNED_HD float round_split_f32(int64_t hi, int64_t lo, int q) {
  constexpr int64_t lim = (int64_t)1 << 53;
  if (hi > -lim && hi < lim && lo > -lim && lo < lim && q > -900 && q < 900) {
    const double s = sum_round_odd((double)hi * 4294967296.0, (double)lo);
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

// One output's epilogue from its split accumulator: the single rounding (or NaN), then the bias as one fp32
// add (bias == nullptr: none); the caller rounds the result once to T. The single-device kernels' scalar
// epilogue and the TP finish (linear_exact_finish) both call this.
ALIGNED_HD float exact_epilogue_f32(int64_t hi, int64_t lo, int Ex, int Ew, bool bad, const float* bias) {
  float y = exact_output_f32(hi, lo, Ex, Ew, bad);
  if (bias != nullptr) y = y + *bias;
  return y;
}

// ---- tensor parallelism: K split over ranks (docs/exact_linear.md, "TP") ----------------------------------
//
// A row-parallel layer gives rank r the slice K_r of every x row and every weight row. The definition above
// needs the canonical forms of the FULL rows: a form computed from a slice has another E (another unit of
// the integers) and, where the full row spans more than kMaxExactRange bits, another rounding of V. The scan
// of a row is an order-free merge (row_scan_merge: max, min, or), so the full row's scan is the merge of its
// slices' scans. Stored as three int32 (emax, -lmin, bad) so ONE elementwise integer MAX (an all-reduce MAX)
// merges them: scans of x rows per call, of weight rows once per weight version (Sw, the max of the merged
// rows' S, is then the same on every rank).
// With the merged forms every rank packs the same digits for its slice, and its split accumulator (hi, lo)
// over K_r (the kernels' `combine`) is an exact integer partial: the unsplit op's (hi, lo) is the
// elementwise integer sum of the parts' (hi, lo), whatever the order. Bounds: a part over K_r elements has
// |hi| < 3 * 2^30 K_r and |lo| < 4 * 2^38 K_r (the lo bound uses the top digit's |D_0| <= 64, from |V| <
// 2^(8S-2); with |D| <= 128 in every digit it would be ~4.05 * 2^38 K_r, still far inside int64 at K = 2^17),
// so the sum over any number of parts with sum K_r <= kMaxK is
// bounded as one part over K: it fits int64 (an int64 SUM all-reduce is exact and cannot overflow), and
// exact_epilogue_f32 on the sum gives the unsplit op's bits.
constexpr int kScanInts = 3;
ALIGNED_HD void row_scan_store(const RowScan& s, int32_t* out) {
  out[0] = s.emax;
  out[1] = -s.lmin;
  out[2] = s.bad ? 1 : 0;
}
ALIGNED_HD RowScan row_scan_load(const int32_t* in) { return RowScan{in[0], -in[1], in[2] != 0}; }

// ---- the fp64 path: the same exact sum in double arithmetic (CPU kernels: gemm_exact_kernels.cpp) -------
//
// The digit path above is one way to compute the exact sum P = sum_k x_k w_k of a row pair; where the sum
// provably fits a double, fp64 arithmetic computes the same P, hence the same bits. Per row v (x rows at each
// call, weight rows once per weight version: linear_exact_f64_bounds) an integer bound
//     b(v) = nb(v) - lsb(v)   with   ||v||_2 < 2^nb(v)                     (f64_row_bound below)
// and for a row pair the condition
//     b(x) + b(w) <= 53.                                                                          (B)
// Claim: if (B) holds, both rows are finite and both canonical forms are exact (E - lsb <= kMaxExactRange =
// 8 kMaxDigits - 3 = 29, so V_k 2^q == v_k and P is the definition's sum), then EVERY fp64 evaluation of P
// made of exact products and additions / FMAs — any lane split, any number of accumulators, any order or tree
// of the horizontal sums — returns P exactly, and one RNE conversion double -> fp32 is round_f32(P), the value
// the definition rounds (the epilogue after it — non-finite flag, bias add, rounding to T — is the digit
// path's).
// Proof. Let u = 2^(lsb(x) + lsb(w)). (1) Products: a bf16 (fp16, fp32) significand has at most 8 (11, 24)
// bits, so x_k w_k has at most 16 (22, 48) <= 53 significant bits: it is an exact double, and a multiple of u
// (each factor is a multiple of its row's lsb). (2) Every partial sum Q of any subset S of the K products (each
// addition or FMA of any evaluation order adds two partial sums of disjoint subsets, or a product to one)
// is, if all operations before it were exact, an integer multiple n u with, by Cauchy-Schwarz,
// |Q| <= sum_S |x_k w_k| <= ||x||_2 ||w||_2 < 2^(nb(x) + nb(w)), so |n| < 2^(b(x) + b(w)) <= 2^53 by (B).
// (3) An integer multiple n u with |n| <= 2^53 is a double: n fits the 53-bit significand, and u >= 2^-298
// (the fp32 / bf16 lowest bit is 2^-149, fp16's 2^-24) is far above the double subnormal range (2^-1074),
// |Q| < 2^(2 * 129 + 17) far below overflow. A correctly rounded operation whose exact result is representable
// returns it (an FMA rounds a*b + c once), so by induction every operation is exact. (4) Subnormal inputs:
// bf16 / fp16 / fp32 subnormals are exact doubles (cvtps2pd is exact unless DAZ is set — the CPU glue runs
// every task of the exact linear with the IEEE MXCSR: no FTZ / DAZ, round to nearest even); a subnormal fp32
// result of the final conversion is kept (no FTZ), as round_i128_f32 keeps it. (5) Signed zero: the
// definition gives +0 for an exact zero sum (round_split_f32(0, 0, q) = (float)(+0.0 * 2^q) = +0;
// round_i128_f32(0) = +0), whatever the signs of the zero products. In the fp64 path every accumulator starts
// at +0.0, and under round-to-nearest x + y is -0 only when both are -0 (an exact cancellation x + (-x) is
// +0), so by induction no accumulator, lane or horizontal sum is ever -0: an exact zero sum gives +0, and a
// nonzero P rounds with its own sign (an fp32 underflow to zero keeps the sign, as round_i128_f32 does).
// (6) Non-finite: a row of x holding NaN / inf takes the digit path (its outputs are NaN by the definition);
// a weight row holding NaN / inf makes its output column NaN in both paths (the fp64 kernel's value is
// overridden by the flag). (7) A zero row (no finite nonzero element) makes P = +0 whatever the other row:
// b = kF64Zero makes (B) hold. A row whose canonical form rounds (range > 29) gets b = kF64Never: (B) fails
// for every partner that is not zero, and the digit path computes it.
// nb is computed in integers (order-free, so a pure function of the row): with e_k = floor(log2 |v_k|) and
// E = max e_k, ||v||^2 < sum_k 4^(e_k + 1) <= 4^(E + 1 - kNormBins) I, I = sum_k (d_k <= kNormBins ?
// 4^(kNormBins - d_k) : 1), d_k = E - e_k (an integer < 2^57 for K <= 2^17), so nb = E + 1 - kNormBins +
// ceil(ceil_log2(I) / 2). The bound is tight for rows of equal magnitudes (Cauchy-Schwarz is then an
// equality): tests/ops/test_linear_exact_f64.py builds a pair AT (B), which the fp64 path computes, and one
// bit past it, whose exact sum needs 54 bits (the fp64 sum is inexact: it must, and does, take the digit
// path). Typical rows: a Gaussian bf16 row of 1536 has ||v|| ~ 2^5.3 sigma and lsb ~ 2^-17 sigma, b ~ 24, so
// (B) holds with ~5 bits to spare; a weight row holding one element 2^-20 below its max fails (B) and its
// output column takes the digit path.
constexpr int kMaxExactRange = 8 * kMaxDigits - 3;  // a row's E - lsb for which its canonical form is exact
constexpr int kF64Bits = 53;
constexpr int kF64Never = 1 << 20;    // b of a row whose canonical form rounds
constexpr int kF64Zero = -(1 << 20);  // b of a row without finite nonzero elements
constexpr int kNormBins = 20;

ALIGNED_HD int ceil_log2_u64(uint64_t v) {  // v >= 1
  return v <= 1 ? 0 : 64 - clz64(v - 1);
}
// The norm term of element f (finite, nonzero) for a row of max exponent E.
ALIGNED_HD uint64_t f64_norm_term(int e, int E) {
  const int d = E - e;
  return d <= kNormBins ? (uint64_t)1 << (2 * (kNormBins - d)) : 1;
}
// b of a row from its scan (E = emax, lsb = lmin) and its norm sum I (over finite nonzero elements).
ALIGNED_HD int f64_row_bound(const RowScan& s, uint64_t I) {
  if (s.lmin == 100000) return kF64Zero;
  if (s.emax - s.lmin > kMaxExactRange) return kF64Never;
  const int nb = s.emax + 1 - kNormBins + (ceil_log2_u64(I) + 1) / 2;
  return nb - s.lmin;
}
// The scalar form (tests, generic rows): two passes over the row.
template <typename T>
ALIGNED_HD int f64_row_bound(const T* v, int64_t K, bool* bad) {
  RowScan s = row_scan_init();
  for (int64_t k = 0; k < K; ++k) row_scan_add(s, to_f32(v[k]));
  uint64_t I = 0;
  if (s.lmin != 100000)
    for (int64_t k = 0; k < K; ++k) {
      const float f = to_f32(v[k]);
      if (f != 0.0f && is_finite_bits(f)) I += f64_norm_term(ilog2_abs(f), s.emax);
    }
  *bad = s.bad;
  return f64_row_bound(s, I);
}
// (B) for a pair of finite rows.
ALIGNED_HD bool f64_sum_exact(int bx, int bw) { return (int64_t)bx + bw <= kF64Bits; }

// ---- the fp64 split route: a pair failing (B) whose x row splits into two halves that each meet it -------
//
// Most pairs failing (B) are rows a few bits too wide (b(x) + b(w) in 54..60 for Gaussian bf16 rows of a few
// thousand elements: one small element lowers a row's lsb). For such a pair with both canonical forms exact
// (b(x), b(w) != kF64Never), cut every element of x at the bit 2^tau:
//     hi_k = v_k truncated toward zero to a multiple of 2^tau,   lo_k = v_k - hi_k,
// both exact (each holds a subset of v_k's significand bits), so P = sum_k hi_k w_k + sum_k lo_k w_k = H + L.
// Bounds without another pass over the row (f64_split_bounds): hi is a multiple of 2^tau with |hi_k| <= |v_k|,
// so b(hi) <= nb(x) - tau; |lo_k| < 2^tau gives ||lo||_2 < 2^tau sqrt(K) <= 2^(tau + c), c = ceil(log2(K) / 2),
// and lo is a multiple of 2^lsb(x), so b(lo) <= tau + c - lsb(x). (The claim above needs only ||v|| < 2^nb and
// v a multiple of 2^lsb, so these upper bounds serve as b.) tau = ceil((nb + lsb - c) / 2) balances them. Where
// b(hi) + b(w) <= 53 and b(lo) + b(w) <= 53, the claim makes H and L the exact sums in any fp64 evaluation; P
// is then rounded to fp32 once from the pair (H, L) by round_f64_pair_f32 — the same value as round_f32(P),
// the definition's rounding (a plain RN32(H + L) would round twice: 1 + 2^-24 + 2^-58 would give 1). Pairs that still fail take the digit path.

// nb(v) and lsb(v) of a finite row from its scan and norm sum (the pieces of f64_row_bound; the row is not
// zero: s.lmin != 100000).
ALIGNED_HD int f64_row_nb(const RowScan& s, uint64_t I) { return s.emax + 1 - kNormBins + (ceil_log2_u64(I) + 1) / 2; }

// nb(v) and lsb(v) of a finite nonzero row (scalar; the glue's split route, only rows with pairs failing (B)).
template <typename T>
ALIGNED_HD void f64_row_nb_lsb(const T* v, int64_t K, int* nb, int* lsb) {
  RowScan s = row_scan_init();
  for (int64_t k = 0; k < K; ++k) row_scan_add(s, to_f32(v[k]));
  uint64_t I = 0;
  for (int64_t k = 0; k < K; ++k) {
    const float f = to_f32(v[k]);
    if (f != 0.0f && is_finite_bits(f)) I += f64_norm_term(ilog2_abs(f), s.emax);
  }
  *nb = f64_row_nb(s, I);
  *lsb = s.lmin;
}

struct F64Split {
  int tau;   // the cut: hi = bits at or above 2^tau
  int b_hi;  // bound b of the hi half
  int b_lo;  // bound b of the lo half
};
ALIGNED_HD F64Split f64_split_bounds(int nb, int lsb, int64_t K) {
  const int c = (ceil_log2_u64((uint64_t)(K < 1 ? 1 : K)) + 1) / 2;  // ceil(log2(K) / 2) >= log2 sqrt(K)
  const int t2 = nb + lsb - c;
  const int tau = t2 >= 0 ? (t2 + 1) / 2 : -((-t2) / 2);  // ceil(t2 / 2)
  return F64Split{tau, nb - tau, tau + c - lsb};
}

// P = h + l exactly (h, l: the split route's two exact fp64 sums) rounded to fp32 once: round to odd, then to
// nearest even (sum_round_odd) — round_f32(P), the definition's rounding. An exact zero P gives +0 (h and l
// are never -0, see (5)); a nonzero P keeps its sign through both roundings, as round_i128_f32 does.
ALIGNED_HD float round_f64_pair_f32(double h, double l) { return (float)sum_round_odd(h, l); }

// A row whose canonical form rounds (E - lsb > 29), replaced in place by the values the definition sums,
// V_k 2^q (quantize with the row's own S = 4, as both the x packing and the weight packing — Sw = 4 once
// any row rounds — use). Each is representable in T: rounding v_k to the coarser grid 2^q keeps at most v_k's
// bits (or gives 0 or one grid step above v_k's lowest bit), and the row's max does not round (its bits
// reach down to 2^(E - 23) at worst, above 2^q = 2^(E - 29)). The fp64 path's claim then covers the row.
template <typename T>
inline void canonical_row(T* v, int64_t K) {
  const RowForm f = row_form(v, K);
  if (f.bad || f.zero) return;
  const int q = f.E + 3 - 8 * f.S;
  const uint64_t pb = (uint64_t)(q + 1023) << 52;  // 2^q, a normal double (q in [-190, 130])
  double p2;
  __builtin_memcpy(&p2, &pb, 8);
  for (int64_t k = 0; k < K; ++k) v[k] = from_f32<T>((float)((double)quantize(to_f32(v[k]), f.S, f.E) * p2));
}

// The two halves of a row cut at 2^tau, as doubles (exact: v * 2^-tau and back are exact scalings — |tau| is
// far below the double exponent range — and trunc is exact), zero padded from K to ldx.
template <typename T>
inline void f64_split_row(const T* v, int64_t K, int64_t ldx, int tau, double* hi, double* lo) {
  double down = 1.0, up = 1.0;  // 2^-tau and 2^tau, built by exact doublings / halvings
  for (int i = 0; i < (tau < 0 ? -tau : tau); ++i) {
    down = tau > 0 ? down * 0.5 : down * 2.0;
    up = tau > 0 ? up * 2.0 : up * 0.5;
  }
  for (int64_t k = 0; k < K; ++k) {
    const double x = (double)to_f32(v[k]);
    const double t = x * down;
    const double h = (t < 0 ? -__builtin_floor(-t) : __builtin_floor(t)) * up;  // toward zero
    hi[k] = h;
    lo[k] = x - h;
  }
  for (int64_t k = K; k < ldx; ++k) hi[k] = lo[k] = 0.0;
}


// The scalar definition: one output from the canonical integers (no digits), for tests and the generic path.
inline __int128 exact_dot_ref(const int32_t* X, const int32_t* W, int64_t K) {
  __int128 acc = 0;
  for (int64_t k = 0; k < K; ++k) acc += (__int128)((int64_t)X[k] * (int64_t)W[k]);
  return acc;
}

}  // namespace aligned::exact
