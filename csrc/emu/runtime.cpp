// runtime.cpp — the SIMT runtime of the emulation target (torch-free).
//
// A launch runs every block of the grid to completion before it returns. Blocks are independent, so they
// are spread over a few worker OS threads (ALIGNED_EMU_THREADS, default min(4, cores)); which worker runs a
// block never changes a result of a correct kernel, because a block's threads only share memory within the block.
//
// Inside a block every GPU thread is a fiber with a small stack: a 128 KiB region (1 MiB under ASan) aligned to its
// size, with a guard page below the stack and above it the header (simt_api.h FiberHeader) that kernels read
// threadIdx / blockIdx from and device calls find their lane in. The worker runs the runnable fibers one at a time,
// each until it blocks at __syncthreads or a warp collective, or finishes. When none is runnable, warp collectives
// whose lanes all arrived are resolved (values exchanged, votes counted), then — if nothing else can run — the
// barrier is released once every live thread waits at it; anything else is a deadlock and fails the launch with a
// description. Fibers are created once per worker and reused by every block and launch (a finished fiber waits at
// the top of its loop for the next thread).
//
// Schedules (ALIGNED_EMU_SCHEDULE, read at every launch): a GPU promises no order between the threads of a block
// between two barriers, between the warps of a block, or between the blocks of a grid. A kernel whose result
// depends on one (a missing __syncthreads / __syncwarp, a block reading another block's output) is wrong, but
// one fixed order can hide it: in index order a reader of a lower thread's write always sees it. So the order
// of each pass over the runnable threads, of the warps and of the blocks is a parameter:
//   forward        thread, warp and block index order (the default);
//   reverse        the reverse of each;
//   random:SEED    per pass a permutation of the warps and, within each warp, of its lanes; the blocks in a
//                  permuted order. Drawn from SEED, the kernel's name, the launch shape, the block and the pass
//                  number, so a run is reproducible from the seed alone.
// A correct kernel gives the same bits under every schedule (tests/emulated run under all of them); the planted
// races of selftest_kernels.cuh give stale reads under reverse and random (tests/emulated/test_emulation_runtime.py).
//
// FP environment: every worker pins MXCSR to the IEEE default (round to nearest, no flush-to-zero, no
// denormals-are-zero, exceptions masked) for the launch, and the x87 control word to its default, then restores
// the caller's: a GPU kernel's arithmetic never depends on what the host thread set (torch.set_flush_denormal).
//
// Dynamic shared memory is modelled with the vendor's limits (emulation.h Arch): a launch above the kernel's limit
// fails as on a GPU, and the limit rises only through set_max_dynamic_shared (cudaFuncSetAttribute).
//
// Context switches: a 6-register x86-64 switch (callee-saved registers + stack pointer; MXCSR and the x87
// control word are pinned for the whole launch, see above), ucontext elsewhere. Under ASan every switch is
// announced with __sanitizer_start/finish_switch_fiber so stack checking follows the fibers.
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#if defined(__x86_64__)
#include <xmmintrin.h>
#else
#include <fenv.h>
#endif

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bf16_mma_models.h"
#include "emulation.h"
#include "simt_api.h"

#if defined(ALIGNED_EMU_ASAN)  // (simt_api.h)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

namespace aligned::emu {

// ---- archs -----------------------------------------------------------------------------------------------
namespace {
constexpr size_t kCudaDefaultDynamicShared = 48 * 1024;  // every CUDA arch, before cudaFuncSetAttribute
// max_shared_bytes: cudaDevAttrMaxSharedMemoryPerBlockOptin of A100 (163 KB), H100/H200 and B200 (227 KB), RTX 50xx
// (99 KB); the LDS of a CDNA3 (64 KB) and CDNA4 (160 KB) workgroup.
const Arch kArchs[] = {
    {"sm_80", Vendor::kCuda, 32, 163 * 1024, kCudaDefaultDynamicShared,
     "integer mma.sync m16n8k32 s8 (exact, PTX fragment layout); bf16 mma.sync m16n8k16 under mma_model 'mmasim': "
     "MMA-Sim's Ampere model (k16 as two chained fused k8 steps, 24 fractional bits, round toward zero)",
     (int)Bf16MmaUnit::kNvSplitF24},
    {"sm_90", Vendor::kCuda, 32, 227 * 1024, kCudaDefaultDynamicShared,
     "integer mma.sync m16n8k32 s8 (exact: int32 sums of int8 products, PTX fragment layout); bf16 mma.sync "
     "m16n8k16 under mma_model 'mmasim': MMA-Sim's Hopper model (K=16 fused dot + C, terms aligned to the largest "
     "exponent, truncated to 25 fractional bits, round toward zero)",
     (int)Bf16MmaUnit::kNvFusedF25},
    {"sm_100", Vendor::kCuda, 32, 227 * 1024, kCudaDefaultDynamicShared,
     "integer mma.sync m16n8k32 s8 (exact, PTX fragment layout); bf16 mma.sync m16n8k16 under mma_model 'mmasim': "
     "MMA-Sim's Blackwell model (as Hopper: 25 fractional bits, no split)",
     (int)Bf16MmaUnit::kNvFusedF25},
    {"sm_120", Vendor::kCuda, 32, 99 * 1024, kCudaDefaultDynamicShared,
     "integer mma.sync m16n8k32 s8 (exact, PTX fragment layout); bf16 mma.sync m16n8k16 under mma_model 'mmasim': "
     "MMA-Sim's RTX Blackwell mma model (as Hopper: 25 fractional bits, no split)",
     (int)Bf16MmaUnit::kNvFusedF25},
    {"gfx942", Vendor::kHip, 64, 64 * 1024, 64 * 1024,
     "integer v_mfma_i32_16x16x32_i8 (exact: int32 sums of int8 products, CDNA3 fragment layout); bf16 "
     "v_mfma_f32_16x16x16_bf16 under mma_model 'mmasim': MMA-Sim's CDNA3 model (two chained groups of 8 products "
     "truncated to 24 bits, group sum floored to 31 bits, c floored to 24, round to nearest even)",
     (int)Bf16MmaUnit::kCdna3},
    {"gfx950", Vendor::kHip, 64, 160 * 1024, 160 * 1024,
     "integer v_mfma_i32_16x16x32_i8 (exact, CDNA3 fragment layout, kept on CDNA4); bf16 v_mfma_f32_16x16x16_bf16 "
     "under mma_model 'mmasim': the CDNA3 model, an ASSUMPTION (MMA-Sim has no CDNA4 model)",
     (int)Bf16MmaUnit::kCdna3},
};
}  // namespace

const Arch* find_arch(const std::string& name) {
  for (const Arch& a : kArchs)
    if (name == a.name) return &a;
  return nullptr;
}
std::vector<const Arch*> all_archs() {
  std::vector<const Arch*> v;
  for (const Arch& a : kArchs) v.push_back(&a);
  return v;
}
std::string known_archs() {
  std::string s;
  for (const Arch& a : kArchs) s += (s.empty() ? "" : ", ") + std::string(a.name);
  return s;
}

// ---- activation and records -----------------------------------------------------------------------------
namespace {
struct Scope {
  const Arch* prev_arch;
  Fault prev_fault;
  int prev_mma_model;
  size_t first_record;
};
std::mutex g_state_mutex;
std::vector<Scope> g_scopes;
std::vector<LaunchRecord> g_records;
std::atomic<const Arch*> g_arch{nullptr};
std::atomic<int> g_fault{0};
std::atomic<int> g_mma_model{0};
}  // namespace

void enter(const Arch* arch, Fault fault, int mma_model) {
  std::lock_guard<std::mutex> lock(g_state_mutex);
  g_scopes.push_back({g_arch.load(), (Fault)g_fault.load(), g_mma_model.load(), g_records.size()});
  g_fault.store((int)fault);
  g_mma_model.store(mma_model);
  g_arch.store(arch);
}
std::vector<LaunchRecord> exit() {
  std::lock_guard<std::mutex> lock(g_state_mutex);
  if (g_scopes.empty()) return {};
  const Scope s = g_scopes.back();
  g_scopes.pop_back();
  std::vector<LaunchRecord> mine(g_records.begin() + (ptrdiff_t)s.first_record, g_records.end());
  if (g_scopes.empty()) g_records.clear();
  g_arch.store(s.prev_arch);
  g_fault.store((int)s.prev_fault);
  g_mma_model.store(s.prev_mma_model);
  return mine;
}
const Arch* active_arch() { return g_arch.load(std::memory_order_acquire); }
void record_host_copy(size_t bytes) {
  std::lock_guard<std::mutex> lock(g_state_mutex);
  const Arch* arch = g_arch.load();
  if (!g_scopes.empty() && arch) g_records.push_back(LaunchRecord{kHostCopyRecord, arch->name, {1, 1, 1}, {1, 1, 1}, bytes});
}
Fault active_fault() { return (Fault)g_fault.load(std::memory_order_relaxed); }
int active_mma_model() { return g_mma_model.load(std::memory_order_relaxed); }

// ---- errors (sticky per calling thread, like cudaGetLastError) -----------------------------------------------
namespace {
thread_local std::string tl_error;
thread_local bool tl_error_pending = false;
}  // namespace
const char* take_last_error() {
  if (!tl_error_pending) return nullptr;
  tl_error_pending = false;
  return tl_error.c_str();
}
const char* last_error_message() { return tl_error.empty() ? "no error" : tl_error.c_str(); }

namespace {
// pretty_kernel_name's interned names, made on first use under the mutex: no function-local static, whose
// initialisation guard a fork (which holds the mutex, not a guard) could leave taken in the child.
std::mutex g_name_mutex;
std::vector<std::unique_ptr<std::string>>* g_interned_names = nullptr;  // never freed: names outlive exit()
}  // namespace
const char* pretty_kernel_name(const char* pretty) {
  // GCC: "... [with auto K = aligned::gpu::emulated_cuda::rms_norm_kernel<float, float>]"; clang: "[K = &...]".
  std::string s(pretty);
  size_t b = s.find("K = ");
  b = b == std::string::npos ? 0 : b + 4;
  if (b < s.size() && s[b] == '&') ++b;
  size_t e = s.rfind(']');
  std::string name = s.substr(b, e == std::string::npos || e < b ? std::string::npos : e - b);
  const size_t lt = name.find('<');
  const size_t ns = name.rfind("::", lt);
  if (ns != std::string::npos) name = name.substr(ns + 2);
  std::lock_guard<std::mutex> lock(g_name_mutex);
  if (!g_interned_names) g_interned_names = new std::vector<std::unique_ptr<std::string>>;
  g_interned_names->push_back(std::make_unique<std::string>(name));
  return g_interned_names->back()->c_str();
}

// ---- fibers ----------------------------------------------------------------------------------------------
namespace {

#if defined(__x86_64__)
extern "C" void aligned_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .globl aligned_emu_switch
  .hidden aligned_emu_switch
  .type aligned_emu_switch,@function
aligned_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size aligned_emu_switch,.-aligned_emu_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");
struct Context {
  void* sp = nullptr;
};
#else
struct Context {
  ucontext_t uc;
};
#endif

struct Lane;

// A fiber's region (simt_api.h kFiberRegionBytes, aligned to its size): a guard page, the stack, the FiberHeader the
// kernels' built-ins and the device calls' lane are read from (simt_api.h fiber_header_of).
struct Fiber {
  Context ctx;
  char* map = nullptr;  // the region (a slot of its worker's chunk)
  char* stack_lo() const { return map + page(); }
  size_t stack_bytes() const { return kFiberRegionBytes - page() - kFiberHeaderBytes; }
  FiberHeader* header() const { return reinterpret_cast<FiberHeader*>(map + kFiberRegionBytes - kFiberHeaderBytes); }
  static size_t page() { return (size_t)sysconf(_SC_PAGESIZE); }
};

enum class LaneState : uint8_t { kRunnable, kBarrier, kWarpOp, kDone, kFailed };

struct PendingCopy {
  void* dst;
  const void* src;
  size_t bytes, zero_fill;
};

// One GPU thread of the block being run.
struct Lane {
  ThreadCoords coords;
  int linear = 0, warp = 0, lane = 0;
  LaneState state = LaneState::kRunnable;
  // the warp collective it waits at
  WarpOp op = WarpOp::kSyncWarp;
  uint64_t value = 0, result = 0, mask = 0;
  int arg = 0, width = 0;
  bool has_mask = false;
  // async copies not yet retired, and the end index of each committed group
  std::vector<PendingCopy> copies;
  std::vector<size_t> group_ends;
  Fiber* fiber = nullptr;
};

enum class ScheduleKind : int { kForward, kReverse, kRandom };
struct Schedule {
  ScheduleKind kind = ScheduleKind::kForward;
  uint64_t seed = 0;
};

// splitmix64: the schedule's random stream (deterministic, no global state).
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
struct Rng {
  uint64_t state;
  uint64_t next() { return mix64(state++); }
  uint64_t below(uint64_t n) { return next() % n; }  // n small: the bias is irrelevant for a schedule
};

struct Job {
  const char* kernel;
  LaunchConfig cfg;
  const Arch* arch;
  Fault fault;
  int mma_model = 0;  // bf16_mma_models.h MmaModel of the scope that launched
  Schedule schedule;
  uint64_t launch_key = 0;  // mixes the kernel's name and shape into the random schedule
  void (*thunk)(const void*);
  const void* args;
  uint64_t blocks;
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  uint64_t error_block = ~0ull;
  std::string error;
  void fail(uint64_t block, const std::string& what) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (block < error_block) {  // the lowest failing block reports: deterministic message
      error_block = block;
      error = what;
    }
    failed.store(true);
  }
};

// ---- fiber regions ---------------------------------------------------------------------------------------
// A worker's fibers live in one chunk: kMaxBlockThreads regions (one per thread of the largest block), reserved
// (MAP_NORESERVE: a page costs memory only once a stack grows into it) when the worker makes its first fiber. The
// chunks are registered process-wide, so a device call can check, without TLS, that it runs on a fiber's stack
// (on_fiber_stack) before it reads the header there: a device function called from host code is refused by name
// instead of reading memory that is not a header.
constexpr int kMaxBlockThreads = 1024;
constexpr size_t kChunkBytes = (size_t)kMaxBlockThreads * kFiberRegionBytes;
constexpr int kMaxChunks = 256;  // live worker OS threads: the pool's and every thread that has launched (a chunk is
                                 // held until its thread ends)
std::atomic<uintptr_t> g_chunk_base[kMaxChunks];  // 0: a free entry
std::atomic<int> g_chunk_entries{0};              // the entries below it may be in use
std::atomic<int> g_chunk_fibers[kMaxChunks];      // the fibers made in each entry's chunk (its regions in use)
std::mutex g_chunk_mutex;                         // reserve / release

bool on_fiber_stack(uintptr_t frame) {
  const int n = g_chunk_entries.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i) {
    const uintptr_t base = g_chunk_base[i].load(std::memory_order_relaxed);
    if (base != 0 && frame - base < kChunkBytes) return true;
  }
  return false;
}

char* reserve_chunk(int* entry) {
  const size_t R = kFiberRegionBytes;
  // the chunk and one region more, then the part aligned to a region kept and the rest unmapped
  void* m = mmap(nullptr, kChunkBytes + R, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) throw std::runtime_error("aligned emulation: cannot map the fiber stacks");
  char* raw = (char*)m;
  char* base = (char*)(((uintptr_t)raw + R - 1) & ~(uintptr_t)(R - 1));
  if (base > raw) munmap(raw, (size_t)(base - raw));
  if (raw + kChunkBytes + R > base + kChunkBytes) munmap(base + kChunkBytes, (size_t)(raw + R - base));
  std::lock_guard<std::mutex> lock(g_chunk_mutex);
  const int n = g_chunk_entries.load(std::memory_order_relaxed);
  int i = 0;
  while (i < n && g_chunk_base[i].load(std::memory_order_relaxed) != 0) ++i;
  if (i == kMaxChunks) {
    munmap(base, kChunkBytes);
    throw std::runtime_error(
        "aligned emulation: more than " + std::to_string(kMaxChunks) +
        " live threads hold fiber stacks (a thread that launched keeps its own until it ends)");
  }
  g_chunk_base[i].store((uintptr_t)base, std::memory_order_relaxed);
  g_chunk_fibers[i].store(0, std::memory_order_relaxed);
  if (i == n) g_chunk_entries.store(n + 1, std::memory_order_release);
  *entry = i;
  return base;
}

}  // namespace
int live_fiber_chunks() {
  std::lock_guard<std::mutex> lock(g_chunk_mutex);
  int live = 0;
  for (int i = 0, n = g_chunk_entries.load(std::memory_order_relaxed); i < n; ++i)
    live += g_chunk_base[i].load(std::memory_order_relaxed) != 0;
  return live;
}
namespace {

void release_chunk(char* base, int entry) {
  if (!base) return;
  std::lock_guard<std::mutex> lock(g_chunk_mutex);
  g_chunk_base[entry].store(0, std::memory_order_relaxed);
  munmap(base, kChunkBytes);
}

// The calling thread's worker's chunk entry (-1: none), read by the fork child's handler, which must construct
// no Worker.
thread_local int tl_chunk_entry = -1;

// Per worker OS thread: its fibers, the scheduler's own context and the block it runs.
struct Worker {
  Context sched;
  std::vector<std::unique_ptr<Fiber>> fibers;
  std::vector<Lane> lanes;
  std::vector<int> order, warp_order, lane_order;  // the schedule's pass order (scratch)
  std::vector<unsigned char> dyn_smem_store;       // the running block's dynamic shared memory (+ alignment slack)
  unsigned char* dyn_smem = nullptr;
  Lane* current = nullptr;
  const Job* job = nullptr;
  std::string block_error;
  const void* sched_stack_lo = nullptr;  // ASan: the scheduler's stack (learnt on the first switch)
  size_t sched_stack_bytes = 0;
  char* chunk = nullptr;  // its fibers' regions (reserve_chunk), reserved with its first fiber
  int chunk_entry = -1;
  ~Worker() {
#if defined(ALIGNED_EMU_ASAN)
    // a fiber's frames that never returned leave poisoned redzones in ASan's shadow: cleared before the addresses
    // can be mapped again
    for (auto& f : fibers) __asan_unpoison_memory_region(f->stack_lo(), f->stack_bytes());
#endif
    release_chunk(chunk, chunk_entry);
    tl_chunk_entry = -1;
  }
};
thread_local Worker tl_worker;  // read by launch and run_blocks only; fibers reach theirs through the header

[[noreturn]] void fiber_main();

void init_fiber_context(Fiber* f) {
#if defined(ALIGNED_EMU_ASAN)
  __asan_unpoison_memory_region(f->stack_lo(), f->stack_bytes());  // frames abandoned by a failed launch
#endif
#if defined(__x86_64__)
  uintptr_t top = ((uintptr_t)(f->stack_lo() + f->stack_bytes())) & ~(uintptr_t)15;
  void** sp = (void**)top;
  *--sp = nullptr;                      // fiber_main's (never used) return address
  *--sp = (void*)&fiber_main;           // aligned_emu_switch returns here
  for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp rbx r12 r13 r14 r15
  f->ctx.sp = sp;
#else
  getcontext(&f->ctx.uc);
  f->ctx.uc.uc_stack.ss_sp = f->stack_lo();
  f->ctx.uc.uc_stack.ss_size = f->stack_bytes();
  f->ctx.uc.uc_link = nullptr;
  makecontext(&f->ctx.uc, (void (*)())fiber_main, 0);
#endif
}

// The worker's next fiber, in the next region of its chunk.
Fiber* new_fiber(Worker& w) {
  if (!w.chunk) {
    w.chunk = reserve_chunk(&w.chunk_entry);
    tl_chunk_entry = w.chunk_entry;
  }
  const size_t slot = w.fibers.size();
  if (slot >= (size_t)kMaxBlockThreads)
    throw std::runtime_error("aligned emulation: more fibers than threads in a block");
  auto* f = new Fiber;
  f->map = w.chunk + slot * kFiberRegionBytes;
  *f->header() = FiberHeader{nullptr, nullptr, &w};
  // stack overflow faults instead of corrupting memory (the region below, its header included)
  if (mprotect(f->map, Fiber::page(), PROT_NONE) != 0) {
    delete f;
    throw std::runtime_error(
        "aligned emulation: cannot protect a fiber stack's guard page (too many memory mappings?)");
  }
  init_fiber_context(f);
  g_chunk_fibers[w.chunk_entry].store((int)slot + 1, std::memory_order_relaxed);
  return f;
}

inline void raw_switch(Context& from, Context& to) {
#if defined(__x86_64__)
  aligned_emu_switch(&from.sp, to.sp);
#else
  swapcontext(&from.uc, &to.uc);
#endif
}

// Scheduler -> fiber of `lane`; returns when the fiber blocks or finishes.
void resume(Worker& w, Lane& lane) {
  w.current = &lane;
  FiberHeader* h = lane.fiber->header();
  h->coords = &lane.coords;
  h->lane = &lane;
#if defined(ALIGNED_EMU_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, lane.fiber->stack_lo(), lane.fiber->stack_bytes());
#endif
  raw_switch(w.sched, lane.fiber->ctx);
#if defined(ALIGNED_EMU_ASAN)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  w.current = nullptr;
}

// The worker whose fiber runs the caller (the caller is on a fiber's stack: the header is its fiber's).
inline Worker& fiber_worker() {
  return *static_cast<Worker*>(fiber_header_of((uintptr_t)__builtin_frame_address(0))->worker);
}

// Fiber -> scheduler (the lane's state says why); returns when the scheduler resumes this fiber.
void yield_to_scheduler() {
  Worker& w = fiber_worker();
  Fiber* f = w.current->fiber;
#if defined(ALIGNED_EMU_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, w.sched_stack_lo, w.sched_stack_bytes);
#endif
  raw_switch(f->ctx, w.sched);
#if defined(ALIGNED_EMU_ASAN)
  __sanitizer_finish_switch_fiber(fake, &w.sched_stack_lo, &w.sched_stack_bytes);
#endif
}

void retire_copies(Lane& l, size_t groups) {
  if (groups == 0) return;
  const size_t end = l.group_ends[groups - 1];
  for (size_t i = 0; i < end; ++i) {
    const PendingCopy& c = l.copies[i];
    memcpy(c.dst, c.src, c.bytes - c.zero_fill);
    memset((char*)c.dst + (c.bytes - c.zero_fill), 0, c.zero_fill);
  }
  l.copies.erase(l.copies.begin(), l.copies.begin() + (ptrdiff_t)end);
  l.group_ends.erase(l.group_ends.begin(), l.group_ends.begin() + (ptrdiff_t)groups);
  for (size_t& g : l.group_ends) g -= end;
}

[[noreturn]] void fiber_main() {
  Worker& w = fiber_worker();
#if defined(ALIGNED_EMU_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &w.sched_stack_lo, &w.sched_stack_bytes);
#endif
  for (;;) {
    w.job->thunk(w.job->args);
    Lane& l = *w.current;
    // Copies still in flight when a thread exits complete anyway on a GPU.
    l.group_ends.push_back(l.copies.size());
    retire_copies(l, l.group_ends.size());
    l.state = LaneState::kDone;
    yield_to_scheduler();
  }
}

// A rule broken by the running thread: fail the block and never resume this fiber.
[[noreturn]] void device_fault(const std::string& what) {
  Worker& w = fiber_worker();
  Lane& l = *w.current;
  if (w.block_error.empty()) {
    w.block_error = what + " (thread (" + std::to_string(l.coords.thread_idx.x) + "," +
                    std::to_string(l.coords.thread_idx.y) + "," + std::to_string(l.coords.thread_idx.z) + "))";
  }
  l.state = LaneState::kFailed;
  yield_to_scheduler();
  abort();  // unreachable: a failed fiber is reset, not resumed
}

Lane& running_lane(const char* what) {
  const uintptr_t frame = (uintptr_t)__builtin_frame_address(0);
  if (!on_fiber_stack(frame)) {
    fprintf(stderr, "aligned emulation: %s called outside an emulated kernel\n", what);
    abort();
  }
  return *static_cast<Lane*>(fiber_header_of(frame)->lane);
}

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::kShflXor: return "shfl_xor";
    case WarpOp::kShflIdx: return "shfl";
    case WarpOp::kShflUp: return "shfl_up";
    case WarpOp::kShflDown: return "shfl_down";
    case WarpOp::kBallot: return "ballot";
    case WarpOp::kAny: return "any";
    case WarpOp::kAll: return "all";
    case WarpOp::kSyncWarp: return "syncwarp";
    case WarpOp::kMatrix: return "matrix instruction";
  }
  return "?";
}

}  // namespace

// ---- device calls ----------------------------------------------------------------------------------------
uint64_t warp_collective(WarpOp op, uint64_t value, int arg, int width, uint64_t mask, bool has_mask) {
  Lane& l = running_lane("a warp collective");
  const int ws = l.coords.warp_size;
  if (width <= 0 || width > ws || (width & (width - 1)) != 0)
    device_fault(std::string(op_name(op)) + ": width " + std::to_string(width) + " is not a power of two <= warpSize " +
                 std::to_string(ws));
  if (has_mask && !((mask >> l.lane) & 1))
    device_fault(std::string(op_name(op)) + ": the calling lane " + std::to_string(l.lane) + " is not in the _sync mask");
  l.op = op;
  l.value = value;
  l.arg = arg;
  l.width = width;
  l.mask = has_mask ? mask : ~0ull;
  l.has_mask = has_mask;
  l.state = LaneState::kWarpOp;
  yield_to_scheduler();
  return l.result;
}

void warp_matrix(MatrixOp op, MatrixFragment* f, uint64_t mask, bool has_mask) {
  Lane& l = running_lane("a matrix instruction");
  if (has_mask && !((mask >> l.lane) & 1))
    device_fault("matrix instruction: the calling lane " + std::to_string(l.lane) + " is not in the warp mask");
  l.op = WarpOp::kMatrix;
  l.value = (uint64_t)(uintptr_t)f;
  l.arg = (int)op;
  l.width = l.coords.warp_size;
  l.mask = has_mask ? mask : ~0ull;
  l.has_mask = has_mask;
  l.state = LaneState::kWarpOp;
  yield_to_scheduler();
}

void sync_threads() {
  Lane& l = running_lane("__syncthreads");
  if (fiber_worker().job->fault == Fault::kBarrierNoop) return;
  l.state = LaneState::kBarrier;
  yield_to_scheduler();
}

void async_copy(void* dst, const void* src, size_t bytes, size_t zero_fill) {
  Lane& l = running_lane("__pipeline_memcpy_async");
  if ((bytes != 4 && bytes != 8 && bytes != 16) || zero_fill > bytes)
    device_fault("__pipeline_memcpy_async: size must be 4, 8 or 16 bytes and zero_fill <= size");
  if (((uintptr_t)dst | (uintptr_t)src) % bytes != 0)
    device_fault("__pipeline_memcpy_async: source and destination must be aligned to the copy size");
  l.copies.push_back({dst, src, bytes, zero_fill});
}
void async_commit() {
  Lane& l = running_lane("__pipeline_commit");
  l.group_ends.push_back(l.copies.size());
}
void async_wait_prior(size_t pending_groups) {
  Lane& l = running_lane("__pipeline_wait_prior");
  const size_t groups = l.group_ends.size();
  retire_copies(l, groups > pending_groups ? groups - pending_groups : 0);
}

// ---- the block scheduler ---------------------------------------------------------------------------------
namespace {

std::string hex(uint64_t v) {
  char b[32];
  snprintf(b, sizeof b, "0x%llx", (unsigned long long)v);
  return b;
}

// The xor mask with its log2(width) low bits reversed: the butterfly 16, 8, 4, 2, 1 becomes 1, 2, 4, 8, 16,
// i.e. the neighbour-pairs tree ((a0 + a1) + (a2 + a3)) + ... instead of the contract's halving tree.
int reverse_low_bits(int mask, int width) {
  int r = 0, bits = 0;
  while ((1 << bits) < width) ++bits;
  for (int b = 0; b < bits; ++b)
    if (mask & (1 << b)) r |= 1 << (bits - 1 - b);
  return r | (mask & ~(width - 1));
}

// The source lane (index within the warp) that `l` reads in a shuffle.
int shuffle_source(const Lane& l, Fault fault) {
  const int lane = l.lane, width = l.width, seg = lane & ~(width - 1), ws = l.coords.warp_size;
  int s = lane;
  switch (l.op) {
    case WarpOp::kShflXor:
      s = lane ^ (fault == Fault::kShuffleNeighbourTree ? reverse_low_bits(l.arg, width) : l.arg);
      if (s >= seg + width || s >= ws) s = lane;  // later segments: own value (both vendors)
      break;
    case WarpOp::kShflIdx: s = seg + (int)((unsigned)l.arg % (unsigned)width); break;
    case WarpOp::kShflUp: s = lane - l.arg < seg ? lane : lane - l.arg; break;
    case WarpOp::kShflDown: s = lane + l.arg >= seg + width ? lane : lane + l.arg; break;
    default: break;
  }
  return s;
}

// ---- integer matrix instruction models (simt_api.h: exact sums, the vendors' fragment layouts) --------------
int8_t frag_byte(uint32_t word, int i) { return (int8_t)(uint8_t)(word >> (8 * i)); }

// mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 — PTX ISA "Matrix Fragments for mma.m16n8k32" (.s8/.u8):
// lane l, g = l >> 2, q = l & 3: a[0] A[g][4q + i], a[1] A[g + 8][4q + i], a[2] A[g][16 + 4q + i],
// a[3] A[g + 8][16 + 4q + i]; b[0] B[4q + i][g], b[1] B[16 + 4q + i][g]; c[r] C[g + 8 (r >> 1)][2q + (r & 1)].
void model_mma_m16n8k32_s8(MatrixFragment* const* f, bool wrong_layout) {
  int32_t A[16][32], B[32][8];
  int64_t C[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, q = l & 3;
    const int a1 = wrong_layout ? 2 : 1, a2 = wrong_layout ? 1 : 2;  // negative control: a[1] <-> a[2]
    for (int i = 0; i < 4; ++i) {
      A[g][4 * q + i] = frag_byte(f[l]->a[0], i);
      A[g + 8][4 * q + i] = frag_byte(f[l]->a[a1], i);
      A[g][16 + 4 * q + i] = frag_byte(f[l]->a[a2], i);
      A[g + 8][16 + 4 * q + i] = frag_byte(f[l]->a[3], i);
      B[4 * q + i][g] = frag_byte(f[l]->b[0], i);
      B[16 + 4 * q + i][g] = frag_byte(f[l]->b[1], i);
    }
    for (int r = 0; r < 4; ++r) C[g + 8 * (r >> 1)][2 * q + (r & 1)] = f[l]->c[r];
  }
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j)
      for (int k = 0; k < 32; ++k) C[i][j] += (int64_t)A[i][k] * B[k][j];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, q = l & 3;
    for (int r = 0; r < 4; ++r) f[l]->c[r] = (int32_t)(uint32_t)(uint64_t)C[g + 8 * (r >> 1)][2 * q + (r & 1)];
  }
}

// v_mfma_i32_16x16x32_i8 — AMD matrix instruction calculator (CDNA3 ISA, gfx942; kept on gfx950): lane l,
// i = l & 15, h = l >> 4: A[i][8h + e] = byte e of the 64-bit a (a[0] low word, a[1] high), B[8h + e][i]
// likewise from b; c[r] = C[4h + r][i].
void model_mfma_i32_16x16x32_i8(MatrixFragment* const* f, bool wrong_layout) {
  int32_t A[16][32], B[32][16];
  int64_t C[16][16];
  for (int l = 0; l < 64; ++l) {
    const int i = l & 15, h = l >> 4;
    for (int e = 0; e < 8; ++e) {
      A[i][8 * h + e] = frag_byte(f[l]->a[e >> 2], e & 3);
      B[8 * h + e][i] = frag_byte(f[l]->b[(e >> 2) ^ (wrong_layout ? 1 : 0)], e & 3);  // control: words swapped
    }
    for (int r = 0; r < 4; ++r) C[4 * h + r][i] = f[l]->c[r];
  }
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j)
      for (int k = 0; k < 32; ++k) C[i][j] += (int64_t)A[i][k] * B[k][j];
  for (int l = 0; l < 64; ++l)
    for (int r = 0; r < 4; ++r) f[l]->c[r] = (int32_t)(uint32_t)(uint64_t)C[4 * (l >> 4) + r][l & 15];
}

// ---- bf16 matrix instruction models: the vendors' fragment layouts, then bf16_mma_models.h per element --------
uint16_t frag_half(uint32_t word, int i) { return (uint16_t)(word >> (16 * i)); }
float frag_f32(int32_t v) {
  float f;
  memcpy(&f, &v, 4);
  return f;
}
int32_t f32_frag(float f) {
  int32_t v;
  memcpy(&v, &f, 4);
  return v;
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 — PTX ISA "Matrix Fragments for mma.m16n8k16" (.bf16):
// lane l, g = l >> 2, q = l & 3 (element 0 of a register is its low half): a[0] A[g][2q + i], a[1]
// A[g + 8][2q + i], a[2] A[g][8 + 2q + i], a[3] A[g + 8][8 + 2q + i]; b[0] B[2q + i][g], b[1] B[8 + 2q + i][g];
// c[r] C[g + 8 (r >> 1)][2q + (r & 1)] (fp32 bits).
void model_mma_m16n8k16_bf16(MatrixFragment* const* f, Bf16MmaUnit unit, MmaModel model, bool wrong_layout) {
  uint16_t A[16][16], Bt[8][16];  // Bt[n][k]: a column of B, contiguous in k
  float C[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, q = l & 3;
    const int a1 = wrong_layout ? 2 : 1, a2 = wrong_layout ? 1 : 2;  // negative control: a[1] <-> a[2]
    for (int i = 0; i < 2; ++i) {
      A[g][2 * q + i] = frag_half(f[l]->a[0], i);
      A[g + 8][2 * q + i] = frag_half(f[l]->a[a1], i);
      A[g][8 + 2 * q + i] = frag_half(f[l]->a[a2], i);
      A[g + 8][8 + 2 * q + i] = frag_half(f[l]->a[3], i);
      Bt[g][2 * q + i] = frag_half(f[l]->b[0], i);
      Bt[g][8 + 2 * q + i] = frag_half(f[l]->b[1], i);
    }
    for (int r = 0; r < 4; ++r) C[g + 8 * (r >> 1)][2 * q + (r & 1)] = frag_f32(f[l]->c[r]);
  }
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j) C[i][j] = bf16_mma_step(unit, model, A[i], Bt[j], C[i][j]);
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, q = l & 3;
    for (int r = 0; r < 4; ++r) f[l]->c[r] = f32_frag(C[g + 8 * (r >> 1)][2 * q + (r & 1)]);
  }
}

// v_mfma_f32_16x16x16_bf16 (_1k) — AMD matrix instruction calculator (CDNA3, gfx942; same on gfx950): lane l,
// i = l & 15, h = l >> 4: A[i][4h + e] = half e of the 64-bit a (a[0] low word, a[1] high), B[4h + e][i]
// likewise from b; c[r] = C[4h + r][i] (fp32 bits).
void model_mfma_f32_16x16x16_bf16(MatrixFragment* const* f, Bf16MmaUnit unit, MmaModel model, bool wrong_layout) {
  uint16_t A[16][16], Bt[16][16];
  float C[16][16];
  for (int l = 0; l < 64; ++l) {
    const int i = l & 15, h = l >> 4;
    for (int e = 0; e < 4; ++e) {
      A[i][4 * h + e] = frag_half(f[l]->a[e >> 1], e & 1);
      Bt[i][4 * h + e] = frag_half(f[l]->b[(e >> 1) ^ (wrong_layout ? 1 : 0)], e & 1);  // control: words swapped
    }
    for (int r = 0; r < 4; ++r) C[4 * h + r][i] = frag_f32(f[l]->c[r]);
  }
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) C[i][j] = bf16_mma_step(unit, model, A[i], Bt[j], C[i][j]);
  for (int l = 0; l < 64; ++l)
    for (int r = 0; r < 4; ++r) f[l]->c[r] = f32_frag(C[4 * (l >> 4) + r][l & 15]);
}

// The whole warp is at one matrix instruction (checked by the caller): run its model.
bool run_matrix(Worker& w, int first, int lanes, int op, const Arch* arch, std::string& err) {
  MatrixFragment* f[64];
  for (int l = 0; l < lanes; ++l) f[l] = (MatrixFragment*)(uintptr_t)w.lanes[first + l].value;
  if (op == (int)MatrixOp::kMmaM16N8K32S8 && arch->vendor == Vendor::kCuda && lanes == 32) {
    model_mma_m16n8k32_s8(f, w.job->fault == Fault::kMatrixLayout);
    return true;
  }
  if (op == (int)MatrixOp::kMfmaI32x16x16x32I8 && arch->vendor == Vendor::kHip && lanes == 64) {
    model_mfma_i32_16x16x32_i8(f, w.job->fault == Fault::kMatrixLayout);
    return true;
  }
  const Bf16MmaUnit unit = (Bf16MmaUnit)arch->bf16_mma_unit;
  const MmaModel model = (MmaModel)w.job->mma_model;
  if (op == (int)MatrixOp::kMmaM16N8K16Bf16 && arch->vendor == Vendor::kCuda && lanes == 32) {
    model_mma_m16n8k16_bf16(f, unit, model, w.job->fault == Fault::kMatrixLayout);
    return true;
  }
  if (op == (int)MatrixOp::kMfmaF32x16x16x16Bf16 && arch->vendor == Vendor::kHip && lanes == 64) {
    model_mfma_f32_16x16x16_bf16(f, unit, model, w.job->fault == Fault::kMatrixLayout);
    return true;
  }
  err = "matrix instruction " + std::to_string(op) + " does not exist on " + arch->name;
  return false;
}

// Resolves the collectives of warp `warp` whose lanes all arrived. Returns whether any lane became runnable;
// a broken rule is written to `err`.
bool resolve_warp(Worker& w, int warp, int nthreads, std::string& err) {
  const int ws = w.job->arch->warp_size;
  const int first = warp * ws, last = std::min(nthreads, first + ws);
  Lane* lanes = w.lanes.data();
  uint64_t arrived = 0;
  for (int t = first; t < last; ++t)
    if (lanes[t].state == LaneState::kWarpOp) arrived |= 1ull << (t - first);
  if (!arrived) return false;
  uint64_t done = 0;
  bool progressed = false;
  for (int t = first; t < last; ++t) {
    const uint64_t bit = 1ull << (t - first);
    if (!(arrived & bit) || (done & bit)) continue;
    const Lane& lead = lanes[t];
    // The participants: on CUDA the lanes of the lead's _sync mask; on HIP every lane at a collective.
    uint64_t group = lead.has_mask ? lead.mask : arrived;
    const uint64_t exists = (last - first) == 64 ? ~0ull : ((1ull << (last - first)) - 1);
    if (lead.has_mask && (group & ~arrived)) {
      const uint64_t missing = group & ~arrived;
      err = std::string(op_name(lead.op)) + ": lanes " + hex(missing & exists) + (missing & ~exists ? " (and lanes past the block's last thread)" : "") +
            " named in the _sync mask " + hex(group) + " of warp " + std::to_string(warp) +
            " did not arrive (exited, or waiting elsewhere)";
      return false;
    }
    for (int u = first; u < last; ++u) {
      const uint64_t ub = 1ull << (u - first);
      if (!(group & ub)) continue;
      const Lane& o = lanes[u];
      if (o.op != lead.op || o.width != lead.width || o.has_mask != lead.has_mask || (lead.has_mask && o.mask != lead.mask) ||
          (lead.op == WarpOp::kMatrix && o.arg != lead.arg)) {
        err = "divergent warp collectives in warp " + std::to_string(warp) + ": lane " + std::to_string(t - first) +
              " is at " + op_name(lead.op) + " (width " + std::to_string(lead.width) + ", mask " + hex(lead.mask) +
              "), lane " + std::to_string(u - first) + " at " + op_name(o.op) + " (width " + std::to_string(o.width) +
              ", mask " + hex(o.mask) + ")";
        return false;
      }
    }
    if (lead.op == WarpOp::kMatrix) {  // a warp-wide instruction: every lane of a full warp, one instruction
      if (last - first != ws || (group & arrived) != exists || group != exists) {
        err = "matrix instruction in warp " + std::to_string(warp) + ": every lane of a full warp must execute it " +
              "(arrived " + hex(arrived) + ", warp of " + std::to_string(ws) + " lanes, " +
              std::to_string(last - first) + " present)";
        return false;
      }
      if (!run_matrix(w, first, ws, lead.arg, w.job->arch, err)) return false;
      for (int u = first; u < last; ++u) lanes[u].state = LaneState::kRunnable;
      return true;
    }
    uint64_t votes = 0;
    for (int u = first; u < last; ++u)
      if ((group & (1ull << (u - first))) && lanes[u].value) votes |= 1ull << (u - first);
    for (int u = first; u < last; ++u) {
      const uint64_t ub = 1ull << (u - first);
      if (!(group & ub)) continue;
      Lane& o = lanes[u];
      switch (o.op) {
        case WarpOp::kShflXor:
        case WarpOp::kShflIdx:
        case WarpOp::kShflUp:
        case WarpOp::kShflDown: {
          const int s = shuffle_source(o, w.job->fault);
          if (!(group & (1ull << s))) {
            err = std::string(op_name(o.op)) + ": lane " + std::to_string(u - first) + " of warp " + std::to_string(warp) +
                  " reads lane " + std::to_string(s) + ", which is not at this collective (exited or diverged)";
            return false;
          }
          o.result = lanes[first + s].value;
          break;
        }
        case WarpOp::kBallot: o.result = votes; break;
        case WarpOp::kAny: o.result = votes != 0; break;
        case WarpOp::kAll: o.result = votes == (group & arrived); break;
        case WarpOp::kSyncWarp: o.result = 0; break;
      }
      o.state = LaneState::kRunnable;
      progressed = true;
    }
    done |= group;
  }
  return progressed;
}

void reset_block_fibers(Worker& w, int nthreads) {
  for (int t = 0; t < nthreads; ++t) {
    Lane& l = w.lanes[t];
    if (l.state != LaneState::kDone) init_fiber_context(l.fiber);  // abandon its frames
  }
}

// The order of one pass over the block's threads (w.order) and of the warps (w.warp_order): see "Schedules" at
// the top. Random: the warps in a random order, each warp's lanes in a random order (a fresh draw every pass).
void schedule_pass(Worker& w, ScheduleKind kind, Rng& rng, int nthreads, int ws, int nwarps) {
  w.order.resize(nthreads);
  w.warp_order.resize(nwarps);
  for (int i = 0; i < nwarps; ++i) w.warp_order[i] = kind == ScheduleKind::kReverse ? nwarps - 1 - i : i;
  if (kind == ScheduleKind::kForward) {
    for (int t = 0; t < nthreads; ++t) w.order[t] = t;
    return;
  }
  if (kind == ScheduleKind::kReverse) {
    for (int t = 0; t < nthreads; ++t) w.order[t] = nthreads - 1 - t;
    return;
  }
  for (int i = nwarps - 1; i > 0; --i) std::swap(w.warp_order[i], w.warp_order[rng.below(i + 1)]);
  int o = 0;
  for (int i = 0; i < nwarps; ++i) {
    const int first = w.warp_order[i] * ws, n = std::min(nthreads - first, ws);
    w.lane_order.resize(n);
    for (int l = 0; l < n; ++l) w.lane_order[l] = l;
    for (int l = n - 1; l > 0; --l) std::swap(w.lane_order[l], w.lane_order[rng.below(l + 1)]);
    for (int l = 0; l < n; ++l) w.order[o++] = first + w.lane_order[l];
  }
}

// The block run as the c-th of `n` under the schedule: forward c, reverse n-1-c, random a bijection of [0, n)
// (a 4-round Feistel network on the next power of two, cycle-walking back into [0, n)).
uint64_t block_of_slot(const Job& job, uint64_t c) {
  const uint64_t n = job.blocks;
  if (job.schedule.kind == ScheduleKind::kForward) return c;
  if (job.schedule.kind == ScheduleKind::kReverse) return n - 1 - c;
  int bits = 2;
  while ((1ull << bits) < n) ++bits;
  if (bits & 1) ++bits;
  const int half = bits / 2;
  const uint64_t mask = (1ull << half) - 1;
  uint64_t x = c;
  do {
    uint64_t l = x >> half, r = x & mask;
    for (int round = 0; round < 4; ++round) {
      const uint64_t f = mix64(job.schedule.seed ^ mix64(job.launch_key + (uint64_t)round) ^ r) & mask;
      const uint64_t nl = r;
      r = l ^ f;
      l = nl;
    }
    x = (l << half) | r;
  } while (x >= n);
  return x;
}

// Runs block `b` of the job on this worker; returns false (and the message) on a broken rule.
bool run_block(Worker& w, const Job& job, uint64_t b, std::string& err) {
  const dim3 g = job.cfg.grid, bd = job.cfg.block;
  const int nthreads = (int)(bd.x * bd.y * bd.z);
  const int ws = job.arch->warp_size;
  try {  // fiber stacks are made on first use: a failed mmap / mprotect fails the launch, not the process
    w.fibers.reserve(nthreads);  // (then emplace_back cannot throw after new_fiber succeeded)
    while ((int)w.fibers.size() < nthreads) w.fibers.emplace_back(new_fiber(w));
  } catch (const std::exception& e) {  // before any lane or fiber of this block changed: the worker stays usable
    err = e.what();
    return false;
  }
  if ((int)w.lanes.size() < nthreads) w.lanes.resize(nthreads);
  const uint3 bidx{(unsigned)(b % g.x), (unsigned)((b / g.x) % g.y), (unsigned)(b / ((uint64_t)g.x * g.y))};
  for (int t = 0; t < nthreads; ++t) {
    Lane& l = w.lanes[t];
    l.coords = ThreadCoords{uint3{t % bd.x, (t / bd.x) % bd.y, t / (bd.x * bd.y)}, bidx, bd, g, ws};
    l.linear = t;
    l.warp = t / ws;
    l.lane = t % ws;
    l.state = LaneState::kRunnable;
    l.copies.clear();
    l.group_ends.clear();
    l.fiber = w.fibers[t].get();
  }
  w.job = &job;
  w.block_error.clear();
  const int nwarps = (nthreads + ws - 1) / ws;
  if (job.cfg.shared_bytes > 0) {  // fresh contents are undefined on a GPU: 0xff bytes (NaN) here
    w.dyn_smem_store.assign(job.cfg.shared_bytes + 64, 0xff);
    w.dyn_smem = (unsigned char*)(((uintptr_t)w.dyn_smem_store.data() + 63) & ~(uintptr_t)63);
  } else {
    w.dyn_smem = nullptr;
  }
  Rng rng{mix64(job.schedule.seed ^ mix64(job.launch_key ^ mix64(b)))};
  int live = nthreads;
  for (;;) {
    schedule_pass(w, job.schedule.kind, rng, nthreads, ws, nwarps);
    for (int t : w.order) {
      Lane& l = w.lanes[t];
      if (l.state != LaneState::kRunnable) continue;
      resume(w, l);
      if (l.state == LaneState::kDone) --live;
      if (l.state == LaneState::kFailed) break;
    }
    if (!w.block_error.empty()) {
      err = w.block_error;
      reset_block_fibers(w, nthreads);
      return false;
    }
    if (live == 0) return true;
    bool progressed = false;
    for (int i = 0; i < nwarps && err.empty(); ++i) progressed |= resolve_warp(w, w.warp_order[i], nthreads, err);
    if (!err.empty()) {
      reset_block_fibers(w, nthreads);
      return false;
    }
    if (progressed) continue;
    int at_barrier = 0, at_warp = 0;
    for (int t = 0; t < nthreads; ++t) {
      at_barrier += w.lanes[t].state == LaneState::kBarrier;
      at_warp += w.lanes[t].state == LaneState::kWarpOp;
    }
    if (at_barrier == live) {
      for (int t = 0; t < nthreads; ++t)
        if (w.lanes[t].state == LaneState::kBarrier) w.lanes[t].state = LaneState::kRunnable;
      continue;
    }
    err = "deadlock: " + std::to_string(at_barrier) + " thread(s) wait at __syncthreads while " +
          std::to_string(at_warp) + " wait at a warp collective that cannot complete";
    reset_block_fibers(w, nthreads);
    return false;
  }
}

// The IEEE default FP environment for the kernels of one launch on this OS thread (see "FP environment" at the
// top); the destructor gives the host thread its own environment back.
class PinnedFpEnvironment {
 public:
  PinnedFpEnvironment() {
#if defined(__x86_64__)
    saved_csr_ = _mm_getcsr();
    _mm_setcsr(kDefaultCsr);
    __asm__ volatile("fnstcw %0" : "=m"(saved_cw_));
    const uint16_t cw = 0x037f;  // x87: all exceptions masked, 64-bit precision, round to nearest
    __asm__ volatile("fldcw %0" : : "m"(cw));
#else
    fegetenv(&saved_);
    fesetenv(FE_DFL_ENV);
#endif
  }
  ~PinnedFpEnvironment() {
#if defined(__x86_64__)
    _mm_setcsr(saved_csr_);
    __asm__ volatile("fldcw %0" : : "m"(saved_cw_));
#else
    fesetenv(&saved_);
#endif
  }
#if defined(__x86_64__)
  static constexpr unsigned kDefaultCsr = 0x1f80;  // exceptions masked, round to nearest, no FTZ, no DAZ
#endif

 private:
#if defined(__x86_64__)
  unsigned saved_csr_;
  uint16_t saved_cw_;
#else
  fenv_t saved_;
#endif
};

// noexcept: an exception here (only std::bad_alloc can escape: run_block reports its own failures) would leave
// Pool::run without waiting for the helpers still running the job; it ends the process instead.
void run_blocks(Job& job) noexcept {
  Worker& w = tl_worker;
  PinnedFpEnvironment fp_env;
  std::string err;
  for (;;) {
    if (job.failed.load(std::memory_order_relaxed)) return;
    const uint64_t slot = job.next.fetch_add(1);
    if (slot >= job.blocks) return;
    const uint64_t b = block_of_slot(job, slot);
    err.clear();
    if (!run_block(w, job, b, err)) {
      const dim3 g = job.cfg.grid;
      job.fail(b, "block (" + std::to_string(b % g.x) + "," + std::to_string((b / g.x) % g.y) + "," +
                      std::to_string(b / ((uint64_t)g.x * g.y)) + "): " + err);
      return;
    }
  }
}

// A few persistent worker threads (fibers and their stacks are per worker, created once).
class Pool {
 public:
  static Pool& get() {
    // never destroyed: workers may outlive static destruction (its initialisation guard is taken only under the
    // launch mutex, which a fork holds: no fork lands while another thread holds the guard)
    static Pool* pool = new Pool;
    if (pool->pid_ != getpid()) pool = new Pool;  // after fork() the workers are gone
    return *pool;
  }
  void run(Job& job) {
    const int helpers = std::min<int>((int)threads_.size(), (int)std::min<uint64_t>(job.blocks, 64) - 1);
    if (helpers > 0) {
      std::unique_lock<std::mutex> lock(m_);
      job_ = &job;
      wanted_ = helpers;
      busy_ = helpers;
      ++generation_;
      cv_.notify_all();
    }
    run_blocks(job);
    if (helpers > 0) {
      std::unique_lock<std::mutex> lock(m_);
      done_cv_.wait(lock, [&] { return busy_ == 0; });
      job_ = nullptr;
    }
  }

 private:
  Pool() : pid_(getpid()) {
    int n = (int)std::thread::hardware_concurrency();
    if (const char* e = getenv("ALIGNED_EMU_THREADS")) n = atoi(e);
    n = std::max(1, std::min(n, 4));
    for (int i = 0; i + 1 < n; ++i) threads_.emplace_back([this, i] { loop(i); });
    for (auto& t : threads_) t.detach();
  }
  void loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      Job* job;
      {
        std::unique_lock<std::mutex> lock(m_);
        cv_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (index >= wanted_) continue;
        job = job_;
      }
      run_blocks(*job);
      std::unique_lock<std::mutex> lock(m_);
      if (--busy_ == 0) done_cv_.notify_all();
    }
  }
  pid_t pid_;
  std::vector<std::thread> threads_;
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  Job* job_ = nullptr;
  int wanted_ = 0, busy_ = 0;
  uint64_t generation_ = 0;
};

std::mutex g_launch_mutex;  // one launch at a time (launches are synchronous anyway)

void set_error(const std::string& what) {
  tl_error = what;
  tl_error_pending = true;
}

// ALIGNED_EMU_SCHEDULE: "" or "forward", "reverse", "random:SEED" (SEED a decimal integer). false: malformed.
bool parse_schedule(const char* text, Schedule* out) {
  const std::string v = text ? text : "";
  if (v.empty() || v == "forward") {
    *out = Schedule{ScheduleKind::kForward, 0};
    return true;
  }
  if (v == "reverse") {
    *out = Schedule{ScheduleKind::kReverse, 0};
    return true;
  }
  if (v.rfind("random:", 0) == 0 && v.size() > 7 && v.size() <= 7 + 19 &&
      v.find_first_not_of("0123456789", 7) == std::string::npos) {
    *out = Schedule{ScheduleKind::kRandom, std::stoull(v.substr(7))};
    return true;
  }
  return false;
}

// Per (kernel, arch): the dynamic shared memory limit raised by set_max_dynamic_shared.
std::mutex g_attr_mutex;
std::map<std::pair<const void*, const Arch*>, size_t> g_dynamic_shared_limit;

size_t dynamic_shared_limit(const void* kernel, const Arch* arch) {
  std::lock_guard<std::mutex> lock(g_attr_mutex);
  auto it = g_dynamic_shared_limit.find({kernel, arch});
  return it == g_dynamic_shared_limit.end() ? arch->default_dynamic_shared_bytes : it->second;
}

// fork(): the child runs only the forking thread, so every other worker's chunk (the pool's helpers', other
// launching threads') is a dead copy there: the child unmaps them and frees their entries, or a chain of forks that
// each launch would fill the registry (kMaxChunks) a few entries per generation. The runtime's process-wide mutexes
// are held across the fork, so the child never inherits one locked by a thread it does not have (a fork waits for a
// launch running on another thread). Order: launch, state, attr, name, chunk — the only nesting elsewhere is launch
// -> chunk (a launch's first fibers), and none is taken while a later one is held. Not held: the pool's own mutex
// (the child makes a new Pool and never touches the old one) and a Job's (it lives inside a launch, which the launch
// mutex excludes). Registered when the library loads: enter() / exit() take the state mutex before any launch.
void before_fork() {
  g_launch_mutex.lock();
  g_state_mutex.lock();
  g_attr_mutex.lock();
  g_name_mutex.lock();
  g_chunk_mutex.lock();
}
void after_fork_parent() {
  g_chunk_mutex.unlock();
  g_name_mutex.unlock();
  g_attr_mutex.unlock();
  g_state_mutex.unlock();
  g_launch_mutex.unlock();
}
void after_fork_child() {
  const int n = g_chunk_entries.load(std::memory_order_relaxed);
  for (int i = 0; i < n; ++i) {
    const uintptr_t base = g_chunk_base[i].load(std::memory_order_relaxed);
    if (i == tl_chunk_entry || base == 0) continue;
#if defined(ALIGNED_EMU_ASAN)
    // the dead fibers' abandoned frames: only the regions of the fibers made (a chunk's whole shadow is 128 MiB)
    __asan_unpoison_memory_region((void*)base,
                                  (size_t)g_chunk_fibers[i].load(std::memory_order_relaxed) * kFiberRegionBytes);
#endif
    munmap((void*)base, kChunkBytes);
    g_chunk_base[i].store(0, std::memory_order_relaxed);
  }
  after_fork_parent();
}

const bool g_fork_handlers = pthread_atfork(before_fork, after_fork_parent, after_fork_child) == 0;

}  // namespace

unsigned char* dynamic_shared_memory() {
  running_lane("dynamic shared memory");
  return fiber_worker().dyn_smem;
}

const char* set_max_dynamic_shared(const void* kernel, long long bytes) {
  const Arch* arch = active_arch();
  if (!arch) return "set_max_dynamic_shared: no emulated arch is active (aligned_ops.emulate)";
  if (bytes < 0 || (unsigned long long)bytes > arch->max_shared_bytes) {
    static thread_local std::string msg;
    msg = "cudaFuncSetAttribute(MaxDynamicSharedMemorySize, " + std::to_string(bytes) + "): invalid argument, " +
          arch->name + " gives a block at most " + std::to_string(arch->max_shared_bytes) + " bytes";
    return msg.c_str();
  }
  std::lock_guard<std::mutex> lock(g_attr_mutex);
  g_dynamic_shared_limit[{kernel, arch}] = (size_t)bytes;
  return nullptr;
}

size_t max_dynamic_shared_optin() {
  const Arch* arch = active_arch();
  return arch ? arch->max_shared_bytes : 0;
}

void launch(const char* kernel, const void* kernel_key, const LaunchConfig& cfg, void (*thunk)(const void*),
            const void* args) {
  const Arch* arch = active_arch();
  const std::string where = std::string("emulated launch of ") + kernel;
  if (!g_fork_handlers) return set_error(where + ": cannot register the fork handlers (pthread_atfork)");
  if (!arch) return set_error(where + ": no emulated arch is active (aligned_ops.emulate)");
  if (tl_worker.current) return set_error(where + ": launched from inside an emulated kernel");
  Schedule schedule;
  const char* sched_text = getenv("ALIGNED_EMU_SCHEDULE");
  if (!parse_schedule(sched_text, &schedule))
    return set_error(where + ": ALIGNED_EMU_SCHEDULE must be forward, reverse or random:SEED (SEED a decimal " +
                     "integer), got '" + std::string(sched_text) + "'");
  const dim3 g = cfg.grid, b = cfg.block;
  const uint64_t threads = (uint64_t)b.x * b.y * b.z;
  if (threads == 0 || threads > (uint64_t)kMaxBlockThreads || b.z > 64)
    return set_error(where + ": invalid block (" + std::to_string(b.x) + "," + std::to_string(b.y) + "," +
                     std::to_string(b.z) + "): 1.." + std::to_string(kMaxBlockThreads) + " threads, z <= 64");
  if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535)
    return set_error(where + ": invalid grid (" + std::to_string(g.x) + "," + std::to_string(g.y) + "," +
                     std::to_string(g.z) + ")");
  const size_t smem_limit = dynamic_shared_limit(kernel_key, arch);
  if (cfg.shared_bytes > smem_limit) {
    const bool raisable = smem_limit < arch->max_shared_bytes && cfg.shared_bytes <= arch->max_shared_bytes;
    return set_error(where + ": " + std::to_string(cfg.shared_bytes) + " bytes of dynamic shared memory exceed the " +
                     "kernel's limit of " + std::to_string(smem_limit) + " on " + arch->name +
                     (raisable ? " (raise it first: cudaFuncSetAttribute(kernel, "
                                 "cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), compat.cuh "
                                 "allow_dynamic_shared)"
                               : std::string(" (the arch gives a block at most ") +
                                     std::to_string(arch->max_shared_bytes) + ")"));
  }
  {
    std::lock_guard<std::mutex> lock(g_state_mutex);
    if (!g_scopes.empty())
      g_records.push_back(LaunchRecord{kernel, arch->name, {g.x, g.y, g.z}, {b.x, b.y, b.z}, cfg.shared_bytes});
  }
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  Job job;
  job.kernel = kernel;
  job.cfg = cfg;
  job.arch = arch;
  job.fault = active_fault();
  job.mma_model = active_mma_model();
  job.schedule = schedule;
  uint64_t key = mix64((uint64_t)g.x | ((uint64_t)g.y << 32)) ^ mix64((uint64_t)g.z | ((uint64_t)threads << 32));
  for (const char* c = kernel; *c; ++c) key = mix64(key ^ (unsigned char)*c);
  job.launch_key = key;
  job.thunk = thunk;
  job.args = args;
  job.blocks = (uint64_t)g.x * g.y * g.z;
  Pool::get().run(job);
  if (job.failed.load()) set_error(where + " on " + arch->name + ": " + job.error);
}

}  // namespace aligned::emu
