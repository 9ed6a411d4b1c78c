// ops_emulated_cuda.cpp — the GPU glue (csrc/cuda/ops_cuda.cpp) compiled for the emulated CUDA build of
// csrc/gpu (csrc/emu/model_cuda.h): same argument checks, params and launcher calls, CPU tensors, launchers in
// aligned::gpu_emu_cuda, registered into glue_registry(Vendor::kCuda). Also the control ops behind
// aligned_ops.emulate (python/aligned_ops/emulation.py).
#include "emulated_glue_prelude.h"

#include <string>
#include <vector>

#define ALIGNED_EMULATED_VENDOR ::aligned::emu::Vendor::kCuda
#define gpu gpu_emu_cuda
#include "../cuda/ops_cuda.cpp"
#include "../cuda/ops_attention_cuda.cpp"  // the attention family's GPU glue
#undef gpu

namespace aligned::gpu_emu_cuda {
const char* run_selftest(const std::string& name, std::vector<long long>& out);  // selftest_cuda.cpp
}
namespace aligned::gpu_emu_hip {
const char* run_selftest(const std::string& name, std::vector<long long>& out);  // selftest_hip.cpp
}

namespace aligned::emu {
namespace {

// The runtime's self-test kernels (selftest_kernels.cuh) at the active arch.
std::vector<int64_t> emulate_selftest(const std::string& name) {
  const Arch* a = active_arch();
  TORCH_CHECK(a != nullptr, "aligned::_emulate_selftest: needs aligned_ops.emulate(arch)");
  std::vector<long long> out;
  const char* err = a->vendor == Vendor::kHip ? gpu_emu_hip::run_selftest(name, out)
                                              : gpu_emu_cuda::run_selftest(name, out);
  TORCH_CHECK(err == nullptr, "aligned::_emulate_selftest(", name, "): ", err ? err : "");
  return std::vector<int64_t>(out.begin(), out.end());
}

void emulate_enter(const std::string& arch, int64_t fault) {
  const Arch* a = find_arch(arch);
  TORCH_CHECK(a != nullptr, "aligned_ops.emulate: arch must be one of ", known_archs(), ", got '", arch, "'");
  TORCH_CHECK(fault >= 0 && fault <= 3, "aligned_ops.emulate: unknown fault ", fault);
  enter(a, (Fault)fault);
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

// No tensor arguments: catch-all kernels (schemas in torch_bindings.cpp).
TORCH_LIBRARY_IMPL(aligned, CatchAll, m) {
  m.impl("_emulate_enter", &aligned::emu::emulate_enter);
  m.impl("_emulate_exit", &aligned::emu::emulate_exit);
  m.impl("_emulated_archs", &aligned::emu::emulated_archs);
  m.impl("_emulate_selftest", &aligned::emu::emulate_selftest);
}
