"""The numerics contract of csrc/common: scalar exp/log accuracy and special values, and every dense op
restated in Python (torch float32 elementwise ops, each separately rounded: no contraction in eager) and
compared bit for bit with the kernels. The references follow the comments of reduce.h / contract.h, so a
kernel that changes any element's expression tree (a different lane assignment, a fused multiply-add the
contract does not write, a skipped division) fails here."""

import math

import pytest
import torch

import aligned_ops  # noqa: F401
from aligned_ops.testing import bitwise_equal

ops = torch.ops.aligned
LANES = 32
F32_MAX = 3.4028234663852886e38


def ulp_error(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|y - ref| in units of the float32 spacing at ref (subnormal spacing 2^-149 below 2^-126)."""
    a = ref.abs().clamp_min(2.0**-149)
    ulp = torch.pow(2.0, torch.clamp(torch.floor(torch.log2(a)) - 23, min=-149))
    return (y.double() - ref).abs() / ulp


def random_f32_bits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)


# ---- exp / log ----------------------------------------------------------------------------------------

# numerics.h documents "max error ~1 ulp" for exp_f32: the Cody-Waite reduced argument r is itself rounded
# (<= 1/4 ulp of the result) on top of the final rounding, so the worst case measured over 4M inputs is
# 1.008 ulp (e.g. x = -59.918983). log_f32 stays below 0.81 ulp.
EXP_MAX_ULP = 1.01
LOG_MAX_ULP = 1.0


@pytest.mark.parametrize("source", ["uniform", "bits", "subnormal_results"])
def test_exp_f32_accuracy(source):
    g = torch.Generator().manual_seed(1)
    if source == "uniform":
        x = torch.empty(1_000_000).uniform_(-104.0, 88.72, generator=g)
    elif source == "bits":
        x = random_f32_bits(1_000_000, 2)
        x = x[x.isfinite()]
    else:  # exp(x) below 2^-126: results are subnormal, produced without flush
        x = torch.empty(200_000).uniform_(-103.97, -87.34, generator=g)
    y = ops._exp_f32(x)
    ref = torch.exp(x.double())
    finite = ref < F32_MAX
    err = ulp_error(y[finite], ref[finite])
    assert err.max().item() <= EXP_MAX_ULP, f"worst x = {x[finite][err.argmax()].item()!r}"
    assert torch.isinf(y[~finite]).all() and (y[~finite] > 0).all()
    if source == "subnormal_results":
        assert ((y > 0) & (y < 2.0**-126)).float().mean() > 0.9  # really subnormal, not flushed


def test_exp_f32_special_values_and_boundaries():
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([0.0, -0.0, inf, -inf, nan, 88.72283, 88.7229, 88.8, 89.0, 1e30,
                      -103.5, -103.98, -104.0, -104.5, -1e30, 1e-30, -1e-30, 2.0**-149])
    y = ops._exp_f32(x)
    assert y[0].item() == 1.0 and y[1].item() == 1.0
    assert y[2].item() == inf and y[3].item() == 0.0 and math.isnan(y[4].item())
    assert y[5].item() == pytest.approx(3.4028e38, rel=1e-4) and math.isfinite(y[5].item())  # last finite
    assert (y[6:10] == inf).all()  # overflow -> +inf, not a clamp to FLT_MAX
    assert y[10].item() == 2.0**-149  # smallest subnormal result
    assert (y[11:15] == 0.0).all()  # underflow -> +0
    assert y[15].item() == 1.0 and y[16].item() == 1.0 and y[17].item() == 1.0
    assert not torch.signbit(y[[3, 11, 12, 13, 14]]).any()


@pytest.mark.parametrize("source", ["bits", "near_one", "subnormal_inputs"])
def test_log_f32_accuracy(source):
    g = torch.Generator().manual_seed(3)
    if source == "bits":
        x = random_f32_bits(1_000_000, 4).abs()
        x = x[x.isfinite() & (x > 0)]
    elif source == "near_one":
        x = torch.empty(1_000_000).uniform_(0.5, 2.0, generator=g)
    else:
        x = torch.randint(1, 2**23, (200_000,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
        assert (x < 2.0**-126).all()
    y = ops._log_f32(x)
    err = ulp_error(y, torch.log(x.double()))
    assert err.max().item() <= LOG_MAX_ULP, f"worst x = {x[err.argmax()].item()!r}"


def test_log_f32_special_values():
    inf = float("inf")
    x = torch.tensor([0.0, -0.0, -1.0, -1e-40, -inf, inf, float("nan"), 1.0, 2.0**-149, 3.4028234663852886e38])
    y = ops._log_f32(x)
    assert y[0].item() == -inf and y[1].item() == -inf
    assert torch.isnan(y[2:5]).all()
    assert y[5].item() == inf and math.isnan(y[6].item())
    assert y[7].item() == 0.0 and not torch.signbit(y[7])
    assert y[8].item() == pytest.approx(-149 * math.log(2), rel=1e-7)
    assert y[9].item() == pytest.approx(math.log(3.4028234663852886e38), rel=1e-7)


def test_exp_log_reject_non_fp32():
    with pytest.raises(RuntimeError, match="must be float32"):
        ops._exp_f32(torch.ones(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="must be float32"):
        ops._log_f32(torch.ones(3, dtype=torch.bfloat16))


# ---- the row reduction (reduce.h) restated ------------------------------------------------------------


def lane_sum_ref(terms: torch.Tensor) -> torch.Tensor:
    """reduce.h for every row of terms [rows, n] (float32): lane j sums k = j, j+32, ... in order from +0,
    then the halving tree 16, 8, 4, 2, 1. Zero padding of the last chunk equals skipping (see reduce.h)."""
    rows, n = terms.shape
    t = torch.nn.functional.pad(terms, (0, (-n) % LANES))
    lanes = torch.zeros(rows, LANES, dtype=torch.float32)
    for c in range(t.shape[1] // LANES):
        lanes = lanes + t[:, c * LANES:(c + 1) * LANES]
    w = LANES // 2
    while w >= 1:
        lanes = lanes[:, :w] + lanes[:, w:2 * w]
        w //= 2
    return lanes[:, 0]


# torch's float32 sqrt (and division by a scalar, done as a multiplication by the reciprocal) are not
# correctly rounded on every CPU build; float64 then one rounding to float32 is (53 >= 2*24 + 2 bits).
def div32(a, b) -> torch.Tensor:
    a = a.double() if isinstance(a, torch.Tensor) else torch.tensor(a, dtype=torch.float32).double()
    b = b.double() if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=torch.float32).double()
    return (a / b).float()


def sqrt32(a: torch.Tensor) -> torch.Tensor:
    return a.double().sqrt().float()


def rms_inv_ref(x32: torch.Tensor, eps: float) -> torch.Tensor:
    H = x32.shape[-1]
    ss = lane_sum_ref(x32 * x32)
    return div32(1.0, sqrt32(div32(ss, float(H)) + torch.tensor(eps, dtype=torch.float32)))


def test_lane_sum_ref_is_not_a_plain_sum():
    # The reference really fixes an order: on data with cancellation it differs from torch.sum somewhere.
    g = torch.Generator().manual_seed(5)
    t = torch.randn(256, 1000, generator=g) * torch.logspace(-3, 3, 1000)
    assert not bitwise_equal(lane_sum_ref(t), t.sum(-1))


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [1, 31, 32, 33, 100, 1536])
def test_rms_norm_equals_contract(dtype, H):
    g = torch.Generator().manual_seed(H)
    x = (torch.randn(19, H, generator=g) * 3).to(dtype)
    w = (torch.rand(H, generator=g) + 0.5).to(dtype)
    eps = 1e-5
    inv = rms_inv_ref(x.float(), eps)
    ref = ((x.float() * inv[:, None]) * w.float()).to(dtype)
    assert bitwise_equal(ops.rms_norm(x, w, eps), ref)
    # fp32 weight with low-precision activations
    ref32 = ((x.float() * inv[:, None]) * w.float()).to(dtype)
    assert bitwise_equal(ops.rms_norm(x, w.float(), eps), ref32)
    # fused: the rounded residual is normalised
    res = torch.randn(19, H, generator=g).to(dtype)
    r = (x.float() + res.float()).to(dtype)
    inv_r = rms_inv_ref(r.float(), eps)
    out, res_out = ops.fused_add_rms_norm(x, res, w, eps)
    assert bitwise_equal(res_out, r)
    assert bitwise_equal(out, ((r.float() * inv_r[:, None]) * w.float()).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [7, 64, 257])
def test_rms_norm_backward_equals_contract(dtype, H):
    g = torch.Generator().manual_seed(H + 1)
    rows = 23
    x = torch.randn(rows, H, generator=g).to(dtype)
    w = (torch.rand(H, generator=g) + 0.5).to(dtype)
    go = torch.randn(rows, H, generator=g).to(dtype)
    eps = 1e-6
    x32, w32, g32 = x.float(), w.float(), go.float()
    inv = rms_inv_ref(x32, eps)
    gw = g32 * w32
    dot = lane_sum_ref(gw * x32)
    c = (div32(dot, float(H)) * inv) * inv
    dx_ref = ((gw - x32 * c[:, None]) * inv[:, None]).to(dtype)
    dw_ref = torch.zeros(H)
    for r in range(rows):  # one chain per column, rows in batch order
        dw_ref = dw_ref + g32[r] * (x32[r] * inv[r])
    dx, dw = ops.rms_norm_backward(go, x, w, eps)
    assert bitwise_equal(dx, dx_ref)
    assert bitwise_equal(dw, dw_ref.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_contract(dtype):
    g = torch.Generator().manual_seed(7)
    d = 301
    x = (torch.randn(9, 2 * d, generator=g) * 4).to(dtype)
    a, b = x.float()[:, :d], x.float()[:, d:]
    silu = div32(a, 1.0 + ops._exp_f32(-a))
    assert bitwise_equal(ops.silu_and_mul(x), (silu * b).to(dtype))
    go = torch.randn(9, d, generator=g).to(dtype)
    gf = go.float()
    s = div32(1.0, 1.0 + ops._exp_f32(-a))
    da = (gf * b) * (s + (a * s) * (1.0 - s))
    db = gf * silu
    assert bitwise_equal(ops.silu_and_mul_backward(go, x), torch.cat([da.to(dtype), db.to(dtype)], -1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_equals_contract(dtype, is_neox):
    g = torch.Generator().manual_seed(8)
    T, heads, head_dim, rot = 11, 3, 40, 24
    cache = aligned_ops.rotary_cos_sin_cache(rot, 64)
    pos = torch.randint(0, 64, (T,), generator=g)
    x = torch.randn(T, heads, head_dim, generator=g).to(dtype)
    half = rot // 2
    idx1 = torch.arange(half) if is_neox else torch.arange(0, rot, 2)
    idx2 = idx1 + half if is_neox else idx1 + 1
    c = cache[pos, :half][:, None, :]
    s = cache[pos, half:][:, None, :]
    x1, x2 = x.float()[..., idx1], x.float()[..., idx2]
    for inverse in (False, True):
        ref = x.clone()
        if not inverse:
            ref[..., idx1] = (x1 * c - x2 * s).to(dtype)
            ref[..., idx2] = (x2 * c + x1 * s).to(dtype)
            out = ops.rotary_embedding(pos, x, cache, rot, is_neox)
        else:
            ref[..., idx1] = (x1 * c + x2 * s).to(dtype)
            ref[..., idx2] = (x2 * c - x1 * s).to(dtype)
            out = ops.rotary_embedding_backward(pos, x, cache, rot, is_neox)
        assert bitwise_equal(out, ref)


def lse_pair_ref(z: torch.Tensor, tau):
    """contract.h lse_pair_row for ordinary rows: s = z / tau, m = max s, L = log(lane_sum exp(s - m))."""
    s = div32(z.float(), tau)
    m = s.max(-1).values
    total = lane_sum_ref(ops._exp_f32(s - m[:, None]))
    return s, m, ops._log_f32(total)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [1, 5, 32, 1000, 4099])
def test_logsumexp_and_log_softmax_equal_contract(dtype, V):
    g = torch.Generator().manual_seed(V)
    T = 6
    z = (torch.randn(T, V, generator=g) * 5).to(dtype)
    z[2] = z[2] + 300.0 if dtype != torch.float16 else z[2] + 3000.0  # large logits: the shift matters
    for tau in (1.0, 0.7):
        s, m, L = lse_pair_ref(z, tau)
        assert bitwise_equal(ops.logsumexp(z, tau, None), m + L)
        logp = (s - m[:, None]) - L[:, None]
        assert bitwise_equal(ops.log_softmax(z, tau, None), logp)
        ids = torch.randint(0, V, (T,), generator=g)
        assert bitwise_equal(ops.token_logprobs(z, ids, tau, None), logp.gather(1, ids[:, None])[:, 0])
        grad = torch.randn(T, generator=g)
        onehot = torch.nn.functional.one_hot(ids, V).float()
        p = ops._exp_f32(logp)
        dz = div32((onehot - p) * grad[:, None], tau)
        assert bitwise_equal(ops.token_logprobs_backward(grad, z, ids, tau, None), dz.to(dtype))
        assert bitwise_equal(ops.logsumexp_backward(grad, z, tau, None), div32(p * grad[:, None], tau).to(dtype))
        gfull = torch.randn(T, V, generator=g)
        gsum = lane_sum_ref(gfull)
        ref = div32(gfull - p * gsum[:, None], tau).to(dtype)
        assert bitwise_equal(ops.log_softmax_backward(gfull, z, tau, None), ref)


def test_negative_control_unshifted_log_softmax_differs_from_contract():
    # The former expression s - (m + L) is a different tree: the contract test above can tell them apart.
    g = torch.Generator().manual_seed(3)
    z = torch.randn(8, 1000, generator=g) * 5 + 1e4
    s, m, L = lse_pair_ref(z, 1.0)
    assert not bitwise_equal(ops.log_softmax(z, 1.0, None), s - (m + L)[:, None])
