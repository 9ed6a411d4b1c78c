// cpu_exact.cpp — the CPU backend's runs of the `exact` linear families: weight packing (once per weight
// version; the Python wrapper caches it), activation packing, the split of row blocks x 64-column groups across
// threads, the choice of integer unit, the fp64 routes, and the TP pieces. The numbers are defined in
// csrc/common/exact_linear.h; the arithmetic is in csrc/cpu/gemm_exact_kernels.cpp. Threads only pick which
// tiles they compute; every output is an exact integer rounded once, so neither threads, nor the unit, nor the
// route can change a bit. Also the CPU key's registrations of these families (register_cpu.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <stdlib.h>
#include <string.h>

#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../cpu/cpu_backend.h"
#include "../glue/exact.h"
#include "../make_params.h"
#include "../registration_impl.h"
#include "cpu.h"
#include "emulated.h"
#include "gpu.h"

namespace aligned::glue {

using cpu::cpu_backend;
using cpu::exact_kernels;
using cpu::ExactF64Params;
using cpu::ExactF64SplitParams;

namespace {

// AMX-INT8 tiles where the chosen level grants them (cpu_backend.h: level "amx").
bool use_amx() { return cpu_backend().amx_int8; }

constexpr int64_t ceil_to(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// The IEEE floating-point environment (csrc/cpu/ieee_env.h) for the exact linear: every op below sets it in the
// calling thread (Call does too), ieee_parallel_for in every task. The fp64 path's conversions (fp32 -> fp64 of
// subnormal inputs, the final double -> fp32) and the digit path's epilogue depend on it; under DAZ a subnormal
// compares equal to zero, so even the row scans (E, lsb, b) would change.
using cpu::IeeeFpEnv;
using cpu::ieee_parallel_for;


// The weight's digits against the canonical forms `forms` (its rows', or, TP, the full rows' its slices
// belong to).
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_weight_with_forms(const at::Tensor& weight, const at::Tensor& wc,
                                                                      DType dt,
                                                                      const std::vector<exact::RowForm>& forms) {
  const int64_t N = wc.size(0), K = wc.size(1), Np = ceil_to(N, 16), Kp = ceil_to(K, 64);
  const auto& k = exact_kernels();
  int sw = 1;
  for (int64_t n = 0; n < N; ++n) sw = std::max(sw, forms[n].S);
  auto opts = weight.options();
  auto wd = at::zeros({sw, Np * Kp}, opts.dtype(at::kChar));
  auto we = at::zeros({N + 1}, opts.dtype(at::kInt));
  we.data_ptr<int32_t>()[N] = (int32_t)K;  // the packed form's in_features
  auto wb = at::zeros({N}, opts.dtype(at::kByte));
  ieee_parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    k.pack_w(dt, wc.data_ptr(), K, Kp, Np * Kp, sw, forms.data(), wd.data_ptr<int8_t>(), we.data_ptr<int32_t>(),
             wb.data_ptr<uint8_t>(), b, e);
  });
  return {wd, we, wb};
}

// ---- tensor parallelism (exact_linear.h, "tensor parallelism"; docs/exact_linear.md, "TP") ----------------
// A rank holds a K slice of every row. linear_exact_row_scan gives its slice's scans; an elementwise integer
// MAX over the ranks (all-reduce MAX) gives the full rows' scans; the weight is packed against them once per
// weight version (linear_exact_pack_weight_scanned), x per call inside linear_exact_partial, which returns
// the exact integer partials (hi, lo). An int64 SUM over the ranks, then linear_exact_finish: the one rounding
// and the epilogue. The digit path only (the fp64 path does not take part: same bits, it would only be a
// speed-up at M = 1).

// The scans (emax, -lmin, bad) of every row of v [R, K] (contiguous).
std::vector<int32_t> scans_of(const at::Tensor& vc, DType dt) {
  const int64_t R = vc.size(0), K = vc.size(1);
  std::vector<int32_t> s((size_t)std::max<int64_t>(R, 1) * exact::kScanInts);
  const auto& k = exact_kernels();
  ieee_parallel_for(0, R, 16, [&](int64_t b, int64_t e) { k.row_scans(dt, vc.data_ptr(), K, s.data(), b, e); });
  return s;
}

// The given scans must cover this rank's slices (merging a slice's own scan into them changes nothing): a
// scan of another tensor, or not merged over every rank, is refused rather than packed against.
void check_scan_covers(const at::Tensor& given, const std::vector<int32_t>& local, int64_t R, const char* op,
                       const char* name) {
  const int32_t* g = given.data_ptr<int32_t>();
  for (int64_t r = 0; r < R * exact::kScanInts; ++r)
    TORCH_CHECK(local[r] <= g[r], "aligned::", op, ": ", name, " row ", r / exact::kScanInts,
                " does not cover this rank's slice of that row (", name,
                " must be the MAX-merge of every rank's linear_exact_row_scan of the same rows)");
}


// The digit path for every row of xc [M, K] (contiguous) into out [M, N]: every column, or only the 16-column
// panels listed (the fp64 path's leftovers).
void digit_linear(const at::Tensor& xc, DType dt, const at::Tensor& wd, const at::Tensor& w_exp,
                  const at::Tensor& w_bad, int64_t N, const at::Tensor& bias, int64_t k_parts, at::Tensor& out,
                  const std::vector<int64_t>* panels = nullptr, const int32_t* scans = nullptr,
                  int64_t* partial = nullptr) {
  const int64_t M = xc.size(0), K = xc.size(1), Mp = ceil_to(M, 16), Kp = ceil_to(K, 64);
  const auto& k = exact_kernels();
  const int maxd = exact::kMaxDigits;
  auto opts = xc.options();
  auto xd = at::empty({maxd, Mp, Kp}, opts.dtype(at::kChar));
  auto xe = at::zeros({Mp}, opts.dtype(at::kInt));
  auto xs = at::zeros({Mp}, opts.dtype(at::kChar));
  auto xb = at::zeros({Mp}, opts.dtype(at::kByte));
  if (Mp > M) {  // padding rows of the last tile: zero digits
    for (int t = 0; t < maxd; ++t) memset(xd.data_ptr<int8_t>() + (t * Mp + M) * Kp, 0, (size_t)((Mp - M) * Kp));
  }
  ieee_parallel_for(0, M, 4, [&](int64_t b, int64_t e) {
    if (scans)
      k.pack_x_scanned(dt, xc.data_ptr(), K, Kp, Mp * Kp, maxd, scans, xd.data_ptr<int8_t>(), xe.data_ptr<int32_t>(),
                       xs.data_ptr<int8_t>(), xb.data_ptr<uint8_t>(), b, e);
    else
      k.pack_x(dt, xc.data_ptr(), K, Kp, Mp * Kp, maxd, xd.data_ptr<int8_t>(), xe.data_ptr<int32_t>(),
               xs.data_ptr<int8_t>(), xb.data_ptr<uint8_t>(), b, e);
  });
  ExactGemmParams p = make_exact_gemm_params(dt, xd, Mp, xe, xs, xb, wd, w_exp, w_bad, bias, out, M, N, K, Kp);
  p.partial = partial;
  p.k_parts = (int)std::min<int64_t>(k_parts, 1 << 20);
  p.use_amx = use_amx();
  // Tasks: blocks of rows x groups of 64 columns, column group outermost, so a thread's consecutive tasks
  // share the group's weight digits (the kernel keeps each 16-column panel in cache while its row tiles
  // pass). AMX takes up to 256 rows per task (its tile configuration is loaded once per task); the vector
  // levels 16.
  const int64_t kCols = panels ? 16 : 64;
  const int64_t rows_per_task = p.use_amx ? 256 : 16;
  const int64_t mt = (M + rows_per_task - 1) / rows_per_task;
  const int64_t ng = panels ? (int64_t)panels->size() : (N + kCols - 1) / kCols;
  ieee_parallel_for(0, mt * ng, 1, [&](int64_t b, int64_t e) {
    IeeeFpEnv fenv;
    for (int64_t task = b; task < e; ++task) {
      ExactGemmParams q = p;
      const int64_t g = task / mt, i = task % mt;
      q.m0 = i * rows_per_task;
      q.m1 = std::min(M, q.m0 + rows_per_task);
      q.n0 = (panels ? (*panels)[g] : g) * kCols;
      q.n1 = std::min(N, q.n0 + kCols);
      k.gemm(q);
    }
  });
}

// The fp64 path's mode (ALIGNED_EXACT_F64, read per call): "auto" (default) — row pairs meeting bound (B) take
// it when the call has at most kF64MaxRows rows; "all" — at any M; "off" — never (the digit path everywhere).
// Bits cannot depend on it (both paths compute the same exact sum): tests force each to show it.
enum class F64Mode { kOff, kAuto, kAll };
F64Mode f64_mode() {
  const char* e = getenv("ALIGNED_EXACT_F64");
  if (e == nullptr || *e == 0 || strcmp(e, "auto") == 0) return F64Mode::kAuto;
  if (strcmp(e, "off") == 0) return F64Mode::kOff;
  if (strcmp(e, "all") == 0) return F64Mode::kAll;
  TORCH_CHECK(false, "aligned::linear_exact_packed: ALIGNED_EXACT_F64 must be auto, all or off, got '", e, "'");
}
// Measured (bench/RESULTS.md, "exact linear: the fp64 path"; shared 2-vCPU AMX VM): the fp64 path beats the
// AMX digit kernel at M = 1 (memory-bound: it streams 2 bytes per weight element, the digits 4) and loses from
// M = 2 on (its fp64 FMA rate, plus the digit-path recomputation of the pairs failing the bound).
constexpr int64_t kF64MaxRows = 1;

// b (exact_linear.h) of every row of v [R, K] (contiguous) and its NaN / inf flag.
void row_bounds(const at::Tensor& v, DType dt, std::vector<int32_t>& bound, std::vector<uint8_t>& bad) {
  const int64_t R = v.size(0), K = v.size(1);
  bound.assign((size_t)R, 0);
  bad.assign((size_t)R, 0);
  const auto& k = exact_kernels();
  ieee_parallel_for(0, R, 16, [&](int64_t b, int64_t e) {
    k.row_bounds(dt, v.data_ptr(), K, bound.data(), bad.data(), b, e);
  });
}

// The fp64 routes of one call (linear_exact_packed with the weight and its bounds). A row of x whose
// canonical form rounds (range > 29 bits: massive activations) is replaced, for the fp64 routes, by the values
// the definition sums (exact_linear.h canonical_row), and so, per call, is a weight row whose form rounds (the
// split route's substitutes). Then the fp64 path computes every output of the finite rows; outputs whose pair
// fails (B) are recomputed by the split route where both halves of the x row meet (B) with the weight row,
// else on the digit path (their 16-column panels, for the rows concerned); rows with NaN / inf entirely on the
// digit path. Every route gives the same bits wherever it may run (tests/ops/test_linear_exact_f64.py forces
// and checks each; _linear_exact_f64_routes reports which one each output takes).
struct F64Plan {
  at::Tensor xf;                      // x for the fp64 routes: rounding rows canonicalised
  std::vector<int64_t> f64_rows;      // rows on the fp64 path
  std::vector<int64_t> bad_rows;      // rows on the digit path entirely (NaN / inf)
  std::vector<int64_t> mixed_rows;    // rows with some columns on the digit path
  std::vector<uint8_t> panel_needed;  // [N/16] panels those columns lie in
  struct SplitRow {
    int64_t m;
    int tau;
    std::vector<int64_t> cols, slots;  // output columns; substitute slot of the weight row (-1: the row itself)
  };
  std::vector<SplitRow> splits;
  std::vector<char> wsub;  // substitutes of rounding weight rows, K elements each
};

enum : int8_t { kRouteF64 = 0, kRouteSplit = 1, kRouteDigit = 2 };

F64Plan plan_f64_routes(const at::Tensor& xc, DType dt, const at::Tensor& wc, const int32_t* bw,
                        int8_t* routes /* [M, N] or null */) {
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  const int64_t es = xc.element_size();
  F64Plan P;
  std::vector<int32_t> bx;
  std::vector<uint8_t> xbad;
  row_bounds(xc, dt, bx, xbad);
  P.xf = xc;
  for (int64_t m = 0; m < M; ++m) {
    if (xbad[m] || bx[m] != exact::kF64Never) continue;
    if (P.xf.data_ptr() == xc.data_ptr()) P.xf = xc.clone();
    with_type(dt, [&](auto* tp) {
      using T = std::remove_pointer_t<decltype(tp)>;
      T* row = (T*)P.xf.data_ptr() + m * K;
      exact::canonical_row(row, K);
      bool bad = false;
      bx[m] = exact::f64_row_bound((const T*)row, K, &bad);
    });
  }
  // Weight rows whose form rounds: their canonical rounding and its bound, built on first use in this call.
  std::vector<int64_t> wsub_slot((size_t)N, -1);
  std::vector<int32_t> wsub_bound;
  auto weight_row = [&](int64_t n, int32_t* b) -> int64_t {
    if (bw[n] != exact::kF64Never) {
      *b = bw[n];
      return -1;
    }
    if (wsub_slot[n] < 0) {
      wsub_slot[n] = (int64_t)wsub_bound.size();
      P.wsub.resize(P.wsub.size() + (size_t)(K * es));
      char* dst = P.wsub.data() + wsub_slot[n] * K * es;
      memcpy(dst, (const char*)wc.data_ptr() + n * K * es, (size_t)(K * es));
      int32_t bn = 0;
      with_type(dt, [&](auto* tp) {
        using T = std::remove_pointer_t<decltype(tp)>;
        exact::canonical_row((T*)dst, K);
        bool bad = false;
        bn = exact::f64_row_bound((const T*)dst, K, &bad);
      });
      wsub_bound.push_back(bn);
    }
    *b = wsub_bound[(size_t)wsub_slot[n]];
    return wsub_slot[n];
  };
  P.panel_needed.assign((size_t)((N + 15) / 16), 0);
  std::vector<int64_t> failing;
  for (int64_t m = 0; m < M; ++m) {
    int8_t* route = routes ? routes + m * N : nullptr;
    if (xbad[m]) {
      P.bad_rows.push_back(m);
      if (route) memset(route, kRouteDigit, (size_t)N);
      continue;
    }
    failing.clear();
    for (int64_t n = 0; n < N; ++n)
      if (!exact::f64_sum_exact(bx[m], bw[n])) failing.push_back(n);
    // A row failing (B) with many columns (long K: b grows with it) takes the split route for every column:
    // one pass over the weight with two x rows (hi, lo) instead of the fp64 path's pass plus a second one over
    // the failing columns.
    const bool whole = (int64_t)failing.size() * 8 > N;
    if (whole) {
      failing.resize((size_t)N);
      for (int64_t n = 0; n < N; ++n) failing[(size_t)n] = n;
    } else {
      P.f64_rows.push_back(m);
    }
    if (route) memset(route, kRouteF64, (size_t)N);
    if (failing.empty()) continue;
    int nb = 0, lsb = 0;
    with_type(dt, [&](auto* tp) {
      using T = std::remove_pointer_t<decltype(tp)>;
      exact::f64_row_nb_lsb((const T*)P.xf.data_ptr() + m * K, K, &nb, &lsb);
    });
    const exact::F64Split sp = exact::f64_split_bounds(nb, lsb, K);
    F64Plan::SplitRow sr{m, sp.tau, {}, {}};
    bool mixed = false;
    for (int64_t n : failing) {
      int32_t b = 0;
      const int64_t slot = weight_row(n, &b);
      if (exact::f64_sum_exact(sp.b_hi, b) && exact::f64_sum_exact(sp.b_lo, b)) {
        sr.cols.push_back(n);
        sr.slots.push_back(slot);
        if (route) route[n] = kRouteSplit;
      } else {
        P.panel_needed[(size_t)(n / 16)] = 1;
        mixed = true;
        if (route) route[n] = kRouteDigit;
      }
    }
    if (!sr.cols.empty()) P.splits.push_back(std::move(sr));
    if (mixed) P.mixed_rows.push_back(m);
  }
  return P;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> Cpu::linear_exact_pack_weight(const Call&, DType dt,
                                                                           const at::Tensor& wc) {
  IeeeFpEnv fenv;
  const int64_t N = wc.size(0), K = wc.size(1);
  const auto& k = exact_kernels();
  std::vector<exact::RowForm> forms((size_t)std::max<int64_t>(N, 1));
  ieee_parallel_for(0, N, 16, [&](int64_t b, int64_t e) { k.w_forms(dt, wc.data_ptr(), K, forms.data(), b, e); });
  return pack_weight_with_forms(wc, wc, dt, forms);
}

bool Cpu::exact_f64_path_enabled() { return f64_mode() != F64Mode::kOff; }

// The digit path, or (with the weight and its bounds, per ALIGNED_EXACT_F64) the fp64 routes and the digit path
// for what they leave.
void Cpu::linear_exact_packed(const Call&, const ExactPackedRun& r) {
  IeeeFpEnv fenv;
  const auto& a = r.a;
  const at::Tensor& xc = r.x;
  const at::Tensor &wd = r.wd, &w_exp = r.w_exp, &w_bad = r.w_bad;
  const int64_t M = a.M, K = a.K, N = a.N, k_parts = r.k_parts;
  at::Tensor out = r.out;
  const F64Mode mode = r.weight.defined() ? f64_mode() : F64Mode::kOff;
  if (mode == F64Mode::kOff || (mode == F64Mode::kAuto && M > kF64MaxRows)) {
    digit_linear(xc, a.dt, wd, w_exp, w_bad, N, a.bias, k_parts, out);
    return;
  }
  auto wc = r.weight.contiguous();
  const int64_t es = out.element_size();
  F64Plan plan = plan_f64_routes(xc, a.dt, wc, r.weight_f64_bounds.data_ptr<int32_t>(), nullptr);
  const at::Tensor& xf = plan.xf;
  const auto& f64_rows = plan.f64_rows;
  const auto& splits = plan.splits;
  const auto& wsub = plan.wsub;
  const int64_t npanels = (N + 15) / 16;
  if (!f64_rows.empty()) {
    const auto& k = exact_kernels();
    const int64_t R = (int64_t)f64_rows.size(), ldx = ceil_to(K, 8);
    auto x64 = at::empty({R, ldx}, xc.options().dtype(at::kDouble));
    ieee_parallel_for(0, R, 4, [&](int64_t b, int64_t e) {
      k.f64_convert_rows(a.dt, xf.data_ptr(), K, ldx, f64_rows.data(), x64.data_ptr<double>(), b, e);
    });
    ExactF64Params p{};
    p.dt = a.dt;
    p.x64 = x64.data_ptr<double>();
    p.ldx = ldx;
    p.rows = f64_rows.data();
    p.R = R;
    p.w = wc.data_ptr();
    p.w_bad = w_bad.data_ptr<uint8_t>();
    p.bias = a.bias.defined() ? a.bias.data_ptr() : nullptr;
    p.out = out.data_ptr();
    p.N = N;
    p.K = K;
    // Threads split the N columns (each streams its own weight rows once).
    ieee_parallel_for(0, npanels, 1, [&](int64_t b, int64_t e) {
      IeeeFpEnv fenv;
      ExactF64Params q = p;
      q.n0 = b * 16;
      q.n1 = std::min(N, e * 16);
      k.f64_gemm(q);
    });
  }
  if (!splits.empty()) {
    // The split route writes its columns of its rows (after the fp64 path: it overwrites the failing ones).
    // Tasks: chunks of 128 listed columns of one row; each task cuts its row into halves in its own buffer.
    const auto& k = exact_kernels();
    const int64_t ldx = ceil_to(K, 8);
    constexpr int64_t kSplitChunk = 128;
    std::vector<std::pair<int64_t, int64_t>> tasks;  // (split row, first listed column)
    for (size_t i = 0; i < splits.size(); ++i)
      for (int64_t j = 0; j < (int64_t)splits[i].cols.size(); j += kSplitChunk) tasks.emplace_back((int64_t)i, j);
    ieee_parallel_for(0, (int64_t)tasks.size(), 1, [&](int64_t b, int64_t e) {
      IeeeFpEnv fenv;
      std::vector<double> halves((size_t)(2 * ldx));
      std::vector<const void*> rows;
      int64_t cut = -1;  // the split row whose halves the buffer holds
      for (int64_t t = b; t < e; ++t) {
        const F64Plan::SplitRow& sr = splits[(size_t)tasks[(size_t)t].first];
        const int64_t j0 = tasks[(size_t)t].second;
        const int64_t nc = std::min<int64_t>(kSplitChunk, (int64_t)sr.cols.size() - j0);
        if (cut != tasks[(size_t)t].first) {
          with_type(a.dt, [&](auto* tp) {
            using T = std::remove_pointer_t<decltype(tp)>;
            exact::f64_split_row((const T*)xf.data_ptr() + sr.m * K, K, ldx, sr.tau, halves.data(),
                                 halves.data() + ldx);
          });
          cut = tasks[(size_t)t].first;
        }
        rows.clear();
        for (int64_t j = j0; j < j0 + nc; ++j)
          rows.push_back(sr.slots[(size_t)j] < 0
                             ? (const void*)((const char*)wc.data_ptr() + sr.cols[(size_t)j] * K * es)
                             : (const void*)(wsub.data() + sr.slots[(size_t)j] * K * es));
        ExactF64SplitParams q{};
        q.dt = a.dt;
        q.x64 = halves.data();
        q.ldx = ldx;
        q.w_rows = rows.data();
        q.cols = sr.cols.data() + j0;
        q.ncols = nc;
        q.w_bad = w_bad.data_ptr<uint8_t>();
        q.bias = a.bias.defined() ? a.bias.data_ptr() : nullptr;
        q.out_row = (char*)out.data_ptr() + sr.m * N * es;
        q.K = K;
        k.f64_split_gemm(q);
      }
    });
  }
  auto redo = [&](const std::vector<int64_t>& rows, const std::vector<int64_t>* panels) {
    if (rows.empty() || (panels && panels->empty())) return;
    auto idx = at::from_blob((void*)rows.data(), {(int64_t)rows.size()}, at::TensorOptions().dtype(at::kLong)).clone();
    auto xs = xc.index_select(0, idx);
    auto od = at::empty({xs.size(0), N}, xc.options());
    digit_linear(xs, a.dt, wd, w_exp, w_bad, N, a.bias, k_parts, od, panels);
    const int64_t es = out.element_size();
    char* o = (char*)out.data_ptr();
    const char* d = (const char*)od.data_ptr();
    for (size_t i = 0; i < rows.size(); ++i) {
      if (!panels) {
        memcpy(o + rows[i] * N * es, d + (int64_t)i * N * es, (size_t)(N * es));
        continue;
      }
      for (int64_t pn : *panels) {
        const int64_t c0 = pn * 16, nc = std::min<int64_t>(16, N - c0);
        memcpy(o + (rows[i] * N + c0) * es, d + ((int64_t)i * N + c0) * es, (size_t)(nc * es));
      }
    }
  };
  std::vector<int64_t> panels;
  for (int64_t pn = 0; pn < npanels; ++pn)
    if (plan.panel_needed[(size_t)pn]) panels.push_back(pn);
  redo(plan.bad_rows, nullptr);
  redo(plan.mixed_rows, &panels);
  return;
}

// Once per weight version (the Python cache keeps it beside the digits): b of every weight row; a NaN / inf
// weight row: its column is NaN on both paths, any value may be computed first.
void Cpu::linear_exact_f64_bounds(const Call&, DType dt, const at::Tensor& wc, const at::Tensor& out) {
  IeeeFpEnv fenv;
  std::vector<int32_t> bound;
  std::vector<uint8_t> bad;
  row_bounds(wc, dt, bound, bad);
  for (int64_t n = 0; n < wc.size(0); ++n) out.data_ptr<int32_t>()[n] = bad[n] ? exact::kF64Zero : bound[n];
}

void Cpu::linear_exact_f64_pairs(const Call&, DType dt, const at::Tensor& xc, const at::Tensor& bounds,
                                 const at::Tensor& out) {
  IeeeFpEnv fenv;
  const int64_t N = bounds.size(0);
  std::vector<int32_t> bx;
  std::vector<uint8_t> xbad;
  row_bounds(xc, dt, bx, xbad);
  const int32_t* bw = bounds.data_ptr<int32_t>();
  for (int64_t m = 0; m < xc.size(0); ++m)
    for (int64_t n = 0; n < N; ++n) out.data_ptr<bool>()[m * N + n] = !xbad[m] && exact::f64_sum_exact(bx[m], bw[n]);
}

void Cpu::linear_exact_f64_routes(const Call&, DType dt, const at::Tensor& xc, const at::Tensor& wc,
                                  const at::Tensor& bounds, const at::Tensor& out) {
  IeeeFpEnv fenv;
  plan_f64_routes(xc, dt, wc, bounds.data_ptr<int32_t>(), out.data_ptr<int8_t>());
}

// ---- tensor parallelism -------------------------------------------------------------------------------------
void Cpu::linear_exact_row_scan(const Call&, DType dt, const at::Tensor& vc, const at::Tensor& out) {
  IeeeFpEnv fenv;
  auto s = scans_of(vc, dt);
  if (vc.size(0) > 0) memcpy(out.data_ptr<int32_t>(), s.data(), (size_t)out.numel() * 4);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> Cpu::linear_exact_pack_weight_scanned(const Call& call, DType dt,
                                                                                   const at::Tensor& wc,
                                                                                   const at::Tensor& row_scan) {
  IeeeFpEnv fenv;
  const int64_t N = wc.size(0);
  check_scan_covers(row_scan, scans_of(wc, dt), N, call.op, "row_scan");
  std::vector<exact::RowForm> forms((size_t)std::max<int64_t>(N, 1));
  const int32_t* g = row_scan.data_ptr<int32_t>();
  for (int64_t n = 0; n < N; ++n) forms[n] = exact::row_scan_form(exact::row_scan_load(g + n * exact::kScanInts));
  return pack_weight_with_forms(wc, wc, dt, forms);
}

void Cpu::linear_exact_partial(const Call& call, const ExactPackedRun& r, const at::Tensor& x_scan) {
  IeeeFpEnv fenv;
  const int64_t M = r.a.M, N = r.a.N;
  check_scan_covers(x_scan, scans_of(r.x, r.a.dt), M, call.op, "x_scan");
  // a rank's empty slice (K_r = 0): its exact sums are 0, which r.out (zeros) holds; the digit path would pack
  // tensors of no memory (memset / loops on their null pointers: undefined, UBSan halts)
  if (M == 0 || N == 0 || r.x.size(1) == 0) return;
  at::Tensor none, out = r.out;
  digit_linear(r.x, r.a.dt, r.wd, r.w_exp, r.w_bad, N, none, 1, out, nullptr, x_scan.data_ptr<int32_t>(),
               out.data_ptr<int64_t>());
}

void Cpu::linear_exact_finish(const Call&, DType dt, const at::Tensor& partial, const at::Tensor& x_scan,
                              const at::Tensor& w_exp, const at::Tensor& w_bad, const at::Tensor& bias,
                              const at::Tensor& out) {
  IeeeFpEnv fenv;
  const int64_t M = out.size(0), N = out.size(1);
  const at::Tensor b32 = bias.defined() ? bias.to(at::kFloat).contiguous() : at::Tensor();  // exact widening
  const int64_t* P = partial.data_ptr<int64_t>();
  const int32_t* sc = x_scan.data_ptr<int32_t>();
  const int32_t* we = w_exp.data_ptr<int32_t>();
  const uint8_t* wb = w_bad.data_ptr<uint8_t>();
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  with_type(dt, [&](auto* tp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    T* o = (T*)out.data_ptr();
    ieee_parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
      IeeeFpEnv fenv;
      for (int64_t m = b; m < e; ++m) {
        const exact::RowForm f = exact::row_scan_form(exact::row_scan_load(sc + m * exact::kScanInts));
        for (int64_t n = 0; n < N; ++n)
          o[m * N + n] = from_f32<T>(exact::exact_epilogue_f32(P[(m * N + n) * 2], P[(m * N + n) * 2 + 1], f.E,
                                                               we[n], f.bad || wb[n], bp ? bp + n : nullptr));
      }
    });
  });
}

// The scalar definition (exact_linear.h: canonical integers, one int128 sum, one rounding): for tests.
at::Tensor Cpu::linear_exact_reference(const Call&, const at::Tensor& x, const at::Tensor& weight,
                                       const at::Tensor& bias) {
  IeeeFpEnv fenv;
  const int64_t K = weight.size(1), N = weight.size(0);
  auto x2 = x.reshape({-1, K}).to(at::kFloat).contiguous();
  auto w2 = weight.to(at::kFloat).contiguous();
  const int64_t M = x2.size(0);
  const float* xp = x2.data_ptr<float>();
  const float* wp = w2.data_ptr<float>();
  std::vector<exact::RowForm> wf(N);
  int sw = 1;
  for (int64_t n = 0; n < N; ++n) {
    wf[n] = exact::row_form(wp + n * K, K);
    sw = std::max(sw, wf[n].S);
  }
  std::vector<int32_t> W((size_t)(N * K)), X((size_t)K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const float v = wp[n * K + k];
      W[n * K + k] = exact::is_finite_bits(v) ? exact::quantize(v, sw, wf[n].E) : 0;
    }
  auto out32 = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* o = out32.data_ptr<float>();
  std::optional<at::Tensor> b32;
  if (bias.defined()) b32 = bias.to(at::kFloat).contiguous();
  for (int64_t m = 0; m < M; ++m) {
    const exact::RowForm f = exact::row_form(xp + m * K, K);
    for (int64_t k = 0; k < K; ++k) {
      const float v = xp[m * K + k];
      X[k] = exact::is_finite_bits(v) ? exact::quantize(v, f.S, f.E) : 0;
    }
    for (int64_t n = 0; n < N; ++n) {
      float y;
      if (f.bad || wf[n].bad) {
        y = float_of(0x7fc00000u);
      } else {
        const __int128 s = exact::exact_dot_ref(X.data(), W.data() + n * K, K);
        y = exact::round_i128_f32(s, (f.E + 3 - 8 * f.S) + (wf[n].E + 3 - 8 * sw));
      }
      if (b32) y = y + b32->data_ptr<float>()[n];
      o[m * N + n] = y;
    }
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return out32.to(x.scalar_type()).view(sizes);
}

// ---- the CPU key's registrations of these families (register_cpu.cpp) ---------------------------------------
template void register_family<ExactLinear, Cpu, EmulatedCuda, EmulatedHip>(torch::Library&);
template void register_family<ExactF64, Cpu>(torch::Library&);
template void register_family<ExactTp, Cpu>(torch::Library&);
template void register_family<ExactReference, Cpu>(torch::Library&);

}  // namespace aligned::glue

// The exact linear's CPU unit: amx / avx512-vnni / avx2-madd / generic. No tensor arguments: a catch-all kernel.
TORCH_LIBRARY_IMPL(aligned, CatchAll, m) {
  m.impl("_exact_unit", +[]() -> std::string {
    return aligned::cpu::exact_kernels().unit(aligned::cpu::cpu_backend().amx_int8);
  });
}
