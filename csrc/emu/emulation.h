// emulation.h — host side of the emulation target (torch-free): the emulated archs, the process-wide switch
// that routes the aligned ops on CPU tensors to the GPU kernel source, and the launch records.
//
// Dispatch (csrc/torch/registration.h): the CPU dispatch key's implementation of every op family with GPU
// kernels is a switch over three instantiations of the op's one glue body — Cpu, and the Emulated backend of
// each vendor spelling (csrc/torch/backends/emulated.h), whose launchers are the emulated builds of csrc/gpu
// (csrc/emu/model_*.h, csrc/gpu/launchers.h). While an arch is active the switch runs the Emulated backend of
// its vendor: the same argument checks, the same params, the same launchers as on a GPU.
#pragma once

#include <stddef.h>

#include <string>
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
  const char* matrix_model; // the bit model of its MMA instructions (documentation)
  int bf16_mma_unit;        // bf16_mma_models.h Bf16MmaUnit: which published model its bf16 MMA follows
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
  // Kernel variants the mma linear's emulated launcher builds on request (csrc/gpu/mma_launch.cuh), each
  // breaking mma.h's order only for M > 16, so a batch-invariance test must catch them:
  kMmaSplitKByM = 4,     // each K-lane's chain cut in two halves summed afterwards (a split-K chosen by M)
  kMmaBlockOrderByM = 5, // each K-lane's k-blocks issued in descending order (also moe_experts' grouped mma
                         // tiles holding more than one token: csrc/gpu/moe_launch.cuh)
  // moe_experts' emulated combine (csrc/gpu/moe_launch.cuh) adds a token's expert outputs in expert-id order
  // instead of its top-k rank order (moe.h): a token's bits then depend on the ids, not the rank order.
  kMoeCombineByExpert = 6,
  // The mma attention's emulated launcher (csrc/gpu/attention_launch.cuh): the score's head_dim blocks in
  // descending order for sequences with more than one new row (an order that depends on prefill vs decode).
  kMmaAttnBlockOrderByQLen = 7,
  // ... and FlashAttention's shared operand: one PV pass per tile with V cut at the group's longest row (and in
  // the backward: dq's K and dk / dv's q and dO cut at the group's union, attention_mma_kernels.cuh).
  kMmaAttnSharedV = 8,
  // moe_experts' grouped `fma` tiles (csrc/gpu/moe_kernels.cuh) holding more than one row run each output as one
  // sequential chain instead of the 8-lane tree: a token's bits then depend on how many tokens share its expert.
  kMoeFmaChainByM = 9,
  // The mma attention's emulated dk / dv kernel counts its pair-blocks of 16 (row, head) pairs from the batch's
  // global pair index (offset q_begin * G mod 16) instead of the sequence's own: batch-dependent gradients.
  kMmaAttnPairBlocksGlobal = 10,
  // The mma linear's tiled kernel (M > 64, csrc/gpu/mma_tiled_kernels.cuh) folds its lane sums left to right as
  // they complete ((((s0 + s1) + s2) + s3) ...) instead of linear_lane_fold's tree.
  kMmaFoldOrderByM = 11,
  kCount,  // one past the last fault: the range emulate_enter accepts (a new fault goes above this line)
};

struct LaunchRecord {
  std::string kernel;  // e.g. "rms_norm_kernel<float, float>"
  std::string arch;
  unsigned grid[3], block[3];
  size_t shared_bytes;  // dynamic shared memory of the launch
};

// Process-wide (every OS thread, so autograd's worker threads see it too). Scopes nest: exit() restores the
// arch that was active before the matching enter() and returns the launches made since it.
// mma_model: bf16_mma_models.h MmaModel (0 kMmaSim, 1 kFmaChain), the arithmetic of the bf16 matrix
// instructions in the scope.
void enter(const Arch* arch, Fault fault, int mma_model = 0);
std::vector<LaunchRecord> exit();
const Arch* active_arch();  // nullptr: the CPU backend runs
Fault active_fault();
int active_mma_model();
// A host-to-device copy made by the emulated GPU glue (under emulation: a memcpy), recorded among the launches
// as kernel kHostCopyRecord, grid = block = (1, 1, 1), shared_bytes = the bytes copied: so a test can prove a
// run makes no copy (the CUDA-graph-safe attention run forms), with the per-call forms as negative control.
constexpr const char* kHostCopyRecord = "<host-to-device copy>";
void record_host_copy(size_t bytes);
// The chunks of fiber stacks registered now: one per OS thread that has run a block and not ended (tests: a
// forked child keeps only its own thread's).
int live_fiber_chunks();

}  // namespace aligned::emu
