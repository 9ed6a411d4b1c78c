"""The exact linear's tensor-parallel ops (csrc/common/exact_linear.h, "tensor parallelism"), no processes.

K split into t parts (even and uneven): every part packs against the MAX-merged scans of the full rows, its
exact integer partials (int64 [.., N, 2]) are summed as integers, and linear_exact_finish gives
linear_exact(x, w, bias) bit for bit (integer views) — across dtypes, with outlier rows whose span exceeds 29
bits (S clamps to 4: the canonical form rounds), NaN / inf rows, zero rows, bias. Negative control: parts using
their LOCAL forms have a different exact sum exactly on the outlier rows (and so different bits).
"""

from fractions import Fraction

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, bits

ops = torch.ops.aligned
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _cuts(K, t, uneven):
    if not uneven:
        return [K * i // t for i in range(t + 1)]
    w = [1 + (i * 7) % 5 for i in range(t)]  # uneven, fixed widths
    c = [0]
    for v in w:
        c.append(c[-1] + v)
    return [K * v // c[-1] for v in c]


def _inputs(dtype, M=7, N=21, K=203, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.05
    big = 3.0e4 if dtype == torch.float16 else 2.0 ** 20
    x[1] *= 2.0 ** -6
    x[1, 150] = big        # outlier row: span > 29 bits, and the outlier sits in the LAST part only
    w[3] *= 2.0 ** -6
    w[3, 200] = big * 1e-3  # outlier weight row
    x[2] = 0.0             # zero row
    x[4, 5] = float("nan")  # NaN row
    x[5, 90] = float("inf")
    w[6, 30] = float("-inf")  # a non-finite weight row: its column is NaN
    w[7] = 0.0
    b = torch.randn(N, generator=g)
    return x.to(dtype), w.to(dtype), b.to(dtype)


def _tp(x, w, b, cuts, local=False):
    """The TP composition over the K parts [cuts[i], cuts[i+1]); local: each part uses its own scans."""
    N = w.shape[0]
    xs = [x[:, a:e].contiguous() for a, e in zip(cuts, cuts[1:])]
    ws = [w[:, a:e].contiguous() for a, e in zip(cuts, cuts[1:])]
    xl = [ops.linear_exact_row_scan(v) for v in xs]
    wl = [ops.linear_exact_row_scan(v) for v in ws]
    xg, wg = torch.stack(xl).amax(0), torch.stack(wl).amax(0)  # the all-reduce MAX
    parts = []
    for i in range(len(xs)):
        wd, we, wb = ops.linear_exact_pack_weight_scanned(ws[i], wl[i] if local else wg)
        parts.append((ops.linear_exact_partial(xs[i], wd, we, wb, N, xl[i] if local else xg), we, wb))
    return parts, xg, xl


def _small():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(3, 70, generator=g).bfloat16(), torch.randn(17, 70, generator=g).bfloat16(),
            torch.randn(17, generator=g).bfloat16())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [2, 4, 8])
@pytest.mark.parametrize("uneven", [False, True])
def test_integer_sum_of_partials_equals_linear_exact(dtype, t, uneven):
    x, w, b = _inputs(dtype)
    cuts = _cuts(x.shape[1], t, uneven)
    parts, xg, _ = _tp(x, w, b, cuts)
    total = sum(p for p, _, _ in parts)
    we, wb = parts[0][1], parts[0][2]
    for p in parts[1:]:  # every rank's packing carries the same exponents / flags (the merged forms)
        assert torch.equal(p[1][:-1], we[:-1]) and torch.equal(p[2], wb)
    for bias in (None, b):
        out = ops.linear_exact_finish(total, xg, we, wb, bias, dtype)
        assert_bitwise_equal(out, aligned_ops.linear_exact(x, w, bias))
    # the sum's order does not matter (integers): reversed
    rev = sum(reversed([p for p, _, _ in parts]))
    assert_bitwise_equal(ops.linear_exact_finish(rev, xg, we, wb, b, dtype), aligned_ops.linear_exact(x, w, b))
    # rows with NaN / inf are NaN, the non-finite weight column too
    out = ops.linear_exact_finish(total, xg, we, wb, None, dtype)
    assert torch.isnan(out[4]).all() and torch.isnan(out[5]).all() and torch.isnan(out[:, 6]).all()


def _exact_values(parts, scans_x, N):
    """The exact rational value of every output (m, n) of a list of parts, each with its own forms."""
    M = parts[0][0].shape[0]
    vals = [[Fraction(0)] * N for _ in range(M)]
    for (p, we, _), sx in zip(parts, scans_x):
        for m in range(M):
            ex = int(sx[m, 0])
            for n in range(N):
                acc = int(p[m, n, 0]) * 2 ** 32 + int(p[m, n, 1])
                q = ex + int(we[n]) - 10 - 48  # exact_linear.h combine_q
                vals[m][n] += Fraction(acc) * Fraction(2) ** q
    return vals


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_negative_control_local_forms_differ_on_rows_that_round(dtype):
    x, w, b = _inputs(dtype)
    x, w = x[:4].contiguous(), w[:6].contiguous()  # rows: 0, 3 ordinary, 1 outlier, 2 zero; finite weights
    w[:3, 150] = 0  # columns 0..2: the outlier channel meets zero weights (the output is the rounded small part)
    cuts = _cuts(x.shape[1], 2, False)
    glob, xg, xl = _tp(x, w, b, cuts)
    loc, _, _ = _tp(x, w, b, cuts, local=True)
    N = w.shape[0]
    vg = _exact_values(glob, [xg, xg], N)
    vl = _exact_values(loc, xl, N)
    # the outlier row (span > 29 bits over the full row; each half alone is exact, the full row rounds): the
    # local forms keep bits the global form rounds away, so the exact sums differ; the bits too
    assert all(vl[1][n] != vg[1][n] for n in range(N) if n != 3)
    ref = aligned_ops.linear_exact(x, w)
    local_bits = torch.tensor([[float(v) for v in row] for row in vl], dtype=torch.float64).to(torch.float32).to(dtype)
    assert int((bits(local_bits[1, :3]) != bits(ref[1, :3])).sum()) == 3
    # the ordinary rows and weight rows (spans <= 29 bits: every form exact) have equal exact sums
    assert all(vl[m][n] == vg[m][n] for m in (0, 2, 3) for n in range(N) if n != 3)


def test_row_scan_merge_is_the_full_rows_scan():
    x, w, _ = _inputs(torch.bfloat16)
    for t in (2, 3, 8):
        cuts = _cuts(x.shape[1], t, True)
        merged = torch.stack([ops.linear_exact_row_scan(x[:, a:e].contiguous()) for a, e in zip(cuts, cuts[1:])]).amax(0)
        assert torch.equal(merged, ops.linear_exact_row_scan(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rank_with_an_empty_slice(dtype):
    """K_r = 0 (a rank holding no input feature): its scan is the rows' scan of no element, which the MAX merge
    leaves unchanged, and its partials are zero. linear_exact_row_scan failed on it (reshape({-1, 0}) raised
    "cannot reshape tensor of 0 elements", naming no op)."""
    x, w, b = _inputs(dtype)
    K = x.shape[1]
    want = aligned_ops.linear_exact(x, w, b)
    for cuts in ([0, 50, K], [0, 0, K], [0, K, K], [0, 50, 50, K], [0, 150, 151, 151, K]):  # the first: the control
        parts, xg, _ = _tp(x, w, b, cuts)
        total = sum(p for p, _, _ in parts)
        assert_bitwise_equal(ops.linear_exact_finish(total, xg, parts[0][1], parts[0][2], b, dtype), want, str(cuts))
    assert torch.equal(ops.linear_exact_row_scan(x[:, :0]), ops.linear_exact_row_scan(torch.zeros_like(x)))
    assert ops.linear_exact_row_scan(x.new_empty(2, 3, 0)).shape == (6, 3)
    assert ops.linear_exact_row_scan(x.new_empty(0)).shape == (1, 3)


def test_opcheck_compile_and_no_backward():
    x, w, b = _small()
    xs = ops.linear_exact_row_scan(x)
    ws = ops.linear_exact_row_scan(w)
    wd, we, wb = ops.linear_exact_pack_weight_scanned(w, ws)
    p = ops.linear_exact_partial(x, wd, we, wb, 17, xs)
    tu = ("test_schema", "test_faketensor")
    torch.library.opcheck(ops.linear_exact_row_scan.default, (x,), test_utils=tu)
    torch.library.opcheck(ops.linear_exact_pack_weight_scanned.default, (w, ws), test_utils=("test_schema",))
    torch.library.opcheck(ops.linear_exact_partial.default, (x, wd, we, wb, 17, xs), test_utils=tu)
    torch.library.opcheck(ops.linear_exact_finish.default, (p, xs, we, wb, b, torch.bfloat16), test_utils=tu)

    def f(x):
        s = ops.linear_exact_row_scan(x)
        return ops.linear_exact_finish(ops.linear_exact_partial(x, wd, we, wb, 17, s), s, we, wb, b, x.dtype)

    assert_bitwise_equal(torch.compile(f, fullgraph=True)(x), f(x))
    assert_bitwise_equal(f(x), aligned_ops.linear_exact(x, w, b))
    # integer outputs carry no gradient; the finish's float output through a bias that requires one raises
    br = b.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="linear_exact_finish has no backward"):
        ops.linear_exact_finish(p, xs, we, wb, br, torch.bfloat16).float().sum().backward()


def test_bad_inputs_name_the_op_and_argument():
    x, w, b = _small()
    xs, ws = ops.linear_exact_row_scan(x), ops.linear_exact_row_scan(w)
    wd, we, wb = ops.linear_exact_pack_weight_scanned(w, ws)
    p = ops.linear_exact_partial(x, wd, we, wb, 17, xs)
    with pytest.raises(RuntimeError, match=r"linear_exact_partial: x_scan must be contiguous int32 \[3, 3\]"):
        ops.linear_exact_partial(x, wd, we, wb, 17, xs[:2].contiguous())
    with pytest.raises(RuntimeError, match=r"linear_exact_pack_weight_scanned: row_scan must be contiguous int32"):
        ops.linear_exact_pack_weight_scanned(w, ws.float())
    # a scan that does not cover the slice (a LOCAL scan of another part, not the merged one)
    small = ops.linear_exact_row_scan(x * 0.5)
    with pytest.raises(RuntimeError, match="linear_exact_partial: x_scan row 0 does not cover"):
        ops.linear_exact_partial(x, wd, we, wb, 17, small)
    with pytest.raises(RuntimeError, match="linear_exact_partial: x has 69 input features but the packed weight has 70"):
        ops.linear_exact_partial(x[:, :69], wd, we, wb, 17, ops.linear_exact_row_scan(x[:, :69]))
    with pytest.raises(RuntimeError, match=r"linear_exact_finish: partial must be int64 \[\.\.\., out_features, 2\]"):
        ops.linear_exact_finish(p.int(), xs, we, wb, None, torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"linear_exact_finish: weight_exponents must be contiguous int32 \[18\]"):
        ops.linear_exact_finish(p, xs, we[:-1], wb, None, torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"linear_exact_finish: bias must be \[17\] in dtype"):
        ops.linear_exact_finish(p, xs, we, wb, b.float(), torch.bfloat16)
    with pytest.raises(RuntimeError, match="linear_exact_finish: dtype must be float32, bfloat16 or float16"):
        ops.linear_exact_finish(p, xs, we, wb, None, torch.float64)


_ISA_SCRIPT = """
import sys, torch, aligned_ops
ops = torch.ops.aligned
g = torch.Generator().manual_seed(3)
out = {"unit": ops._exact_unit()}
for dt in (torch.bfloat16, torch.float32):
    x = torch.randn(37, 300, generator=g).to(dt)
    w = (torch.randn(40, 300, generator=g) * 0.05).to(dt)
    x[5, 250] = 2e4
    xs, ws = x[:, :130].contiguous(), w[:, :130].contiguous()  # one rank's slice, against the full rows' scans
    wd, we, wb = ops.linear_exact_pack_weight_scanned(ws, ops.linear_exact_row_scan(w))
    out[str(dt)] = ops.linear_exact_partial(xs, wd, we, wb, 40, ops.linear_exact_row_scan(x))
torch.save(out, sys.argv[1])
"""


ISA_FAMILIES = {"linear_exact_tp": _ISA_SCRIPT}  # run once per level for the whole run by tests/_isa_matrix.py


@pytest.mark.slow
def test_partials_identical_on_every_isa_level(isa_matrix):
    from _isa_matrix import supported_levels

    res = {}
    for lvl in supported_levels(amx=True):
        res[lvl] = torch.load(isa_matrix.run(lvl, "linear_exact_tp").path)
    assert res["generic"]["unit"] == "generic"
    for lvl, r in res.items():
        for k in ("torch.bfloat16", "torch.float32"):
            assert torch.equal(r[k], res["generic"][k]), (lvl, r["unit"], k)  # int64 partials: exact equality
