"""aligned::moe_routing and aligned::moe_experts: contract (csrc/common/moe.h), invariance, accuracy, backward."""

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, bits, count_bitwise_equal

ops = torch.ops.aligned
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _weights(E, H, I, dtype, seed=0, scale=0.1):
    g = _g(seed)
    w13 = (scale * torch.randn(E, 2 * I, H, generator=g)).to(dtype)
    w2 = (scale * torch.randn(E, H, I, generator=g)).to(dtype)
    return w13, w2


def _shared(H, Is, dtype, seed=7):
    g = _g(seed)
    return ((0.1 * torch.randn(2 * Is, H, generator=g)).to(dtype), (0.1 * torch.randn(H, Is, generator=g)).to(dtype),
            (0.1 * torch.randn(1, H, generator=g)).to(dtype))


def _route(T, E, k, seed=0, dtype=torch.float32):
    z = torch.randn(T, E, generator=_g(seed)).to(dtype)
    return aligned_ops.moe_routing(z, k)


# ---- routing ----------------------------------------------------------------------------------------------


def test_routing_ties_lower_expert_id_wins():
    z = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0]])
    for k, expect in [(1, [1]), (2, [1, 2]), (3, [1, 2, 4]), (4, [1, 2, 4, 0])]:
        w, ids, _ = aligned_ops.moe_routing(z, k, "softmax", True)
        assert ids[0].tolist() == expect
    # All equal: ids 0..k-1 and equal weights 1/k (exact for k a power of two).
    w, ids, _ = aligned_ops.moe_routing(torch.zeros(3, 8), 4)
    assert ids.tolist() == [[0, 1, 2, 3]] * 3
    assert torch.equal(w, torch.full((3, 4), 0.25))
    # Sigmoid ties too.
    w, ids, _ = aligned_ops.moe_routing(torch.tensor([[0.5, 2.0, 0.5, 2.0]]), 3, "sigmoid", False)
    assert ids[0].tolist() == [1, 3, 0]


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_k_1_to_8_vs_float64(k, scoring, renormalize):
    E = 16
    z = 3 * torch.randn(64, E, generator=_g(k))
    w, ids, scores = aligned_ops.moe_routing(z, k, scoring, renormalize)
    z64 = z.double()
    p64 = torch.softmax(z64, -1) if scoring == "softmax" else torch.sigmoid(z64)
    assert torch.allclose(scores.double(), p64, rtol=4e-6, atol=1e-12)
    # The chosen experts are the k best by the op's key (moe.h: the scores for softmax, the logits for sigmoid),
    # ties to the lower id (stable sort).
    key = scores if scoring == "softmax" else z
    order = torch.sort(-key, dim=-1, stable=True).indices[:, :k]
    assert torch.equal(ids, order)
    sel = p64.gather(-1, ids)
    ref = sel / sel.sum(-1, keepdim=True) if renormalize else sel
    assert w.dtype == torch.float32
    assert torch.allclose(w.double(), ref, rtol=1e-5, atol=1e-12)
    # The rank-order renormalisation of moe.h, evaluated here in fp32 step by step: bitwise.
    if renormalize:
        s = torch.zeros(64)
        chosen = scores.gather(-1, ids)
        for r in range(k):
            s = s + chosen[:, r]
        assert_bitwise_equal(w, chosen / s[:, None])


@pytest.mark.parametrize("dtype", DTYPES)
def test_routing_row_invariant_and_logit_dtypes(dtype):
    z = torch.randn(37, 64, generator=_g(1)).to(dtype)
    w, ids, s = aligned_ops.moe_routing(z, 8)
    for t in (0, 5, 36):
        w1, ids1, s1 = aligned_ops.moe_routing(z[t : t + 1], 8)
        assert_bitwise_equal(w1[0], w[t])
        assert torch.equal(ids1[0], ids[t])
        assert_bitwise_equal(s1[0], s[t])


def test_routing_extreme_and_nan():
    z = torch.tensor([[1e30, -1e30, 0.0, 5.0], [float("nan"), 1.0, 2.0, 3.0], [-float("inf"), 0.0, 0.0, 1.0]])
    w, ids, s = aligned_ops.moe_routing(z, 2)
    assert ids[0].tolist()[0] == 0 and float(w[0, 0]) == 1.0
    assert torch.isnan(w[1]).all() and ((ids[1] >= 0) & (ids[1] < 4)).all()
    assert ids[2].tolist() == [3, 1] and float(s[2, 0]) == 0.0


# ---- sigmoid routing at the edges (issue 21.6; moe.h "sigmoid_score", the logit form of the weights) ----------
def _sigmoid_reference64(z, k, renormalize):
    """float64 of moe.h's sigmoid semantics: ids by the logits (ties: lower id), p = sigmoid(z), w = p / sum p
    over the chosen (renormalize) or p; a NaN logit makes its row NaN (ids 0..k-1)."""
    z64 = z.double()
    ids = torch.sort(-z64, dim=-1, stable=True).indices[:, :k]
    p = torch.sigmoid(z64)
    nan_row = torch.isnan(z64).any(-1, keepdim=True)
    ids = torch.where(nan_row, torch.arange(k).expand_as(ids), ids)
    p = p.masked_fill(nan_row, float("nan"))
    sel = p.gather(-1, ids)
    if renormalize:  # per row: the ratio of the sigmoids; from the logits where float64 underflows as well
        zs = z64.gather(-1, ids)
        all_inf = torch.isneginf(zs).all(-1, keepdim=True)
        by_logits = torch.where(all_inf, torch.full_like(zs, 1.0 / k), torch.softmax(zs, -1))
        total = sel.sum(-1, keepdim=True)
        w = torch.where(total > 0, sel / total, by_logits)
        w = w.masked_fill(nan_row, float("nan"))
    else:
        w = sel
    return w, ids, p


def _extreme_sigmoid_rows():
    g = _g(41)
    rows = [
        -88.7 - 20 * torch.rand(8, generator=g),                # every logit below the old form's 1/inf
        -120.0 - 300 * torch.rand(8, generator=g),               # every score underflows to 0 (was 0/0)
        torch.tensor([-200.0, -90.0, -95.0, -1e30, -150.0, -89.0, -3e38, -100.0]),
        torch.tensor([-90.0, -90.0, -95.0, -95.0, -90.0, -200.0, -200.0, -200.0]),  # ties: lower id, equal w
        torch.tensor([-float("inf")] * 8),                       # all chosen -inf: equal logits, w = 1/k
        torch.tensor([-float("inf"), -float("inf"), -91.0, -float("inf"), -95.0, -99.0, -float("inf"), -130.0]),
        torch.tensor([-87.0, -87.5, -88.0, -88.5, -89.0, -89.5, -90.0, -104.0]),  # around the normal bound
        torch.tensor([3.0, -90.0, 2.0, -100.0, 0.5, -0.0, 0.0, -1e4]),            # a normal row with tiny ones
        torch.tensor([-0.0, 0.0, -0.0, 0.0, 1.0, -1.0, 40.0, 50.0]),             # sigmoid(40) = sigmoid(50) = 1
        torch.tensor([-20.0, -25.0, -30.0, -17.0, -40.0, -60.0, -18.0, -80.0]),  # normal scores, logit form
        torch.tensor([-16.0, -16.5, -16.6, -16.7, -17.0, -15.0, -16.63, -16.64]),  # around s = 2^-24
    ]
    return torch.stack(rows)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_sigmoid_routing_far_below_zero_keeps_logit_order_and_finite_weights(k, renormalize):
    """Finite logits below -88.7 gave p = 1/inf = 0: ids by expert id, not by logit, and 0/0 = NaN weights.
    Now: ids in logit order (ties: lower id), finite weights, equal to float64 of moe.h's semantics."""
    z = _extreme_sigmoid_rows()
    w, ids, p = aligned_ops.moe_routing(z, k, "sigmoid", renormalize)
    w64, ids64, p64 = _sigmoid_reference64(z, k, renormalize)
    assert torch.equal(ids, ids64)
    assert bool(torch.isfinite(w).all()) and bool((w >= 0).all())
    assert torch.allclose(p.double(), p64, rtol=2e-7, atol=3e-45)  # subnormal scores: one ulp of 2^-149
    if renormalize:  # subnormal scores in the ratio form are divided by s >= 2^-24: at most 2^-125 off
        assert torch.allclose(w.double(), w64, rtol=4e-7, atol=2.0**-124)
        assert torch.allclose(w.double().sum(-1), torch.ones(len(z), dtype=torch.float64), rtol=1e-6)
        assert torch.equal(w[4], torch.full((k,), 1.0 / k))  # all -inf: equal weights
    else:
        assert torch.allclose(w.double(), w64, rtol=2e-7, atol=3e-45)
    if k >= 3:  # ties: the lower id first, equal weights
        assert ids[3, :3].tolist() == [0, 1, 4] and float(w[3, 0]) == float(w[3, 1]) == float(w[3, 2])
    # row-local: each row alone gives the same bits
    for r in range(len(z)):
        w1, ids1, p1 = aligned_ops.moe_routing(z[r : r + 1].clone(), k, "sigmoid", renormalize)
        assert_bitwise_equal(w1[0], w[r])
        assert torch.equal(ids1[0], ids[r])
        assert_bitwise_equal(p1[0], p[r])


def test_sigmoid_routing_negative_control_plain_form_fails_there():
    """The plain form 1 / (1 + exp(-z)) on the same rows: 0/0 weights and ids by expert id (what main did)."""
    z = _extreme_sigmoid_rows()[:2]
    p = 1.0 / (1.0 + torch.ops.aligned._exp_f32(-z))
    assert bool((p == 0).all())
    ids = torch.sort(-p, dim=-1, stable=True).indices[:, :2]
    assert ids.tolist() == [[0, 1], [0, 1]] and not torch.equal(ids, _sigmoid_reference64(z, 2, True)[1])
    sel = p.gather(-1, ids)
    assert bool(torch.isnan(sel / sel.sum(-1, keepdim=True)).all())


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_nan_router_logit_poisons_its_token_at_every_expert(scoring, renormalize):
    """A NaN logit at any expert makes every weight of its token NaN (sigmoid made only expert 0's NaN and
    dropped it elsewhere), and the token's MoE output NaN in every column; other tokens keep their bits."""
    T, E, H, I, k = 5, 8, 32, 16, 2
    g = _g(43)
    z = torch.randn(T, E, generator=g)
    x = torch.randn(T, H, generator=g)
    w13, w2 = _weights(E, H, I, torch.float32, seed=44)
    clean_w, clean_ids, _ = aligned_ops.moe_routing(z, k, scoring, renormalize)
    clean_out = aligned_ops.moe_experts(x, clean_w, clean_ids, w13, w2)
    for e in range(E):
        zn = z.clone()
        zn[2, e] = float("nan")
        w, ids, p = aligned_ops.moe_routing(zn, k, scoring, renormalize)
        assert bool(torch.isnan(w[2]).all()), (e, w[2])
        assert bool(torch.isnan(p[2]).all())
        assert ids[2].tolist() == list(range(k))  # the NaN row's scan: ids 0..k-1
        out = aligned_ops.moe_experts(x, w, ids, w13, w2)
        assert bool(torch.isnan(out[2]).all())
        others = [0, 1, 3, 4]
        assert_bitwise_equal(w[others], clean_w[others])
        assert_bitwise_equal(out[others], clean_out[others])
        # backward: the NaN reaches the token's logit gradient, nothing else's
        zg = zn.clone().requires_grad_(True)
        wg, _, _ = aligned_ops.moe_routing(zg, k, scoring, renormalize)
        wg.sum().backward()
        assert bool(torch.isnan(zg.grad[2]).all()) and bool(torch.isfinite(zg.grad[others]).all())


@pytest.mark.parametrize("renormalize", [True, False])
def test_sigmoid_routing_backward_far_below_zero_vs_float64(renormalize):
    """The logit-gradient of the weights and scores where every chosen p is subnormal or 0: finite, and equal to
    float64 autograd of the same semantics (the logit form is the float64 ratio's own limit there)."""
    z = _extreme_sigmoid_rows()[[0, 1, 2, 3, 6, 7, 9, 10]].clone().requires_grad_(True)
    k = 3
    w, ids, p = aligned_ops.moe_routing(z, k, "sigmoid", renormalize)
    g = _g(45)
    gw, gs = torch.randn(w.shape, generator=g), torch.randn(p.shape, generator=g)
    ((w * gw).sum() + (p * gs).sum()).backward()
    assert bool(torch.isfinite(z.grad).all())
    z64 = z.detach().double().requires_grad_(True)
    p64 = torch.sigmoid(z64)
    zs = z64.gather(-1, ids)
    if renormalize:
        # float64 itself is exact here except for sums of e^-700-sized terms: take the ratio in the logit form
        w64 = torch.softmax(zs, -1) * (1 - torch.sigmoid(zs)).detach() / (1 - torch.sigmoid(zs)).detach()
        sel = p64.gather(-1, ids)
        ok = sel.sum(-1, keepdim=True) > 0
        w64 = torch.where(ok, sel / sel.sum(-1, keepdim=True), w64)
    else:
        w64 = p64.gather(-1, ids)
    ((w64 * gw.double()).sum() + (p64 * gs.double()).sum()).backward()
    assert torch.allclose(z.grad.double(), z64.grad, rtol=1e-5, atol=1e-30), (z.grad, z64.grad)


def test_routing_backward_vs_torch_float64():
    for scoring in ("softmax", "sigmoid"):
        for renorm in (True, False):
            z = torch.randn(20, 12, generator=_g(3), requires_grad=True)
            w, ids, scores = aligned_ops.moe_routing(z, 3, scoring, renorm)
            gw, gs = torch.randn(20, 3, generator=_g(4)), torch.randn(20, 12, generator=_g(5))
            (w * gw).sum().backward(retain_graph=True)
            (scores * gs).sum().backward()
            z64 = z.detach().double().requires_grad_(True)
            p = torch.softmax(z64, -1) if scoring == "softmax" else torch.sigmoid(z64)
            sel = p.gather(-1, ids)
            w64 = sel / sel.sum(-1, keepdim=True) if renorm else sel
            ((w64 * gw.double()).sum() + (p * gs.double()).sum()).backward()
            assert torch.allclose(z.grad.double(), z64.grad, rtol=1e-4, atol=1e-6), (scoring, renorm)


# ---- experts ----------------------------------------------------------------------------------------------


def _reference64(x, w, ids, w13, w2, sw13=None, sw2=None, sgate=None):
    """float64 reference of the whole experts op (no intermediate rounding)."""
    x64 = x.double()
    I = w2.shape[2]
    out = torch.zeros_like(x64)
    for t in range(x.shape[0]):
        for r in range(ids.shape[1]):
            e = int(ids[t, r])
            h = w13[e].double() @ x64[t]
            a = torch.nn.functional.silu(h[:I]) * h[I:]
            out[t] += w[t, r].double() * (w2[e].double() @ a)
    if sw13 is not None:
        Is = sw2.shape[1]
        h = x64 @ sw13.double().T
        ys = (torch.nn.functional.silu(h[:, :Is]) * h[:, Is:]) @ sw2.double().T
        g = torch.sigmoid(x64 @ sgate.double().T) if sgate is not None else 1.0
        out += g * ys
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [False, True])
def test_experts_kernel_equals_contract_reference(dtype, shared):
    T, E, H, I, k = 29, 8, 213, 37, 3  # odd shapes: no 16/32 multiple anywhere
    x = torch.randn(T, H, generator=_g(0)).to(dtype)
    w, ids, _ = _route(T, E, k)
    w13, w2 = _weights(E, H, I, dtype)
    extra = _shared(H, 19, dtype) if shared else (None, None, None)
    out = aligned_ops.moe_experts(x, w, ids, w13, w2, *extra)
    ref = ops._moe_experts_reference(x, w, ids, w13, w2, *extra)
    assert out.dtype == dtype and out.shape == x.shape
    assert_bitwise_equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_accuracy_vs_float64(dtype):
    T, E, H, I, k = 16, 6, 96, 40, 2
    x = torch.randn(T, H, generator=_g(2)).to(dtype)
    w, ids, _ = _route(T, E, k, seed=2)
    w13, w2 = _weights(E, H, I, dtype, seed=2)
    sw = _shared(H, 24, dtype)
    out = aligned_ops.moe_experts(x, w, ids, w13, w2, *sw).double()
    ref = _reference64(x, w, ids, w13, w2, *sw)
    tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    assert (out - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_row_invariance_token_alone_vs_in_batch(dtype):
    """A token's bits do not depend on which other tokens are in the batch or share its experts."""
    T, E, H, I, k = 70, 8, 128, 64, 2
    x = torch.randn(T, H, generator=_g(5)).to(dtype)
    w, ids, _ = _route(T, E, k, seed=5)
    w13, w2 = _weights(E, H, I, dtype, seed=5)
    sw = _shared(H, 32, dtype)
    full = aligned_ops.moe_experts(x, w, ids, w13, w2, *sw)
    perm = torch.randperm(T, generator=_g(6))
    shuffled = aligned_ops.moe_experts(x[perm], w[perm], ids[perm], w13, w2, *sw)
    assert_bitwise_equal(shuffled, full[perm])
    for t in (0, 13, 69):
        alone = aligned_ops.moe_experts(x[t : t + 1], w[t : t + 1], ids[t : t + 1], w13, w2, *sw)
        assert_bitwise_equal(alone[0], full[t])
    # Thread count does not matter either.
    torch.set_num_threads(1)
    assert_bitwise_equal(aligned_ops.moe_experts(x, w, ids, w13, w2, *sw), full)


def test_negative_control_other_combine_order_is_detected():
    """The bitwise comparison above can fail: summing the same fp32 expert outputs in reverse rank order (a
    different, equally plausible combine) changes bits for many tokens."""
    T, E, H, I, k = 64, 8, 128, 64, 4
    x = torch.randn(T, H, generator=_g(8))
    w, ids, _ = _route(T, E, k, seed=8)
    w13, w2 = _weights(E, H, I, torch.float32, seed=8)
    out = aligned_ops.moe_experts(x, w, ids, w13, w2)
    ys = []
    for r in range(k):
        one = torch.zeros(T, k)
        one[:, r] = 1.0
        ys.append(aligned_ops.moe_experts(x, one, ids, w13, w2))  # y_r exactly (1 * y_r, + 0s)
    acc = torch.zeros(T, H)
    for r in range(k):
        acc = acc + w[:, r : r + 1] * ys[r]
    assert_bitwise_equal(acc, out)  # the rank-order combine of moe.h, rebuilt in torch: equal
    rev = torch.zeros(T, H)
    for r in reversed(range(k)):
        rev = rev + w[:, r : r + 1] * ys[r]
    assert count_bitwise_equal(rev, out) < out.numel()


def test_expert_with_no_tokens_and_all_tokens_to_one_expert():
    T, E, H, I = 12, 8, 64, 32
    x = torch.randn(T, H, generator=_g(9))
    w13, w2 = _weights(E, H, I, torch.float32, seed=9)
    # Expert 3 and 7 receive nothing.
    ids = torch.tensor([[0, 1], [1, 2], [2, 4], [4, 5], [5, 6], [6, 0]] * 2)
    w = torch.rand(T, 2, generator=_g(10))
    out = aligned_ops.moe_experts(x, w, ids, w13, w2)
    assert_bitwise_equal(out, ops._moe_experts_reference(x, w, ids, w13, w2))
    w13r, w2r = w13.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    aligned_ops.moe_experts(x, w, ids, w13r, w2r).sum().backward()
    assert bits(w13r.grad[3]).eq(0).all() and bits(w2r.grad[7]).eq(0).all()
    assert w13r.grad[0].abs().sum() > 0
    # Every token to expert 5 (k = 1), and every token to experts (5, 2).
    for ids in (torch.full((T, 1), 5), torch.tensor([[5, 2]] * T)):
        w = torch.rand(T, ids.shape[1], generator=_g(11))
        out = aligned_ops.moe_experts(x, w, ids, w13, w2)
        assert_bitwise_equal(out, ops._moe_experts_reference(x, w, ids, w13, w2))
        assert torch.allclose(out.double(), _reference64(x, w, ids, w13, w2), rtol=0, atol=1e-5)


def test_zero_tokens():
    w13, w2 = _weights(4, 16, 8, torch.float32)
    out = aligned_ops.moe_experts(torch.empty(0, 16), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.long), w13, w2)
    assert out.shape == (0, 16)


@pytest.mark.parametrize("shared", [False, True])
def test_experts_backward_vs_torch(shared):
    T, E, H, I, k = 10, 5, 48, 24, 2
    x = torch.randn(T, H, generator=_g(12), requires_grad=True)
    z = torch.randn(T, E, generator=_g(13), requires_grad=True)
    w13, w2 = [t.requires_grad_(True) for t in _weights(E, H, I, torch.float32, seed=12)]
    sw = [t.requires_grad_(True) for t in _shared(H, 16, torch.float32)] if shared else [None, None, None]
    tw, ids, _ = aligned_ops.moe_routing(z, k)
    out = aligned_ops.moe_experts(x, tw, ids, w13, w2, *sw)
    gout = torch.randn(T, H, generator=_g(14))
    leaves = [x, z, w13, w2] + [t for t in sw if t is not None]
    grads = torch.autograd.grad((out * gout).sum(), leaves)
    # float64 torch reference with the same expert ids
    leaves64 = [t.detach().double().requires_grad_(True) for t in leaves]
    x64, z64, w1364, w264 = leaves64[:4]
    p = torch.softmax(z64, -1).gather(-1, ids)
    tw64 = p / p.sum(-1, keepdim=True)
    out64 = _reference64(x64, tw64, ids, w1364, w264, *(leaves64[4:] if shared else []))
    grads64 = torch.autograd.grad((out64 * gout.double()).sum(), leaves64)
    for g, g64, name in zip(grads, grads64, ["x", "logits", "w13", "w2", "sw13", "sw2", "sgate"]):
        assert torch.allclose(g.double(), g64, rtol=1e-4, atol=1e-5), name
    # Deterministic: same bits on a second run.
    out2 = aligned_ops.moe_experts(x, *aligned_ops.moe_routing(z, k)[:2], w13, w2, *sw)
    grads2 = torch.autograd.grad((out2 * gout).sum(), leaves)
    for a, b in zip(grads, grads2):
        assert_bitwise_equal(a, b)


def _weight_and_gate_grads(x, tw, ids, w13, w2, sw13, sw2, sgate, gout):
    """(d topk_weights, d shared_gate logit's x-part) of moe_experts_backward: the two row sums of moe.h."""
    dx, dtw, *_rest, dgate = ops.moe_experts_backward(gout, x, tw, ids, w13, w2, sw13, sw2, sgate)
    return dtw, dx


@pytest.mark.parametrize("H", [40000])
def test_experts_backward_weight_grad_row_local_any_batch_and_threads(H):
    """Issue 21.9: the routing-weight gradient (and the shared gate's) summed with torch.sum, whose order splits a
    lone row across threads once H > 32768: a token alone (its experts get one row) and the same token in a
    batch, with 1 and 2 threads, must give the same bits (moe.h "Backward": the linear contract's row sum)."""
    T, E, I, k = 3, 3, 4, 2
    g = _g(50)
    x = (0.5 * torch.randn(T, H, generator=g)).to(torch.bfloat16)
    w13, w2 = _weights(E, H, I, torch.bfloat16, seed=51, scale=0.05)
    sw13, sw2, sgate = _shared(H, 4, torch.bfloat16, seed=52)
    tw, ids, _ = aligned_ops.moe_routing(torch.randn(T, E, generator=g), k)
    gout = torch.randn(T, H, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batch1 = _weight_and_gate_grads(x, tw, ids, w13, w2, sw13, sw2, sgate, gout)
        torch.set_num_threads(2)
        batch2 = _weight_and_gate_grads(x, tw, ids, w13, w2, sw13, sw2, sgate, gout)
        for t in range(T):  # alone, 2 threads: every expert of the token holds one row
            dtw, dx = _weight_and_gate_grads(x[t : t + 1], tw[t : t + 1], ids[t : t + 1], w13, w2, sw13, sw2, sgate,
                                             gout[t : t + 1])
            assert_bitwise_equal(dtw[0], batch2[0][t])  # d topk_weights
            assert_bitwise_equal(dx[0], batch2[1][t])  # dx (carries the shared gate's logit gradient)
        assert_bitwise_equal(batch1[0], batch2[0])
        assert_bitwise_equal(batch1[1], batch2[1])
        # Negative control: torch.sum of the same products, a lone row with 2 threads vs 1, differs in the bits.
        prod = torch.randn(1, H, generator=_g(53)) * torch.randn(1, H, generator=_g(54))
        torch.set_num_threads(1)
        one = prod.sum(-1)
        torch.set_num_threads(2)
        two = prod.sum(-1)
        if torch.get_num_threads() == 2:
            assert not torch.equal(one.view(torch.int32), two.view(torch.int32))
    finally:
        torch.set_num_threads(threads)


def test_bf16_backward_runs_and_is_close():
    T, E, H, I, k = 8, 4, 32, 16, 2
    x = torch.randn(T, H, generator=_g(15)).bfloat16().requires_grad_(True)
    w13, w2 = [t.requires_grad_(True) for t in _weights(E, H, I, torch.bfloat16, seed=15)]
    tw, ids, _ = _route(T, E, k, seed=15)
    out = aligned_ops.moe_experts(x, tw, ids, w13, w2)
    out.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w13.grad.dtype == torch.bfloat16
    x64 = x.detach().double().requires_grad_(True)
    _reference64(x64, tw, ids, w13.detach(), w2.detach()).sum().backward()
    assert torch.allclose(x.grad.double(), x64.grad, rtol=5e-2, atol=5e-3)


def test_opcheck_and_compile():
    T, E, H, I, k = 6, 4, 32, 16, 2
    z = torch.randn(T, E, generator=_g(16), requires_grad=True)
    torch.library.opcheck(ops.moe_routing.default, (z, k, "softmax", True))
    torch.library.opcheck(ops.moe_routing.default, (z.detach(), k, "sigmoid", False))
    tw, ids, _ = aligned_ops.moe_routing(z.detach(), k)
    torch.library.opcheck(ops.moe_routing_backward.default,
                          (torch.randn(T, k), torch.randn(T, E), z.detach(), ids, "softmax", True))
    x = torch.randn(T, H, generator=_g(17), requires_grad=True)
    w13, w2 = [t.requires_grad_(True) for t in _weights(E, H, I, torch.float32, seed=17)]
    sw = _shared(H, 8, torch.float32)
    torch.library.opcheck(ops.moe_experts.default, (x, tw.requires_grad_(True), ids, w13, w2, *sw))
    torch.library.opcheck(ops.moe_experts.default, (x, tw, ids, w13, w2, None, None, None))

    def f(x, z, w13, w2):
        return aligned_ops.moe_layer(x, z, w13, w2, 2)

    router = torch.randn(E, H, generator=_g(18))
    args = (x.detach(), router, w13.detach(), w2.detach())
    cf = torch.compile(f, fullgraph=True)
    assert_bitwise_equal(cf(*args), f(*args))


def test_bad_inputs():
    z = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="aligned::moe_routing: top_k must be in \\[1, 8\\]"):
        ops.moe_routing(z, 9, "softmax", True)
    with pytest.raises(RuntimeError, match="aligned::moe_routing: scoring must be 'softmax' or 'sigmoid'"):
        ops.moe_routing(z, 2, "relu", True)
    with pytest.raises(ValueError, match="moe_routing: scoring must be one of"):
        aligned_ops.moe_routing(z, 2, "relu")
    with pytest.raises(RuntimeError, match="aligned::moe_routing: router_logits must be 2-D"):
        ops.moe_routing(z[0], 2, "softmax", True)
    w13, w2 = _weights(4, 16, 8, torch.float32)
    x = torch.randn(3, 16)
    w = torch.rand(3, 2)
    with pytest.raises(RuntimeError, match="aligned::moe_experts: topk_ids must lie in \\[0, 4\\)"):
        ops.moe_experts(x, w, torch.tensor([[0, 4]] * 3), w13, w2)
    with pytest.raises(RuntimeError, match="aligned::moe_experts: w2 must be \\[4, 16, 8\\]"):
        ops.moe_experts(x, w, torch.zeros(3, 2, dtype=torch.long), w13, w2[:, :, :4])
    with pytest.raises(RuntimeError, match="aligned::moe_experts: topk_weights must be float32"):
        ops.moe_experts(x, w.double(), torch.zeros(3, 2, dtype=torch.long), w13, w2)
    with pytest.raises(RuntimeError, match="aligned::moe_experts: w13 and w2 must have x's dtype"):
        ops.moe_experts(x.bfloat16(), w, torch.zeros(3, 2, dtype=torch.long), w13, w2)
    with pytest.raises(RuntimeError, match="aligned::moe_experts: shared_w13 and shared_w2 must be given together"):
        ops.moe_experts(x, w, torch.zeros(3, 2, dtype=torch.long), w13, w2, torch.randn(8, 16), None, None)


@pytest.mark.parametrize("shape", [(16,), (16, 1), (2, 8), (4, 4), (1, 1, 16)])
def test_shared_gate_shape_is_checked_not_reinterpreted(shape):
    """Issue 21.9: any gate with H elements was accepted (and reshaped to [1, H]); only [1, H] is a gate."""
    x = torch.randn(3, 16)
    w13, w2 = _weights(4, 16, 8, torch.float32)
    w, ids = torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.long)
    sw13, sw2 = torch.randn(8, 16), torch.randn(16, 4)
    with pytest.raises(RuntimeError, match=r"aligned::moe_experts: shared_gate must be \[1, 16\] with x's dtype, got"):
        ops.moe_experts(x, w, ids, w13, w2, sw13, sw2, torch.randn(shape))
    with pytest.raises(RuntimeError, match=r"shared_gate must be \[1, 16\]"):  # the fake impl (torch.compile) too
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            ops.moe_experts(*(mode.from_tensor(t) for t in (x, w, ids, w13, w2, sw13, sw2, torch.randn(shape))))
    ops.moe_experts(x, w, ids, w13, w2, sw13, sw2, torch.randn(1, 16))  # positive control


def _backward_args(ids, E=4, H=8, I=8, seed=0):
    T, k = ids.shape
    w13, w2 = _weights(E, H, I, torch.float32, seed)
    x = torch.randn(T, H, generator=_g(seed + 1))
    tw = torch.rand(T, k, generator=_g(seed + 2))
    return torch.randn(T, H, generator=_g(seed + 3)), x, tw, ids, w13, w2


@pytest.mark.parametrize("bad,what", [([[0, 1], [2, 3], [1, 4]], r"0 id\(s\) < 0 and 1 id\(s\) >= 4"),
                                      ([[0, 1], [-1, 3], [1, 2]], r"1 id\(s\) < 0 and 0 id\(s\) >= 4")])
def test_experts_backward_refuses_out_of_range_ids_by_name(bad, what):
    """An id >= E used to give its rank a zero gradient silently, a negative one to fail inside torch.bincount."""
    args = _backward_args(torch.tensor(bad))
    with pytest.raises(RuntimeError, match=r"aligned::moe_experts_backward: topk_ids must lie in \[0, 4\), got " + what):
        ops.moe_experts_backward(*args)
    ops.moe_experts_backward(*_backward_args(torch.tensor([[0, 1], [2, 3], [1, 2]])))  # the control: in range runs


def test_experts_forward_defines_a_repeated_expert_backward_refuses_it():
    """The forward's contract (moe.h) takes each rank on its own: ids [e, e] equal ids [e, e'] with expert e' a copy
    of e, bit for bit. The backward refuses the repeat by name (dx would sum two rows of one expert in a
    run-dependent order on a GPU)."""
    E, H, I = 4, 16, 8
    w13, w2 = _weights(E, H, I, torch.bfloat16, 5)
    w13[3], w2[3] = w13[1], w2[1]
    x = torch.randn(3, H, generator=_g(6)).to(torch.bfloat16)
    tw = torch.rand(3, 2, generator=_g(7))
    rep = ops.moe_experts(x, tw, torch.tensor([[1, 1], [0, 2], [2, 2]]), w13, w2)
    twin = ops.moe_experts(x, tw, torch.tensor([[1, 3], [0, 2], [2, 2]]), w13, w2)
    assert_bitwise_equal(rep[:2], twin[:2])
    args = _backward_args(torch.tensor([[1, 1], [0, 2], [2, 3]]))
    with pytest.raises(RuntimeError, match=r"aligned::moe_experts_backward: topk_ids must not list an expert twice "
                                           r"in a token .* got 1 such token"):
        ops.moe_experts_backward(*args)
    x2 = args[1].clone().requires_grad_()
    out = ops.moe_experts(x2, args[2], args[3], args[4], args[5])
    with pytest.raises(RuntimeError, match="aligned::moe_experts_backward: topk_ids must not list an expert twice"):
        out.sum().backward()  # through autograd too
