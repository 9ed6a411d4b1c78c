// cpu_kernels.cpp — CPU backend kernels, compiled once per ISA level (see CMakeLists.txt: this file is
// built with -DALIGNED_ISA=generic / avx2 / avx512 and the matching -m flags). The bodies only call the
// per-row definitions of csrc/common/contract.h, so every ISA level computes the same bits; the wider
// levels are faster because the compiler vectorises the lane loops (32 independent lanes) and the
// across-n fma chains of the GEMM.
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <memory>

#include "../common/contract.h"
#include "cpu_kernels.h"

#ifndef ALIGNED_ISA
#error "ALIGNED_ISA must name the ISA level this translation unit is compiled for"
#endif

namespace aligned::cpu::ALIGNED_ISA {

using aligned::bf16_t;
using aligned::f16_t;

// Calls fn with a typed null pointer for the storage type named by dt.
template <typename Fn>
static void with_type(DType dt, Fn&& fn) {
  switch (dt) {
    case DType::F32: fn((float*)nullptr); break;
    case DType::BF16: fn((bf16_t*)nullptr); break;
    case DType::F16: fn((f16_t*)nullptr); break;
  }
}

static void rms_norm(DType dt, DType wdt, const void* x, const void* w, void* out, int64_t H, float eps,
                     int64_t r0, int64_t r1) {
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    with_type(wdt, [&](auto* wp) {
      using TW = std::remove_pointer_t<decltype(wp)>;
      for (int64_t r = r0; r < r1; ++r)
        rms_norm_row((const T*)x + r * H, (const TW*)w, (T*)out + r * H, H, eps);
    });
  });
}

static void fused_add_rms_norm(DType dt, DType wdt, const void* x, const void* res, const void* w, void* out,
                               void* res_out, int64_t H, float eps, int64_t r0, int64_t r1) {
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    with_type(wdt, [&](auto* wp) {
      using TW = std::remove_pointer_t<decltype(wp)>;
      for (int64_t r = r0; r < r1; ++r)
        fused_add_rms_norm_row((const T*)x + r * H, (const T*)res + r * H, (const TW*)w, (T*)out + r * H,
                               (T*)res_out + r * H, H, eps);
    });
  });
}

static void rms_norm_backward_dx(DType dt, DType wdt, const void* g, const void* x, const void* w, void* dx,
                                 int64_t H, float eps, int64_t r0, int64_t r1) {
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    with_type(wdt, [&](auto* wp) {
      using TW = std::remove_pointer_t<decltype(wp)>;
      for (int64_t r = r0; r < r1; ++r)
        rms_norm_backward_row((const T*)g + r * H, (const T*)x + r * H, (const TW*)w, (T*)dx + r * H, H, eps);
    });
  });
}

static void rms_inv_rows(DType dt, const void* x, float* inv, int64_t H, float eps, int64_t r0, int64_t r1) {
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = r0; r < r1; ++r) inv[r] = rms_inv((const T*)x + r * H, H, eps);
  });
}

// dw[k] = chain over rows r = 0..rows-1 of (. + g[r,k] * (x[r,k] * inv[r])), columns [c0, c1).
static void rms_norm_backward_dw(DType dt, const void* g, const void* x, float* dw, int64_t rows, int64_t H,
                                 float eps, const float* inv, int64_t c0, int64_t c1) {
  (void)eps;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    const T* gt = (const T*)g;
    const T* xt = (const T*)x;
    for (int64_t k = c0; k < c1; ++k) dw[k] = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      const T* gr = gt + r * H;
      const T* xr = xt + r * H;
      float iv = inv[r];
      for (int64_t k = c0; k < c1; ++k) dw[k] = dw[k] + to_f32(gr[k]) * (to_f32(xr[k]) * iv);
    }
  });
}

static void silu_and_mul(DType dt, const void* x, void* out, int64_t d, int64_t r0, int64_t r1) {
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = r0; r < r1; ++r) {
      const T* a = (const T*)x + r * 2 * d;
      const T* b = a + d;
      T* o = (T*)out + r * d;
      for (int64_t i = 0; i < d; ++i) o[i] = from_f32<T>(silu_mul(to_f32(a[i]), to_f32(b[i])));
    }
  });
}

static void silu_and_mul_backward(DType dt, const void* g, const void* x, void* dx, int64_t d, int64_t r0,
                                  int64_t r1) {
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = r0; r < r1; ++r) {
      const T* gr = (const T*)g + r * d;
      const T* a = (const T*)x + r * 2 * d;
      const T* b = a + d;
      T* da = (T*)dx + r * 2 * d;
      T* db = da + d;
      for (int64_t i = 0; i < d; ++i) {
        float fa, fb;
        silu_mul_backward(to_f32(gr[i]), to_f32(a[i]), to_f32(b[i]), &fa, &fb);
        da[i] = from_f32<T>(fa);
        db[i] = from_f32<T>(fb);
      }
    }
  });
}

static void rotary(DType dt, const int64_t* positions, const void* x, void* out, const float* cache, int64_t heads,
                   int64_t head_dim, int64_t rot, bool is_neox, bool inverse, int64_t r0, int64_t r1) {
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    const int64_t half = rot / 2;
    for (int64_t t = r0; t < r1; ++t) {
      const float* cs = cache + positions[t] * rot;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = (const T*)x + (t * heads + h) * head_dim;
        T* o = (T*)out + (t * heads + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const int64_t i1 = is_neox ? i : 2 * i;
          const int64_t i2 = is_neox ? i + half : 2 * i + 1;
          float o1, o2;
          rotate_pair(to_f32(xr[i1]), to_f32(xr[i2]), cs[i], cs[half + i], inverse, &o1, &o2);
          o[i1] = from_f32<T>(o1);
          o[i2] = from_f32<T>(o2);
        }
        for (int64_t i = rot; i < head_dim; ++i) o[i] = xr[i];
      }
    }
  });
}

static void logsumexp(DType dt, const void* z, float* lse, int64_t V, float tau, const float* temps, int64_t r0,
                      int64_t r1) {
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = r0; r < r1; ++r) lse[r] = logsumexp_row((const T*)z + r * V, V, temps ? temps[r] : tau);
  });
}

static void log_softmax(DType dt, const void* z, const float* lse, float* out, int64_t V, float tau,
                        const float* temps, int64_t r0, int64_t r1) {
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = r0; r < r1; ++r) {
      const T* zr = (const T*)z + r * V;
      const float t = temps ? temps[r] : tau;
      const float l = lse[r];
      float* o = out + r * V;
      for (int64_t v = 0; v < V; ++v) o[v] = div_f32(to_f32(zr[v]), t) - l;
    }
  });
}

static void token_logprobs_backward(DType dt, const float* g, const void* z, const int64_t* ids, const float* lse,
                                    void* dz, int64_t V, float tau, const float* temps, int64_t r0, int64_t r1) {
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    for (int64_t r = r0; r < r1; ++r) {
      const T* zr = (const T*)z + r * V;
      T* o = (T*)dz + r * V;
      const float t = temps ? temps[r] : tau;
      const float l = lse[r];
      const float gr = g[r];
      const int64_t id = ids[r];
      for (int64_t v = 0; v < V; ++v) {
        float p = exp_f32(div_f32(to_f32(zr[v]), t) - l);
        float onehot = v == id ? 1.0f : 0.0f;
        o[v] = from_f32<T>(div_f32((onehot - p) * gr, t));
      }
    }
  });
}

// GEMM (linear and its backward): gemm_kernels.cpp, compiled per ISA level like this file.
void gemm(DType adt, const void* A, int64_t a_sm, int64_t a_sk, DType bdt, const void* B, int64_t b_sn, int64_t b_sk,
          const void* bias, DType cdt, void* C, int64_t c_sm, int64_t K, int64_t m0, int64_t m1, int64_t n0,
          int64_t n1);

static void column_sum(DType dt, const void* g, int64_t rows, int64_t cols, DType out_dt, void* out, int64_t n0,
                       int64_t n1) {
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    with_type(out_dt, [&](auto* op) {
      using TO = std::remove_pointer_t<decltype(op)>;
      const T* gt = (const T*)g;
      for (int64_t n = n0; n < n1; ++n) {
        float acc = 0.0f;
        for (int64_t m = 0; m < rows; ++m) acc = acc + to_f32(gt[m * cols + n]);
        ((TO*)out)[n] = from_f32<TO>(acc);
      }
    });
  });
}

static float exp_scalar(float x) { return exp_f32(x); }
static float log_scalar(float x) { return log_f32(x); }

extern const KernelTable kTable;
const KernelTable kTable = {
#define ALIGNED_STR2(x) #x
#define ALIGNED_STR(x) ALIGNED_STR2(x)
    ALIGNED_STR(ALIGNED_ISA),
    rms_norm,
    fused_add_rms_norm,
    rms_norm_backward_dx,
    rms_norm_backward_dw,
    rms_inv_rows,
    silu_and_mul,
    silu_and_mul_backward,
    rotary,
    logsumexp,
    log_softmax,
    token_logprobs_backward,
    gemm,
    column_sum,
    exp_scalar,
    log_scalar,
};

}  // namespace aligned::cpu::ALIGNED_ISA
