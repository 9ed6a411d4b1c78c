// emulated.cpp — the emulation target's host side in the torch library: the error words of each vendor's
// emulated kernels, and the control ops behind aligned_ops.emulate (python/aligned_ops/emulation.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "../../common/attention_mma.h"
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

template <emu::Vendor V>
void EmulatedDevice<V>::attention_mma_reference(const char* op, const AttnProblem& f, const int32_t* cu_q,
                                                const int32_t* cu_k, int64_t n_seqs, void* out, float* lse) {
  const emu::Arch* arch = emu::active_arch();
  TORCH_CHECK(arch != nullptr, "aligned::", op, ": no emulated arch is active");
  const auto unit = (emu::Bf16MmaUnit)arch->bf16_mma_unit;
  const auto model = (emu::MmaModel)emu::active_mma_model();
  const auto step = [&](float acc, const uint16_t* xb, const uint16_t* wb) {
    return emu::bf16_mma_step(unit, model, xb, wb, acc);
  };
  const auto* q = (const bf16_t*)f.q;
  const auto* k = (const bf16_t*)f.k;
  const auto* v = (const bf16_t*)f.v;
  const int64_t G = f.Hq / f.Hkv, D = f.D;
  std::vector<float> part, w;
  for (int64_t b = 0; b < n_seqs; ++b) {
    const int64_t q0 = cu_q[b], q_len = cu_q[b + 1] - q0, k0 = cu_k[b], n_ctx = cu_k[b + 1] - k0;
    const KvRows kv{f.Hkv, D, 0, k0, nullptr};
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t n_keys = attn_row_keys(n_ctx - q_len + i, n_ctx, f.causal), ns = attn_num_splits(n_keys);
      part.assign((size_t)std::max<int64_t>(1, ns * (D + 2)), 0.0f);
      w.assign((size_t)std::max<int64_t>(1, ns), 0.0f);
      for (int64_t h = 0; h < f.Hq; ++h) {
        const int64_t row = (q0 + i) * f.Hq + h;
        attn_mma_row_reference(q + row * D, k, v, kv, h / G, n_keys, D, f.scale, step, part.data(), w.data(),
                               (bf16_t*)out + row * D, lse + row);
      }
    }
  }
}

template <emu::Vendor V>
void EmulatedDevice<V>::attention_mma_backward_reference(const char* op, const AttnBackwardRun& r, const int32_t* cu_q,
                                                         const int32_t* cu_k, int64_t n_seqs) {
  const emu::Arch* arch = emu::active_arch();
  TORCH_CHECK(arch != nullptr, "aligned::", op, ": no emulated arch is active");
  const auto unit = (emu::Bf16MmaUnit)arch->bf16_mma_unit;
  const auto model = (emu::MmaModel)emu::active_mma_model();
  const auto step = [&](float acc, const uint16_t* xb, const uint16_t* wb) {
    return emu::bf16_mma_step(unit, model, xb, wb, acc);
  };
  const AttnProblem& f = r.problem;
  for (int64_t b = 0; b < n_seqs; ++b)
    for (int64_t g = 0; g < f.Hkv; ++g)
      attn_mma_backward_reference((const bf16_t*)r.q.data_ptr(), (const bf16_t*)r.k.data_ptr(),
                                  (const bf16_t*)r.v.data_ptr(), (const bf16_t*)r.grad_out.data_ptr(),
                                  (const bf16_t*)r.out.data_ptr(), r.lse.data_ptr<float>(), cu_q[b],
                                  cu_q[b + 1] - cu_q[b], cu_k[b], cu_k[b + 1] - cu_k[b], f.Hq, f.Hkv, f.D, g,
                                  f.causal, f.scale, step, (bf16_t*)r.dq.data_ptr(), (bf16_t*)r.dk.data_ptr(),
                                  (bf16_t*)r.dv.data_ptr());
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
  if (name == "live_fiber_chunks") return {live_fiber_chunks()};  // the runtime's state, not a kernel
  std::vector<long long> out;
  const char* err = a->vendor == Vendor::kHip ? gpu::emulated_hip::run_selftest(name, out)
                                              : gpu::emulated_cuda::run_selftest(name, out);
  TORCH_CHECK(err == nullptr, "aligned::_emulate_selftest(", name, "): ", err ? err : "");
  return std::vector<int64_t>(out.begin(), out.end());
}

void emulate_enter(const std::string& arch, int64_t fault, int64_t mma_model) {
  const Arch* a = find_arch(arch);
  TORCH_CHECK(a != nullptr, "aligned_ops.emulate: arch must be one of ", known_archs(), ", got '", arch, "'");
  TORCH_CHECK(fault >= 0 && fault < (int64_t)Fault::kCount, "aligned_ops.emulate: unknown fault ", fault);
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
