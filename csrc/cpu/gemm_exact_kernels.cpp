// gemm_exact_kernels.cpp — the CPU `exact` linear (contract: csrc/common/exact_linear.h), compiled once per
// ISA level like every *_kernels.cpp. Torch-free: raw pointers behind ExactGemmParams.
//
// Each output is an exact integer sum rounded once, so the levels may compute it any way that is exact:
//   generic   scalar int32 digit products;
//   avx2      vpmaddwd on sign-extended digits (int16 x int16 -> int32 pair sums, exact);
//   avx512    vpdpbusd (AVX512-VNNI, u8 x s8): the x digit is fed as d + 128 (one xor) and 128 * sum_k w is
//             subtracted, computed by the same instruction from a vector of ones (wrapping int32 arithmetic
//             is exact modulo 2^32 and the true sums fit); without VNNI the avx2 code;
//   amx       tdpbssd (AMX-INT8, s8 x s8 -> int32): 16x16 tiles, k in blocks of 64 (gemm_amx: its own loop,
//             digit pairs accumulated by level t + u in the tiles, see there).
// The vector levels produce C[t][u][16 rows][16 cols] = sum_k Dx_t * Dw_u (int32) for one 16-row tile and one
// 16-column panel; every path combines the digit pairs exactly into the same two int64 halves and rounds once
// (round_split_f32: a two-sum rounded to odd, or int128; the AVX-512 epilogue does the same double operations).
// No float arithmetic happens before that single rounding.
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "exact_kernels.h"

#ifndef ALIGNED_ISA
#error "ALIGNED_ISA must name the ISA level this translation unit is compiled for"
#endif

namespace aligned::cpu::ALIGNED_ISA {

namespace {

namespace ex = aligned::exact;
using aligned::bf16_t;
constexpr int kD = ex::kMaxDigits;
// C buffer for one tile: [t][u][16][16] int32
constexpr int kTileC = 16 * 16;

template <typename T>
void pack_x_typed(const T* x, int64_t K, int64_t Kp, int64_t plane, int maxd, int8_t* xd, int32_t* xe, int8_t* xs,
                  uint8_t* xbad, int64_t r0, int64_t r1, const int32_t* scans = nullptr) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* row = x + r * K;
    // scans given (TP): the forms of the full rows this slice belongs to (exact_linear.h, "tensor parallelism")
    const ex::RowForm f = scans ? ex::row_scan_form(ex::row_scan_load(scans + r * ex::kScanInts)) : ex::row_form(row, K);
    xe[r] = f.E;
    xs[r] = (int8_t)f.S;
    xbad[r] = f.bad;
    for (int t = 0; t < maxd; ++t) memset(xd + t * plane + r * Kp, 0, (size_t)Kp);
    if (f.zero) continue;
    int8_t* base = xd + r * Kp;
    for (int64_t k = 0; k < K; ++k) {
      const float v = to_f32(row[k]);
      if (!ex::is_finite_bits(v)) continue;
      ex::split_digits(ex::quantize(v, f.S, f.E), f.S, base + k, plane);
    }
  }
}

// bf16 rows (the common case) without the generic decomposition: a bf16 is (-1)^s m 2^(e - 134) with m the
// 8-bit significand (implicit bit included; e = 1 for subnormals, whose m has no implicit bit). The row max
// is the max of the 15 magnitude bits (monotonic), the lowest set bit comes from a ctz table. Same numbers
// as row_form / quantize / split_digits (tests compare the packed results of every level bit for bit).
void pack_x_bf16(const bf16_t* x, int64_t K, int64_t Kp, int64_t plane, int maxd, int8_t* xd, int32_t* xe,
                 int8_t* xs, uint8_t* xbad, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* row = (const uint16_t*)(x + r * K);
    uint16_t mag_max = 0;
    int lmin = 1 << 20;
    bool bad = false;
    for (int64_t k = 0; k < K; ++k) {
      const uint16_t mag = row[k] & 0x7fff;
      mag_max = mag > mag_max ? mag : mag_max;
      bad |= mag >= 0x7f80;
      if (mag != 0 && mag < 0x7f80) {
        const int be = mag >> 7, man = mag & 0x7f;
        const int m = be ? (man | 0x80) : man;
        const int l = (be ? be : 1) - 134 + __builtin_ctz((unsigned)m);
        lmin = l < lmin ? l : lmin;
      }
    }
    for (int t = 0; t < maxd; ++t) memset(xd + t * plane + r * Kp, 0, (size_t)Kp);
    xbad[r] = bad;
    if (lmin == (1 << 20)) {  // all zero (or all non-finite)
      xe[r] = 0;
      xs[r] = 1;
      continue;
    }
    // max over finite magnitudes only
    uint16_t fmax = 0;
    if (bad) {
      for (int64_t k = 0; k < K; ++k) {
        const uint16_t mag = row[k] & 0x7fff;
        if (mag < 0x7f80 && mag > fmax) fmax = mag;
      }
    } else {
      fmax = mag_max;
    }
    const int bmax = fmax >> 7;
    const int E = bmax ? bmax - 127 : ex::ilog2_abs(to_f32(bf16_t{fmax}));
    int S = (E - lmin + 3 + 7) / 8;
    S = S < 1 ? 1 : (S > kD ? kD : S);
    xe[r] = E;
    xs[r] = (int8_t)S;
    const int base_sh = 8 * S - 3 - E;
    int8_t* out = xd + r * Kp;
    for (int64_t k = 0; k < K; ++k) {
      const uint16_t b = row[k], mag = b & 0x7fff;
      if (mag == 0 || mag >= 0x7f80) continue;
      const int be = mag >> 7, man = mag & 0x7f;
      const int64_t m = be ? (man | 0x80) : man;
      const int sh = (be ? be : 1) - 134 + base_sh;
      int64_t v;
      if (sh >= 0) {
        v = m << sh;
      } else {
        const int s = -sh;
        if (s > 40) {
          v = 0;
        } else {
          int64_t q = m >> s;
          const int64_t rem = m - (q << s), half = (int64_t)1 << (s - 1);
          if (rem > half || (rem == half && (q & 1))) ++q;
          v = q;
        }
      }
      ex::split_digits((int32_t)((b & 0x8000) ? -v : v), S, out + k, plane);
    }
  }
}

void pack_x(DType dt, const void* x, int64_t K, int64_t Kp, int64_t plane, int maxd, int8_t* xd, int32_t* xe,
            int8_t* xs, uint8_t* xbad, int64_t r0, int64_t r1) {
  if (dt == DType::BF16) return pack_x_bf16((const bf16_t*)x, K, Kp, plane, maxd, xd, xe, xs, xbad, r0, r1);
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    pack_x_typed((const T*)x, K, Kp, plane, maxd, xd, xe, xs, xbad, r0, r1);
  });
}

// TP: rows [r0, r1) of x packed against the given scans of their full rows (generic decomposition; the same
// numbers as pack_x for the same forms).
void pack_x_scanned(DType dt, const void* x, int64_t K, int64_t Kp, int64_t plane, int maxd, const int32_t* scans,
                    int8_t* xd, int32_t* xe, int8_t* xs, uint8_t* xbad, int64_t r0, int64_t r1) {
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    pack_x_typed((const T*)x, K, Kp, plane, maxd, xd, xe, xs, xbad, r0, r1, scans);
  });
}

// The scan (emax, -lmin, bad) of rows [r0, r1) of v [., K] (exact_linear.h, row_scan_store).
void row_scans(DType dt, const void* v, int64_t K, int32_t* scans, int64_t r0, int64_t r1) {
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = (const T*)v + r * K;
      ex::RowScan sc = ex::row_scan_init();
      for (int64_t k = 0; k < K; ++k) ex::row_scan_add(sc, to_f32(row[k]));
      ex::row_scan_store(sc, scans + r * ex::kScanInts);
    }
  });
}

void w_forms(DType dt, const void* w, int64_t K, ex::RowForm* forms, int64_t r0, int64_t r1) {
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = r0; r < r1; ++r) forms[r] = ex::row_form((const T*)w + r * K, K);
  });
}

void pack_w(DType dt, const void* w, int64_t K, int64_t Kp, int64_t plane, int sw, const ex::RowForm* forms,
            int8_t* wd, int32_t* we, uint8_t* wbad, int64_t r0, int64_t r1) {
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t n = r0; n < r1; ++n) {
      const T* row = (const T*)w + n * K;
      const ex::RowForm& f = forms[n];
      we[n] = f.E;
      wbad[n] = f.bad;
      if (f.zero) continue;
      // element (n, k) of digit plane u sits at panel n/16, quad k/4, column n%16, byte k%4
      int8_t* base = wd + (n / 16) * (Kp * 16) + (n % 16) * 4;
      for (int64_t k = 0; k < K; ++k) {
        const float v = to_f32(row[k]);
        if (!ex::is_finite_bits(v)) continue;
        ex::split_digits(ex::quantize(v, sw, f.E), sw, base + (k / 4) * 64 + (k % 4), plane);
      }
    }
  });
}

// ---- digit-pair products for one 16-row tile x one 16-column panel, k blocks [kb0, kb1) of 64 -----------
// C[(t * sw + u) * 256 + r * 16 + j] = sum_k xd[t][m0 + r][k] * wd[u][panel][k][j]
void pairs_generic(const ExactGemmParams& p, int64_t m0, int64_t panel, int sxt, int64_t kb0, int64_t kb1,
                   int32_t* C) {
  const int sw = p.w_digits;
  for (int t = 0; t < sxt; ++t)
    for (int u = 0; u < sw; ++u) {
      int32_t* c = C + (t * sw + u) * kTileC;
      const int8_t* wp = p.wd + u * p.w_plane + panel * (p.Kp * 16);
      for (int r = 0; r < 16; ++r) {
        const int8_t* xr = p.xd + t * p.x_plane + (m0 + r) * p.Kp;
        int32_t acc[16] = {0};
        for (int64_t q = kb0 * 16; q < kb1 * 16; ++q) {
          const int8_t* wq = wp + q * 64;
          for (int j = 0; j < 16; ++j)
            for (int i = 0; i < 4; ++i) acc[j] += (int32_t)xr[4 * q + i] * (int32_t)wq[4 * j + i];
        }
        memcpy(c + r * 16, acc, sizeof(acc));
      }
    }
}

#if defined(__AVX2__)
// vpmaddwd: 4 columns x 4 k per 16-byte slice of the quad, widened to int16; x's 4 k broadcast as int16.
void pairs_avx2(const ExactGemmParams& p, int64_t m0, int64_t panel, int sxt, int64_t kb0, int64_t kb1, int32_t* C) {
  const int sw = p.w_digits;
  for (int t = 0; t < sxt; ++t)
    for (int u = 0; u < sw; ++u) {
      int32_t* c = C + (t * sw + u) * kTileC;
      const int8_t* wp = p.wd + u * p.w_plane + panel * (p.Kp * 16);
      for (int r0 = 0; r0 < 16; r0 += 2) {
        __m256i acc[2][4];
        for (int a = 0; a < 2; ++a)
          for (int s = 0; s < 4; ++s) acc[a][s] = _mm256_setzero_si256();
        const int8_t* xr0 = p.xd + t * p.x_plane + (m0 + r0) * p.Kp;
        const int8_t* xr1 = xr0 + p.Kp;
        for (int64_t q = kb0 * 16; q < kb1 * 16; ++q) {
          const int8_t* wq = wp + q * 64;
          __m256i wv[4];
          for (int s = 0; s < 4; ++s) wv[s] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wq + 16 * s)));
          int32_t x0, x1;
          memcpy(&x0, xr0 + 4 * q, 4);
          memcpy(&x1, xr1 + 4 * q, 4);
          const __m256i xv0 = _mm256_broadcastq_epi64(_mm_cvtepi8_epi16(_mm_cvtsi32_si128(x0)));
          const __m256i xv1 = _mm256_broadcastq_epi64(_mm_cvtepi8_epi16(_mm_cvtsi32_si128(x1)));
          for (int s = 0; s < 4; ++s) {
            acc[0][s] = _mm256_add_epi32(acc[0][s], _mm256_madd_epi16(xv0, wv[s]));
            acc[1][s] = _mm256_add_epi32(acc[1][s], _mm256_madd_epi16(xv1, wv[s]));
          }
        }
        // acc[a][s] lanes: column 4s + l/2, half l%2 -> add the two halves
        for (int a = 0; a < 2; ++a)
          for (int s = 0; s < 4; ++s) {
            alignas(32) int32_t v[8];
            _mm256_store_si256((__m256i*)v, acc[a][s]);
            for (int l = 0; l < 4; ++l) c[(r0 + a) * 16 + 4 * s + l] = v[2 * l] + v[2 * l + 1];
          }
      }
    }
}
#endif

// TP (params.partial set): the tile's split accumulators, unrounded, instead of the epilogue.
void store_partial(const ExactGemmParams& p, int64_t m0, int64_t panel, const int64_t* hi, const int64_t* lo) {
  const int64_t nb = panel * 16;
  const int64_t rows = std::min<int64_t>(16, p.M - m0), cols = std::min<int64_t>(16, p.N - nb);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      int64_t* o = p.partial + ((m0 + r) * p.N + nb + j) * 2;
      o[0] = hi[r * 16 + j];
      o[1] = lo[r * 16 + j];
    }
}

#if defined(__AVX512F__)
__attribute__((target("avx512vnni"))) void pairs_vnni(const ExactGemmParams& p, int64_t m0, int64_t panel,
                                                      int sxt, int64_t kb0, int64_t kb1, int32_t* C) {
  const int sw = p.w_digits;
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i flip = _mm512_set1_epi32((int)0x80808080u);
  int rows = (int)std::min<int64_t>(16, p.M - m0);
  for (int t = 0; t < sxt; ++t)
    for (int u = 0; u < sw; ++u) {
      int32_t* c = C + (t * sw + u) * kTileC;
      const int8_t* wp = p.wd + u * p.w_plane + panel * (p.Kp * 16);
      for (int r0 = 0; r0 < rows; r0 += 8) {
        const int nr = std::min(8, rows - r0);
        __m512i acc[8], ws = _mm512_setzero_si512();
        for (int a = 0; a < 8; ++a) acc[a] = _mm512_setzero_si512();
        const int8_t* xr = p.xd + t * p.x_plane + (m0 + r0) * p.Kp;
        for (int64_t q = kb0 * 16; q < kb1 * 16; ++q) {
          const __m512i w = _mm512_loadu_si512((const void*)(wp + q * 64));
          ws = _mm512_dpbusd_epi32(ws, ones, w);
#pragma GCC unroll 8
          for (int a = 0; a < 8; ++a) {
            if (a < nr) {
              int32_t xv;
              memcpy(&xv, xr + a * p.Kp + 4 * q, 4);
              acc[a] = _mm512_dpbusd_epi32(acc[a], _mm512_xor_si512(_mm512_set1_epi32(xv), flip), w);
            }
          }
        }
        const __m512i corr = _mm512_slli_epi32(ws, 7);
        for (int a = 0; a < nr; ++a) _mm512_storeu_si512((void*)(c + (r0 + a) * 16), _mm512_sub_epi32(acc[a], corr));
      }
      for (int r = rows; r < 16; ++r) memset(c + r * 16, 0, 64);
    }
}

// AMX-INT8 (gemm_amx below). Tile configuration: 0..2 = C (three digit levels), 4, 5 = A (two x digits of
// one 16-row tile, `rows` rows), 6, 7 = B (two weight digits of one 16-column panel, 16 quads of k x 16 cols).
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Loaded at the start of every gemm call (and when a tail tile has fewer rows) and released at its end:
// other libraries on the same thread (oneDNN) load their own configuration and release the tiles, so a
// configuration cannot be cached across calls.
__attribute__((target("amx-tile,amx-int8"))) void amx_release() { _tile_release(); }

__attribute__((target("amx-tile,amx-int8"))) void amx_config(int rows) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = (uint8_t)(i < 6 ? rows : 16);  // C and A: the tile's live rows; B: 16 quads of k
  }
  // GCC 12 does not model ldtilecfg's read of `cfg`: once inlined, the stores above can be deleted as dead (seen in
  // gemm_amx_mma_kernels.cpp: SIGILL at the first tile instruction). The asm makes the configuration escape.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// round_split_f32 for 8 lanes (hi, lo as int64, q per lane): the same double operations as the scalar
// fast path (int64 -> double exact below 2^53, a two-sum, round to odd by a step of the last bit, an exact
// power-of-two scaling, one RNE conversion to fp32), so the same bits. Returns false (and writes nothing)
// when a lane is outside the fast path: the caller then uses the scalar function for those 8 outputs.
inline bool round_split8(const int64_t* hi, const int64_t* lo, __m512i q, float* out) {
  const __m512i lim = _mm512_set1_epi64((int64_t)1 << 53), nlim = _mm512_set1_epi64(-((int64_t)1 << 53));
  const __m512i h = _mm512_loadu_si512((const void*)hi), l = _mm512_loadu_si512((const void*)lo);
  __mmask8 ok = _mm512_cmpgt_epi64_mask(h, nlim) & _mm512_cmplt_epi64_mask(h, lim) &
                _mm512_cmpgt_epi64_mask(l, nlim) & _mm512_cmplt_epi64_mask(l, lim) &
                _mm512_cmpgt_epi64_mask(q, _mm512_set1_epi64(-900)) & _mm512_cmplt_epi64_mask(q, _mm512_set1_epi64(900));
  if (ok != 0xff) return false;
  const __m512d a = _mm512_mul_pd(_mm512_cvtepi64_pd(h), _mm512_set1_pd(4294967296.0));
  const __m512d b = _mm512_cvtepi64_pd(l);
  const __m512d s = _mm512_add_pd(a, b);
  const __m512d bb = _mm512_sub_pd(s, a);
  const __m512d err = _mm512_add_pd(_mm512_sub_pd(a, _mm512_sub_pd(s, bb)), _mm512_sub_pd(b, bb));
  const __m512d zero = _mm512_setzero_pd();
  __m512i u = _mm512_castpd_si512(s);
  const __mmask8 fix = _mm512_cmp_pd_mask(err, zero, _CMP_NEQ_OQ) & _mm512_testn_epi64_mask(u, _mm512_set1_epi64(1));
  const __mmask8 away = (__mmask8)~(_mm512_cmp_pd_mask(err, zero, _CMP_GT_OQ) ^ _mm512_cmp_pd_mask(s, zero, _CMP_GT_OQ));
  const __m512i one = _mm512_set1_epi64(1);
  u = _mm512_mask_add_epi64(u, fix & away, u, one);
  u = _mm512_mask_sub_epi64(u, fix & (__mmask8)~away, u, one);
  // q1 = q / 2 truncated (as the scalar code), q2 = q - q1; 2^q1, 2^q2 built from their exponent fields
  const __m512i q1 = _mm512_srai_epi64(_mm512_add_epi64(q, _mm512_srli_epi64(q, 63)), 1);
  const __m512i q2 = _mm512_sub_epi64(q, q1);
  const __m512i bias = _mm512_set1_epi64(1023);
  const __m512d f1 = _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_add_epi64(q1, bias), 52));
  const __m512d f2 = _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_add_epi64(q2, bias), 52));
  const __m512d r = _mm512_mul_pd(_mm512_mul_pd(_mm512_castsi512_pd(u), f1), f2);
  _mm256_storeu_ps(out, _mm512_cvtpd_ps(r));
  return true;
}

// The AVX-512 form of `epilogue` (same bits: the rounding above, then the scalar non-finite / bias / dtype
// steps of the scalar epilogue).
template <typename T>
void epilogue_avx512(const ExactGemmParams& p, int64_t m0, int64_t panel, const int64_t* hi, const int64_t* lo) {
  const int64_t nb = panel * 16;
  const int64_t rows = std::min<int64_t>(16, p.M - m0), cols = std::min<int64_t>(16, p.N - nb);
  T* out = (T*)p.out;
  const T* bias = (const T*)p.bias;
  alignas(64) int32_t wexp[16];
  for (int j = 0; j < 16; ++j) wexp[j] = j < cols ? p.w_exp[nb + j] : 0;
  const __m512i we0 = _mm512_cvtepi32_epi64(_mm256_load_si256((const __m256i*)wexp));
  const __m512i we1 = _mm512_cvtepi32_epi64(_mm256_load_si256((const __m256i*)(wexp + 8)));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    alignas(64) float y[16];
    const __m512i qx = _mm512_set1_epi64((int64_t)p.x_exp[m] - 10 - 8 * ex::kCombineTop);
    for (int h = 0; h < 2; ++h) {
      if (!round_split8(hi + r * 16 + 8 * h, lo + r * 16 + 8 * h, _mm512_add_epi64(qx, h ? we1 : we0), y + 8 * h))
        for (int j = 8 * h; j < 8 * h + 8 && j < cols; ++j)
          y[j] = ex::round_split_f32(hi[r * 16 + j], lo[r * 16 + j], ex::combine_q(p.x_exp[m], p.w_exp[nb + j]));
    }
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t n = nb + j;
      float v = (p.x_bad[m] || p.w_bad[n]) ? float_of(0x7fc00000u) : y[j];
      if (bias) v = v + to_f32(bias[n]);
      out[m * p.N + n] = from_f32<T>(v);
    }
  }
}

// Adds three int32 level tiles (levels s0, s0 + 1, s0 + 2) into the split accumulator, as `combine`.
void add_levels(const int32_t* L, int s0, int top, int64_t* hi, int64_t* lo) {
  for (int d = 0; d < 3; ++d) {
    const int s = s0 + d;
    if (s > top) break;
    const int32_t* c = L + d * kTileC;
    int64_t* acc = s <= 2 ? hi : lo;
    const int sh = s <= 2 ? 8 * (2 - s) : 8 * (6 - s);
    for (int i = 0; i < kTileC; i += 16) {
      const __m512i v = _mm512_loadu_si512((const void*)(c + i));
      const __m512i v0 = _mm512_slli_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(v)), sh);
      const __m512i v1 = _mm512_slli_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1)), sh);
      _mm512_storeu_si512((void*)(acc + i), _mm512_add_epi64(_mm512_loadu_si512((const void*)(acc + i)), v0));
      _mm512_storeu_si512((void*)(acc + i + 8), _mm512_add_epi64(_mm512_loadu_si512((const void*)(acc + i + 8)), v1));
    }
  }
}

// The AMX-INT8 gemm over the call's whole range: tiles configured once, then for each 16-column panel, for
// each 16-row tile (the panel's weight digits stay in L2 while the row tiles pass), for each chunk of k:
// digit pairs (t, u) are taken in 2x2 blocks (x digits t0, t0+1 in A tiles 4, 5; weight digits u0, u0+1 in
// B tiles 6, 7) and accumulated by LEVEL s = t + u, not by pair: C tile 0 += level s0 = t0 + u0, tile 1 +=
// s0 + 1 (two pairs), tile 2 += s0 + 2, and every block with the same s0 (t0, u0 even) adds into the same
// three tiles, k outermost so each k block's A and B bytes are loaded while hot. Bound: a level holds at most
// min(Sx, Sw) <= 4 pairs, each |sum| <= 2^14 per k, so a chunk of at most 16384 k keeps |C| <= 2^30 (int32
// exact); chunks add into the int64 split accumulator (the same integers as `combine`: the sum is exact).
__attribute__((target("amx-tile,amx-int8"))) void gemm_amx(const ExactGemmParams& p) {
  const int sw = p.w_digits;
  const int64_t nkb = p.Kp / 64;
  const int parts = std::max(1, std::min<int>(p.k_parts, (int)std::max<int64_t>(1, nkb)));
  constexpr int64_t kChunkKb = 256;  // 16384 k (the int32 bound above)
  constexpr int kPfKb = 2;           // software prefetch distance of the weight stream, in k blocks
  const int64_t astride = p.Kp;
  alignas(64) int32_t L[3 * kTileC];
  alignas(64) int64_t hi[kTileC], lo[kTileC];
  int cfg_rows = 0;
  for (int64_t nb = p.n0; nb < p.n1; nb += 16) {
    const int64_t panel = nb / 16;
    const int8_t* wpan = p.wd + panel * (p.Kp * 16);
    for (int64_t m0 = p.m0; m0 < p.m1; m0 += 16) {
      const int rows = (int)std::min<int64_t>(16, p.M - m0);
      if (rows != cfg_rows) {
        amx_config(rows);
        cfg_rows = rows;
      }
      int sxt = 1;
      for (int64_t m = m0; m < m0 + rows; ++m) sxt = std::max<int>(sxt, p.x_digits[m]);
      const int top = sxt - 1 + sw - 1;
      // the first row tile of a panel streams its weight digits from L3 / memory (measured: M = 1 is
      // bound by that stream); later row tiles find them in L2
      const bool first_tile = m0 == p.m0;
      memset(hi, 0, sizeof(hi));
      memset(lo, 0, sizeof(lo));
      const int8_t* xrow = p.xd + m0 * p.Kp;
      for (int part = 0; part < parts; ++part) {
        const int64_t pk0 = nkb * part / parts, pk1 = nkb * (part + 1) / parts;
        for (int64_t c0 = pk0; c0 < pk1; c0 += kChunkKb) {
          const int64_t c1 = std::min(pk1, c0 + kChunkKb);
          for (int s0 = 0; s0 <= top; s0 += 2) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            for (int64_t kb = c0; kb < c1; ++kb) {
              const bool prefetch = first_tile && kb + kPfKb < c1;
              for (int t0 = 0; t0 < sxt; t0 += 2) {
                const int u0 = s0 - t0;
                if (u0 < 0) break;
                if (u0 >= sw) continue;
                const bool t2 = t0 + 1 < sxt, u2 = u0 + 1 < sw;
                const int8_t* a0 = xrow + t0 * p.x_plane + kb * 64;
                const int8_t* b0 = wpan + u0 * p.w_plane + kb * 1024;
                if (prefetch) {  // the weight digits PF k blocks ahead (the stream from L3 / memory)
                  const int8_t* pb = b0 + kPfKb * 1024;
                  for (int l = 0; l < 16; ++l) _mm_prefetch((const char*)(pb + 64 * l), _MM_HINT_T0);
                  if (u2)
                    for (int l = 0; l < 16; ++l) _mm_prefetch((const char*)(pb + p.w_plane + 64 * l), _MM_HINT_T0);
                }
                _tile_loadd(4, a0, astride);
                _tile_loadd(6, b0, 64);
                _tile_dpbssd(0, 4, 6);
                if (u2) {
                  _tile_loadd(7, b0 + p.w_plane, 64);
                  _tile_dpbssd(1, 4, 7);
                }
                if (t2) {
                  _tile_loadd(5, a0 + p.x_plane, astride);
                  if (u2) _tile_dpbssd(2, 5, 7);
                  _tile_dpbssd(1, 5, 6);
                }
              }
            }
            _tile_stored(0, L, 64);
            _tile_stored(1, L + kTileC, 64);
            _tile_stored(2, L + 2 * kTileC, 64);
            if (rows < 16)  // rows past the tile's live rows were not written
              for (int d = 0; d < 3; ++d) memset(L + d * kTileC + rows * 16, 0, (size_t)(16 - rows) * 64);
            add_levels(L, s0, top, hi, lo);
          }
        }
      }
      if (p.partial) {
        store_partial(p, m0, panel, hi, lo);
        continue;
      }
      with_type(p.dt, [&](auto* tp) {
        using T = std::remove_pointer_t<decltype(tp)>;
        epilogue_avx512<T>(p, m0, panel, hi, lo);
      });
    }
  }
  amx_release();
}
#endif

void pairs_best(const ExactGemmParams& p, int64_t m0, int64_t panel, int sxt, int64_t kb0, int64_t kb1, int32_t* C) {
#if defined(__AVX512F__)
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  if (vnni) return pairs_vnni(p, m0, panel, sxt, kb0, kb1, C);
#endif
#if defined(__AVX2__)
  return pairs_avx2(p, m0, panel, sxt, kb0, kb1, C);
#else
  return pairs_generic(p, m0, panel, sxt, kb0, kb1, C);
#endif
}

// Epilogue: out[m, n] = round_T(round_f32(sum_tu C_tu 2^(8 (6 - t - u)) * 2^q) (+ bias)).
template <typename T>
void epilogue(const ExactGemmParams& p, int64_t m0, int64_t panel, int sxt, const int64_t* hi, const int64_t* lo) {
  const int64_t nb = panel * 16;
  const int64_t rows = std::min<int64_t>(16, p.M - m0), cols = std::min<int64_t>(16, p.N - nb);
  T* out = (T*)p.out;
  const T* bias = (const T*)p.bias;
  (void)sxt;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t n = nb + j;
      const float b = bias ? to_f32(bias[n]) : 0.0f;
      const float y = ex::exact_epilogue_f32(hi[r * 16 + j], lo[r * 16 + j], p.x_exp[m], p.w_exp[n],
                                             p.x_bad[m] || p.w_bad[n], bias ? &b : nullptr);
      out[m * p.N + n] = from_f32<T>(y);
    }
  }
}

// Adds the digit pairs of C into the split accumulator: level s = t + u weighs 2^(8 (6 - s)); levels 0..2
// go to hi (units of 2^32), levels 3..6 to lo. Digits past a row's S are zero, so rows mix freely. Bounds:
// |C| <= 2^14 k per part (gemm cuts K into parts of at most kMaxPartKb blocks, so |C| <= 2^30 is exact in
// int32), so |hi| < 3 * 2^30 K and |lo| < 4 * 2^38 K fit int64 for K <= 2^17.
void combine(const ExactGemmParams& p, int sxt, const int32_t* C, int64_t* hi, int64_t* lo) {
  const int sw = p.w_digits;
  for (int t = 0; t < sxt; ++t)
    for (int u = 0; u < sw; ++u) {
      const int s = t + u;
      const int32_t* c = C + (t * sw + u) * kTileC;
      if (s <= 2) {
        const int sh = 8 * (2 - s);
        for (int i = 0; i < kTileC; ++i) hi[i] += (int64_t)c[i] << sh;
      } else {
        const int sh = 8 * (6 - s);
        for (int i = 0; i < kTileC; ++i) lo[i] += (int64_t)c[i] << sh;
      }
    }
}

void gemm(const ExactGemmParams& p) {
#if defined(__AVX512F__)
  if (p.use_amx) return gemm_amx(p);
#endif
  const int64_t nkb = p.Kp / 64;
  // A part's digit sums are int32: |C| <= 2^14 per k (a -128 x -128 pair), so a part holds at most 2^16 k
  // (|C| <= 2^30). One part of K = 2^17 = kMaxK would reach 2^31 (rows whose digits are all -128 wrapped
  // to -2^31). Parts add exactly into the int64 accumulator, so the bits do not depend on the cut.
  constexpr int64_t kMaxPartKb = 1024;  // 65536 k
  const int parts = std::max<int>((int)((nkb + kMaxPartKb - 1) / kMaxPartKb),
                                  std::max(1, std::min<int>(p.k_parts, (int)std::max<int64_t>(1, nkb))));
  alignas(64) int32_t C[kD * kD * kTileC];
  alignas(64) int64_t hi[kTileC], lo[kTileC];
  for (int64_t m0 = p.m0; m0 < p.m1; m0 += 16) {
    int sxt = 1;
    for (int64_t m = m0; m < std::min<int64_t>(m0 + 16, p.M); ++m) sxt = std::max<int>(sxt, p.x_digits[m]);
    for (int64_t nb = p.n0; nb < p.n1; nb += 16) {
      const int64_t panel = nb / 16;
      for (int i = 0; i < kTileC; ++i) hi[i] = lo[i] = 0;
      for (int part = 0; part < parts; ++part) {
        const int64_t kb0 = nkb * part / parts, kb1 = nkb * (part + 1) / parts;
        pairs_best(p, m0, panel, sxt, kb0, kb1, C);
        combine(p, sxt, C, hi, lo);
      }
      if (p.partial) {
        store_partial(p, m0, panel, hi, lo);
        continue;
      }
      with_type(p.dt, [&](auto* tp) {
        using T = std::remove_pointer_t<decltype(tp)>;
#if defined(__AVX512F__)
        epilogue_avx512<T>(p, m0, panel, hi, lo);
#else
        epilogue<T>(p, m0, panel, sxt, hi, lo);
#endif
      });
    }
  }
}

// ---- the fp64 path (exact_linear.h, "the fp64 path": for row pairs meeting bound (B) every fp64 sum of the
// exact products is exact, so this computes the digit path's numbers) ------------------------------------
// Rows of x arrive as doubles (x64, rows padded to ldx = 8 ceil(K/8) with zeros); the weight is read in its
// own dtype [N, K] (2 bytes per element for bf16 / fp16) and converted on the fly (bf16 -> fp32 -> fp64 and
// fp16 -> fp32 -> fp64 are exact). A tile of RM rows x CN columns keeps RM * CN accumulators of W lanes
// (FMAs: each one exact); lanes are summed in a fixed order (any order is exact), the k tail (< 8) is added
// scalar, then one RNE conversion to fp32 and the digit path's epilogue (non-finite flag, bias, dtype).

// b of each row [r0, r1) (exact_linear.h, f64_row_bound) and its NaN / inf flag.
void row_bounds(DType dt, const void* v, int64_t K, int32_t* bound, uint8_t* bad, int64_t r0, int64_t r1) {
  if (dt == DType::BF16) {  // the bf16 bit tricks of pack_x_bf16: exponents and lowest bits from the bits
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* row = (const uint16_t*)v + r * K;
      ex::RowScan sc = ex::row_scan_init();
      uint16_t fmax = 0;
      for (int64_t k = 0; k < K; ++k) {
        const uint16_t mag = row[k] & 0x7fff;
        if (mag >= 0x7f80) {
          sc.bad = true;
          continue;
        }
        if (mag == 0) continue;
        fmax = mag > fmax ? mag : fmax;
        const int be = mag >> 7, man = mag & 0x7f;
        const int m = be ? (man | 0x80) : man;
        const int l = (be ? be : 1) - 134 + __builtin_ctz((unsigned)m);
        sc.lmin = l < sc.lmin ? l : sc.lmin;
      }
      bad[r] = sc.bad;
      uint64_t I = 0;
      if (fmax != 0) {
        sc.emax = ex::ilog2_abs(to_f32(bf16_t{fmax}));
        for (int64_t k = 0; k < K; ++k) {
          const uint16_t mag = row[k] & 0x7fff;
          if (mag == 0 || mag >= 0x7f80) continue;
          const int be = mag >> 7;
          const int e = be ? be - 127 : -133 + 31 - __builtin_clz((unsigned)(mag & 0x7f));
          I += ex::f64_norm_term(e, sc.emax);
        }
      }
      bound[r] = ex::f64_row_bound(sc, I);
    }
    return;
  }
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = r0; r < r1; ++r) {
      bool b = false;
      bound[r] = ex::f64_row_bound((const T*)v + r * K, K, &b);
      bad[r] = b;
    }
  });
}

void f64_convert_rows(DType dt, const void* x, int64_t K, int64_t ldx, const int64_t* rows, double* x64, int64_t i0,
                      int64_t i1) {
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t i = i0; i < i1; ++i) {
      const T* row = (const T*)x + rows[i] * K;
      double* o = x64 + i * ldx;
      for (int64_t k = 0; k < K; ++k) o[k] = (double)to_f32(row[k]);
      for (int64_t k = K; k < ldx; ++k) o[k] = 0.0;
    }
  });
}

// The lane type of this level: W doubles, an exact fused multiply-add, a fixed-order lane sum, and loads of 8
// consecutive weight elements converted exactly to W-lane groups (8 / W registers).
#if defined(__AVX512F__)
struct F64Lanes {
  using R = __m512d;
  static constexpr int W = 8;
  static R zero() { return _mm512_setzero_pd(); }
  static R load(const double* p) { return _mm512_loadu_pd(p); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_pd(a, b, c); }
  static double sum(R v) {  // ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)): exact in any order
    const __m256d h = _mm256_add_pd(_mm512_castpd512_pd256(v), _mm512_extractf64x4_pd(v, 1));
    const __m128d q = _mm_add_pd(_mm256_castpd256_pd128(h), _mm256_extractf128_pd(h, 1));
    return _mm_cvtsd_f64(_mm_add_sd(q, _mm_unpackhi_pd(q, q)));
  }
  static void load8(const bf16_t* p, R* out) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    out[0] = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
  }
  static void load8(const f16_t* p, R* out) { out[0] = _mm512_cvtps_pd(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p))); }
  static void load8(const float* p, R* out) { out[0] = _mm512_cvtps_pd(_mm256_loadu_ps(p)); }
};
#elif defined(__AVX2__)
struct F64Lanes {
  using R = __m256d;
  static constexpr int W = 4;
  static R zero() { return _mm256_setzero_pd(); }
  static R load(const double* p) { return _mm256_loadu_pd(p); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_pd(a, b, c); }
  static double sum(R v) {
    const __m128d q = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(q, _mm_unpackhi_pd(q, q)));
  }
  static void load8(const bf16_t* p, R* out) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    const __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    out[0] = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
    out[1] = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
  }
  static void load8(const f16_t* p, R* out) {
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    out[0] = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
    out[1] = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
  }
  static void load8(const float* p, R* out) {
    out[0] = _mm256_cvtps_pd(_mm_loadu_ps(p));
    out[1] = _mm256_cvtps_pd(_mm_loadu_ps(p + 4));
  }
};
#else
struct F64Lanes {  // scalar: one lane; a * b + c is two exact operations (-ffp-contract=off: not fused)
  using R = double;
  static constexpr int W = 1;
  static R zero() { return 0.0; }
  static R load(const double* p) { return *p; }
  static R fma(R a, R b, R c) { return c + a * b; }
  static double sum(R v) { return v; }
  template <typename T>
  static void load8(const T* p, R* out) {
    for (int i = 0; i < 8; ++i) out[i] = (double)to_f32(p[i]);
  }
};
#endif

// sums[r * ls + c] += sum_{k in [k0, k1)} x64[r][k] * w[c][k] for RM rows and CN weight rows, exactly
// (k1 - k0 a multiple of 8 except at k1 == K; every partial sum is exact, so adding chunks is exact too).
template <typename T, int RM, int CN>
__attribute__((flatten)) void f64_tile(const double* const* xr, const T* const* wr, int64_t k0, int64_t k1, int64_t K,
                                       double* sums, int64_t ls) {
  using L = F64Lanes;
  constexpr int G = 8 / L::W;  // lane groups per 8 k
  typename L::R acc[RM][CN][G];
#pragma GCC unroll 8
  for (int r = 0; r < RM; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < CN; ++c)
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) acc[r][c][g] = L::zero();
  const int64_t kv = k1 == K ? k0 + ((k1 - k0) & ~(int64_t)7) : k1;
  for (int64_t k = k0; k < kv; k += 8) {
    typename L::R w[CN][G];
#pragma GCC unroll 8
    for (int c = 0; c < CN; ++c) L::load8(wr[c] + k, w[c]);
#pragma GCC unroll 8
    for (int r = 0; r < RM; ++r)
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const typename L::R xv = L::load(xr[r] + k + g * L::W);
#pragma GCC unroll 8
        for (int c = 0; c < CN; ++c) acc[r][c][g] = L::fma(xv, w[c][g], acc[r][c][g]);
      }
  }
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < CN; ++c) {
      double s = L::sum(acc[r][c][0]);
      for (int g = 1; g < G; ++g) s = s + L::sum(acc[r][c][g]);
      for (int64_t k = kv; k < k1; ++k) s = s + xr[r][k] * (double)to_f32(wr[c][k]);
      sums[r * ls + c] = sums[r * ls + c] + s;
    }
}

// accumulator registers RM * CN * (8 / W): 16 of AVX-512's 32 registers, 8 of AVX2's 16; at most 8 weight streams
#if defined(__AVX512F__)
constexpr int kF64Acc = 16;
#else
constexpr int kF64Acc = 8;
#endif
template <int RM>
constexpr int f64_cols() {
  constexpr int c = kF64Acc / (RM * (8 / F64Lanes::W));
  return c < 1 ? 1 : (c > 8 ? 8 : c);
}

// bf16 weights at the AVX-512 level: 32 elements per 64-byte load, split into the even and the odd elements by
// one shift and one mask (each 32-bit lane holds two bf16), then 4 conversions to fp64 — 14 port-0/5 operations
// per 32 products against 20 for four 8-element loads. The x rows are reordered to match, within each whole
// block of 32 (f64_block32_order); the tail (< 32) stays in order and takes f64_tile. The products summed are
// the same (each x_k meets its own w_k), and every sum is exact, so the order cannot change a bit.
#if defined(__AVX512F__)
template <typename T>
constexpr bool f64_block32() {
  return std::is_same<T, bf16_t>::value;
}
#else
template <typename T>
constexpr bool f64_block32() {
  return false;
}
#endif
// Position j of a block of 32 holds element block32_src(j): the even elements 0..14, 16..30, the odd 1..15, 17..31
// (the lanes of cvtps2pd of the low / high halves of the shifted / masked load).
constexpr int block32_src(int j) { return j < 16 ? 2 * j : 2 * (j - 16) + 1; }
// rows [R][ldx] reordered as above into out (same shape)
void f64_block32_order(const double* x, int64_t R, int64_t ldx, int64_t K, std::vector<double>& out) {
  out.resize((size_t)(R * ldx));
  const int64_t k32 = K & ~(int64_t)31;
  for (int64_t r = 0; r < R; ++r) {
    const double* s = x + r * ldx;
    double* d = out.data() + r * ldx;
    for (int64_t b = 0; b < k32; b += 32)
      for (int j = 0; j < 32; ++j) d[b + j] = s[b + block32_src(j)];
    for (int64_t k = k32; k < ldx; ++k) d[k] = s[k];
  }
}
template <int RM>
constexpr int f64_block32_cols() {  // 4 weight streams; RM * 4 * (4 / RM) = 16 accumulators of the 32 registers
  return 4;
}
#if defined(__AVX512F__)
// f64_tile for bf16 on reordered x rows; k0 a multiple of 32, k1 a multiple of 32 or K.
template <int RM, int CN>
__attribute__((flatten)) void f64_tile_block32(const double* const* xr, const bf16_t* const* wr, int64_t k0,
                                               int64_t k1, int64_t K, double* sums, int64_t ls) {
  const int64_t kb = std::min(k1, K & ~(int64_t)31);
  constexpr int A = RM >= 4 ? 1 : 4 / RM;  // accumulators per (row, column); group g adds into g % A
  __m512d acc[RM][CN][A];
#pragma GCC unroll 8
  for (int r = 0; r < RM; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < CN; ++c)
#pragma GCC unroll 4
      for (int a = 0; a < A; ++a) acc[r][c][a] = _mm512_setzero_pd();
  const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
  for (int64_t k = k0; k < kb; k += 32) {
#pragma GCC unroll 8
    for (int c = 0; c < CN; ++c) {
      const __m512i u = _mm512_loadu_si512((const void*)(wr[c] + k));
      const __m512d ev = _mm512_castps_pd(_mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
      const __m512d od = _mm512_castps_pd(_mm512_castsi512_ps(_mm512_and_si512(u, hi_mask)));
      __m512d w[4];
      w[0] = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_castpd512_pd256(ev)));
      w[1] = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(ev, 1)));
      w[2] = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_castpd512_pd256(od)));
      w[3] = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(od, 1)));
#pragma GCC unroll 8
      for (int r = 0; r < RM; ++r)
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g)
          acc[r][c][g % A] = _mm512_fmadd_pd(_mm512_loadu_pd(xr[r] + k + 8 * g), w[g], acc[r][c][g % A]);
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < CN; ++c) {
      double s = F64Lanes::sum(acc[r][c][0]);
      for (int a = 1; a < A; ++a) s = s + F64Lanes::sum(acc[r][c][a]);
      sums[r * ls + c] = sums[r * ls + c] + s;
    }
  if (kb < k1) f64_tile<bf16_t, RM, CN>(xr, wr, kb, k1, K, sums, ls);  // the tail, in order
}
#endif
// One tile, whichever kernel the type takes at this level (CN: f64_tile_cols).
template <typename T, int RM, int CN>
void f64_tile_any(const double* const* xr, const T* const* wr, int64_t k0, int64_t k1, int64_t K, double* sums,
                  int64_t ls) {
#if defined(__AVX512F__)
  if constexpr (f64_block32<T>()) {
    f64_tile_block32<RM, CN>(xr, wr, k0, k1, K, sums, ls);
    return;
  }
#endif
  f64_tile<T, RM, CN>(xr, wr, k0, k1, K, sums, ls);
}
template <typename T, int RM>
constexpr int f64_tile_cols() {
  return f64_block32<T>() ? f64_block32_cols<RM>() : f64_cols<RM>();
}

// Rows [i0, i0 + RM) of the call, columns [n0, n1), k chunk [k0, k1): into sums [R][ls] (column n0 at 0).
template <typename T, int RM>
void f64_rows(const ExactF64Params& p, int64_t i0, int64_t n0, int64_t n1, int64_t k0, int64_t k1, double* sums,
              int64_t ls) {
  constexpr int CN = f64_tile_cols<T, RM>();
  const double* xr[RM];
  for (int r = 0; r < RM; ++r) xr[r] = p.x64 + (i0 + r) * p.ldx;
  const T* w = (const T*)p.w;
  for (int64_t n = n0; n < n1; n += CN) {
    const int cn = (int)std::min<int64_t>(CN, n1 - n);
    const T* wr[CN];
    for (int c = 0; c < CN; ++c) wr[c] = w + (n + (c < cn ? c : 0)) * p.K;  // a tail repeats a live row
    if (cn == CN) {
      f64_tile_any<T, RM, CN>(xr, wr, k0, k1, p.K, sums + i0 * ls + (n - n0), ls);
    } else {
      double tmp[RM * CN] = {};
      f64_tile_any<T, RM, CN>(xr, wr, k0, k1, p.K, tmp, CN);
      for (int r = 0; r < RM; ++r)
        for (int c = 0; c < cn; ++c) sums[(i0 + r) * ls + (n - n0) + c] += tmp[r * CN + c];
    }
  }
}

// Both fp64 routes end here: a column whose weight row holds NaN / inf gives NaN (the digit path's rule), then
// the bias (one fp32 add), then the output dtype.
template <typename T>
inline T f64_epilogue(float y, const uint8_t* w_bad, const T* bias, int64_t n) {
  if (w_bad[n]) y = float_of(0x7fc00000u);
  if (bias) y = y + to_f32(bias[n]);
  return from_f32<T>(y);
}

void f64_gemm(const ExactF64Params& p_in) {
  with_type(p_in.dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    ExactF64Params p = p_in;
    std::vector<double> reordered;
    if (f64_block32<T>()) {
      f64_block32_order(p_in.x64, p_in.R, p_in.ldx, p_in.K, reordered);
      p.x64 = reordered.data();
    }
    const T* bias = (const T*)p.bias;
    T* out = (T*)p.out;
    // column blocks of 64 outermost, then k chunks of 256 (a 4-row x tile: 8 KiB in L1; the block's weight
    // chunk: 32 KiB), then row tiles; chunk sums add exactly into `sums`
    constexpr int64_t kColBlock = 64, kChunk = 256;
    std::vector<double> sums((size_t)(p.R * kColBlock));
    for (int64_t nb = p.n0; nb < p.n1; nb += kColBlock) {
      const int64_t ne = std::min(p.n1, nb + kColBlock);
      std::fill(sums.begin(), sums.end(), 0.0);  // +0: no sum is ever -0 (exact_linear.h, (5))
      // one or two rows (decode): whole weight rows per tile, so each of the tile's weight streams is one long
      // sequential read (the rows' doubles stay in L1/L2)
      const int64_t chunk = p.R <= 2 ? p.K : kChunk;
      for (int64_t k0 = 0; k0 < p.K; k0 += chunk) {
        const int64_t k1 = std::min(p.K, k0 + chunk);
        int64_t i = 0;
        for (; i + 4 <= p.R; i += 4) f64_rows<T, 4>(p, i, nb, ne, k0, k1, sums.data(), kColBlock);
        for (; i + 2 <= p.R; i += 2) f64_rows<T, 2>(p, i, nb, ne, k0, k1, sums.data(), kColBlock);
        for (; i < p.R; ++i) f64_rows<T, 1>(p, i, nb, ne, k0, k1, sums.data(), kColBlock);
      }
      for (int64_t i = 0; i < p.R; ++i) {
        const int64_t m = p.rows[i];
        for (int64_t n = nb; n < ne; ++n) {
          // the one rounding: RNE (IEEE MXCSR, set by the glue)
          out[m * p.N + n] = f64_epilogue<T>((float)sums[i * kColBlock + (n - nb)], p.w_bad, bias, n);
        }
      }
    }
  });
}

// The split route: H = hi . w_n and L = lo . w_n for the listed columns (both exact: the glue checked (B) for
// each half), one rounding from the pair (exact_linear.h round_f64_pair_f32), then f64_gemm's epilogue.
void f64_split_gemm(const ExactF64SplitParams& p) {
  with_type(p.dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    constexpr int CN = f64_tile_cols<T, 2>();
    std::vector<double> reordered;
    const double* x64 = p.x64;
    if (f64_block32<T>()) {
      f64_block32_order(p.x64, 2, p.ldx, p.K, reordered);
      x64 = reordered.data();
    }
    const double* xr[2] = {x64, x64 + p.ldx};
    const T* bias = (const T*)p.bias;
    T* out = (T*)p.out_row;
    for (int64_t j = 0; j < p.ncols; j += CN) {
      const int cn = (int)std::min<int64_t>(CN, p.ncols - j);
      const T* wr[CN];
      for (int c = 0; c < CN; ++c) wr[c] = (const T*)p.w_rows[j + (c < cn ? c : 0)];  // a tail repeats a live row
      double sums[2 * CN] = {};  // +0 (exact_linear.h, (5))
      f64_tile_any<T, 2, CN>(xr, wr, 0, p.K, p.K, sums, CN);
      for (int c = 0; c < cn; ++c) {
        const int64_t n = p.cols[j + c];
        out[n] = f64_epilogue<T>(ex::round_f64_pair_f32(sums[c], sums[CN + c]), p.w_bad, bias, n);
      }
    }
  });
}

const char* unit(bool use_amx) {
#if defined(__AVX512F__)
  if (use_amx) return "amx";
  if (__builtin_cpu_supports("avx512vnni")) return "avx512-vnni";
  return "avx2-madd";
#elif defined(__AVX2__)
  (void)use_amx;
  return "avx2-madd";
#else
  (void)use_amx;
  return "generic";
#endif
}

}  // namespace

#define ALIGNED_STR2(x) #x
#define ALIGNED_STR(x) ALIGNED_STR2(x)
extern const ExactKernels kExact = {ALIGNED_STR(ALIGNED_ISA), &pack_x, &w_forms, &pack_w, &gemm, &unit,
                                    &row_bounds, &f64_convert_rows, &f64_gemm, &f64_split_gemm, &row_scans,
                                    &pack_x_scanned};

}  // namespace aligned::cpu::ALIGNED_ISA
