// contract.h — the reduction order of every dense op, written down once.
//
// Each function below is the per-row (or per-element) definition of an op: the exact fp32 expression
// tree, with the order of every sum. The CPU backend calls these functions row by row (the compiler
// vectorises them without changing any element's tree: no contraction, no reassociation); the CUDA and
// HIP kernels parallelise each row across a warp/wave with the same lane assignment (reduce.h) and
// the same per-element expressions. Rows never interact, so an output row depends only on its own
// input row and the weights: batch size, row position, other rows and thread count cannot change it.
// Matrix work (linear) is written per numerics profile (section "linear" below): the GEMM kernels run its
// lane chains register-tiled and call linear_lane_fold / linear_epilogue for the combine; the scalar
// linear_partial_dot / linear_dot are the reference the tests hold every backend to.
//
// Arithmetic type V: the per-element formulas below are templates over the type they compute in, so the
// scalar code, the GPU kernels (V = float) and the CPU vector kernels (V = a csrc/cpu/simd.h type, each lane
// an IEEE fp32 operation) call the SAME helper instead of re-expressing it. V needs + - * (binary, unary -)
// and fma_f32 / div_f32 / sqrt_f32 / exp_f32 / exp_f32_not_nan (numerics.h for float, simd.h for vectors);
// float constants are written V(c). tests/common/test_simd_conformance.py holds every instantiation to a plain
// scalar reference.
//
// Storage types T: float, bf16_t, f16_t. Inputs are widened to fp32 exactly; every result is rounded
// once to its output type (round to nearest even).
//
// NaN policy (all ops): NaN inputs propagate to the outputs that depend on them; nothing is clamped,
// nothing is silently dropped. A row of log_softmax that holds a NaN or +inf yields NaN for the row
// (logsumexp of a row with +inf and no NaN is +inf); the log-prob section below lists every special row.
// WHICH NaN (sign, payload) is contracted only where a helper writes one itself (the log-probs: logp_value;
// exact_linear.h; moe.h): 0x7fc00000. Elsewhere, where an input NaN meets another NaN in an add/fma (inf - inf),
// IEEE leaves the result to the hardware's operand order (x86: one operand's; NVIDIA: a canonical NaN), so e.g. a
// linear's NaN sign may differ between kernels and with M. That an output IS NaN is invariant; the log-probs of
// such a row are bitwise the same.
#pragma once

#include "numerics.h"
#include "reduce.h"

namespace aligned {

// ---- linear: numerics profiles ------------------------------------------------------------------------
// Matrix work is written per *profile*: a named order (and arithmetic) that every backend implementing the
// profile computes bit for bit. Each profile states what its bits are invariant to and what they are not.
//
//  * `fma` (LinearProfile::kFma, this section, what aligned::linear and aligned::linear_partial compute):
//    portable fp32 CUDA-core / vector-fma arithmetic. Formula, for out[m, n] with K input features:
//      lane l = 0..7 covers k in [lo(l), lo(l + 1)), lo(l) = floor(l * K / 8)    (linear_lane_begin)
//      s_l    = dot_chain over that lane: acc = +0, acc = fma(x[m, k], w[n, k], acc), k ascending (reduce.h)
//      acc    = ((s_0 + s_1) + (s_2 + s_3)) + ((s_4 + s_5) + (s_6 + s_7))          (linear_lane_tree)
//      out    = round_T(acc + bias[n])   (one fp32 add; without bias: round_T(acc), no "+ 0" added)
//    Inputs are widened to fp32 exactly; no flush-to-zero (subnormal inputs, partials and outputs are kept);
//    NaN/inf propagate as IEEE fma/add do. An empty lane (K < 8) is +0.
//    INVARIANT: batch size M, the row's position, other rows, M/N tiling, thread count, prompt chunking,
//    prefill vs decode, run, backend (CPU generic ≡ AVX2 ≡ AVX-512 ≡ CUDA ≡ HIP), and the tensor-parallel
//    degree t ∈ {1, 2, 4, 8} of a row-parallel layer whose rank r holds the whole lanes
//    [r·8/t, (r+1)·8/t) — K slice [lo(r·8/t), lo((r+1)·8/t)) = [floor(r·K/t), floor((r+1)·K/t)) — computes
//    linear_partial over them (the sub-tree of those lanes) and a tree all-reduce finishes the tree by the
//    same pairing (rank partials combined (0+1), (2+3), ... level by level: linear_lane_fold).
//    When K % 8 == 0 every such slice is K/t long and its local 8/t-lane cut (the floor rule applied to the
//    local K) is exactly the global lanes. When K % 8 != 0 that holds only for some (K, t); the Python
//    helper aligned_ops.linear_tp_slices(K, t) computes the slices and refuses the others.
//    NOT INVARIANT: the lane count (a 1-lane chain or another tree is another result), TP degrees other
//    than 1, 2, 4, 8 or splits that cut a lane, column-parallel splits of the backward's dx (see below).
//    Backward (linear_backward, unchanged by the lanes): every element is ONE dot_chain (a 1-lane linear):
//      dx[m, k] = dot_chain over n = 0..N-1 of (g[m, n], w[n, k])
//      dw[n, k] = dot_chain over m = 0..M-1 of (g[m, n], x[m, k])   (tokens in their order in the batch)
//      db[n]    = chain over m = 0..M-1 of (. + g[m, n])
//    dx is batch-invariant (per row); dw/db depend on the batch's token order by design (a fixed chain, run
//    to run and thread count invariant). None of them is TP-invariant: row-parallel dx needs no reduction
//    across ranks, but a column-parallel dx (N split) would need lanes over N — not part of this profile.
//  * `exact` (LinearProfile::kExact, slot only): an integer-MMA linear whose bits are the same on every
//    backend by exact integer arithmetic (aligned::linear_exact, its own issue/helper). Its order and
//    invariants are stated next to its helper, not here.
//  * `mma` (LinearProfile::kMma, csrc/common/mma.h: aligned::linear_mma, linear_mma_partial): the machine's
//    matrix unit (the CPU: AVX512-BF16 vdpbf16ps; GPUs: a later kernel) in THIS profile's 8 lanes and tree,
//    bf16 only; invariant to batch, chunking, threads and TP degree on ONE unit, not across units. Its order,
//    the CPU unit's exact scalar model and its backward are stated next to its helpers in mma.h.
//
// bf16 dot-product instruction (vdpbf16ps), measured and NOT taken into the `fma` profile
// (bench/experiments/dpbf16_order.c, bench/RESULTS.md): it equals exactly, on 19.2M random and adversarial
// lanes, the chain "acc = ftz(fma(a1, b1, acc)); acc = ftz(fma(a0, b0, acc))" over each pair, odd element
// first, with every bf16 input and the incoming accumulator DAZ'd and every fma result flushed after
// rounding (sign kept). Taking it would pair-swap the lane order and flush subnormals for bf16 only, and every
// other backend (generic, AVX2, CUDA, HIP) would have to emulate the flush after each fma: it is the `mma`
// profile's CPU unit instead (mma.h), a profile of its own with its own bits.
enum class LinearProfile : int { kFma = 0, kExact = 1, kMma = 2 };

constexpr int kLinearLanes = 8;  // lanes of the `fma` profile; TP degrees 1, 2, 4, 8 hold whole lanes

// First k of lane l when K is cut into `lanes` lanes (floor rule); lane l covers [begin(l), begin(l + 1)).
ALIGNED_HD int64_t linear_lane_begin(int64_t l, int64_t K, int64_t lanes) { return (l * K) / lanes; }

// Fold of n ∈ {1, 2, 4, 8} adjacent lane (or rank) partials: the sub-tree of the 8-lane tree over them,
// adjacent pairs first, level by level. n = 8 is ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)).
// V: float, or a csrc/cpu/simd.h vector (each lane the float tree: the CPU kernels fold 16 outputs at a time).
template <typename V>
ALIGNED_HD V linear_lane_fold(const V* s, int n) {
  if (n == 1) return s[0];
  if (n == 2) return s[0] + s[1];
  if (n == 4) return (s[0] + s[1]) + (s[2] + s[3]);
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// aligned::linear_partial for one output: the sub-tree over `lanes` lanes of the (local) K, fp32, no bias.
template <typename TX, typename TW>
ALIGNED_HD float linear_partial_dot(const TX* x_row, const TW* w_row, int64_t K, int lanes) {
  float s[kLinearLanes];
  for (int l = 0; l < lanes; ++l) {
    const int64_t k0 = linear_lane_begin(l, K, lanes), k1 = linear_lane_begin(l + 1, K, lanes);
    s[l] = dot_chain(x_row + k0, w_row + k0, k1 - k0);
  }
  return linear_lane_fold(s, lanes);
}

// aligned::linear for one output before the bias: the full 8-lane tree.
template <typename TX, typename TW>
ALIGNED_HD float linear_dot(const TX* x_row, const TW* w_row, int64_t K) {
  return linear_partial_dot(x_row, w_row, K, kLinearLanes);
}

// The epilogue of aligned::linear: one fp32 add of the bias (if any), one rounding to the output type.
template <typename TC>
ALIGNED_HD TC linear_epilogue(float acc, const TC* bias, int64_t n) {
  return from_f32<TC>(bias ? acc + to_f32(bias[n]) : acc);
}

// ---- rms_norm ----------------------------------------------------------------------------------------
// ss = lane_sum over k of (x_k * x_k)        (product rounded, then added; reduce.h order)
// inv = 1 / sqrt(ss / H + eps)               (division, add, sqrt, division: each correctly rounded)
// out_k = round_T((x_k * inv) * w_k)
// The pieces (every backend's row loop calls these):
// A lane's step is its term (a function of one element: any thread may compute it) added to the chain (the order
// the contract fixes); the GPU's wide-row kernels compute terms on many warps and add them on one.
template <typename V>
ALIGNED_HD V rms_sq_term(V x) { return x * x; }
template <typename V>
ALIGNED_HD V rms_sq_step(V acc, V x) { return acc + rms_sq_term(x); }  // one lane's step of ss
ALIGNED_HD float rms_inv_of_sum(float ss, int64_t H, float eps) {
  return div_f32(1.0f, sqrt_f32(div_f32(ss, (float)H) + eps));
}
template <typename V>
ALIGNED_HD V rms_scale(V x, V inv, V w) { return (x * inv) * w; }  // out_k before its rounding

template <typename T>
ALIGNED_HD float rms_inv(const T* x, int64_t H, float eps) {
  float lanes[kReduceLanes];
  for (int j = 0; j < kReduceLanes; ++j) lanes[j] = 0.0f;
  int64_t k0 = 0;
  for (; k0 + kReduceLanes <= H; k0 += kReduceLanes) {
    for (int j = 0; j < kReduceLanes; ++j) lanes[j] = rms_sq_step(lanes[j], to_f32(x[k0 + j]));
  }
  for (int j = 0; k0 + j < H; ++j) lanes[j] = rms_sq_step(lanes[j], to_f32(x[k0 + j]));
  return rms_inv_of_sum(fold_lanes(lanes), H, eps);
}

template <typename T, typename TW>
ALIGNED_HD void rms_norm_row(const T* x, const TW* w, T* out, int64_t H, float eps) {
  float inv = rms_inv(x, H, eps);
  for (int64_t k = 0; k < H; ++k) out[k] = from_f32<T>(rms_scale(to_f32(x[k]), inv, to_f32(w[k])));
}

// fused_add_rms_norm: r_k = round_T(x_k + res_k) is the new residual; the norm is rms_norm of the
// *rounded* r (as HF computes it: the residual stream is stored in T between layers).
template <typename T, typename TW>
ALIGNED_HD void fused_add_rms_norm_row(const T* x, const T* res, const TW* w, T* out, T* res_out, int64_t H,
                                       float eps) {
  for (int64_t k = 0; k < H; ++k) res_out[k] = from_f32<T>(to_f32(x[k]) + to_f32(res[k]));
  rms_norm_row(res_out, w, out, H, eps);
}

// rms_norm backward, per row (g = upstream gradient, y_k = x_k * inv):
//   gw_k = g_k * w_k ; dot = lane_sum(gw_k * x_k) ; c = ((dot / H) * inv) * inv
//   dx_k = round_T((gw_k - x_k * c) * inv)
// dw_k = chain over rows in order of (. + g_k * (x_k * inv)), computed by the column pass below.
template <typename V>
ALIGNED_HD V rms_grad_dot_step(V acc, V g, V w, V x) { return acc + (g * w) * x; }  // one lane's step of dot
ALIGNED_HD float rms_grad_coef(float dot, int64_t H, float inv) { return (div_f32(dot, (float)H) * inv) * inv; }
template <typename V>
ALIGNED_HD V rms_grad_dx(V g, V w, V x, V c, V inv) { return (g * w - x * c) * inv; }  // dx_k before rounding
template <typename V>
ALIGNED_HD V rms_grad_dw_step(V acc, V g, V x, V inv) { return acc + g * (x * inv); }  // dw_k's step for one row

template <typename T, typename TW>
ALIGNED_HD void rms_norm_backward_row(const T* g, const T* x, const TW* w, T* dx, int64_t H, float eps) {
  float inv = rms_inv(x, H, eps);
  float lanes[kReduceLanes];
  for (int j = 0; j < kReduceLanes; ++j) lanes[j] = 0.0f;
  for (int64_t k = 0; k < H; ++k)
    lanes[k % kReduceLanes] = rms_grad_dot_step(lanes[k % kReduceLanes], to_f32(g[k]), to_f32(w[k]), to_f32(x[k]));
  const float c = rms_grad_coef(fold_lanes(lanes), H, inv);
  for (int64_t k = 0; k < H; ++k) dx[k] = from_f32<T>(rms_grad_dx(to_f32(g[k]), to_f32(w[k]), to_f32(x[k]), c, inv));
}

// ---- silu_and_mul -------------------------------------------------------------------------------------
// x = [a | b] (last dim 2d): out_i = round_T(silu(a_i) * b_i), silu(a) = a / (1 + exp(-a)).
// Backward: s = 1 / (1 + exp(-a)); da = round_T((g * b) * (s + (a * s) * (1 - s))); db = round_T(g * silu(a)).
// silu's exp needs no NaN fix-up: a NaN a makes a / (1 + e) return a's NaN whatever e is (numerics.h).
template <typename V>
ALIGNED_HD V silu(V a) { return div_f32(a, V(1.0f) + exp_f32_not_nan(-a)); }
template <typename V>
ALIGNED_HD V silu_mul(V a, V b) { return silu(a) * b; }
template <typename V>
ALIGNED_HD void silu_mul_backward(V g, V a, V b, V* da, V* db) {
  const V s = div_f32(V(1.0f), V(1.0f) + exp_f32(-a));
  *da = (g * b) * (s + (a * s) * (V(1.0f) - s));
  *db = g * silu(a);
}

// ---- rotary_embedding -----------------------------------------------------------------------------------
// cos_sin_cache[pos] = [cos_0 .. cos_{R/2-1} | sin_0 .. sin_{R/2-1}] (fp32, R = rotary_dim).
// The table is built once on the host (python/aligned_ops/rope.py): RN32 of the real cos / sin of each float64
// angle, without libm, so both sides and every host hold the same bits.
// Pair i (i < R/2) is (i, i + R/2) for neox style, (2i, 2i+1) for gpt-j style; dims >= R pass through.
//   o1 = x1 * c - x2 * s ; o2 = x2 * c + x1 * s        (each product rounded, then one add/sub)
// Backward is the rotation by -theta: g1' = g1 * c + g2 * s ; g2' = g2 * c - g1 * s.
template <typename V>
ALIGNED_HD void rotate_pair(V x1, V x2, V c, V s, bool inverse, V* o1, V* o2) {
  if (!inverse) {
    *o1 = x1 * c - x2 * s;
    *o2 = x2 * c + x1 * s;
  } else {
    *o1 = x1 * c + x2 * s;
    *o2 = x2 * c - x1 * s;
  }
}

// ---- log_softmax / logsumexp / token_logprobs (+ their backward) ----------------------------------------
// s_v = z_v / tau (IEEE division; tau > 0 and a normal fp32 value, checked by the glue),
// m = max_v s_v (exact, order-free), sum = lane_sum over v of exp(s_v - m), L = log(sum).
// The row is kept as the pair (m, L) — never as one lse = m + L — so that the shift stays exact:
//   logp_v  = (s_v - m) - L                  (log_softmax; token_logprobs is logp_id of the same expression,
//                                             so it equals log_softmax(z)[id] bit for bit)
//   lse     = m + L                          (logsumexp)
//   p_v     = exp(logp_v)
// Why the pair: s_v - m is exact whenever s_v is within a factor 2 of m (Sterbenz) and L is in [0, log V],
// so logp of the likely tokens keeps full fp32 relative accuracy however large the logits are. The former
// s_v - (m + L) rounded m + L to the ulp of m first: errors of 3.7e-6 at max logit 1e2, 4.6e-4 at 1e4 and
// 3e-2 at 1e6; and a fully masked row (every logit -3e38 or the bf16 minimum) gave logp = 0 for every token
// (probabilities summing to V). With the pair that row gives (s - s) - log V = -log V exactly as it should.
// Backward (g = upstream gradient; each product rounded, then the division by tau):
//   token_logprobs: dz_v = round_T(((v == id ? 1 : 0) - p_v) * g / tau)        [(. * g) then / tau]
//   logsumexp:      dz_v = round_T((p_v * g) / tau)
//   log_softmax:    G = lane_sum over v of g_v (reduce.h order), dz_v = round_T((g_v - p_v * G) / tau)
// Special rows (decided by the max pass alone; NaN policy, see also the README):
//   a NaN s_v anywhere      -> (NaN, NaN): every logp, the lse and every gradient of the row are NaN;
//   a +inf s_v (no NaN)     -> (+inf, NaN): logsumexp = +inf (as torch.logsumexp), logp and gradients NaN;
//   every s_v = -inf        -> (-inf, 0): logsumexp = -inf, logp = (-inf - -inf) - 0 = NaN (as torch);
//   a NaN logp or logsumexp is the canonical NaN 0x7fc00000 on every backend (logp_value, lse_value); a NaN
//   gradient is a NaN (which one: the hardware's, see the NaN policy above);
//   some -inf, some finite  -> the -inf entries get logp = -inf and p = 0 (masked logits), others are exact.
// Note tau < 1 can turn a finite masked logit (-3e38) into s = -inf: such a row is an all -inf row.
// Accuracy limit of the exp-sum: each of the 32 lanes is a sequential fp32 chain of V/32 terms, so the
// relative error of sum (and the absolute error of L, in nats) grows like (V/32) * 2^-24 in the worst case,
// ~sqrt(V/32) * 2^-24 typically: ~1e-7 at V = 152k, but V = 2^24 (2^19 terms per lane) was off by 3e-4 nats.
struct LsePair {
  float m;  // shift: the row maximum of s (NaN / +inf / -inf for the special rows above)
  float L;  // log of the shifted exp-sum, in [0, log V] for an ordinary row
};

constexpr int32_t kRowHasNaN = 1;     // flags gathered by the max pass
constexpr int32_t kRowHasPosInf = 2;

ALIGNED_HD int32_t logit_flags(float s) {
  return (is_nan_f32(s) ? kRowHasNaN : 0) | (s == float_of(0x7f800000u) ? kRowHasPosInf : 0);
}

// The special rows: true when (m, flags) already decide the row (the exp-sum pass is skipped).
ALIGNED_HD bool lse_special_row(float m, int32_t flags, LsePair* out) {
  const float inf = float_of(0x7f800000u), nan = float_of(0x7fc00000u);
  if (flags & kRowHasNaN) {
    *out = LsePair{nan, nan};
    return true;
  }
  if (flags & kRowHasPosInf) {
    *out = LsePair{inf, nan};
    return true;
  }
  if (m == -inf) {
    *out = LsePair{-inf, 0.0f};
    return true;
  }
  return false;
}

// The pieces of the pair (every backend's row loop calls these):
template <typename V>
ALIGNED_HD V logit_scale(V z, V tau) { return div_f32(z, tau); }  // s_v
// One lane's step of the exp-sum. Only ordinary rows get here (no NaN, no +inf, m finite), so s - m is never
// NaN (s = -inf gives -inf) and the exp needs no NaN fix-up.
template <typename V>
ALIGNED_HD V lse_sum_term(V s, V m) { return exp_f32_not_nan(s - m); }
template <typename V>
ALIGNED_HD V lse_sum_step(V acc, V s, V m) { return acc + lse_sum_term(s, m); }
// A part's (max, flags) merged into the row's: the max in the total order (max_total_f32: exact, and order-free
// down to the sign of a zero maximum, which token_logprobs_pairs returns: with max_f32 a row holding +0 and -0 as
// its maximum got the sign of whichever came last in the fold, so the pair's m changed with the thread count and
// the batch's row count), flags are ORed.
ALIGNED_HD void lse_max_merge(float part_m, int32_t part_flags, float* m, int32_t* flags) {
  *m = max_total_f32(part_m, *m);
  *flags |= part_flags;
}
ALIGNED_HD LsePair lse_pair_of_sum(float m, float sum) { return LsePair{m, log_f32(sum)}; }

ALIGNED_HD float lse_value(LsePair p) {
  const float r = p.m == float_of(0x7f800000u) ? p.m : p.m + p.L;
  return is_nan_f32(r) ? float_of(0x7fc00000u) : r;  // NaN + NaN: NVIDIA writes 0x7fffffff (see logp_value)
}
// A NaN log-prob (a NaN or +inf row, an all -inf row) is the canonical NaN 0x7fc00000 on every backend: (s - m) - L
// would pass on s's own NaN (a NaN logit's sign and payload, which the linear before it leaves to the hardware's
// operand order: they varied with M) or the host's default NaN of -inf - -inf (x86 0xffc00000, NVIDIA 0x7fffffff).
ALIGNED_HD float logp_value(float s, LsePair p) {
  const float r = (s - p.m) - p.L;
  return is_nan_f32(r) ? float_of(0x7fc00000u) : r;
}
ALIGNED_HD float prob_value(float s, LsePair p) { return exp_f32(logp_value(s, p)); }

// The reference row: max pass, then the reduce.h lane sums of exp(s_v - m). Backends compute the same
// values with their own loops (cpu_kernels.cpp, dense_kernels.cuh); tests compare them.
template <typename T>
ALIGNED_HD LsePair lse_pair_row(const T* z, int64_t V, float tau) {
  float m = -float_of(0x7f800000u);
  int32_t flags = 0;
  for (int64_t v = 0; v < V; ++v) {
    float s = logit_scale(to_f32(z[v]), tau);
    lse_max_merge(s, logit_flags(s), &m, &flags);
  }
  LsePair p;
  if (lse_special_row(m, flags, &p)) return p;
  float lanes[kReduceLanes];
  for (int j = 0; j < kReduceLanes; ++j) lanes[j] = 0.0f;
  for (int64_t v = 0; v < V; ++v)
    lanes[v % kReduceLanes] = lse_sum_step(lanes[v % kReduceLanes], logit_scale(to_f32(z[v]), tau), m);
  return lse_pair_of_sum(m, fold_lanes(lanes));
}

ALIGNED_HD float token_logprobs_grad(float s, LsePair p, bool is_id, float g, float tau) {
  return div_f32(((is_id ? 1.0f : 0.0f) - prob_value(s, p)) * g, tau);
}
ALIGNED_HD float logsumexp_grad(float s, LsePair p, float g, float tau) { return div_f32(prob_value(s, p) * g, tau); }
ALIGNED_HD float log_softmax_grad(float s, LsePair p, float g_v, float g_sum, float tau) {
  return div_f32(g_v - prob_value(s, p) * g_sum, tau);
}

}  // namespace aligned
