"""The exact linear's fp64 path (csrc/common/exact_linear.h, "the fp64 path"): for row pairs meeting bound (B)
every fp64 evaluation of the exact sum is exact, so the fp64 path, the digit path and the scalar int128
definition give the same bits. Each path is forced (ALIGNED_EXACT_F64=all / off) and the pairs it took are
checked (_linear_exact_f64_pairs), so every comparison below compares two different computations."""

import os
import textwrap
from contextlib import contextmanager

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, bitwise_equal

ops = torch.ops.aligned


@contextmanager
def f64_mode(mode):
    old = os.environ.get("ALIGNED_EXACT_F64")
    os.environ["ALIGNED_EXACT_F64"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("ALIGNED_EXACT_F64")
        else:
            os.environ["ALIGNED_EXACT_F64"] = old


def run(x, w, b=None, mode="all"):
    wd, we, wb = ops.linear_exact_pack_weight(w)
    bounds = ops.linear_exact_f64_bounds(w)
    with f64_mode(mode):
        return ops.linear_exact_packed(x, wd, we, wb, w.shape[0], b, 1, w, bounds)


def pairs(x, w):
    return ops._linear_exact_f64_pairs(x, ops.linear_exact_f64_bounds(w))


def check_three_ways(x, w, b=None, want_f64=None):
    """fp64 path == digit path == int128 definition, bitwise; returns the fp64-eligible pair mask."""
    p = pairs(x, w)
    if want_f64 is not None:
        assert bool(p.any()) == want_f64, "the case must (not) reach the fp64 path"
    ref = ops._linear_exact_reference(x, w, b)
    f64, digits = run(x, w, b, "all"), run(x, w, b, "off")
    assert_bitwise_equal(f64, digits, "fp64 path vs digit path")
    # the scalar reference writes NaN outputs with another payload (torch's conversion): NaN positions equal,
    # every other output bitwise
    nan = ref.isnan()
    assert torch.equal(f64.isnan(), nan)
    assert_bitwise_equal(f64[~nan], ref[~nan], "fp64 path vs definition")
    return p


def _g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_random_and_outlier_rows(dtype):
    g = _g(1)
    M, K, N = 9, 300, 70
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.02
    for i, s in enumerate((1e2, 1e3, 1e4)):  # outlier channels (massive activations)
        x[3 + i, [5, 77, 200]] *= s
    x, w = x.to(dtype), w.to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    p = check_three_ways(x, w, b, want_f64=True)
    assert p[:3].float().mean() > 0.9, "ordinary rows must take the fp64 path"


def test_subnormal_cancelling_signed_zero_nonfinite_wide():
    g = _g(2)
    M, K, N = 12, 96, 40
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    tiny = torch.tensor(2.0**-130).bfloat16()  # bf16 subnormal
    x[0] = tiny * torch.randint(-3, 4, (K,), generator=g).bfloat16()  # subnormal inputs: tiny products
    x[1] = 0.0
    x[1, ::2] = -0.0  # signed zeros only: the sum is +0
    v = x[3, : K // 2].clone()
    x[2, : K // 2], x[2, K // 2:] = v, -v
    w[5, :] = 1.0  # row 2 meets a constant weight row -> an exact zero sum from cancellation
    x[4, 3] = float("nan")
    x[5, 9] = float("inf")
    x[6, 1] = 1e30  # wide range: canonical form rounds -> digit path
    w[7, 2] = float("-inf")  # a non-finite weight row: column NaN on both paths
    w[8, :] = 0.0  # a zero weight row
    w[9] = (tiny * torch.randint(-3, 4, (K,), generator=g)).bfloat16()
    p = check_three_ways(x, w, None, want_f64=True)
    assert p[0].all() and p[1].all() and p[2].any(), "subnormal, zero and cancelling rows take the fp64 path"
    assert not p[4].any() and not p[5].any(), "NaN / inf rows take the digit path"
    assert p[6].sum() <= 2, "a row beyond the exact range takes the digit path (except against zero rows)"
    out = run(x, w, None, "all")
    assert out[2, 5].item() == 0 and not torch.signbit(out[2, 5]), "cancelling sum is +0"
    assert not torch.signbit(out[1]).any(), "a row of signed zeros gives +0"
    assert torch.isnan(out[:, 7]).all() and torch.isnan(out[4]).all() and torch.isnan(out[5]).all()
    assert (out[0] != 0).any(), "subnormal products are kept"


def test_subnormal_results_ignore_flush_to_zero():
    # outputs that are fp32 subnormals (then bf16 subnormals): both paths keep them, whatever the caller's FTZ/DAZ
    g = _g(3)
    x = (torch.randn(4, 64, generator=g) * 2.0**-70).bfloat16()
    w = (torch.randn(8, 64, generator=g) * 2.0**-60).bfloat16()
    ref = ops._linear_exact_reference(x, w)
    assert (ref.float().abs() < 2.0**-126).any() and (ref != 0).any()
    assert pairs(x, w).all()
    if not torch.set_flush_denormal(True):
        pytest.skip("no flush-to-zero control on this CPU")
    try:
        assert torch.tensor([2.0**-140]).mul(1.0).item() == 0.0, "FTZ/DAZ is on for the caller"
        assert_bitwise_equal(run(x, w, None, "all"), ref, "fp64 path under the caller's FTZ")
        assert_bitwise_equal(run(x, w, None, "off"), ref, "digit path under the caller's FTZ")
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_subnormal_inputs_and_rounding_rows_ignore_flush_to_zero(dtype):
    # subnormal INPUTS (not only results): under a caller's DAZ a subnormal compares equal to zero, so the row
    # scans (E, lsb, b), the canonical values and the conversions would change — every step of the op (glue,
    # planning and every task) runs in the IEEE environment, on every route
    g = _g(13)
    M, K, N = 3, 64, 16
    x = torch.randn(M, K, generator=g, dtype=torch.float64) * 2.0**-128  # fp32 / bf16 subnormals
    x[1, 3] = 2.0**-100  # row 1: a normal element 2^28 above the rest: its form rounds (canonical_row)
    w = torch.randn(N, K, generator=g, dtype=torch.float64) * 2.0**100
    w[:, 3] = 0
    x, w = x.to(dtype), w.to(dtype)
    ref = ops._linear_exact_reference(x, w)
    r = routes(x, w)
    assert (r != DIGIT).any(), "the fp64 routes must be reached"
    if not torch.set_flush_denormal(True):
        pytest.skip("no flush-to-zero control on this CPU")
    try:
        assert torch.tensor([2.0**-140]).mul(1.0).item() == 0.0, "FTZ/DAZ is on for the caller"
        for mode in ("all", "off"):
            assert_bitwise_equal(run(x, w, None, mode), ref, f"{mode} under the caller's FTZ/DAZ")
        assert torch.equal(routes(x, w), r), "routes under FTZ/DAZ"
    finally:
        torch.set_flush_denormal(False)


def test_bound_edge():
    # K = 4^6 elements of equal magnitude (Cauchy-Schwarz is tight) plus one lowest-bit element: at (B) the
    # pair takes the fp64 path; one bit past, the exact sum needs 54 bits (odd, > 2^53): an fp64 sum cannot be
    # exact, and the pair must fall back
    K, big = 4096, 255 * 2.0**-7  # 1.9921875, an 8-bit significand
    ex, ew = 3, -6

    def rows(rx, rw):
        x = torch.full((1, K), big * 2.0**ex, dtype=torch.float64)
        w = torch.full((1, K), big * 2.0**ew, dtype=torch.float64)
        x[0, 0], w[0, 0] = 2.0 ** (ex - rx), 2.0 ** (ew - rw)
        return x.bfloat16(), w.bfloat16()

    for rx, rw, fits in ((20, 19, True), (21, 19, False)):
        x, w = rows(rx, rw)
        assert bool(pairs(x, w)[0, 0]) == fits
        check_three_ways(x, w)
        unit = 2.0 ** (ex - rx + ew - rw)
        exact = sum(int(round(a * b / unit)) for a, b in zip(x[0].double().tolist(), w[0].double().tolist()))
        assert exact % 2 == 1
        assert (exact < 2**53) == fits
        f64 = torch.dot(x[0].double(), w[0].double()).item() / unit  # one fp64 evaluation
        seq = 0.0
        for a, b in zip(x[0].double().tolist(), w[0].double().tolist()):
            seq += a * b
        assert (int(f64) == exact) == fits and (int(seq / unit) == exact) == fits


def test_rows_invariant_across_batches_and_paths():
    # M = 1 ... 300: a row's bits alone == in any batch, where ALIGNED_EXACT_F64=auto takes the fp64 path for
    # single rows only (and "all" at every M), and some rows (wide range, NaN) take the digit path in every batch
    g = _g(4)
    M, K, N = 300, 100, 37
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    x[::7, 3] = 1e25
    x[5, 0] = float("nan")
    check_three_ways(x, w)
    ref = run(x, w, None, "off")  # the whole batch on the digit path (== the definition, checked above)
    p = pairs(x, w)
    assert p.all(1).sum() > 200 and (~p.any(1)).sum() > 30
    wd, we, wb = ops.linear_exact_pack_weight(w)
    bounds = ops.linear_exact_f64_bounds(w)
    for mode in ("auto", "all"):
        with f64_mode(mode):
            for m in (1, 2, 3, 5, 16, 17, 63, 64, 65, 127, 255, 300):
                got = ops.linear_exact_packed(x[:m], wd, we, wb, N, None, 1, w, bounds)
                assert_bitwise_equal(got, ref[:m], f"{mode} M={m}")
    with f64_mode("auto"):
        for r in range(M):
            assert_bitwise_equal(ops.linear_exact_packed(x[r:r + 1], wd, we, wb, N, None, 1, w, bounds), ref[r:r + 1])
        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert_bitwise_equal(aligned_ops.linear_exact(x[:40], w), ref[:40], "1 thread, cached wrapper")
        finally:
            torch.set_num_threads(old)


def test_negative_control_fp32_accumulation_differs():
    # the same exact products summed in fp32 (torch's fp32 GEMM) are not the correctly rounded sum: the test's
    # comparisons can fail
    # (fp32 tensors holding bf16 values: the same products, fp32 outputs, so the fp32 sum's error shows)
    g = _g(5)
    x = torch.randn(16, 1536, generator=g).bfloat16().float()
    w = (torch.randn(64, 1536, generator=g) * 0.02).bfloat16().float()
    assert pairs(x, w).float().mean() > 0.9
    check_three_ways(x, w)
    ours = run(x, w, None, "all")
    fp32 = torch.nn.functional.linear(x, w)
    assert not bitwise_equal(fp32, ours)
    seq = torch.zeros(16, 64)
    for k in range(0, 1536, 256):  # a blocked fp32 accumulation: differs as well
        seq += x[:, k:k + 256] @ w[:, k:k + 256].T
    assert not bitwise_equal(seq, ours)


F64, SPLIT, DIGIT = 0, 1, 2  # _linear_exact_f64_routes: the route of each output under ALIGNED_EXACT_F64=all


def routes(x, w):
    return ops._linear_exact_f64_routes(x, w, ops.linear_exact_f64_bounds(w))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_split_route_takes_pairs_failing_the_bound(dtype):
    # Gaussian rows of K = 4864 (a down_proj's K): most pairs fail (B) by a few bits (a row's smallest element
    # lowers its lsb); the split route computes them in fp64, the same bits as the digit path and the definition
    g = _g(11)
    M, K, N = 4, 4864, 40
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * 0.02).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    r = routes(x, w)
    p = pairs(x, w)
    assert not ((r == F64) & ~p).any(), "the fp64 path takes only pairs meeting (B)"
    assert not ((r == DIGIT) & p).any(), "a pair meeting (B) never takes the digit path"
    if dtype != torch.float32:  # fp32 rows (24-bit significands) are too wide for two halves: the digit path
        assert (r == SPLIT).float().mean() > 0.3, "the split route must be reached"
    check_three_ways(x, w, b)


def test_split_route_rounds_once_from_the_pair():
    # exact sum 1 + 2^-24 + 2^-58: an fp32 midpoint plus a residue that a double cannot hold next to 1; the pair
    # (H, L) = (1, 2^-24 + 2^-58) keeps it, and rounding once gives 1 + 2^-23 (the definition's value)
    K = 16
    x = torch.zeros(2, K, dtype=torch.float64)
    w = torch.zeros(3, K, dtype=torch.float64)
    x[0, :3] = torch.tensor([1.0, 2.0**-24, 2.0**-29], dtype=torch.float64)
    w[0, :3] = torch.tensor([1.0, 1.0, 2.0**-29], dtype=torch.float64)
    x[1, :3] = -x[0, :3]  # the mirror: -(1 + 2^-23)
    w[1, :3] = torch.tensor([1.0, 1.0, -(2.0**-29)], dtype=torch.float64)  # exactly the midpoint minus: 1
    w[2, :2] = 1.0  # 1 + 2^-24 exactly: a tie, to even (1)
    x, w = x.float(), w.float()
    r = routes(x, w)
    assert r[0, 0] == SPLIT and r[0, 1] == SPLIT and r[1, 0] == SPLIT, r
    out = run(x, w, None, "all")
    assert_bitwise_equal(out, run(x, w, None, "off"), "split route vs digit path")
    assert_bitwise_equal(out, ops._linear_exact_reference(x, w), "split route vs definition")
    want = torch.tensor([[1 + 2.0**-23, 1.0, 1.0], [-(1 + 2.0**-23), -1.0, -1.0]])
    assert_bitwise_equal(out, want)
    # negative control: summing the pair in one double first rounds twice and lands on the even neighbour
    h, l = 1.0, 2.0**-24 + 2.0**-58
    assert torch.tensor(h + l, dtype=torch.float64).float().item() == 1.0


def test_rounding_rows_take_the_fp64_routes_as_their_canonical_values():
    # a weight row and an x row whose canonical forms round (range > 29 bits: one tiny element; a massive
    # activation 2^31 above the rest): the fp64 routes sum the values the definition sums (canonical_row)
    g = _g(12)
    M, K, N = 6, 1536, 32
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.02
    w[3, 10] = 2.0**-40  # weight row 3: its form rounds (its element 2^-40 to the row's 2^-35 grid)
    w[4, 11] = 2.0**-36
    x[2, 7] = 2.0**33  # x row 2: massive activation; the row's other elements lose their low bits
    x[5, 8] = -(2.0**40)
    x, w = x.bfloat16(), w.bfloat16()
    assert ops.linear_exact_f64_bounds(w)[3].item() == 1 << 20, "row 3's form rounds (kF64Never)"
    r = routes(x, w)
    assert (r[:, 3] != DIGIT).all() and (r[:, 4] != DIGIT).all(), r[:, 3:5]
    assert (r[2] != DIGIT).float().mean() > 0.9 and (r[5] != DIGIT).float().mean() > 0.9, r[[2, 5]]
    check_three_ways(x, w)


ISA_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, aligned_ops
    ops = torch.ops.aligned
    g = torch.Generator().manual_seed(0)
    out = {}
    for dt in (torch.bfloat16, torch.float16):
        for (M, K, N) in ((1, 1536, 64), (5, 77, 33), (20, 130, 50), (2, 4864, 24)):
            x = torch.randn(M, K, generator=g).to(dt)
            w = (torch.randn(N, K, generator=g) * 0.05).to(dt)
            b = torch.randn(N, generator=g).to(dt)
            wd, we, wb = ops.linear_exact_pack_weight(w)
            bw = ops.linear_exact_f64_bounds(w)
            for mode in ("all", "off"):
                os.environ["ALIGNED_EXACT_F64"] = mode
                out[f"{mode}{dt}{M}"] = ops.linear_exact_packed(x, wd, we, wb, N, b, 1, w, bw)
            out[f"ref{dt}{M}"] = ops._linear_exact_reference(x, w, b)
            out[f"pairs{dt}{M}"] = ops._linear_exact_f64_pairs(x, bw)
            out[f"routes{dt}{M}"] = ops._linear_exact_f64_routes(x, w, bw)
    torch.save(out, sys.argv[1])
    """
)


ISA_FAMILIES = {"linear_exact_f64": ISA_SCRIPT}  # run once per level for the whole run by tests/_isa_matrix.py


@pytest.mark.slow
def test_isa_levels_bit_identical(isa_matrix):
    from _isa_matrix import supported_levels

    results = {}
    for level in supported_levels(amx=True):  # one level too: the path and definition checks below still hold
        results[level] = torch.load(isa_matrix.run(level, "linear_exact_f64").path)
    base = results["generic"]
    assert any(bool(v.any()) for k, v in base.items() if k.startswith("pairs")), "the fp64 path must be reached"
    assert any(bool((v == SPLIT).any()) for k, v in base.items() if k.startswith("routes")), "and the split route"
    for level, res in results.items():
        for key, val in res.items():
            assert_bitwise_equal(val, base[key], f"{level} {key}")
            if key.startswith(("all", "off")):
                assert_bitwise_equal(val, res["ref" + key[3:]], f"{level} {key} vs definition")


def test_argument_errors_name_the_argument():
    g = _g(6)
    x, w = torch.randn(2, 8, generator=g).bfloat16(), torch.randn(3, 8, generator=g).bfloat16()
    wd, we, wb = ops.linear_exact_pack_weight(w)
    bw = ops.linear_exact_f64_bounds(w)
    with pytest.raises(RuntimeError, match="weight and weight_f64_bounds go together"):
        ops.linear_exact_packed(x, wd, we, wb, 3, None, 1, w, None)
    with pytest.raises(RuntimeError, match="weight_f64_bounds must be contiguous int32 \\[3\\]"):
        ops.linear_exact_packed(x, wd, we, wb, 3, None, 1, w, bw[:2])
    with pytest.raises(RuntimeError, match="weight must be the packed weight itself"):
        ops.linear_exact_packed(x, wd, we, wb, 3, None, 1, w.float(), bw)
    with f64_mode("sometimes"), pytest.raises(RuntimeError, match="ALIGNED_EXACT_F64 must be auto, all or off"):
        ops.linear_exact_packed(x, wd, we, wb, 3, None, 1, w, bw)


def test_opcheck_f64_ops():
    g = _g(7)
    x, w = torch.randn(3, 40, generator=g).bfloat16(), torch.randn(5, 40, generator=g).bfloat16()
    wd, we, wb = ops.linear_exact_pack_weight(w)
    bw = ops.linear_exact_f64_bounds(w)
    torch.library.opcheck(ops.linear_exact_packed, (x, wd, we, wb, 5, None, 1, w, bw))
    torch.library.opcheck(ops.linear_exact_f64_bounds, (w,))
    torch.library.opcheck(ops._linear_exact_f64_pairs, (x, bw))
