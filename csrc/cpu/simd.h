// simd.h — the CPU SIMD vocabulary: one fp32 vector type per ISA level with the operations the contract's
// formulas need, and the widening loads / rounding stores of the storage types (vLLM csrc/cpu style).
//
//   F32x16 (AVX-512)   F32x8 (AVX2 + FMA)   F32x1 (any x86-64 / other CPU: one float)
//   VecF32 = the widest of them this translation unit is compiled for (kernels are compiled once per level).
//
// Every operation is the lane-by-lane IEEE operation of its numerics.h scalar namesake, so a formula of
// csrc/common/contract.h instantiated for a vector type computes in each lane exactly what its float
// instantiation computes (tests/common/test_simd_conformance.py holds every type to a plain scalar reference):
//   + - * /, unary -     one correctly rounded operation each (nothing is contracted: -ffp-contract=off)
//   fma_f32              the fused multiply-add (vfmadd), fma_f32's bits
//   div_f32, sqrt_f32    IEEE division / square root
//   exp_f32              numerics.h exp_f32, the same sequence of operations (see exp_f32 of F32x16)
//   exp_f32_not_nan      exp_f32 for arguments that are never NaN (skips the NaN fix-up; contract.h says where)
//   load(p, n)           n <= kLanes storage elements widened exactly to fp32 (lanes >= n are +0)
//   store(p, v, n)       n lanes rounded once to the storage type (numerics.h from_f32: RNE, NaN stays NaN)
//   select_first(n, a, b) lanes < n from a, the others from b (a tail of a lane chain adds nothing)
// f16 stores stay scalar (from_f32<f16_t>): the hardware conversion writes a different NaN payload.
//
// This header is included only by the per-level *_kernels.cpp translation units and defines everything in
// that level's namespace (aligned::cpu::<ALIGNED_ISA>::simd), so no inline function compiled with one level's
// -m flags can be picked by the linker for another level.
#pragma once

#include <stdint.h>
#include <string.h>

#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "../common/attention.h"  // attn_tile_max (TileMax32)
#include "../common/numerics.h"

#ifndef ALIGNED_ISA
#error "simd.h belongs to the per-ISA kernel translation units (ALIGNED_ISA names the level)"
#endif

#define ALIGNED_SIMD_INLINE inline __attribute__((always_inline))

namespace aligned::cpu::ALIGNED_ISA::simd {

using aligned::bf16_t;
using aligned::f16_t;

// ---- F32x1: the one-lane "vector" of the generic level (and the scalar reference of the others) ----------
struct F32x1 {
  static constexpr int kLanes = 1;
  float v;
  F32x1() = default;
  ALIGNED_SIMD_INLINE F32x1(float x) : v(x) {}  // NOLINT: broadcasts, like the vector types
  static ALIGNED_SIMD_INLINE F32x1 zero() { return F32x1(0.0f); }
  static ALIGNED_SIMD_INLINE F32x1 load_aligned(const float* p) { return F32x1(*p); }
  ALIGNED_SIMD_INLINE void store_aligned(float* p) const { *p = v; }
  friend ALIGNED_SIMD_INLINE F32x1 operator+(F32x1 a, F32x1 b) { return F32x1(a.v + b.v); }
  friend ALIGNED_SIMD_INLINE F32x1 operator-(F32x1 a, F32x1 b) { return F32x1(a.v - b.v); }
  friend ALIGNED_SIMD_INLINE F32x1 operator*(F32x1 a, F32x1 b) { return F32x1(a.v * b.v); }
  friend ALIGNED_SIMD_INLINE F32x1 operator/(F32x1 a, F32x1 b) { return F32x1(a.v / b.v); }
  friend ALIGNED_SIMD_INLINE F32x1 operator-(F32x1 a) { return F32x1(-a.v); }
  friend ALIGNED_SIMD_INLINE F32x1 fma_f32(F32x1 a, F32x1 b, F32x1 c) { return F32x1(aligned::fma_f32(a.v, b.v, c.v)); }
  friend ALIGNED_SIMD_INLINE F32x1 div_f32(F32x1 a, F32x1 b) { return F32x1(aligned::div_f32(a.v, b.v)); }
  friend ALIGNED_SIMD_INLINE F32x1 sqrt_f32(F32x1 a) { return F32x1(aligned::sqrt_f32(a.v)); }
  friend ALIGNED_SIMD_INLINE F32x1 exp_f32(F32x1 a) { return F32x1(aligned::exp_f32(a.v)); }
  friend ALIGNED_SIMD_INLINE F32x1 exp_f32_not_nan(F32x1 a) { return F32x1(aligned::exp_f32(a.v)); }
  friend ALIGNED_SIMD_INLINE F32x1 select_first(int n, F32x1 a, F32x1 b) { return n >= 1 ? a : b; }
};
template <typename T>
ALIGNED_SIMD_INLINE F32x1 load(const T* p, int n, F32x1*) {
  return F32x1(n >= 1 ? to_f32(p[0]) : 0.0f);
}
template <typename T>
ALIGNED_SIMD_INLINE void store(T* p, F32x1 x, int n) {
  if (n >= 1) p[0] = from_f32<T>(x.v);
}

// ---- F32x8: AVX2 + FMA ------------------------------------------------------------------------------------
#if defined(__AVX2__) && defined(__FMA__)
struct F32x8 {
  static constexpr int kLanes = 8;
  __m256 v;
  F32x8() = default;
  ALIGNED_SIMD_INLINE F32x8(__m256 x) : v(x) {}             // NOLINT
  ALIGNED_SIMD_INLINE F32x8(float x) : v(_mm256_set1_ps(x)) {}  // NOLINT: broadcast
  static ALIGNED_SIMD_INLINE F32x8 zero() { return F32x8(_mm256_setzero_ps()); }
  static ALIGNED_SIMD_INLINE F32x8 load_aligned(const float* p) { return F32x8(_mm256_load_ps(p)); }
  ALIGNED_SIMD_INLINE void store_aligned(float* p) const { _mm256_store_ps(p, v); }
  friend ALIGNED_SIMD_INLINE F32x8 operator+(F32x8 a, F32x8 b) { return _mm256_add_ps(a.v, b.v); }
  friend ALIGNED_SIMD_INLINE F32x8 operator-(F32x8 a, F32x8 b) { return _mm256_sub_ps(a.v, b.v); }
  friend ALIGNED_SIMD_INLINE F32x8 operator*(F32x8 a, F32x8 b) { return _mm256_mul_ps(a.v, b.v); }
  friend ALIGNED_SIMD_INLINE F32x8 operator/(F32x8 a, F32x8 b) { return _mm256_div_ps(a.v, b.v); }
  friend ALIGNED_SIMD_INLINE F32x8 operator-(F32x8 a) { return _mm256_xor_ps(a.v, _mm256_set1_ps(-0.0f)); }
  friend ALIGNED_SIMD_INLINE F32x8 fma_f32(F32x8 a, F32x8 b, F32x8 c) { return _mm256_fmadd_ps(a.v, b.v, c.v); }
  friend ALIGNED_SIMD_INLINE F32x8 div_f32(F32x8 a, F32x8 b) { return _mm256_div_ps(a.v, b.v); }
  friend ALIGNED_SIMD_INLINE F32x8 sqrt_f32(F32x8 a) { return _mm256_sqrt_ps(a.v); }
  friend ALIGNED_SIMD_INLINE F32x8 select_first(int n, F32x8 a, F32x8 b) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
    return _mm256_blendv_ps(b.v, a.v, keep);
  }
  // numerics.h exp_f32 lane by lane; the reasoning is the F32x16 form's (below).
  template <bool kNaN>
  static ALIGNED_SIMD_INLINE F32x8 exp_impl(F32x8 x) {
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    const __m256 xc = _mm256_max_ps(_mm256_min_ps(x.v, _mm256_set1_ps(88.8f)), _mm256_set1_ps(-104.0f));
    const __m256 t = _mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_sub_ps(_mm256_add_ps(t, magic), magic);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 er = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(_mm256_add_epi32(ni, _mm256_srli_epi32(ni, 31)), 1);
    const __m256i n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(er, s1), s2);
    if constexpr (kNaN) y = _mm256_blendv_ps(y, x.v, _mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q));
    return y;
  }
  friend ALIGNED_SIMD_INLINE F32x8 exp_f32(F32x8 x) { return exp_impl<true>(x); }
  friend ALIGNED_SIMD_INLINE F32x8 exp_f32_not_nan(F32x8 x) { return exp_impl<false>(x); }
};
ALIGNED_SIMD_INLINE F32x8 load(const float* p, int n, F32x8*) {
  if (n >= 8) return _mm256_loadu_ps(p);
  alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < n; ++i) tmp[i] = p[i];
  return _mm256_load_ps(tmp);
}
ALIGNED_SIMD_INLINE F32x8 load(const bf16_t* p, int n, F32x8*) {
  __m128i h;
  if (n >= 8) {
    h = _mm_loadu_si128((const __m128i*)p);
  } else {
    alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    memcpy(tmp, p, (size_t)(n > 0 ? n : 0) * 2);
    h = _mm_load_si128((const __m128i*)tmp);
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
ALIGNED_SIMD_INLINE F32x8 load(const f16_t* p, int n, F32x8*) {
  __m128i h;
  if (n >= 8) {
    h = _mm_loadu_si128((const __m128i*)p);
  } else {
    alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    memcpy(tmp, p, (size_t)(n > 0 ? n : 0) * 2);
    h = _mm_load_si128((const __m128i*)tmp);
  }
  return _mm256_cvtph_ps(h);  // F16C: exact widening, subnormals kept
}
ALIGNED_SIMD_INLINE void store(float* p, F32x8 x, int n) {
  if (n >= 8) return _mm256_storeu_ps(p, x.v);
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, x.v);
  for (int i = 0; i < n; ++i) p[i] = tmp[i];
}
ALIGNED_SIMD_INLINE void store(bf16_t* p, F32x8 x, int n) {
  const __m256i u = _mm256_castps_si256(x.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q));
  const __m256i b = _mm256_blendv_epi8(rounded, quiet, nan);  // every lane < 2^16: packus is exact
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  if (n >= 8) return _mm_storeu_si128((__m128i*)p, h);
  alignas(16) uint16_t tmp[8];
  _mm_store_si128((__m128i*)tmp, h);
  memcpy(p, tmp, (size_t)(n > 0 ? n : 0) * 2);
}
#endif

// ---- F32x16: AVX-512 F/BW/VL/DQ -------------------------------------------------------------------------
#if defined(__AVX512F__)
ALIGNED_SIMD_INLINE __mmask16 first_lanes16(int n) {
  return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}
struct F32x16 {
  static constexpr int kLanes = 16;
  __m512 v;
  F32x16() = default;
  ALIGNED_SIMD_INLINE F32x16(__m512 x) : v(x) {}              // NOLINT
  ALIGNED_SIMD_INLINE F32x16(float x) : v(_mm512_set1_ps(x)) {}  // NOLINT: broadcast
  static ALIGNED_SIMD_INLINE F32x16 zero() { return F32x16(_mm512_setzero_ps()); }
  static ALIGNED_SIMD_INLINE F32x16 load_aligned(const float* p) { return F32x16(_mm512_load_ps(p)); }
  ALIGNED_SIMD_INLINE void store_aligned(float* p) const { _mm512_store_ps(p, v); }
  friend ALIGNED_SIMD_INLINE F32x16 operator+(F32x16 a, F32x16 b) { return _mm512_add_ps(a.v, b.v); }
  friend ALIGNED_SIMD_INLINE F32x16 operator-(F32x16 a, F32x16 b) { return _mm512_sub_ps(a.v, b.v); }
  friend ALIGNED_SIMD_INLINE F32x16 operator*(F32x16 a, F32x16 b) { return _mm512_mul_ps(a.v, b.v); }
  friend ALIGNED_SIMD_INLINE F32x16 operator/(F32x16 a, F32x16 b) { return _mm512_div_ps(a.v, b.v); }
  // -a: a sign flip, exactly what the scalar negation does (also for 0 and NaN)
  friend ALIGNED_SIMD_INLINE F32x16 operator-(F32x16 a) { return _mm512_xor_ps(a.v, _mm512_set1_ps(-0.0f)); }
  friend ALIGNED_SIMD_INLINE F32x16 fma_f32(F32x16 a, F32x16 b, F32x16 c) { return _mm512_fmadd_ps(a.v, b.v, c.v); }
  friend ALIGNED_SIMD_INLINE F32x16 div_f32(F32x16 a, F32x16 b) { return _mm512_div_ps(a.v, b.v); }
  friend ALIGNED_SIMD_INLINE F32x16 sqrt_f32(F32x16 a) { return _mm512_sqrt_ps(a.v); }
  friend ALIGNED_SIMD_INLINE F32x16 select_first(int n, F32x16 a, F32x16 b) {
    return _mm512_mask_blend_ps(first_lanes16(n), b.v, a.v);
  }
  // numerics.h exp_f32 as straight-line vector code (gcc's own vectorisation of exp_f32 uses masked/blended
  // code for the range checks and runs at about half this speed). The same IEEE operations lane by lane:
  // fma(-n, c, r) == fnmadd(n, c, r) (negation is exact); the two clamps are min/max (equal for every
  // non-NaN x); the range fix-ups need no code: for the clamped arguments the same operations already give
  // exp(88.8) = inf (1.08 * 2^64 * 2^64 overflows) and exp(-104) = 0 (0.486 * 2^-149 rounds to 0), which is
  // what the fix-ups write. kNaN = false drops the NaN fix-up (min/max turn a NaN into 88.8 -> inf), for
  // arguments that are never NaN. Equal to exp_f32 on all 2^32 inputs (measured when it was written).
  template <bool kNaN>
  static ALIGNED_SIMD_INLINE F32x16 exp_impl(F32x16 x) {
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __m512 xc = _mm512_max_ps(_mm512_min_ps(x.v, _mm512_set1_ps(88.8f)), _mm512_set1_ps(-104.0f));
    const __m512 t = _mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(t, magic), magic);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 er = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    const __m512i ni = _mm512_cvtps_epi32(n);  // n is an integer: exact
    const __m512i n1 = _mm512_srai_epi32(_mm512_add_epi32(ni, _mm512_srli_epi32(ni, 31)), 1);  // C's ni / 2
    const __m512i n2 = _mm512_sub_epi32(ni, n1);
    const __m512i bias = _mm512_set1_epi32(127);
    const __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
    const __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(er, s1), s2);
    if constexpr (kNaN) y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q), y, x.v);
    return y;
  }
  friend ALIGNED_SIMD_INLINE F32x16 exp_f32(F32x16 x) { return exp_impl<true>(x); }
  friend ALIGNED_SIMD_INLINE F32x16 exp_f32_not_nan(F32x16 x) { return exp_impl<false>(x); }
};
// Masked loads: nothing past n is touched.
ALIGNED_SIMD_INLINE F32x16 load(const float* p, int n, F32x16*) { return _mm512_maskz_loadu_ps(first_lanes16(n), p); }
ALIGNED_SIMD_INLINE F32x16 load(const bf16_t* p, int n, F32x16*) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(first_lanes16(n), p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
ALIGNED_SIMD_INLINE F32x16 load(const f16_t* p, int n, F32x16*) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes16(n), p));  // exact, subnormals kept
}
ALIGNED_SIMD_INLINE void store(float* p, F32x16 x, int n) { _mm512_mask_storeu_ps(p, first_lanes16(n), x.v); }
ALIGNED_SIMD_INLINE void store(bf16_t* p, F32x16 x, int n) {
  const __m512i u = _mm512_castps_si512(x.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __m512i b = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q), rounded, quiet);
  _mm256_mask_storeu_epi16(p, first_lanes16(n), _mm512_cvtepi32_epi16(b));
}
#endif

#if defined(__AVX512F__)
// In-register transpose of 16 x 16 32-bit elements (moves only: no value changes): r[i] = row i -> r[c] = column c
// (lane i = old row i). The CPU GEMM and attention kernels' one copy.
ALIGNED_SIMD_INLINE void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // within each 128-bit lane: r[4i + c] = column c of rows 4i..4i+3
    r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {  // gather 128-bit lane L of r[c], r[4+c], r[8+c], r[12+c] -> column 4L + c
    __m512 u0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
    __m512 u1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
    __m512 u2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    __m512 u3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
    t[c] = _mm512_shuffle_f32x4(u0, u2, 0x88);
    t[8 + c] = _mm512_shuffle_f32x4(u0, u2, 0xDD);
    t[4 + c] = _mm512_shuffle_f32x4(u1, u3, 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(u1, u3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#endif

// ---- the level's widest type ------------------------------------------------------------------------------
#if defined(__AVX512F__)
using VecF32 = F32x16;
#elif defined(__AVX2__) && defined(__FMA__)
using VecF32 = F32x8;
#else
using VecF32 = F32x1;
#endif

// load<V>(p, n): n <= V::kLanes storage elements of p widened to fp32 (the others +0).
template <typename V, typename T>
ALIGNED_SIMD_INLINE V load(const T* p, int n = V::kLanes) {
  return load(p, n, (V*)nullptr);
}

// attention.h's tile probabilities (AttnTileProbs) kLanes keys at a time: p[j] = exp_f32(s[j] - mu) for j < nv,
// +0 for nv <= j < N (s[j] there is never looked at by the result, whatever it holds), N % V::kLanes == 0. Lane by
// lane the scalar's operations (a subtraction, then exp_f32 of the vector type: numerics.h exp_f32), the masked
// lanes a select; no alignment needed. The CPU attention forward passes it to attn_tile_update, and
// tests/common/simd_conformance.cpp runs this same function against the plain scalar reference.
template <typename V, int N>
struct TileProbs {
  static_assert(N % V::kLanes == 0, "whole vectors");
  ALIGNED_SIMD_INLINE void operator()(const float* s, int nv, float mu, float* p) const {
    for (int h = 0; h < N; h += V::kLanes) {
      const V e = exp_f32(load<V>(s + h) - V(mu));
      store(p + h, select_first(nv - h, e, V::zero()), V::kLanes);
    }
  }
};

#if defined(__AVX512F__)
// attention.h attn_tile_max for a tile of 32 scores with AVX-512 (the scalar's fold was a chain of 32 dependent
// compares and branches: ~30 % of prefill attention). The scalar fold mt = (mt > s_j ? mt : s_j) over j < nv gives
// the tile's largest value; where scores are equal it keeps the LAST one, which only shows in the sign of a zero
// maximum, and after a NaN it restarts from the next score. vmaxps gives the same largest value but not those two
// orders, so a tile whose valid scores hold a NaN or whose maximum is zero runs the scalar itself: the result is
// attn_tile_max's, bit for bit, on every input (tests/common/simd_conformance.cpp).
struct TileMax32 {
  ALIGNED_SIMD_INLINE float operator()(const float* s, int nv, float m) const {
    const __mmask16 k0 = first_lanes16(nv), k1 = first_lanes16(nv - 16);
    const __m512 lowest = _mm512_set1_ps(neg_inf_f32());
    const __m512 a = _mm512_mask_loadu_ps(lowest, k0, s), b = _mm512_mask_loadu_ps(lowest, k1, s + 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
    if (nan) return attn_tile_max(s, nv, m);
    const float mt = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
    if (mt == 0.0f) return attn_tile_max(s, nv, m);
    return max_f32(m, mt);
  }
};
#endif

// Whether store(T*, V, n) is a vector store (else the kernel rounds element by element with from_f32).
template <typename V, typename T>
constexpr bool kVectorStore = V::kLanes == 1 || !std::is_same_v<T, f16_t>;

}  // namespace aligned::cpu::ALIGNED_ISA::simd
