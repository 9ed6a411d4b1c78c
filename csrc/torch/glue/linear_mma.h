// glue/linear_mma.h — the `mma` linear profile (csrc/common/mma.h: the matrix unit's bf16 instruction in the
// `fma` profile's 8 lanes and tree, + bias once, one rounding) for the linear glue bodies (glue/linear.h, one
// per op for every profile), and its families: linear_mma, linear_mma_partial, linear_mma_backward (LinearMma)
// and the scalar model of the unit the kernels are held to, _linear_mma_reference (LinearMmaReference: a test
// hook).
//
// The backend supplies mma_gemm(call, params) — its unit's GEMM over its own tiling (which never changes a bit:
// every output is one lane tree over all of K), refusing by the op's name where the machine has no unit —,
// column_sum (db: the fp32 column chains, as linear_backward's) and linear_mma_reference.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "linear.h"

namespace aligned::glue {

struct MmaLinear {
  static constexpr LinearOpNames kOps{"linear_mma", "linear_mma_partial", "linear_mma_backward",
                                      "_linear_mma_reference"};
  static constexpr LinearDtypes kDtypes = LinearDtypes::kBf16Only;
  // The unit's kernels read pairs along contiguous rows of A and B: a weight whose rows do not have unit stride
  // is copied (a view with unit k-stride is read in place).
  static at::Tensor weight_operand(const at::Tensor& w) { return w.stride(1) == 1 ? w : w.contiguous(); }
  template <class B>
  static void gemm(const typename B::Call& call, const GemmParams& p) {
    B::mma_gemm(call, p);
  }
  template <class B>
  static void reference(const typename B::Call& call, const GemmParams& p) {
    B::linear_mma_reference(call, p);
  }
  // Backward on the unit, every GEMM the profile's 8-lane linear: w and x are read in place as column-major B
  // operands; g^T is one contiguous copy (the unit reads its A operand along its rows).
  static GemmParams dx_params(const LinearArgs<DType>& a, const at::Tensor& g, const at::Tensor& w,
                              const at::Tensor& dx) {
    return make_linear_mma_dx_params(a, g, w, dx);
  }
  static at::Tensor dw_grad_operand(const at::Tensor& g) { return g.t().contiguous(); }
  static GemmParams dw_params(const LinearArgs<DType>& a, const at::Tensor& gt, const at::Tensor& x,
                              const at::Tensor& dw) {
    return make_linear_mma_dw_params(a, gt, x, dw);
  }
};

struct LinearMma {
  template <class B>
  static constexpr std::tuple ops{
      Op{"linear_mma", &linear<MmaLinear, B>},
      Op{"linear_mma_partial", &linear_partial<MmaLinear, B>},
      Op{"linear_mma_backward", &linear_backward<MmaLinear, B>},
  };
};

// ---- the AMX unit's packed weights (CPU; csrc/cpu/gemm_amx_mma_kernels.cpp) -----------------------------------
// linear_mma_pack_weight: the weight's tiles in the unit's packed layout (int16 [ceil(N / 16) * Q * 512], Q =
// mma_amx_lane_blocks(K)); linear_mma_packed: linear_mma reading them instead of the weight's rows — the same
// products in the same instructions, so the same bits. The weight is still passed: its shape, dtype and device
// are checked and the packing's size is held to them (a packing of another shape is refused by name).
inline int64_t mma_packed_weight_elems(int64_t N, int64_t K) { return (N + 15) / 16 * mma_amx_lane_blocks(K) * 512; }

template <class B>
at::Tensor linear_mma_pack_weight(const at::Tensor& weight) {
  const char* op = "linear_mma_pack_weight";
  const typename B::Call call(op, weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "aligned::", op, ": weight must be 2-D [out_features, in_features], got ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "aligned::", op, ": weight must be bfloat16 (the mma ",
              "profile's matrix units take bf16), got ", weight.scalar_type());
  const at::Tensor wc = MmaLinear::weight_operand(weight);
  auto out = at::empty({mma_packed_weight_elems(wc.size(0), wc.size(1))}, wc.options().dtype(at::kShort));
  B::mma_pack_weight(call, wc, out);
  return out;
}

template <class B>
at::Tensor linear_mma_packed(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& packed,
                             const std::optional<at::Tensor>& bias) {
  const char* op = "linear_mma_packed";
  const typename B::Call call(op, x, "x");
  call.on_device(weight, "weight");
  call.on_device(packed, "packed");
  call.on_device(bias, "bias");
  const auto a = check_linear<DType>(x, weight, bias, op, LinearDtypes::kBf16Only);
  const int64_t want = mma_packed_weight_elems(a.N, a.K);
  TORCH_CHECK(packed.scalar_type() == at::kShort && packed.dim() == 1 && packed.numel() == want &&
                  packed.is_contiguous(),
              "aligned::", op, ": packed must be linear_mma_pack_weight(weight): a contiguous int16 [", want,
              "] for a weight of ", weight.sizes(), ", got ", packed.scalar_type(), " ", packed.sizes());
  auto xc = x.reshape({a.M, a.K}).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = a.N;
  auto out = at::empty({a.M, a.N}, x.options());
  GemmParams p = make_linear_params(a, xc, MmaLinear::weight_operand(weight), out, a.dt, kLinearLanes);
  p.B_packed = want > 0 ? packed.data_ptr() : nullptr;
  B::mma_gemm(call, p);
  return out.view(sizes);
}

struct LinearMmaPacked {
  template <class B>
  static constexpr std::tuple ops{
      Op{"linear_mma_pack_weight", &linear_mma_pack_weight<B>},
      Op{"linear_mma_packed", &linear_mma_packed<B>},
  };
};

struct LinearMmaReference {
  template <class B>
  static constexpr std::tuple ops{Op{"_linear_mma_reference", &linear_reference<MmaLinear, B>}};
};

}  // namespace aligned::glue
