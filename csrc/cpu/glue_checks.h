// glue_checks.h — argument checks shared by the CPU torch glue TUs (ops_cpu.cpp, ops_attention_cpu.cpp),
// so every op words its errors the same way: "aligned::<op>: <argument> must ...".
#pragma once

#include <ATen/ATen.h>

#include "cpu_kernels.h"

namespace aligned::cpu {

inline DType dtype_of(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    default:
      TORCH_CHECK(false, "aligned::", op, ": ", name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

inline void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "aligned::", op, ": ", name, " must be a CPU tensor, got device ", t.device());
}

}  // namespace aligned::cpu
