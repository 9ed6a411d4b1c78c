// emulated.cpp — the emulation target's host side in the torch library: the error words of each vendor's
// emulated kernels, and the control ops behind aligned_ops.emulate (python/aligned_ops/emulation.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <mutex>
#include <string>
#include <vector>

#include "../../common/mma.h"
#include "../../emu/bf16_mma_models.h"
#include "../../gpu/dense_api.h"
#include "emulated.h"

namespace aligned::glue {

// One buffer per vendor, allocated on first use and never freed (like a device's, which must outlive the caching
// allocator's teardown).
template <emu::Vendor V>
int32_t* EmulatedDevice<V>::error_flags(const at::Tensor& first) {
  static std::once_flag once;
  static at::Tensor* flags = nullptr;
  std::call_once(once, [&] {
    flags = new at::Tensor(at::zeros({gpu::kNumDeviceErrors}, first.options().dtype(at::kInt)));
  });
  return flags->data_ptr<int32_t>();
}

template <emu::Vendor V>
at::Tensor EmulatedDevice<V>::error_flags_tensor(const at::Tensor& first) {
  return at::from_blob(error_flags(first), {gpu::kNumDeviceErrors}, first.options().dtype(at::kInt));
}

template <emu::Vendor V>
void EmulatedDevice<V>::mma_reference(const char* op, const GemmParams& p) {
  const emu::Arch* arch = emu::active_arch();
  TORCH_CHECK(arch != nullptr, "aligned::", op, ": no emulated arch is active");
  const auto unit = (emu::Bf16MmaUnit)arch->bf16_mma_unit;
  const auto model = (emu::MmaModel)emu::active_mma_model();
  const auto step = [&](float acc, const uint16_t* xb, const uint16_t* wb) {
    return emu::bf16_mma_step(unit, model, xb, wb, acc);
  };
  const auto* x = (const bf16_t*)p.A;
  const auto* w = (const bf16_t*)p.B;
  float* o = (float*)p.C;
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t n = 0; n < p.N; ++n) {
      float s[kLinearLanes];
      for (int l = 0; l < p.lanes; ++l)
        s[l] = mma_block_chain(x + m * p.a_sm, p.a_sk, w + n * p.b_sn, p.b_sk, linear_lane_begin(l, p.K, p.lanes),
                               linear_lane_begin(l + 1, p.K, p.lanes), step);
      o[m * p.c_sm + n] = linear_lane_fold(s, p.lanes);
    }
}

template struct EmulatedDevice<emu::Vendor::kCuda>;
template struct EmulatedDevice<emu::Vendor::kHip>;

}  // namespace aligned::glue

namespace aligned::emu {
namespace {

// The runtime's self-test kernels (csrc/emu/selftest_kernels.cuh) at the active arch.
std::vector<int64_t> emulate_selftest(const std::string& name) {
  const Arch* a = active_arch();
  TORCH_CHECK(a != nullptr, "aligned::_emulate_selftest: needs aligned_ops.emulate(arch)");
  std::vector<long long> out;
  const char* err = a->vendor == Vendor::kHip ? gpu::emulated_hip::run_selftest(name, out)
                                              : gpu::emulated_cuda::run_selftest(name, out);
  TORCH_CHECK(err == nullptr, "aligned::_emulate_selftest(", name, "): ", err ? err : "");
  return std::vector<int64_t>(out.begin(), out.end());
}

void emulate_enter(const std::string& arch, int64_t fault, int64_t mma_model) {
  const Arch* a = find_arch(arch);
  TORCH_CHECK(a != nullptr, "aligned_ops.emulate: arch must be one of ", known_archs(), ", got '", arch, "'");
  TORCH_CHECK(fault >= 0 && fault <= 7, "aligned_ops.emulate: unknown fault ", fault);
  TORCH_CHECK(mma_model >= 0 && mma_model <= 1, "aligned_ops.emulate: unknown mma_model ", mma_model);
  enter(a, (Fault)fault, (int)mma_model);
}

// One string per launch: "kernel|arch|gx,gy,gz|bx,by,bz|shared_bytes" (parsed by emulation.py).
std::vector<std::string> emulate_exit() {
  std::vector<std::string> out;
  for (const LaunchRecord& r : exit()) {
    out.push_back(r.kernel + "|" + r.arch + "|" + std::to_string(r.grid[0]) + "," + std::to_string(r.grid[1]) + "," +
                  std::to_string(r.grid[2]) + "|" + std::to_string(r.block[0]) + "," + std::to_string(r.block[1]) +
                  "," + std::to_string(r.block[2]) + "|" + std::to_string(r.shared_bytes));
  }
  return out;
}

// "name|vendor|warp_size|max_shared_bytes|matrix model" per arch.
std::vector<std::string> emulated_archs() {
  std::vector<std::string> out;
  for (const Arch* a : all_archs()) {
    out.push_back(std::string(a->name) + "|" + (a->vendor == Vendor::kHip ? "hip" : "cuda") + "|" +
                  std::to_string(a->warp_size) + "|" + std::to_string(a->max_shared_bytes) + "|" + a->matrix_model);
  }
  return out;
}

}  // namespace
}  // namespace aligned::emu

// No tensor arguments: catch-all kernels (schemas in bindings.cpp).
TORCH_LIBRARY_IMPL(aligned, CatchAll, m) {
  m.impl("_emulate_enter", &aligned::emu::emulate_enter);
  m.impl("_emulate_exit", &aligned::emu::emulate_exit);
  m.impl("_emulated_archs", &aligned::emu::emulated_archs);
  m.impl("_emulate_selftest", &aligned::emu::emulate_selftest);
}
