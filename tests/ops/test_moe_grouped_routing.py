"""aligned::moe_grouped_routing (DeepSeek-V3 noaux_tc / Kimi-K2): the contract written in csrc/common/moe.h
("grouped sigmoid routing") against a float64 reference of it, its tie / saturation / -inf / NaN rules, a token
alone == in a batch (bits), threads, ISA levels, the emulated GPUs, HF's router, backward, opcheck, compile, errors.
"""

import math

import numpy as np
import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, bits

ops = torch.ops.aligned
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _g(seed):
    return torch.Generator().manual_seed(seed)


# ---- the float64 reference of the written semantics -----------------------------------------------------------


def _rank_key(key, i):
    """The contract's order as a sort key (ascending = best first): NaN below every number, ties -> lower index."""
    return (1, 0.0, i) if math.isnan(key) else (0, -key, i)


def reference_select(keys32, n_group, topk_group, k):
    """ids of one token from its fp32 keys (a list of Python floats holding fp32 values), by moe.h's rules."""
    E = len(keys32)
    G = E // n_group
    gscore = []
    for g in range(n_group):
        members = sorted(range(g * G, (g + 1) * G), key=lambda i: _rank_key(keys32[i], i))
        s = np.float32(keys32[members[0]])
        if G > 1:
            s = np.float32(s + np.float32(keys32[members[1]]))  # one fp32 add: k1 + k2
        gscore.append(float(s))
    kept = sorted(range(n_group), key=lambda g: _rank_key(gscore[g], g))[:topk_group]
    eligible = [i for i in range(E) if i // G in kept]
    return sorted(eligible, key=lambda i: _rank_key(keys32[i], i))[:k]


def reference(z, bias, k, n_group, topk_group, renormalize, scale, scores32):
    """(ids [T, k], weights float64 [T, k], scores float64 [T, E]). Selection on the op's fp32 scores + bias (one
    fp32 add, the contract's keys; the scores themselves are checked against float64 separately); weights from
    the float64 sigmoid of the chosen logits."""
    z64 = z.double()
    p64 = torch.sigmoid(z64)
    p64[torch.isnan(z64).any(-1)] = float("nan")
    keys = scores32 + (bias if bias is not None else torch.zeros(z.shape[1]))
    ids, ws = [], []
    for t in range(z.shape[0]):
        row = reference_select(keys[t].tolist(), n_group, topk_group, k)
        ids.append(row)
        sel = p64[t, row]
        if renormalize:
            zs = z64[t, row]
            if torch.isneginf(zs).all():
                sel = torch.full((k,), 1.0 / k, dtype=torch.float64)
            else:  # p_r / sum p, written without float64 underflow: softmax of log sigmoid
                sel = torch.softmax(torch.nn.functional.logsigmoid(zs), -1)
        ws.append(sel * np.float64(np.float32(scale)))
    return torch.tensor(ids, dtype=torch.int64), torch.stack(ws), p64


def fp32_weights(scores32, ids, renormalize, scale):
    """The weights' fp32 steps of moe.h (ratio form), evaluated with torch fp32 ops one at a time: bitwise."""
    u = scores32.gather(-1, ids)
    if renormalize:
        s = torch.zeros(u.shape[0])
        for r in range(u.shape[1]):
            s = s + u[:, r]
        u = u / s[:, None]
    return u * torch.tensor(scale, dtype=torch.float32)


CONFIGS = [  # (E, top_k, n_group, topk_group, renormalize, scale)
    (8, 2, 4, 2, True, 2.5),      # the tiny DeepSeek-V3 of issue 23
    (16, 4, 4, 2, True, 2.827),   # scale not representable in fp32 (Kimi-K2's)
    (32, 8, 8, 4, True, 2.5),     # DeepSeek-V3's 256/8/8/4 shape, scaled down
    (24, 6, 1, 1, True, 2.827),   # n_group = 1 (Kimi-K2: 384 top-8, one group)
    (12, 3, 3, 3, False, 1.0),    # topk_group = n_group, no renormalisation
    (10, 1, 5, 1, True, 1.5),     # k = 1, groups of 2
    (6, 2, 6, 2, True, 2.0),      # groups of 1 (group score = the key)
]


@pytest.mark.parametrize("E,k,ng,tg,renorm,scale", CONFIGS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_vs_float64_reference(E, k, ng, tg, renorm, scale, with_bias):
    T = 96
    z = 4 * torch.randn(T, E, generator=_g(E * 7 + k))
    bias = 0.5 * torch.randn(E, generator=_g(E)) if with_bias else None
    w, ids, scores = aligned_ops.moe_grouped_routing(z, bias, k, ng, tg, renorm, scale)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and scores.dtype == torch.float32
    ids_ref, w_ref, p64 = reference(z, bias, k, ng, tg, renorm, scale, scores)
    assert torch.allclose(scores.double(), p64, rtol=4e-6, atol=1e-30)
    assert torch.equal(ids, ids_ref)
    assert torch.allclose(w.double(), w_ref, rtol=1e-5, atol=1e-30)
    assert_bitwise_equal(w, fp32_weights(scores, ids, renorm, scale))
    # the dropped groups are never chosen; the kept groups are the topk_group best
    G = E // ng
    groups_used = torch.stack([(ids // G == g).any(-1) for g in range(ng)], -1).sum(-1)
    assert bool((groups_used <= tg).all())


def test_matches_hf_deepseek_v3_router():
    """The same experts (as sets: HF's topk is unsorted) and weights as transformers' DeepseekV3TopkRouter in fp32."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    for E, k, ng, tg, scale in ((8, 2, 4, 2, 2.5), (32, 8, 8, 4, 2.5), (24, 6, 1, 1, 2.827)):
        cfg = DeepseekV3Config(hidden_size=E, n_routed_experts=E, num_experts_per_tok=k, n_group=ng, topk_group=tg,
                               routed_scaling_factor=scale, norm_topk_prob=True)
        router = DeepseekV3TopkRouter(cfg)
        with torch.no_grad():
            router.weight.copy_(torch.eye(E))  # router logits = the hidden states, exactly
            router.e_score_correction_bias.copy_(0.3 * torch.randn(E, generator=_g(1)))
        z = 3 * torch.randn(200, E, generator=_g(E))
        _, hw, hids = router(z)
        w, ids, _ = aligned_ops.moe_grouped_routing(z, router.e_score_correction_bias.float(), k, ng, tg, True, scale)
        hs, order = hids.sort(-1)
        ms, morder = ids.sort(-1)
        assert torch.equal(hs, ms)
        torch.testing.assert_close(w.gather(-1, morder), hw.gather(-1, order), rtol=2e-6, atol=1e-7)


# ---- ties, saturation, -inf, NaN --------------------------------------------------------------------------------


def test_ties_and_saturated_sigmoids_go_to_the_lower_index():
    # z >= 16.7: sigmoid is exactly 1.0 in fp32; with equal bias every such expert ties -> lower index first.
    z = torch.tensor([[0.0, 20.0, 30.0, 17.0, 25.0, 0.0, 40.0, 18.0]])
    w, ids, s = aligned_ops.moe_grouped_routing(z, None, 4, 1, 1, True, 1.0)
    assert s[0, 1].item() == 1.0 and s[0, 2].item() == 1.0 and s[0, 6].item() == 1.0
    assert ids[0].tolist() == [1, 2, 3, 4]
    assert w[0].tolist() == [0.25] * 4
    # The bias decides between saturated experts: expert 6 gets the largest.
    b = torch.zeros(8)
    b[6] = 0.25
    _, ids, _ = aligned_ops.moe_grouped_routing(z, b, 2, 1, 1, True, 1.0)
    assert ids[0].tolist() == [6, 1]
    # Group ties: 4 groups of 2 with equal group scores -> the lower group indices are kept.
    zg = torch.tensor([[1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 1.0]])
    _, ids, _ = aligned_ops.moe_grouped_routing(zg, None, 4, 4, 2, True, 1.0)
    assert ids[0].tolist() == [1, 2, 0, 3]
    # The group score is the sum of the best TWO: group 1 (0.9 + 0.9) beats group 0 (1.0 + 0.0 logits 20, -20).
    zt = torch.tensor([[20.0, -20.0, 2.2, 2.2]])
    _, ids, _ = aligned_ops.moe_grouped_routing(zt, None, 1, 2, 1, True, 1.0)
    assert ids[0].tolist() == [2]
    _, ids, _ = aligned_ops.moe_grouped_routing(zt, None, 1, 1, 1, True, 1.0)  # one group: the single best
    assert ids[0].tolist() == [0]


def test_bias_selects_but_weights_are_unbiased():
    z = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    b = torch.tensor([0.0, 0.0, 0.0, 5.0])
    w, ids, s = aligned_ops.moe_grouped_routing(z, b, 2, 1, 1, False, 2.5)
    assert ids[0].tolist() == [3, 0]
    assert_bitwise_equal(w[0], torch.stack([s[0, 3], s[0, 0]]) * torch.tensor(2.5))


def test_minus_inf_and_underflowing_logits():
    ninf = -float("inf")
    z = torch.tensor([
        [ninf, ninf, ninf, ninf],        # every chosen logit -inf: 1/k each, times the scale
        [-100.0, -95.0, ninf, -200.0],   # below -88.72: exp(z) scores, subnormal/zero: the logit form
        [-30.0, -30.5, 0.0, ninf],       # a normal row, one -inf (score exactly 0)
    ])
    w, ids, s = aligned_ops.moe_grouped_routing(z, None, 2, 2, 1, True, 2.5)
    assert s[0].tolist() == [0.0] * 4 and s[2, 3].item() == 0.0
    assert ids[0].tolist() == [0, 1] and w[0].tolist() == [1.25, 1.25]
    assert ids[1].tolist() == [1, 0]
    ref = torch.softmax(torch.tensor([-95.0, -100.0], dtype=torch.float64), -1) * 2.5
    torch.testing.assert_close(w[1].double(), ref, rtol=1e-6, atol=0)
    assert torch.isfinite(w).all()
    # Saturated on the other side: +inf logits give score 1.
    w, ids, s = aligned_ops.moe_grouped_routing(torch.tensor([[float("inf"), 0.0]]), None, 1, 1, 1, True, 1.0)
    assert s[0, 0].item() == 1.0 and ids[0].tolist() == [0] and w[0].tolist() == [1.0]


def test_nan_logit_poisons_its_token_only():
    z = 3 * torch.randn(5, 16, generator=_g(3))
    bias = 0.1 * torch.randn(16, generator=_g(4))
    w0, ids0, s0 = aligned_ops.moe_grouped_routing(z, bias, 4, 4, 2, True, 2.5)
    zn = z.clone()
    zn[2, 9] = float("nan")
    w, ids, s = aligned_ops.moe_grouped_routing(zn, bias, 4, 4, 2, True, 2.5)
    assert torch.isnan(s[2]).all() and torch.isnan(w[2]).all()
    assert ids[2].tolist() == [0, 1, 2, 3]  # every key ties: the lower indices (groups 0 and 1 kept)
    keep = [0, 1, 3, 4]
    assert_bitwise_equal(w[keep], w0[keep])
    assert torch.equal(ids[keep], ids0[keep])
    # A NaN bias entry ranks that expert last.
    bn = bias.clone()
    bn[int(ids0[0, 0])] = float("nan")
    _, idsb, _ = aligned_ops.moe_grouped_routing(z[:1], bn, 4, 1, 1, True, 2.5)
    assert int(ids0[0, 0]) not in idsb[0].tolist()


# ---- invariance -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_alone_equals_in_batch(dtype):
    E = 64
    z = (3 * torch.randn(131, E, generator=_g(5))).to(dtype)
    z[7, :32] = 20.0  # saturated rows in the batch too
    bias = 0.05 * torch.randn(E, generator=_g(6))
    w, ids, s = aligned_ops.moe_grouped_routing(z, bias, 6, 8, 3, True, 2.5)
    for t in (0, 7, 64, 130):
        w1, ids1, s1 = aligned_ops.moe_grouped_routing(z[t : t + 1], bias, 6, 8, 3, True, 2.5)
        assert_bitwise_equal(w1[0], w[t])
        assert torch.equal(ids1[0], ids[t])
        assert_bitwise_equal(s1[0], s[t])
    # the rows in another order, a different batch: the same bits per token
    perm = torch.randperm(131, generator=_g(7))
    wp, idsp, _ = aligned_ops.moe_grouped_routing(z[perm], bias, 6, 8, 3, True, 2.5)
    assert_bitwise_equal(wp, w[perm])
    assert torch.equal(idsp, ids[perm])
    # threads
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        w1t, ids1t, _ = aligned_ops.moe_grouped_routing(z, bias, 6, 8, 3, True, 2.5)
    finally:
        torch.set_num_threads(old)
    assert_bitwise_equal(w1t, w)
    assert torch.equal(ids1t, ids)


def test_negative_control_other_renormalisation_order_is_detected():
    """The bit comparison above can fail: the same weights renormalised with the sum in reverse rank order (a
    different tree) differ in some tokens' bits while staying within rounding."""
    z = 3 * torch.randn(512, 64, generator=_g(8))
    w, ids, s = aligned_ops.moe_grouped_routing(z, None, 8, 8, 4, True, 2.5)
    u = s.gather(-1, ids)
    rev = torch.zeros(512)
    for r in reversed(range(8)):
        rev = rev + u[:, r]
    other = (u / rev[:, None]) * torch.tensor(2.5)
    assert not torch.equal(bits(other), bits(w))
    torch.testing.assert_close(other, w, rtol=1e-6, atol=0)


def test_emulated_gpus_run_the_same_bits():
    """The moe family has no GPU kernels: under aligned_ops.emulate it runs the CPU kernels (same bits)."""
    z = 3 * torch.randn(33, 16, generator=_g(9))
    bias = 0.1 * torch.randn(16, generator=_g(10))
    w, ids, s = aligned_ops.moe_grouped_routing(z, bias, 4, 4, 2, True, 2.5)
    for arch in ("sm_90", "gfx942"):
        with aligned_ops.emulate(arch):
            we, idse, se = aligned_ops.moe_grouped_routing(z, bias, 4, 4, 2, True, 2.5)
        assert_bitwise_equal(we, w)
        assert torch.equal(idse, ids)
        assert_bitwise_equal(se, s)


_ISA_SCRIPT = r"""
import hashlib, torch, aligned_ops
torch.set_num_threads(2)
h = hashlib.sha256()
for dt in (torch.float32, torch.bfloat16, torch.float16):
    for E, k, ng, tg, renorm, scale in ((8, 2, 4, 2, True, 2.5), (64, 8, 8, 4, True, 2.827), (24, 6, 1, 1, False, 1.0)):
        g = torch.Generator().manual_seed(E * 10 + k)
        z = (4 * torch.randn(37, E, generator=g)).to(dt)
        z[3, :] = -100.0
        z[4, : E // 2] = 25.0
        b = 0.3 * torch.randn(E, generator=g)
        zl = z.clone().requires_grad_(True)
        w, ids, s = torch.ops.aligned.moe_grouped_routing(zl, b, k, ng, tg, renorm, scale)
        (w * torch.randn(w.shape, generator=g)).sum().add((s * torch.randn(s.shape, generator=g)).sum()).backward()
        for o in (w, ids, s, zl.grad):
            h.update(o.detach().contiguous().view(torch.uint8).numpy().tobytes())
print(h.hexdigest())
"""

ISA_FAMILIES = {"moe_grouped_routing": _ISA_SCRIPT}  # run once per level for the whole run by tests/_isa_matrix.py


@pytest.mark.slow
def test_isa_levels_compute_identical_bits(isa_matrix):
    """generic, AVX2 and AVX-512 builds of the kernel: the same bits (forward and backward)."""
    digests = {isa: isa_matrix.run(isa, "moe_grouped_routing").stdout.strip() for isa in isa_matrix.levels_to_compare()}
    assert all(len(d) == 64 for d in digests.values()), digests
    assert len(set(digests.values())) == 1, digests


# ---- backward ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("renorm", [True, False])
def test_backward_vs_torch_float64(renorm):
    E, k, ng, tg, scale = 16, 4, 4, 2, 2.5
    z = (2 * torch.randn(24, E, generator=_g(11))).requires_grad_(True)
    z.data[5] = torch.linspace(-110.0, -90.0, E)  # the logit form of the weights (renorm)
    bias = (0.2 * torch.randn(E, generator=_g(12))).requires_grad_(True)
    gw = torch.randn(24, k, generator=_g(13))
    gs = torch.randn(24, E, generator=_g(14))
    w, ids, s = aligned_ops.moe_grouped_routing(z, bias, k, ng, tg, renorm, scale)
    ((w * gw).sum() + (s * gs).sum()).backward()
    assert bias.grad is None  # moe.h: the bias only selects; it gets no gradient
    z64 = z.detach().double().requires_grad_(True)
    p = torch.sigmoid(z64)
    zs = z64.gather(-1, ids)
    if renorm:  # the ratios, written without underflow: softmax of log sigmoid over the chosen experts
        u = torch.softmax(torch.nn.functional.logsigmoid(zs), -1)
    else:
        u = p.gather(-1, ids)
    ((u * scale * gw.double()).sum() + (p * gs.double()).sum()).backward()
    # (gu_r - dot) cancels: fp32 rounding of terms of size |scale * gw| ~ 10 gives absolute errors of ~1e-6
    torch.testing.assert_close(z.grad.double(), z64.grad, rtol=2e-5, atol=1e-5)


def test_backward_without_score_gradient_and_bf16():
    z = (2 * torch.randn(9, 8, generator=_g(15))).bfloat16().requires_grad_(True)
    w, ids, _ = aligned_ops.moe_grouped_routing(z, None, 2, 4, 2, True, 2.5)
    w.sum().backward()  # renormalised weights sum to the scale: the gradient is ~0 but defined
    assert z.grad.dtype == torch.bfloat16 and torch.isfinite(z.grad.float()).all()
    with pytest.raises(RuntimeError, match="moe_grouped_routing_backward"):
        g = torch.ones(9, 2, requires_grad=True)
        dz = ops.moe_grouped_routing_backward(g, None, z.detach().float().requires_grad_(True), ids, True, 2.5)
        dz.sum().backward()


# ---- torch integration and errors ----------------------------------------------------------------------------


def test_opcheck_and_compile():
    T, E = 6, 8
    z = torch.randn(T, E, generator=_g(16), requires_grad=True)
    b = torch.randn(E, generator=_g(17))
    torch.library.opcheck(ops.moe_grouped_routing.default, (z, b, 2, 4, 2, True, 2.5))
    torch.library.opcheck(ops.moe_grouped_routing.default, (z.detach(), None, 3, 1, 1, False, 1.0))
    _, ids, _ = aligned_ops.moe_grouped_routing(z.detach(), b, 2, 4, 2)
    torch.library.opcheck(ops.moe_grouped_routing_backward.default,
                          (torch.randn(T, 2), torch.randn(T, E), z.detach(), ids, True, 2.5))

    def f(z, b):
        w, ids, s = aligned_ops.moe_grouped_routing(z, b, 2, 4, 2, True, 2.5)
        return w * 3.0, ids, s

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    for got, want in zip(cf(z.detach(), b), f(z.detach(), b)):
        assert_bitwise_equal(got, want)


def test_bad_inputs_name_op_and_argument():
    z = torch.randn(4, 8)
    b = torch.zeros(8)
    op = "aligned::moe_grouped_routing: "
    with pytest.raises(RuntimeError, match=op + "n_group must divide the number of experts 8"):
        ops.moe_grouped_routing(z, b, 2, 3, 1, True, 1.0)
    with pytest.raises(RuntimeError, match=op + "topk_group must be in \\[1, n_group = 4\\], got 5"):
        ops.moe_grouped_routing(z, b, 2, 4, 5, True, 1.0)
    with pytest.raises(RuntimeError, match=op + "top_k must be in \\[1, 4\\] \\(the experts in the kept groups"):
        ops.moe_grouped_routing(z, b, 5, 4, 2, True, 1.0)
    with pytest.raises(RuntimeError, match=op + "top_k must be in"):
        ops.moe_grouped_routing(z, b, 0, 4, 2, True, 1.0)
    with pytest.raises(RuntimeError, match=op + "correction_bias must be float32"):
        ops.moe_grouped_routing(z, b.bfloat16(), 2, 4, 2, True, 1.0)
    with pytest.raises(RuntimeError, match=op + "correction_bias must be \\[8\\] \\(one per expert\\)"):
        ops.moe_grouped_routing(z, torch.zeros(7), 2, 4, 2, True, 1.0)
    with pytest.raises(RuntimeError, match=op + "router_logits must be 2-D"):
        ops.moe_grouped_routing(z[0], b, 2, 4, 2, True, 1.0)
    # the factor is applied in fp32: what fp32 holds only as inf or 0 (or not > 0) is refused, forward and backward
    for bad in (float("inf"), float("nan"), 1e39, 3.5e38, 1e-50, 1e-40, 0.0, -2.5):
        with pytest.raises(RuntimeError, match=op + "routed_scaling_factor must be > 0 and a normal float32 value"):
            ops.moe_grouped_routing(z, b, 2, 4, 2, True, bad)
        with pytest.raises(RuntimeError, match="aligned::moe_grouped_routing_backward: routed_scaling_factor must be"):
            ops.moe_grouped_routing_backward(torch.ones(4, 2), None, z, torch.zeros(4, 2, dtype=torch.long), True, bad)
    ops.moe_grouped_routing(z, b, 2, 4, 2, True, 3e38)  # the largest kind that fp32 holds: accepted
    with pytest.raises(RuntimeError, match="aligned::moe_grouped_routing_backward: topk_ids must lie in \\[0, 8\\)"):
        ops.moe_grouped_routing_backward(torch.ones(4, 2), None, z, torch.full((4, 2), 8), True, 1.0)
    # Positive control: the same call with valid arguments runs.
    ops.moe_grouped_routing(z, b, 4, 4, 2, True, 1.0)
