// checks/common.h — what every family's argument checks share: the dtype rule and the value-check mode.
//
// The checks of each family (checks/<family>.h) are written once for every backend's glue body
// (csrc/torch/glue/<family>.h), so a bad input is rejected by the same rule with the same words on every
// device: "aligned::<op>: <argument> must ...". Device-independent (ATen only). The glue body checks every
// tensor's device first (B::Call::on_device), then calls check_<op>, which returns what the body needs to
// allocate and fill the params (dtypes, dims, and the few tensors it had to convert).
//
// DTypeEnum is the kernels' dtype enum (aligned::DType, common/dtype.h): any enum with F32, BF16 and F16.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <optional>

namespace aligned {

template <class DTypeEnum>
DTypeEnum dtype_of(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DTypeEnum::F32;
    case at::kBFloat16: return DTypeEnum::BF16;
    case at::kHalf: return DTypeEnum::F16;
    default:
      TORCH_CHECK(false, "aligned::", op, ": ", name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

// Data-value checks (positions, token ids, temperatures, top-k ids) read tensor data: ValueChecks::kHost reads
// them on the host (the CPU backend, where that is free; device checks first). ValueChecks::kInKernel (the GPU
// backends, B::kValueChecks) reads no tensor data in the checks: the kernel checks each value and reports
// through its error flags (csrc/gpu/dense_api.h), so the op never synchronises with the host.
enum class ValueChecks { kHost, kInKernel };

}  // namespace aligned
