// numerics.h — the scalar building blocks of the aligned_ops numerics contract.
//
// Every backend (g++ for the CPU, nvcc for CUDA, clang for HIP) includes this header and evaluates
// the same expression trees with these helpers, so that non-matrix-unit arithmetic is bit-identical
// across CPU, CUDA and HIP:
//   * only IEEE-754 binary32 operations that every backend rounds correctly: +, -, *, /, sqrt, fma;
//   * fma only where written (`fma_f32`); every build disables contraction (-ffp-contract=off,
//     nvcc --fmad=false), so `a * b + c` is two roundings everywhere;
//   * our own exp and log (`exp_f32`, `log_f32`), built from the operations above, instead of libm /
//     __expf / v_exp_f32, whose results differ per vendor and per library version;
//   * no flush-to-zero: subnormals are kept by every helper here (CPU builds never link crtfastmath,
//     CUDA builds use -ftz=false, HIP f32 denormals are IEEE by default);
//   * conversions to bf16/f16 round to nearest even, NaN stays NaN.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define ALIGNED_HD __host__ __device__ __forceinline__
#else
#define ALIGNED_HD inline __attribute__((always_inline))
#include <cmath>
#endif

namespace aligned {

// ---- bit casts -------------------------------------------------------------------------------
ALIGNED_HD uint32_t bits_of(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}
ALIGNED_HD float float_of(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

// ---- correctly rounded primitives, spelled once per compiler ----------------------------------
ALIGNED_HD float fma_f32(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#elif defined(__HIP_DEVICE_COMPILE__)
  return __builtin_fmaf(a, b, c);
#else
  return __builtin_fmaf(a, b, c);  // inlined to vfmadd with -mfma; a correct libm call otherwise
#endif
}
ALIGNED_HD float sqrt_f32(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return __builtin_sqrtf(x);  // correctly rounded (HIP: -fhip-fp32-correctly-rounded-divide-sqrt is the default)
#endif
}
ALIGNED_HD float div_f32(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
ALIGNED_HD float max_f32(float a, float b) { return a > b ? a : b; }  // NaN policy: callers test NaN first
// The maximum in IEEE's total order on non-NaN values (-0 < +0): equal operands give the AND of their bits, so a
// zero maximum is +0 where either is +0 and -0 only where both are. Commutative and associative, so a fold of it
// gives one value — the sign of a zero included — whatever its order or grouping (lanes, threads, warps, blocks);
// max_f32 keeps one operand of two equal zeros by position. A NaN `a` leaves `b` (callers flag NaN rows apart).
ALIGNED_HD float max_total_f32(float a, float b) {
  return a > b ? a : (a == b ? float_of(bits_of(a) & bits_of(b)) : b);
}
ALIGNED_HD bool is_nan_f32(float x) { return x != x; }

// ---- exp ---------------------------------------------------------------------------------------
// exp(x) = 2^n * exp(r), n = round(x / ln2), r = x - n*ln2 (Cody–Waite, two-constant ln2), exp(r) by a
// degree-6 polynomial on |r| <= ln2/2 evaluated by Horner with fma. Max error 1.008 ulp over the whole range
// (measured in tests/common); subnormal results are produced by scaling in two steps (no flush); exp(-inf) = 0,
// exp(+inf) = inf, exp(NaN) = NaN, overflow -> inf.
ALIGNED_HD float exp_f32(float x) {
  const float kLog2e = 1.44269504088896341f;
  const float kLn2Hi = 0.693359375f;      // exact in 9 bits, so n*kLn2Hi is exact for |n| < 2^15
  const float kLn2Lo = -2.12194440e-4f;
  const float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: (t + magic) - magic rounds t to nearest even
  // Clamp so that n stays in [-151, 128]; the clamp keeps inf/0 results and makes the code branch-free.
  float xc = x;
  if (xc > 88.8f) xc = 88.8f;
  if (xc < -104.0f) xc = -104.0f;
  float t = xc * kLog2e;
  float n = (t + kRoundMagic) - kRoundMagic;
  float r = fma_f32(-n, kLn2Hi, xc);
  r = fma_f32(-n, kLn2Lo, r);
  float p = 1.9875691500e-4f;
  p = fma_f32(p, r, 1.3981999507e-3f);
  p = fma_f32(p, r, 8.3334519073e-3f);
  p = fma_f32(p, r, 4.1665795894e-2f);
  p = fma_f32(p, r, 1.6666665459e-1f);
  p = fma_f32(p, r, 5.0000001201e-1f);
  float r2 = r * r;
  float er = fma_f32(p, r2, r) + 1.0f;  // exp(r) in [0.7, 1.42]
  // 2^n in two factors so that n in [-151, 128] never needs a subnormal or infinite scale factor.
  int32_t ni = (int32_t)n;
  int32_t n1 = ni / 2;
  int32_t n2 = ni - n1;
  float s1 = float_of((uint32_t)(n1 + 127) << 23);
  float s2 = float_of((uint32_t)(n2 + 127) << 23);
  float y = (er * s1) * s2;
  if (x > 88.8f) y = float_of(0x7f800000u);  // +inf (also for x = +inf)
  if (x < -104.0f) y = 0.0f;
  if (is_nan_f32(x)) y = x;
  return y;
}

// ---- log ---------------------------------------------------------------------------------------
// log(x) = e*ln2 + log(m), x = m * 2^e with m in [sqrt(1/2), sqrt(2)); log(1+f) by a degree-9 polynomial
// (Cephes logf coefficients) with fma Horner; the ln2 term is added in two parts. ~1 ulp.
// log(0) = -inf, log(x<0) = NaN, log(inf) = inf, log(NaN) = NaN; subnormal inputs are rescaled first.
ALIGNED_HD float log_f32(float x) {
  const float kSqrtHalf = 0.707106781186547524f;
  float xs = x;
  int32_t e_adj = 0;
  if (xs < 1.17549435e-38f) {  // subnormal (or zero/negative, handled below): scale by 2^25
    xs = xs * 33554432.0f;
    e_adj = -25;
  }
  uint32_t u = bits_of(xs);
  int32_t e = (int32_t)((u >> 23) & 0xff) - 126;  // xs = m * 2^e, m in [0.5, 1)
  float m = float_of((u & 0x007fffffu) | 0x3f000000u);
  if (m < kSqrtHalf) {
    e -= 1;
    m = m + m - 1.0f;
  } else {
    m = m - 1.0f;
  }
  e += e_adj;
  float fe = (float)e;
  float z = m * m;
  float p = 7.0376836292e-2f;
  p = fma_f32(p, m, -1.1514610310e-1f);
  p = fma_f32(p, m, 1.1676998740e-1f);
  p = fma_f32(p, m, -1.2420140846e-1f);
  p = fma_f32(p, m, 1.4249322787e-1f);
  p = fma_f32(p, m, -1.6668057665e-1f);
  p = fma_f32(p, m, 2.0000714765e-1f);
  p = fma_f32(p, m, -2.4999993993e-1f);
  p = fma_f32(p, m, 3.3333331174e-1f);
  float y = (p * m) * z;
  y = fma_f32(fe, -2.12194440e-4f, y);
  y = fma_f32(-0.5f, z, y);
  float r = m + y;
  r = fma_f32(fe, 0.693359375f, r);
  if (x == 0.0f) r = -float_of(0x7f800000u);
  if (x < 0.0f) r = float_of(0x7fc00000u);
  if (x == float_of(0x7f800000u)) r = x;
  if (is_nan_f32(x)) r = x;
  return r;
}

// exp_f32 for an argument that is never NaN (same bits as exp_f32 there). A vector type may skip the NaN
// fix-up for it (csrc/cpu/simd.h); contract.h uses it only where the argument cannot be NaN, or where a NaN
// argument cannot reach the result through it.
ALIGNED_HD float exp_f32_not_nan(float x) { return exp_f32(x); }

// silu(a) = a / (1 + exp(-a)): one exp, one add, one IEEE division — contract.h's silu<V> for float.
// (A NaN a makes the quotient a's NaN whatever exp(-a) is, so the exp needs no NaN fix-up.)
ALIGNED_HD float silu_f32(float a) { return div_f32(a, 1.0f + exp_f32_not_nan(-a)); }

// ---- storage types -----------------------------------------------------------------------------
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

ALIGNED_HD float to_f32(float x) { return x; }
ALIGNED_HD float to_f32(bf16_t x) { return float_of((uint32_t)x.bits << 16); }
// The f16 conversions compute every case and pick one with selects: no branch. Early returns per converted element
// made each f16 kernel a maze of small blocks (gemm_small_m_kernel<f16_t, 16>: 11013 PTX branches against bf16's
// 331, 70% of dense.cu's PTX) that cicc and ptxas spent most of their time on (nvcc -arch=sm_90 -cubin, CPU s:
// dense.cu 45.8 -> 20.1, moe.cu 39.9 -> 10.7). The values are those of the branching form bit for bit (every f16
// and every f32 input: tests/common/test_f16_conversion.py).
// A NaN widens to the quiet NaN with the same sign and payload: a signalling NaN gets the quiet bit, as IEEE 754's
// conversions and the CPU's vector widening (F16C vcvtph2ps, csrc/cpu/simd.h load) do, so every backend and ISA level
// widens every f16 to the same bits (tests/common/simd_conformance.cpp checks all 65,536 against simd.h's loads).
ALIGNED_HD float to_f32(f16_t h) {
  const uint32_t sign = (uint32_t)(h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1fu;
  const uint32_t man = h.bits & 0x3ffu;
  // zero or subnormal (exp == 0): value = man * 2^-24, exact in fp32
  const uint32_t tiny = bits_of((float)man * 5.9604644775390625e-8f) | sign;
  // normal: rebias the exponent; inf / NaN (exp == 0x1f): the all-ones exponent, the payload kept, a NaN quiet
  const uint32_t big = sign | ((exp == 0x1fu ? 0xffu : exp + 112u) << 23) | (man << 13) |
                       (exp == 0x1fu && man != 0u ? 0x400000u : 0u);
  return float_of(exp == 0 ? tiny : big);
}

template <typename T>
ALIGNED_HD T from_f32(float x);

template <>
ALIGNED_HD float from_f32<float>(float x) {
  return x;
}
template <>
ALIGNED_HD bf16_t from_f32<bf16_t>(float x) {
  uint32_t u = bits_of(x);
  bf16_t r;
  if (is_nan_f32(x)) {
    r.bits = (uint16_t)((u >> 16) | 0x40u);  // quiet NaN, sign kept
    return r;
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  r.bits = (uint16_t)(u >> 16);
  return r;
}
template <>
ALIGNED_HD f16_t from_f32<f16_t>(float x) {
  const uint32_t u = bits_of(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  // inf, or a value that rounds to >= 65520 (a >= 0x477ff000u): inf; NaN (a > 0x7f800000u): the quiet NaN
  const uint32_t huge = sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u);
  // result subnormal in f16 (|x| < 2^-14): round x * 2^24 to an integer with the magic number in fp32 (exact RNE,
  // |x| * 2^24 < 1024); other inputs compute it from +0, so no lane overflows or converts an out-of-range float
  const bool subnormal = a < 0x38800000u;
  const float v = float_of(subnormal ? a : 0u) * 16777216.0f;  // exact (power of two)
  const float rounded = (v + 8388608.0f) - 8388608.0f;          // round to nearest even integer (v < 2^23)
  const uint32_t tiny = sign | (uint32_t)rounded;
  // normal: rebias exponent and round the 13 dropped mantissa bits to nearest even
  const uint32_t m = a + 0xfffu + ((a >> 13) & 1u);
  const uint32_t normal = sign | ((m - 0x38000000u) >> 13);
  f16_t r;
  r.bits = (uint16_t)(a >= 0x477ff000u ? huge : subnormal ? tiny : normal);
  return r;
}

}  // namespace aligned
