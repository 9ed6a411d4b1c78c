// backends/cpu.h — the CPU backend: what the glue bodies (csrc/torch/glue/) need from it.
//
//   Call                 one op call: its name and first tensor; every tensor must be a CPU tensor
//   kValueChecks         kHost: data values (positions, ids, temperatures) are checked at the call, on the host
//   error_flags(call)    nullptr (no deferred errors on the CPU)
//   <op>(call, params)   the run: the thread split of the op's kernels (at::parallel_for over rows, the split-row
//                        paths of few-row batches, the GEMM's panel tiling), never a reduction
//
// The kernels are torch-free (csrc/cpu/*_kernels.cpp, one build per ISA level, chosen once by
// csrc/cpu/cpu_backend.h); the run functions live in backends/cpu_<family>.cpp, which also instantiate the CPU
// key's registrations of their families (register_cpu.cpp). Threads only pick which rows, columns or tiles a
// kernel call computes, so no choice here can change a bit (contract.h).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "../../common/attention_plan.h"
#include "../../common/params_attention.h"
#include "../../common/params_dense.h"
#include "../../common/params_linear.h"
#include "../../common/params_logits.h"
#include "../../common/params_moe.h"
#include "../../cpu/ieee_env.h"
#include "../checks/common.h"
#include "../families.h"
#include "../run_args.h"

namespace aligned::glue {

struct Cpu {
  static constexpr ValueChecks kValueChecks = ValueChecks::kHost;
  static constexpr bool kExactF64Path = true;  // the exact linear's fp64 routes (ALIGNED_EXACT_F64)

  // The whole op (checks, glue, serial paths, tasks run inline) runs on the calling thread under ieee_env.h's
  // IEEE environment, whatever FTZ / DAZ the caller set; the worker threads get it from ieee_parallel_for.
  class Call {
   public:
    Call(const char* op, const at::Tensor& first, const char* first_name) : op(op), first(first) {
      on_device(first, first_name);
    }
    void on_device(const at::Tensor& t, const char* name) const {
      TORCH_CHECK(t.device().is_cpu(), "aligned::", op, ": ", name, " must be a CPU tensor, got device ",
                  t.device());
    }
    void on_device(const std::optional<at::Tensor>& t, const char* name) const {
      if (t.has_value() && t->defined()) on_device(*t, name);
    }
    const char* const op;
    const at::Tensor& first;

   private:
    cpu::IeeeFpEnv fenv_;
  };
  static int32_t* error_flags(const Call&) { return nullptr; }

  // dense (cpu_dense.cpp)
  static void rms_norm(const Call&, const RmsNormParams& p);
  static void fused_add_rms_norm(const Call&, const RmsNormParams& p);
  static void rms_norm_backward(const Call&, const RmsNormBackwardParams& p);
  static void silu_and_mul(const Call&, const SiluMulParams& p);
  static void silu_and_mul_backward(const Call&, const SiluMulParams& p);
  static void rotary(const Call&, const RotaryParams& p);
  // logits (cpu_dense.cpp); p.pairs: the rows' (m, L) pairs when the op returns them, else scratch of the run
  static void logsumexp(const Call&, const LogitsParams& p);
  static void log_softmax(const Call&, const LogitsParams& p);
  static void token_logprobs(const Call&, const LogitsParams& p);
  static void token_logprobs_backward(const Call&, const LogitsParams& p);
  static void logsumexp_backward(const Call&, const LogitsParams& p);
  static void log_softmax_backward(const Call&, const LogitsParams& p);
  static void token_logprobs_backward_cols(const Call&, const LogitsParams& p);
  // the fma linear and the hooks (cpu_dense.cpp)
  static void gemm(const Call&, const GemmParams& p);
  static void column_sum(const Call&, const ColumnSumParams& p);
  static void linear_partial_reference(const Call&, const GemmParams& p);
  static void exp_f32(const Call&, const ElementwiseParams& p);
  static void log_f32(const Call&, const ElementwiseParams& p);
  static at::Tensor device_error_flags(const Call& call);
  // the mma linear (cpu_mma.cpp): the unit's GEMM (AVX512-BF16 vdpbf16ps, csrc/cpu/mma_kernels.h) over
  // gemm_tiles.h's split, refused by the op's name on a CPU without the unit; mma.h's scalar model
  static void mma_gemm(const Call& call, const GemmParams& p);
  // the amx_bf16 unit's packed weight (refused by the op's name on any other unit)
  static void mma_pack_weight(const Call& call, const at::Tensor& weight, at::Tensor& out);
  static void linear_mma_reference(const Call&, const GemmParams& p);
  // the exact linear (cpu_exact.cpp); every run sets the IEEE environment of exact_linear.h
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_exact_pack_weight(const Call&, DType dt,
                                                                                 const at::Tensor& wc);
  static void linear_exact_packed(const Call&, const ExactPackedRun& r);
  static bool exact_f64_path_enabled();
  static void linear_exact_f64_bounds(const Call&, DType dt, const at::Tensor& wc, const at::Tensor& out);
  static void linear_exact_f64_pairs(const Call&, DType dt, const at::Tensor& xc, const at::Tensor& bounds,
                                     const at::Tensor& out);
  static void linear_exact_f64_routes(const Call&, DType dt, const at::Tensor& xc, const at::Tensor& wc,
                                      const at::Tensor& bounds, const at::Tensor& out);
  static void linear_exact_row_scan(const Call&, DType dt, const at::Tensor& vc, const at::Tensor& out);
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_exact_pack_weight_scanned(const Call&, DType dt,
                                                                                         const at::Tensor& wc,
                                                                                         const at::Tensor& row_scan);
  static void linear_exact_partial(const Call&, const ExactPackedRun& r, const at::Tensor& x_scan);
  static void linear_exact_finish(const Call&, DType dt, const at::Tensor& partial, const at::Tensor& x_scan,
                                  const at::Tensor& w_exp, const at::Tensor& w_bad, const at::Tensor& bias,
                                  const at::Tensor& out);
  static at::Tensor linear_exact_reference(const Call&, const at::Tensor& x, const at::Tensor& weight,
                                           const at::Tensor& bias);
  // attention (cpu_attention.cpp)
  static void attention_forward(const Call&, const AttnProblem& problem, const AttnPlan& plan, void* out,
                                float* lse);
  static void attention_forward_planned(const Call&, const AttnProblem& problem, const AttnPlanInfo& info,
                                        const at::Tensor& plan, const at::Tensor& table, int64_t workspace_floats,
                                        const AttnRunDims& run, void* out, float* lse);
  static void attention_backward(const Call&, const AttnBackwardRun& r);
  // the mma profile's attention (attention_mma.h) has no CPU kernel and no CPU model: refused by name
  static void attention_mma_reference(const Call&, const AttnProblem& problem, const int32_t* cu_q,
                                      const int32_t* cu_k, int64_t n_seqs, void* out, float* lse);
  static void attention_mma_backward_reference(const Call&, const AttnBackwardRun& r, const int32_t* cu_q,
                                               const int32_t* cu_k, int64_t n_seqs);
  static void cache_write(const Call&, DType dt, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& slots);
  static void write_plan(const Call&, const at::Tensor& plan, const at::Tensor& table, const AttnPlan& p);
  // moe (cpu_moe.cpp)
  static void moe_routing(const Call&, const MoeRoutingParams& p);
  static void moe_routing_backward(const Call&, const MoeRoutingParams& p);
  static void moe_experts(const Call&, const MoeExpertsRun& r);
  static void moe_experts_reference(const Call&, const MoeExpertsParams& p);
  static void moe_grouped_routing(const Call&, const MoeGroupedRoutingParams& p);
  static void moe_grouped_routing_backward(const Call&, const MoeGroupedRoutingParams& p);
};

}  // namespace aligned::glue
