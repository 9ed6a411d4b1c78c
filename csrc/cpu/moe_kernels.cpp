// moe_kernels.cpp — the moe family's torch-free CPU kernels (see moe_kernels.h), compiled once per ISA level
// (CMake builds every csrc/cpu/*_kernels.cpp with -DALIGNED_ISA=...). Each loop is the per-token function of
// csrc/common/moe.h; the combine is written with the output column innermost so the compiler vectorises
// across columns without touching any element's tree (contraction is off).
#include <stdlib.h>

#include <type_traits>
#include <vector>

#include "../common/moe.h"
#include "moe_kernels.h"

#ifndef ALIGNED_ISA
#error "ALIGNED_ISA must name the ISA level this translation unit is compiled for"
#endif

namespace aligned::cpu::ALIGNED_ISA {

namespace {

void routing(const MoeRoutingParams& prm, int64_t row_begin, int64_t row_end) {
  const DType dt = prm.dt;
  const void* z = prm.z;
  const int64_t E = prm.E, k = prm.k;
  const MoeScoring scoring = prm.scoring;
  const bool renormalize = prm.renormalize;
  float* scores = prm.scores;
  int64_t* ids = prm.ids;
  float* w = prm.w;
  std::vector<unsigned char> taken(E);
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    const T* zt = (const T*)z;
    for (int64_t r = row_begin; r < row_end; ++r) {
      float* p = scores + r * E;
      moe_scores_row(zt + r * E, E, scoring, p);
      moe_topk_row(zt + r * E, p, E, k, scoring, renormalize, taken.data(), ids + r * k, w + r * k);
    }
  });
}

void routing_backward(const MoeRoutingParams& prm, int64_t row_begin, int64_t row_end) {
  const DType dt = prm.dt;
  const float *gw = prm.gw, *gs = prm.gs;
  const void* z = prm.z;
  const int64_t* ids = prm.ids;
  const int64_t E = prm.E, k = prm.k;
  const MoeScoring scoring = prm.scoring;
  const bool renormalize = prm.renormalize;
  void* dz = prm.dz;
  std::vector<float> scratch(3 * E);
  float *p = scratch.data(), *gp = p + E, *d = gp + E;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = row_begin; r < row_end; ++r) {
      moe_routing_backward_row((const float*)gw + r * k, gs ? gs + r * E : nullptr, (const T*)z + r * E, ids + r * k,
                               E, k, scoring, renormalize, p, gp, d);
      T* out = (T*)dz + r * E;
      for (int64_t i = 0; i < E; ++i) out[i] = from_f32<T>(d[i]);
    }
  });
}

void combine(const MoeCombineParams& prm, int64_t row_begin, int64_t row_end) {
  const DType dt = prm.dt;
  const float *y = prm.y, *w = prm.w, *ys = prm.ys, *g = prm.gate_logit;
  const int64_t* pos = prm.pos;
  void* out = prm.out;
  const int64_t k = prm.k, H = prm.H;
  std::vector<float> acc(H);
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t t = row_begin; t < row_end; ++t) {
      // Same tree as moe_combine_row, column-innermost: acc = +0, + w_r * y_r for r in rank order, + g * y_s.
      float* a = acc.data();
      for (int64_t n = 0; n < H; ++n) a[n] = 0.0f;
      for (int64_t r = 0; r < k; ++r) {
        const float wr = w[t * k + r];
        const float* yr = y + pos[t * k + r] * H;
        for (int64_t n = 0; n < H; ++n) a[n] = moe_combine_step(a[n], wr, yr[n]);
      }
      if (ys) {
        const float gt = g ? moe_shared_gate(g[t]) : 1.0f;  // moe.h: the gate of the logit
        const float* yst = ys + t * H;
        for (int64_t n = 0; n < H; ++n) a[n] = moe_combine_step(a[n], gt, yst[n]);
      }
      T* o = (T*)out + t * H;
      for (int64_t n = 0; n < H; ++n) o[n] = from_f32<T>(a[n]);
    }
  });
}

void experts_reference(const MoeExpertsParams& prm, int64_t row_begin, int64_t row_end) {
  const DType dt = prm.dt;
  const void *x = prm.x, *w13 = prm.w13, *w2 = prm.w2, *sw13 = prm.sw13, *sw2 = prm.sw2, *sgate = prm.sgate;
  const float* w = prm.w;
  const int64_t* ids = prm.ids;
  const int64_t k = prm.k, H = prm.H, I = prm.I, Is = prm.Is;
  void* out = prm.out;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    const int64_t Imax = I > Is ? I : Is;
    std::vector<T> h(2 * Imax), a(Imax);
    std::vector<float> y((k + 1) * H);
    std::vector<const float*> yp(k);
    for (int64_t t = row_begin; t < row_end; ++t) {
      const T* xt = (const T*)x + t * H;
      for (int64_t r = 0; r < k; ++r) {
        const int64_t e = ids[t * k + r];
        moe_expert_row_reference(xt, (const T*)w13 + e * 2 * I * H, (const T*)w2 + e * H * I, H, I, h.data(),
                                 a.data(), y.data() + r * H);
        yp[r] = y.data() + r * H;
      }
      const float* ys = nullptr;
      float g = 1.0f;
      if (sw13) {
        moe_expert_row_reference(xt, (const T*)sw13, (const T*)sw2, H, Is, h.data(), a.data(), y.data() + k * H);
        ys = y.data() + k * H;
        if (sgate) g = moe_shared_gate(linear_dot(xt, (const T*)sgate, H));
      }
      moe_combine_row(yp.data(), w + t * k, k, ys, g, (T*)out + t * H, H);
    }
  });
}

void grouped_routing(const MoeGroupedRoutingParams& prm, int64_t row_begin, int64_t row_end) {
  const int64_t E = prm.E, k = prm.k, G = prm.n_group;
  std::vector<float> key(E), gscore(G);
  std::vector<unsigned char> taken(E), kept(G);
  with_type(prm.dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    const T* zt = (const T*)prm.z;
    for (int64_t r = row_begin; r < row_end; ++r)
      moe_grouped_routing_row(zt + r * E, prm.bias, E, k, G, prm.topk_group, prm.renormalize, prm.scale, key.data(),
                              gscore.data(), taken.data(), kept.data(), prm.scores + r * E, prm.ids + r * k,
                              prm.w + r * k);
  });
}

void grouped_routing_backward(const MoeGroupedRoutingParams& prm, int64_t row_begin, int64_t row_end) {
  const int64_t E = prm.E, k = prm.k;
  std::vector<float> scratch(3 * E + k);
  float *p = scratch.data(), *gp = p + E, *d = gp + E, *u = d + E;
  with_type(prm.dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = row_begin; r < row_end; ++r) {
      moe_grouped_routing_backward_row(prm.gw + r * k, prm.gs ? prm.gs + r * E : nullptr, (const T*)prm.z + r * E,
                                       prm.ids + r * k, E, k, prm.renormalize, prm.scale, p, gp, u, d);
      T* out = (T*)prm.dz + r * E;
      for (int64_t i = 0; i < E; ++i) out[i] = from_f32<T>(d[i]);
    }
  });
}

}  // namespace

extern const MoeKernels kMoe;
const MoeKernels kMoe = {
    .routing = routing,
    .routing_backward = routing_backward,
    .combine = combine,
    .experts_reference = experts_reference,
    .grouped_routing = grouped_routing,
    .grouped_routing_backward = grouped_routing_backward,
};

}  // namespace aligned::cpu::ALIGNED_ISA
