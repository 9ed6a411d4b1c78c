// simt_api.h — the interface between emulated kernels (csrc/emu/simt.h, the macros kernels see) and the SIMT
// runtime (csrc/emu/runtime.cpp). Torch-free, macro-free: runtime.cpp includes it without the kernel macros.
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <tuple>
#include <type_traits>
#include <utility>

// CUDA and HIP declare these at global scope.
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace aligned::emu {

// What the running fiber sees as its built-in variables (set by the scheduler before each resume).
struct ThreadCoords {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
  int warp_size;
};
// Where a fiber finds its thread's state without TLS. Every GPU thread runs on a fiber whose stack is a
// kFiberRegionBytes region aligned to its size (runtime.cpp: a guard page at the bottom, the stack, a FiberHeader in
// the last kFiberHeaderBytes), so the running frame's address gives the header. The scheduler writes the lane's
// coordinates and state there before each resume; kernels read threadIdx, blockIdx, ... through it (fiber_coords) and
// the runtime's device calls find their lane and worker through it. Why not a thread_local: in a shared library every
// access to one is a general-dynamic TLS access — a __tls_get_addr call, which ASan intercepts; through a
// thread_local, about a third of an emulated kernel's time under ASan went there. (The initial-exec TLS model is no
// way out for the shipped library: the module's TLS holds the kernels' __shared__ arrays, ~1.8 MB, and a dlopen'ed
// library's initial-exec TLS must fit in glibc's static TLS surplus, 512 bytes unless a tunable raises it.)
#if defined(__SANITIZE_ADDRESS__)
#define ALIGNED_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ALIGNED_EMU_ASAN 1
#endif
#endif
#if defined(ALIGNED_EMU_ASAN)
constexpr size_t kFiberRegionBytes = 1024 * 1024;  // ASan frames carry redzones: a 1 MiB - 4 KiB stack
#else
constexpr size_t kFiberRegionBytes = 128 * 1024;
#endif
static_assert((kFiberRegionBytes & (kFiberRegionBytes - 1)) == 0, "a fiber's region is aligned to its size");
constexpr size_t kFiberHeaderBytes = 64;
struct FiberHeader {
  const ThreadCoords* coords;  // the running lane's built-ins (written before each resume)
  void* lane;                  // runtime.cpp: the Lane this fiber runs now (written before each resume)
  void* worker;                // runtime.cpp: the Worker that owns the fiber (written when the fiber is made)
};
static_assert(sizeof(FiberHeader) <= kFiberHeaderBytes, "the header fits its slot");
inline FiberHeader* fiber_header_of(uintptr_t frame) {
  const uintptr_t region_end = (frame | (uintptr_t)(kFiberRegionBytes - 1)) + 1;
  return reinterpret_cast<FiberHeader*>(region_end - kFiberHeaderBytes);
}
// The running GPU thread's built-ins. Only kernel code calls it, and kernels run only on fibers (launch): unchecked,
// as threadIdx must be cheap. The runtime's device calls check that they run on a fiber (runtime.cpp running_lane).
inline const ThreadCoords* fiber_coords() { return fiber_header_of((uintptr_t)__builtin_frame_address(0))->coords; }

enum class WarpOp : uint8_t { kShflXor, kShflIdx, kShflUp, kShflDown, kBallot, kAny, kAll, kSyncWarp, kMatrix };

// One warp collective by the calling lane: blocks the fiber until its warp's participating lanes arrived.
// mask: the _sync mask (CUDA spelling) or all ones (HIP spelling, has_mask false). Returns the lane's result
// bits (shuffles: the source lane's value; votes: the mask / 0 / 1).
uint64_t warp_collective(WarpOp op, uint64_t value, int arg, int width, uint64_t mask, bool has_mask);
void sync_threads();

// ---- warp-wide integer matrix instructions (csrc/gpu/int_mma.cuh calls these under emulation) ---------------
// Integer MMA is exact arithmetic, so its model is the definition: D[i][j] = C[i][j] + sum_k A[i][k] B[k][j],
// the sum formed exactly and wrapped to int32 (two's complement, as both vendors' non-saturating forms do).
// What the model must get right is the fragment layout: which lane holds which element (runtime.cpp, beside
// the model of each instruction, with the vendor document it follows). Every lane of the warp must execute
// the same instruction (mma.sync.aligned / an MFMA with a full EXEC mask); the runtime checks it.
enum class MatrixOp : int {
  kMmaM16N8K32S8 = 1,     // CUDA mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 (sm_80+), 32 lanes
  kMfmaI32x16x16x32I8 = 2, // HIP v_mfma_i32_16x16x32_i8 (gfx942, gfx950), 64 lanes
  // bf16 x bf16 -> fp32 (csrc/gpu/bf16_mma.cuh): float arithmetic, so the runtime applies the scope's arithmetic
  // model (bf16_mma_models.h) per output element; c holds the fp32 accumulator's bits.
  kMmaM16N8K16Bf16 = 3,     // CUDA mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (sm_80+), 32 lanes
  kMfmaF32x16x16x16Bf16 = 4, // HIP v_mfma_f32_16x16x16_bf16 (_1k; gfx942, gfx950), 64 lanes
};
// One lane's registers: a, b the A / B fragment words (bytes little-endian, element 0 in the low byte),
// c the accumulator fragment, replaced by D when the instruction completes.
struct MatrixFragment {
  uint32_t a[4];
  uint32_t b[2];
  int32_t c[4];
};
void warp_matrix(MatrixOp op, MatrixFragment* lane_fragment, uint64_t mask, bool has_mask);
void async_copy(void* dst, const void* src, size_t bytes, size_t zero_fill);
void async_commit();
void async_wait_prior(size_t pending_groups);
// The block's dynamic shared memory (`extern __shared__` on a GPU; compat.cuh dynamic_shared()): the launch's
// shared_bytes, 16-byte aligned, filled with 0xff bytes (a NaN in every float format) when the block starts, so
// a read of a byte no thread wrote shows, as the undefined contents of a GPU's shared memory would.
unsigned char* dynamic_shared_memory();

// ---- kernel attributes (the emulated cudaFuncSetAttribute / hipFuncSetAttribute) -------------------------------
// The dynamic shared memory limit of one kernel (its address is the key) on the active arch: nullptr, or why the
// value is refused (above the arch's max_shared_bytes, negative, or no arch active).
const char* set_max_dynamic_shared(const void* kernel, long long bytes);
// The active arch's most dynamic shared memory per block after the opt-in (cudaDevAttrMaxSharedMemoryPerBlockOptin,
// hipDeviceAttributeMaxSharedMemoryPerBlock); 0 when no arch is active.
size_t max_dynamic_shared_optin();

template <class T>
inline uint64_t to_bits(const T& v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "warp shuffles move at most 8 bytes");
  uint64_t u = 0;
  memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T>
inline T from_bits(uint64_t u) {
  T v;
  memcpy(&v, &u, sizeof(T));
  return v;
}
template <class T>
inline T shuffle(WarpOp op, T v, int arg, int width, uint64_t mask, bool has_mask) {
  return from_bits<T>(warp_collective(op, to_bits(v), arg, width, mask, has_mask));
}

// ---- launches -----------------------------------------------------------------------------------------
struct LaunchConfig {
  dim3 grid, block;
  size_t shared_bytes;  // dynamic shared memory of the launch (the third <<< >>> argument)
  void* stream;
};
// Runs every block of the grid to completion (the launch is synchronous, like a launch followed by a stream
// sync). A failure is kept as the sticky last error (cudaGetLastError / hipGetLastError below).
// kernel: the kernel's address, the key of its attributes (set_max_dynamic_shared).
void launch(const char* kernel_name, const void* kernel, const LaunchConfig& cfg, void (*thunk)(const void* args),
            const void* args);
const char* pretty_kernel_name(const char* pretty_function);  // interns the name (see kernel_name)

// "rms_norm_kernel<float, float>" from the compiler's spelling of the template argument K.
// (a constant-initialised atomic, which has no guard, not a dynamically initialised static: that static's
// initialisation guard, taken by another thread when a fork lands, would stay taken in the child; two threads racing
// here intern the name twice, which is harmless)
template <auto K>
const char* kernel_name() {
  static std::atomic<const char*> name{nullptr};  // constant-initialised: no guard
  const char* n = name.load(std::memory_order_acquire);
  if (!n) {
    n = pretty_kernel_name(__PRETTY_FUNCTION__);
    name.store(n, std::memory_order_release);
  }
  return n;
}

template <class... P>
std::tuple<std::decay_t<P>...> kernel_parameters(void (*)(P...));

// ALIGNED_LAUNCH(grid, block, shared, stream, kernel)(args...): converts the arguments to the kernel's
// parameter types (as a <<< >>> launch does) and runs the grid.
template <auto K>
struct Launch {
  LaunchConfig cfg;
  template <class... A>
  void operator()(A&&... a) const {
    using Args = decltype(kernel_parameters(K));
    const Args args(std::forward<A>(a)...);
    launch(kernel_name<K>(), reinterpret_cast<const void*>(K), cfg,
           [](const void* p) { std::apply(K, *static_cast<const Args*>(p)); }, &args);
  }
};

// The sticky error of the last failed launch (nullptr: none); reading it clears it, as cudaGetLastError does.
const char* take_last_error();
const char* last_error_message();

}  // namespace aligned::emu

