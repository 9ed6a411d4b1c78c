// glue_checks.h — the CPU glue TUs' device check (ops_cpu.cpp, ops_attention_cpu.cpp). Every other
// argument check is device-independent and lives once in ../op_checks.h, shared with the GPU glue, so every
// op words its errors the same way: "aligned::<op>: <argument> must ...".
#pragma once

#include <ATen/ATen.h>

#include "../op_checks.h"
#include "cpu_kernels.h"

namespace aligned::cpu {

inline void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "aligned::", op, ": ", name, " must be a CPU tensor, got device ", t.device());
}

}  // namespace aligned::cpu
