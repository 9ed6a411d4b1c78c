// make_params.h — the one place each op family's params struct (csrc/common/params_*.h) is filled from
// tensors, after the family's argument checks (checks/<family>.h). Each op's one glue body
// (csrc/torch/glue/<family>.h) checks devices, calls check_<op>, makes the contiguous inputs and allocates the
// outputs, then calls make_<op>_params here and hands the struct to its backend's run function (B::<op>) —
// no glue body or backend types a field itself.
//
// Tensors passed here are the ones the kernel reads or writes: contiguous (the checks and the glue make them
// so), outputs already allocated; an undefined tensor becomes nullptr. Device-independent (ATen only).
#pragma once

#include <ATen/ATen.h>

#include "../common/contract.h"
#include "../common/params_dense.h"
#include "../common/params_exact.h"
#include "../common/params_linear.h"
#include "../common/params_logits.h"
#include "../common/params_moe.h"
#include "checks/dense.h"
#include "checks/exact.h"
#include "checks/linear.h"
#include "checks/logits.h"

namespace aligned {

namespace detail {
inline const void* cptr(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
inline void* mptr(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
template <typename T>
inline T* typed_ptr(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}
}  // namespace detail

// ---- dense ------------------------------------------------------------------------------------------------
// rms_norm (residual, residual_out undefined) and fused_add_rms_norm.
inline RmsNormParams make_rms_norm_params(const NormArgs<DType>& a, const at::Tensor& x, const at::Tensor& w,
                                          const at::Tensor& out, double eps, const at::Tensor& residual = {},
                                          const at::Tensor& residual_out = {}) {
  RmsNormParams p{};
  p.dt = a.dt;
  p.wdt = a.wdt;
  p.x = x.data_ptr();
  p.residual = detail::cptr(residual);
  p.w = w.data_ptr();
  p.out = out.data_ptr();
  p.residual_out = detail::mptr(residual_out);
  p.rows = a.rows;
  p.H = a.H;
  p.eps = (float)eps;
  return p;
}

inline RmsNormBackwardParams make_rms_norm_backward_params(const NormArgs<DType>& a, const at::Tensor& g,
                                                           const at::Tensor& x, const at::Tensor& w,
                                                           const at::Tensor& dx, const at::Tensor& inv,
                                                           const at::Tensor& dw, double eps) {
  RmsNormBackwardParams p{};
  p.dt = a.dt;
  p.wdt = a.wdt;
  p.g = g.data_ptr();
  p.x = x.data_ptr();
  p.w = w.data_ptr();
  p.dx = dx.data_ptr();
  p.inv = inv.data_ptr<float>();
  p.dw = dw.data_ptr<float>();
  p.rows = a.rows;
  p.H = a.H;
  p.eps = (float)eps;
  return p;
}

// silu_and_mul (g undefined; out [rows, d]) and its backward (out = dx [rows, 2d]).
inline SiluMulParams make_silu_and_mul_params(const SiluMulArgs<DType>& a, const at::Tensor& x,
                                              const at::Tensor& out, const at::Tensor& g = {}) {
  SiluMulParams p{};
  p.dt = a.dt;
  p.g = detail::cptr(g);
  p.x = x.data_ptr();
  p.out = out.data_ptr();
  p.rows = a.rows;
  p.d = a.d;
  return p;
}

// error_flags: the GPU's device words for the in-kernel position check, nullptr on the CPU (host check).
inline RotaryParams make_rotary_params(const RotaryArgs<DType>& a, const at::Tensor& x, const at::Tensor& cache,
                                       const at::Tensor& out, int64_t rot, bool is_neox, bool inverse,
                                       int32_t* error_flags) {
  RotaryParams p{};
  p.dt = a.dt;
  p.positions = a.positions.data_ptr<int64_t>();
  p.x = x.data_ptr();
  p.out = out.data_ptr();
  p.cache = cache.data_ptr<float>();
  p.T = a.T;
  p.heads = a.heads;
  p.head_dim = a.head_dim;
  p.rot = rot;
  p.is_neox = is_neox;
  p.inverse = inverse;
  p.max_pos = cache.size(0);
  p.error_flags = error_flags;
  return p;
}

inline ElementwiseParams make_elementwise_params(const at::Tensor& x, const at::Tensor& out) {
  return ElementwiseParams{x.data_ptr<float>(), out.data_ptr<float>(), x.numel()};
}

// ---- logits -----------------------------------------------------------------------------------------------
// The tensors one log-prob op reads or writes besides the logits (check_logits' z and temps); undefined = not
// used by this op.
struct LogitsTensors {
  at::Tensor ids;      // int64 [T] (check_token_ids)
  at::Tensor g;        // fp32 [T] or [T, V] (check_logits_grad)
  at::Tensor pairs;    // fp32 [T, 2]
  at::Tensor lse;      // fp32 [T] out
  at::Tensor out_f32;  // fp32 [T, V] or [T] out
  at::Tensor dz;       // [T, V] out in the logits dtype
};

inline LogitsParams make_logits_params(const LogitsArgs<DType>& a, const LogitsTensors& t,
                                       LogitsGrad mode = LogitsGrad::kTokenLogprobs, int64_t v0 = 0,
                                       int32_t* error_flags = nullptr) {
  LogitsParams p{};
  p.dt = a.dt;
  p.z = a.z.data_ptr();
  p.T = a.T;
  p.V = a.V;
  p.tau = a.tau;
  p.temps = a.temps_ptr();
  p.ids = detail::typed_ptr<int64_t>(t.ids);
  p.g = detail::typed_ptr<float>(t.g);
  p.pairs = detail::typed_ptr<float>(t.pairs);
  p.lse = detail::typed_ptr<float>(t.lse);
  p.out_f32 = detail::typed_ptr<float>(t.out_f32);
  p.dz = detail::mptr(t.dz);
  p.v0 = v0;
  p.mode = mode;
  p.error_flags = error_flags;
  return p;
}

// ---- linear (`fma` profile) -------------------------------------------------------------------------------
// C [M, N] (row stride N) = the lane tree of A [M, K] (strides a_sm, a_sk) times B [N, K] (strides b_sn, b_sk),
// + bias when defined; A, B in dt, C in cdt (dt, or F32 for linear_partial). The GPU glue adds its lane
// workspace (lane_ws, ws_rows: gemm_workspace_rows).
inline GemmParams make_gemm_params(DType dt, const at::Tensor& A, int64_t a_sm, int64_t a_sk, const at::Tensor& B,
                                   int64_t b_sn, int64_t b_sk, const at::Tensor& bias, DType cdt, const at::Tensor& C,
                                   int64_t M, int64_t N, int64_t K, int lanes) {
  GemmParams p{};
  p.adt = p.bdt = dt;
  p.cdt = cdt;
  p.A = A.data_ptr();
  p.a_sm = a_sm;
  p.a_sk = a_sk;
  p.B = B.data_ptr();
  p.b_sn = b_sn;
  p.b_sk = b_sk;
  p.bias = detail::cptr(bias);
  p.C = C.data_ptr();
  p.c_sm = N;
  p.M = M;
  p.N = N;
  p.K = K;
  p.lanes = lanes;
  return p;
}

// The GEMMs of the family: linear / linear_partial (x [M, K] contiguous, weight [N, K] any strides), and
// linear_backward's dx [M, K] = g [M, N] . w [N, K] and dw [N, K] = g^T . x (one chain each: 1 lane).
inline GemmParams make_linear_params(const LinearArgs<DType>& a, const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& out, DType cdt, int lanes) {
  return make_gemm_params(a.dt, x, a.K, 1, weight, weight.stride(0), weight.stride(1), a.bias, cdt, out, a.M, a.N,
                          a.K, lanes);
}
inline GemmParams make_linear_dx_params(const LinearArgs<DType>& a, const at::Tensor& g, const at::Tensor& w,
                                        const at::Tensor& dx) {
  return make_gemm_params(a.dt, g, a.N, 1, w, 1, a.K, at::Tensor(), a.dt, dx, a.M, a.K, a.N, 1);
}
inline GemmParams make_linear_dw_params(const LinearArgs<DType>& a, const at::Tensor& g, const at::Tensor& x,
                                        const at::Tensor& dw) {
  return make_gemm_params(a.dt, g, 1, a.N, x, 1, a.K, at::Tensor(), a.dt, dw, a.N, a.K, a.M, 1);
}

// The `mma` profile's backward GEMMs (csrc/common/mma.h), every one the profile's 8-lane linear: dx [M, K] = g [M, N]
// . w over N (w read in place, column-major as the GEMM's B); dw [N, K] = (g^T) [N, M] . x over the M tokens (gt:
// the contiguous transposed copy — the unit's A operand is read along its rows —, x in place).
inline GemmParams make_linear_mma_dx_params(const LinearArgs<DType>& a, const at::Tensor& g, const at::Tensor& w,
                                            const at::Tensor& dx) {
  return make_gemm_params(a.dt, g, a.N, 1, w, 1, a.K, at::Tensor(), a.dt, dx, a.M, a.K, a.N, kLinearLanes);
}
inline GemmParams make_linear_mma_dw_params(const LinearArgs<DType>& a, const at::Tensor& gt, const at::Tensor& x,
                                            const at::Tensor& dw) {
  return make_gemm_params(a.dt, gt, a.M, 1, x, 1, a.K, at::Tensor(), a.dt, dw, a.N, a.K, a.M, kLinearLanes);
}

// linear_backward's bias gradient: db [N] = the column chains of g [M, N].
inline ColumnSumParams make_column_sum_params(const LinearArgs<DType>& a, const at::Tensor& g, const at::Tensor& db) {
  ColumnSumParams p{};
  p.dt = p.out_dt = a.dt;
  p.g = g.data_ptr();
  p.out = db.data_ptr();
  p.rows = a.M;
  p.cols = a.N;
  return p;
}

// ---- moe ----------------------------------------------------------------------------------------------------
// The tensors of one top-k routing op (MoeTopkParams): forward — z read, scores, ids, w allocated, gw, gs, dz
// undefined; backward — z and ids read, gw and gs (may be undefined) read, dz written.
struct MoeRoutingTensors {
  at::Tensor z;       // [T, E] router logits, contiguous
  at::Tensor ids;     // int64 [T, k]
  at::Tensor scores;  // fp32 [T, E] out
  at::Tensor w;       // fp32 [T, k] out
  at::Tensor gw;      // fp32 [T, k]
  at::Tensor gs;      // fp32 [T, E]
  at::Tensor dz;      // [T, E] out in the logits dtype
};

namespace detail {
inline void fill_moe_topk_params(MoeTopkParams& p, DType dt, const MoeRoutingTensors& t, int64_t k,
                                 bool renormalize) {
  p.dt = dt;
  p.z = t.z.data_ptr();
  p.T = t.z.size(0);
  p.E = t.z.size(1);
  p.k = k;
  p.renormalize = renormalize;
  p.scores = typed_ptr<float>(t.scores);
  p.ids = typed_ptr<int64_t>(t.ids);
  p.w = typed_ptr<float>(t.w);
  p.gw = typed_ptr<float>(t.gw);
  p.gs = typed_ptr<float>(t.gs);
  p.dz = mptr(t.dz);
}
}  // namespace detail

inline MoeRoutingParams make_moe_routing_params(DType dt, const MoeRoutingTensors& t, int64_t k, MoeScoring scoring,
                                                bool renormalize) {
  MoeRoutingParams p{};
  detail::fill_moe_topk_params(p, dt, t, k, renormalize);
  p.scoring = scoring;
  return p;
}

// moe_grouped_routing: bias is the fp32 correction bias (forward only; may be undefined).
inline MoeGroupedRoutingParams make_moe_grouped_routing_params(DType dt, const MoeRoutingTensors& t,
                                                               const at::Tensor& bias, int64_t k, int64_t n_group,
                                                               int64_t topk_group, bool renormalize, double scale) {
  MoeGroupedRoutingParams p{};
  detail::fill_moe_topk_params(p, dt, t, k, renormalize);
  p.bias = detail::typed_ptr<float>(bias);
  p.n_group = n_group;
  p.topk_group = topk_group;
  p.scale = static_cast<float>(scale);
  return p;
}

inline MoeCombineParams make_moe_combine_params(DType dt, const at::Tensor& y, const at::Tensor& pos,
                                                const at::Tensor& w, const at::Tensor& ys,
                                                const at::Tensor& gate_logit, const at::Tensor& out) {
  MoeCombineParams p{};
  p.dt = dt;
  p.y = y.data_ptr<float>();
  p.pos = pos.data_ptr<int64_t>();
  p.w = w.data_ptr<float>();
  p.T = out.size(0);
  p.k = pos.size(1);
  p.H = out.size(1);
  p.ys = detail::typed_ptr<float>(ys);
  p.gate_logit = detail::typed_ptr<float>(gate_logit);
  p.out = out.data_ptr();
  return p;
}

inline MoeExpertsParams make_moe_experts_params(DType dt, const at::Tensor& x, const at::Tensor& w,
                                                const at::Tensor& ids, const at::Tensor& w13, const at::Tensor& w2,
                                                const at::Tensor& sw13, const at::Tensor& sw2,
                                                const at::Tensor& sgate, const at::Tensor& out) {
  MoeExpertsParams p{};
  p.dt = dt;
  p.x = x.data_ptr();
  p.w = w.data_ptr<float>();
  p.ids = ids.data_ptr<int64_t>();
  p.T = x.size(0);
  p.k = ids.size(1);
  p.H = x.size(1);
  p.I = w13.size(1) / 2;
  p.w13 = w13.data_ptr();
  p.w2 = w2.data_ptr();
  p.sw13 = detail::cptr(sw13);
  p.sw2 = detail::cptr(sw2);
  p.sgate = detail::cptr(sgate);
  p.Is = sw13.defined() ? sw13.size(0) / 2 : 0;
  p.out = out.data_ptr();
  return p;
}

// ---- exact linear ----------------------------------------------------------------------------------------
// The GEMM of packed x digits (xd [max digits, Mp, Kp], per-row E / S / non-finite flags) and the packed weight
// (wd [Sw, Np * Kp] digits, per-row E / flags); out [M, N] in dt. The backend sets its own schedule fields
// (CPU: tile range, k_parts, use_amx; GPU: chunk_k) — none can change a bit (the sum is exact).
inline ExactGemmParams make_exact_gemm_params(DType dt, const at::Tensor& xd, int64_t Mp, const at::Tensor& x_exp,
                                              const at::Tensor& x_digits, const at::Tensor& x_bad,
                                              const at::Tensor& wd, const at::Tensor& w_exp, const at::Tensor& w_bad,
                                              const at::Tensor& bias, const at::Tensor& out, int64_t M, int64_t N,
                                              int64_t K, int64_t Kp) {
  ExactGemmParams p{};
  p.dt = dt;
  p.xd = xd.data_ptr<int8_t>();
  p.x_plane = Mp * Kp;
  p.x_exp = x_exp.data_ptr<int32_t>();
  p.x_digits = x_digits.data_ptr<int8_t>();
  p.x_bad = x_bad.data_ptr<uint8_t>();
  p.wd = wd.data_ptr<int8_t>();
  p.w_plane = wd.size(1);
  p.w_exp = w_exp.data_ptr<int32_t>();
  p.w_bad = w_bad.data_ptr<uint8_t>();
  p.w_digits = (int)wd.size(0);
  p.bias = detail::cptr(bias);
  p.out = out.data_ptr();
  p.M = M;
  p.N = N;
  p.K = K;
  p.Kp = Kp;
  return p;
}

}  // namespace aligned
