// dtype.h — the storage dtypes every backend's kernels take at run time, and the one switch that turns such a
// run-time dtype into a template argument. Shared by the CPU backend (csrc/cpu), the GPU kernels' host side
// (csrc/gpu/*_api.h, *_launch.cuh) and the argument checks (csrc/torch/checks/): a kernel table entry or params
// struct carries a DType, its launcher calls with_type once.
#pragma once

#include "numerics.h"

namespace aligned {

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };

// Calls fn with a typed null pointer for the storage type named by dt (float, bf16_t, f16_t).
template <typename Fn>
inline void with_type(DType dt, Fn&& fn) {
  switch (dt) {
    case DType::F32: fn((float*)nullptr); break;
    case DType::BF16: fn((bf16_t*)nullptr); break;
    case DType::F16: fn((f16_t*)nullptr); break;
  }
}

}  // namespace aligned
