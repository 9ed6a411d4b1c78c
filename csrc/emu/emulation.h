// emulation.h — host side of the emulation target (torch-free): the emulated archs, the process-wide switch
// that routes the aligned ops on CPU tensors to the GPU kernel source, the launch records, and the registry
// through which the emulated GPU glue offers its op implementations to the CPU glue.
//
// Dispatch (see csrc/cpu/emulation_hook.h): the GPU glue csrc/cuda/ops_cuda.cpp is compiled a second time
// per vendor spelling (csrc/emu/ops_emulated_{cuda,hip}.cpp). There its TORCH_LIBRARY_IMPL(aligned, CUDA)
// block fills a GlueRegistry instead, and its launchers are the emulated builds of csrc/gpu (csrc/emu/
// model_*.h). The CPU glue registers each op through EmulationAwareLibrary, which calls the registered GPU
// glue while an arch is active and the CPU kernels otherwise — one set of argument checks (op_checks.h), one
// set of params, the same run(params) launchers as on a GPU.
#pragma once

#include <stddef.h>

#include <atomic>
#include <map>
#include <string>
#include <typeindex>
#include <vector>

namespace aligned::emu {

enum class Vendor : int { kCuda = 0, kHip = 1 };

struct Arch {
  const char* name;         // "sm_80", "sm_90", "sm_100", "sm_120", "gfx942", "gfx950"
  Vendor vendor;            // which vendor spelling of csrc/gpu runs (compat.cuh's CUDA or HIP branch)
  int warp_size;            // 32 (CUDA) or 64 (CDNA wave64)
  size_t max_shared_bytes;  // the most dynamic shared memory / LDS one block can get (CUDA: after the opt-in)
  // Dynamic shared memory a kernel may launch with before any opt-in: 48 KB on every CUDA arch (a larger
  // launch fails until cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, n) raised
  // the kernel's limit); HIP has no such step on CDNA, so there it is the whole LDS.
  size_t default_dynamic_shared_bytes;
  const char* matrix_model; // the bit model of its MMA instructions (documentation: none is emulated yet)
};

// nullptr for an unknown name. known_archs(): "sm_80, sm_90, sm_100, sm_120, gfx942, gfx950".
const Arch* find_arch(const std::string& name);
std::string known_archs();
std::vector<const Arch*> all_archs();  // in known_archs() order

// Negative controls: deliberate deviations of the runtime, so tests can prove that a comparison with the
// CPU backend fails when the emulated kernels do not compute what the GPU would.
enum class Fault : int {
  kNone = 0,
  kShuffleNeighbourTree = 1,  // shfl_xor mask bits reversed: a butterfly 16..1 sums neighbours first
  kBarrierNoop = 2,    // __syncthreads does not wait for the other threads
  kMatrixLayout = 3,   // integer MMA models read a wrong fragment layout (A's k halves / B's k words swapped)
};

struct LaunchRecord {
  std::string kernel;  // e.g. "rms_norm_kernel<float, float>"
  std::string arch;
  unsigned grid[3], block[3];
  size_t shared_bytes;  // dynamic shared memory of the launch
};

// Process-wide (every OS thread, so autograd's worker threads see it too). Scopes nest: exit() restores the
// arch that was active before the matching enter() and returns the launches made since it.
void enter(const Arch* arch, Fault fault);
std::vector<LaunchRecord> exit();
const Arch* active_arch();  // nullptr: the CPU backend runs
Fault active_fault();
// A host-to-device copy made by the emulated GPU glue (under emulation: a memcpy), recorded among the launches
// as kernel kHostCopyRecord, grid = block = (1, 1, 1), shared_bytes = the bytes copied: so a test can prove a
// run makes no copy (the CUDA-graph-safe attention run forms), with the per-call forms as negative control.
constexpr const char* kHostCopyRecord = "<host-to-device copy>";
void record_host_copy(size_t bytes);

// ---- the registry of emulated GPU glue ----------------------------------------------------------------
class GlueRegistry {
 public:
  // Same spelling as torch::Library::impl, so ops_cuda.cpp's registration block fills it unchanged.
  template <class F>
  GlueRegistry& impl(const char* name, F* fn) {
    entries_.insert_or_assign(name, Entry{std::type_index(typeid(F)), reinterpret_cast<void (*)()>(fn)});
    return *this;
  }
  // The implementation of `name` with C++ signature F, nullptr if none; a different signature is a bug
  // of the glue (the CPU and GPU glue implement one schema) and throws.
  template <class F>
  F* find(const std::string& name) const {
    auto it = entries_.find(name);
    if (it == entries_.end()) return nullptr;
    if (it->second.type != std::type_index(typeid(F))) signature_mismatch(name);
    return reinterpret_cast<F*>(it->second.fn);
  }

 private:
  struct Entry {
    std::type_index type;
    void (*fn)();
  };
  [[noreturn]] static void signature_mismatch(const std::string& name);
  std::map<std::string, Entry> entries_;
};
GlueRegistry& glue_registry(Vendor vendor);

}  // namespace aligned::emu

// Replaces `TORCH_LIBRARY_IMPL(aligned, CUDA, m)` in the emulated compilation of the GPU glue: the block's
// m.impl(...) lines register into glue_registry(ALIGNED_EMULATED_VENDOR) at load time.
#define ALIGNED_EMULATED_GLUE_IMPL(m)                                                                     \
  static void aligned_emulated_glue_init(::aligned::emu::GlueRegistry& m);                              \
  static const bool aligned_emulated_glue_registered =                                                  \
      (aligned_emulated_glue_init(::aligned::emu::glue_registry(ALIGNED_EMULATED_VENDOR)), true);       \
  static void aligned_emulated_glue_init(::aligned::emu::GlueRegistry& m)
