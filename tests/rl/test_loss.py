import math

import pytest
import torch

from aligned_ops.rl import AGGREGATIONS, LOG_RATIO_GUARD, LOSS_MODES, policy_loss, reinforce_zero_loss
from aligned_ops.testing import assert_bitwise_equal, bitwise_equal

LN2 = math.log(2.0)


def small_batch():
    """Two sequences; token ratios w = exp(ℓθ − ℓμ) = [[1, 2], [0.5, pad]], advantages [1, −2].

    The padding position holds NaN / −inf to check that it never leaks into loss or gradient.
    """
    lp = torch.tensor([[-1.0, -2.0], [-3.0, float("nan")]], requires_grad=True)
    mu = torch.tensor([[-1.0, -2.0 - LN2], [-3.0 + LN2, -float("inf")]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    return lp, mu, adv, mask


# Per-token −A·w·ℓθ = [[1, 4], [−3]]; d/dℓθ = −A·w = [[−1, −2], [1]].
@pytest.mark.parametrize(
    "agg, loss, grad",
    [
        ("token-mean", 2.0 / 3, [[-1 / 3, -2 / 3], [1 / 3, 0.0]]),
        ("seq-mean-token-sum", (5.0 - 3.0) / 2, [[-0.5, -1.0], [0.5, 0.0]]),
        ("seq-mean-token-mean", (5.0 / 2 - 3.0) / 2, [[-0.25, -0.5], [0.5, 0.0]]),
    ],
)
def test_reinforce_zero_hand_values(agg, loss, grad):
    lp, mu, adv, mask = small_batch()
    value, metrics = reinforce_zero_loss(lp, mu, adv, mask, agg=agg)
    (g,) = torch.autograd.grad(value, lp)
    assert value.dtype == torch.float32
    assert value.item() == pytest.approx(loss, rel=1e-6)
    torch.testing.assert_close(g, torch.tensor(grad), rtol=1e-6, atol=1e-7)
    assert metrics["loss"] == pytest.approx(loss, rel=1e-6)
    assert metrics["num_tokens"] == 3.0 and metrics["num_seqs"] == 2.0
    assert metrics["ratio_mean"] == pytest.approx(3.5 / 3, rel=1e-6)
    assert metrics["ratio_min"] == pytest.approx(0.5, rel=1e-6)
    assert metrics["ratio_max"] == pytest.approx(2.0, rel=1e-6)
    assert metrics["frac_truncated"] == metrics["frac_masked"] == metrics["clip_frac"] == 0.0
    assert all(type(v) is float for v in metrics.values())


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_reinforce_zero_gradient_matches_plain_formula(agg):
    """∇ agg(−A·sg(w)·ℓθ) equals autograd of agg(−A·exp(ℓθ − ℓμ)) written out by hand."""
    gen = torch.Generator().manual_seed(0)
    lp = (-torch.rand(4, 7, generator=gen) * 3).requires_grad_()
    mu = lp.detach() + 0.3 * torch.randn(4, 7, generator=gen)
    adv = torch.randn(4, generator=gen)
    mask = torch.rand(4, 7, generator=gen) > 0.3
    mask[3] = False  # an empty sequence
    value, _ = reinforce_zero_loss(lp, mu, adv, mask, agg=agg)
    (g,) = torch.autograd.grad(value, lp)

    lp_ref = lp.detach().clone().requires_grad_()
    per_token = -adv[:, None] * torch.exp(lp_ref - mu) * mask
    n_b = mask.sum(-1)
    if agg == "token-mean":
        ref = per_token.sum() / mask.sum()
    elif agg == "seq-mean-token-sum":
        ref = per_token.sum(-1).sum() / (n_b > 0).sum()
    else:
        ref = (per_token.sum(-1) / n_b.clamp(min=1)).sum() / (n_b > 0).sum()
    (g_ref,) = torch.autograd.grad(ref, lp_ref)
    torch.testing.assert_close(g, g_ref)
    assert value.item() != pytest.approx(ref.item())  # values differ (ℓθ vs 1 factor); only gradients agree


def test_on_policy_gradient_is_plain_reinforce():
    """Bitwise-equal log-probs give w = 1 exactly, so the gradient is exactly −A / N."""
    lp = torch.tensor([[-0.7, -1.3, -0.2]], requires_grad=True)
    adv = torch.tensor([0.75])
    value, metrics = reinforce_zero_loss(lp, lp.detach(), adv, torch.ones(1, 3))
    (g,) = torch.autograd.grad(value, lp)
    assert bitwise_equal(g, torch.full((1, 3), -0.25))
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1.0


def test_tis_truncates_at_c():
    lp, mu, adv, mask = small_batch()
    value, metrics = policy_loss(lp, mu, adv, mask, mode="tis", clip_c=1.5)
    (g,) = torch.autograd.grad(value, lp)
    # weights [[1, 1.5], [0.5]]; per-token [[1, 3], [−3]]
    assert value.item() == pytest.approx(1.0 / 3, rel=1e-6)
    torch.testing.assert_close(g, torch.tensor([[-1 / 3, -0.5], [1 / 3, 0.0]]))
    assert metrics["frac_truncated"] == pytest.approx(1 / 3)
    assert metrics["weight_mean"] == pytest.approx(3.0 / 3, rel=1e-6)


@pytest.mark.parametrize("mode", ["mis", "icepop"])
def test_mis_masks_tokens_outside_band(mode):
    lp, mu, adv, mask = small_batch()
    value, metrics = policy_loss(lp, mu, adv, mask, mode=mode, mask_lo=0.75, mask_hi=1.5)
    (g,) = torch.autograd.grad(value, lp)
    # only the ratio-1 token survives; masked tokens stay in the denominator
    assert value.item() == pytest.approx(1.0 / 3, rel=1e-6)
    torch.testing.assert_close(g, torch.tensor([[-1 / 3, 0.0], [0.0, 0.0]]))
    assert metrics["frac_masked"] == pytest.approx(2 / 3)


def test_seq_tis_product_and_geometric():
    lp, mu, adv, mask = small_batch()
    # sequence log-ratios: seq0 = ln2 (product 2, geometric √2), seq1 = −ln2 (0.5 both)
    value, metrics = policy_loss(lp, mu, adv, mask, mode="seq_tis", clip_c=1.5, seq_ratio="product")
    (g,) = torch.autograd.grad(value, lp)
    assert value.item() == pytest.approx((1.5 * 1 + 1.5 * 2 - 3) / 3, rel=1e-6)
    torch.testing.assert_close(g, torch.tensor([[-0.5, -0.5], [1 / 3, 0.0]]))
    assert metrics["frac_truncated"] == pytest.approx(2 / 3)

    value, metrics = policy_loss(lp, mu, adv, mask, mode="seq_tis", clip_c=1.5, seq_ratio="geometric")
    assert value.item() == pytest.approx((math.sqrt(2) * 3 - 3) / 3, rel=1e-6)
    assert metrics["frac_truncated"] == 0.0


def test_seq_mis_masks_whole_sequences():
    lp, mu, adv, mask = small_batch()
    value, metrics = policy_loss(lp, mu, adv, mask, mode="seq_mis", mask_lo=0.75, mask_hi=5.0)
    (g,) = torch.autograd.grad(value, lp)
    # seq0 kept with weight 2: per-token [2, 4]; seq1 (ratio 0.5) dropped
    assert value.item() == pytest.approx(6.0 / 3, rel=1e-6)
    torch.testing.assert_close(g, torch.tensor([[-2 / 3, -2 / 3], [0.0, 0.0]]))
    assert metrics["frac_masked"] == pytest.approx(1 / 3)


def test_ppo_clip_decoupled_hand_values():
    # r = exp(ℓθ − ℓprox) = [e^.5, 1.1, e^.5, .5], A = [1, 1, −1, −1], w = exp(ℓprox − ℓμ) = [1, 2, 3→2, 1]
    prox = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    lp = (prox + torch.tensor([[0.5, math.log(1.1), 0.5, -LN2]])).requires_grad_()
    mu = prox - torch.tensor([[0.0, LN2, math.log(3.0), 0.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    value, metrics = policy_loss(
        lp, mu, adv, torch.ones(1, 4), mode="ppo_clip", proximal_logprobs=prox, eps_clip=0.2, clip_c=2.0
    )
    (g,) = torch.autograd.grad(value, lp)
    e = math.exp(0.5)
    # token 0: clipped (1.2·A), token 1: 1.1·A, token 2: min(−e, −1.2) = −e unclipped, token 3: clipped −0.8
    expected = -(1 * 1.2 + 2 * 1.1 + 2 * -e + 1 * -0.8) / 4
    assert value.item() == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(g, torch.tensor([[0.0, -2 * 1.1 / 4, 2 * e / 4, 0.0]]))
    assert metrics["clip_frac"] == pytest.approx(0.5)
    assert metrics["frac_truncated"] == pytest.approx(0.25)
    assert metrics["surrogate"] == metrics["loss"]


def test_ppo_clip_untruncated_weight():
    prox = torch.tensor([[-1.0]])
    mu = prox - math.log(3.0)
    lp = prox.clone().requires_grad_()
    value, _ = policy_loss(lp, mu, torch.tensor([1.0]), torch.ones(1, 1), mode="ppo_clip",
                           proximal_logprobs=prox, clip_c=None)
    assert value.item() == pytest.approx(-3.0, rel=1e-6)


@pytest.mark.parametrize("mode", LOSS_MODES)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_empty_mask_gives_zero_loss_and_zero_grad(mode, agg):
    lp = torch.tensor([[float("nan"), -float("inf")], [-1.0, -2.0]], requires_grad=True)
    mu = torch.tensor([[-float("inf"), float("nan")], [-1.5, -2.0]])
    value, metrics = policy_loss(lp, mu, torch.tensor([1.0, 2.0]), torch.zeros(2, 2, dtype=torch.bool),
                                 mode=mode, agg=agg, proximal_logprobs=mu)
    (g,) = torch.autograd.grad(value, lp)
    assert value.item() == 0.0
    assert_bitwise_equal(g, torch.zeros(2, 2))  # +0 everywhere, not -0 or NaN
    assert metrics["num_tokens"] == 0.0
    assert not any(math.isnan(v) for v in metrics.values())


@pytest.mark.parametrize("mode", LOSS_MODES)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_bf16_inputs_computed_in_fp32(mode, agg):
    gen = torch.Generator().manual_seed(1)
    lp = (-torch.rand(3, 5, generator=gen) * 2).bfloat16().requires_grad_()
    mu = (lp.detach().float() + 0.2 * torch.randn(3, 5, generator=gen)).bfloat16()
    adv = torch.randn(3, generator=gen).bfloat16()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]).float()
    kwargs = dict(mode=mode, agg=agg, proximal_logprobs=(mu.float() + 0.1).bfloat16())
    value, _ = policy_loss(lp, mu, adv, mask, **kwargs)
    (g,) = torch.autograd.grad(value, lp)
    assert value.dtype == torch.float32 and g.dtype == torch.bfloat16
    # widening bf16 → fp32 is exact, so fp32 inputs with the same values give the same loss bit for bit
    kwargs["proximal_logprobs"] = kwargs["proximal_logprobs"].float()
    value32, _ = policy_loss(lp.detach().float(), mu.float(), adv.float(), mask, **kwargs)
    assert_bitwise_equal(value, value32)


@pytest.mark.parametrize("mode", LOSS_MODES)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_data_parallel_global_counts_sum_to_full_batch(mode, agg):
    gen = torch.Generator().manual_seed(2)
    lp = (-torch.rand(6, 5, generator=gen) * 2).requires_grad_()
    mu = lp.detach() + 0.3 * torch.randn(6, 5, generator=gen)
    prox = lp.detach() + 0.1 * torch.randn(6, 5, generator=gen)
    adv = torch.randn(6, generator=gen)
    mask = torch.rand(6, 5, generator=gen) > 0.4
    mask[:, 0] = True
    kw = dict(mode=mode, agg=agg, mask_lo=0.8, mask_hi=1.25, clip_c=1.2)
    full, _ = policy_loss(lp, mu, adv, mask, proximal_logprobs=prox, **kw)
    (g_full,) = torch.autograd.grad(full, lp)

    total = torch.zeros(())
    grads = []
    for rank in (slice(0, 2), slice(2, 6)):  # uneven shards
        shard = lp.detach()[rank].clone().requires_grad_()
        loss, _ = policy_loss(shard, mu[rank], adv[rank], mask[rank], proximal_logprobs=prox[rank],
                              global_num_tokens=int(mask.sum()), global_num_seqs=torch.tensor(6), **kw)
        (g,) = torch.autograd.grad(loss, shard)
        total, grads = total + loss.detach(), grads + [g]
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(torch.cat(grads), g_full)


def test_advantages_per_sequence_or_per_token_agree():
    lp, mu, adv, mask = small_batch()
    a, _ = reinforce_zero_loss(lp, mu, adv, mask)
    b, _ = reinforce_zero_loss(lp, mu, adv[:, None].expand(2, 2), mask)
    assert_bitwise_equal(a, b)


def test_input_validation():
    lp, mu, adv, mask = small_batch()
    with pytest.raises(ValueError, match="rollout_logprobs shape"):
        policy_loss(lp, mu[:, :1], adv, mask)
    with pytest.raises(ValueError, match="mask shape"):
        policy_loss(lp, mu, adv, mask[:1])
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, mu, adv[:1], mask)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        policy_loss(lp[0], mu[0], adv, mask[0])
    with pytest.raises(ValueError, match="mode must be one of"):
        policy_loss(lp, mu, adv, mask, mode="grpo")
    with pytest.raises(ValueError, match="agg must be one of"):
        policy_loss(lp, mu, adv, mask, agg="token-sum")
    with pytest.raises(ValueError, match="seq_ratio"):
        policy_loss(lp, mu, adv, mask, mode="seq_tis", seq_ratio="sum")
    with pytest.raises(ValueError, match="proximal_logprobs"):
        policy_loss(lp, mu, adv, mask, mode="ppo_clip")
    with pytest.raises(ValueError, match="proximal_logprobs shape"):
        policy_loss(lp, mu, adv, mask, mode="ppo_clip", proximal_logprobs=mu[:1])
    with pytest.raises(ValueError, match="clip_c"):
        policy_loss(lp, mu, adv, mask, mode="tis", clip_c=None)
    with pytest.raises(ValueError, match="mask_lo"):
        policy_loss(lp, mu, adv, mask, mode="mis", mask_lo=2.0, mask_hi=1.0)


# ---- issue 8: finite for finite inputs, refused arguments, NaN masks ------------------------------------------

ALL_KW = dict(mask_lo=0.5, mask_hi=5.0, clip_c=2.0)


def overflow_batch():
    """Token (0, 0) has log ratio 94.9 > 88.7 (exp overflows fp32) and advantage exactly 0 (a GRPO group with
    equal rewards); the other tokens are ordinary."""
    lp = torch.tensor([[-0.1, -1.0, -0.5], [-2.0, -0.3, -1.0]], requires_grad=True)
    mu = torch.tensor([[-95.0, -1.2, -0.4], [-2.1, -0.3, -0.9]])
    adv = torch.tensor([[0.0, 0.0, 0.0], [1.0, -0.5, 2.0]])
    return lp, mu, adv, torch.ones(2, 3, dtype=torch.bool)


@pytest.mark.parametrize("mode", LOSS_MODES)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_zero_advantage_with_overflowing_ratio_is_finite(mode, agg):
    # Was: exp(94.9) = inf, inf * 0 = NaN, and the whole step's loss and gradient were NaN.
    lp, mu, adv, mask = overflow_batch()
    kw = dict(ALL_KW, clip_c=None) if mode == "ppo_clip" else ALL_KW
    value, metrics = policy_loss(lp, mu, adv, mask, mode=mode, agg=agg, proximal_logprobs=mu, **kw)
    (g,) = torch.autograd.grad(value, lp)
    assert math.isfinite(value.item()) and torch.isfinite(g).all(), (value, g)
    assert (g[0] == 0).all()  # A = 0: no gradient, exactly
    # the A = 0 row contributes exactly nothing: same loss as the batch with that row masked out
    masked = mask.clone()
    masked[0] = False
    ref, _ = policy_loss(lp.detach(), mu, adv, masked, mode=mode, agg=agg, proximal_logprobs=mu, **kw,
                         global_num_tokens=6 if agg == "token-mean" else None,
                         global_num_seqs=2 if agg != "token-mean" else None)
    assert value.item() == pytest.approx(ref.item(), rel=1e-6, abs=1e-12)
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["surrogate"])


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_huge_ratio_with_nonzero_advantage_is_guarded_not_infinite(mode):
    lp = torch.tensor([[-0.1, -1.0]], requires_grad=True)
    mu = torch.tensor([[-300.0, -1.0]])  # log ratio 299.9: exp is inf in fp32 and fp64 alike
    adv = torch.tensor([[1.0, -1.0]])
    kw = dict(ALL_KW, clip_c=None, mask_hi=1e12) if mode == "ppo_clip" else dict(ALL_KW, mask_hi=1e12)
    value, metrics = policy_loss(lp, mu, adv, torch.ones(1, 2), mode=mode, proximal_logprobs=lp.detach() - 300.0,
                                 **kw)
    (g,) = torch.autograd.grad(value, lp)
    assert math.isfinite(value.item()) and torch.isfinite(g).all()
    if mode in ("reinforce_zero", "mis", "icepop"):
        assert metrics["frac_guarded"] == 0.5
        assert g[0, 0].item() == pytest.approx(-math.exp(LOG_RATIO_GUARD) / 2, rel=1e-6)


def test_guard_leaves_ordinary_ratios_untruncated():
    lp = torch.tensor([[-0.5]], requires_grad=True)
    mu = lp.detach() - 19.0  # ratio e^19, below the guard
    value, metrics = reinforce_zero_loss(lp, mu, torch.tensor([2.0]), torch.ones(1, 1))
    (g,) = torch.autograd.grad(value, lp)
    assert g.item() == pytest.approx(-2.0 * math.exp(19.0), rel=1e-6) and metrics["frac_guarded"] == 0.0


@pytest.mark.parametrize("mode", ["tis", "seq_tis", "ppo_clip"])
@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan")])
def test_non_positive_clip_c_is_refused(mode, bad):
    # Was: a negative C silently flipped the sign of every truncated token's gradient.
    lp, mu, adv, mask = small_batch()
    with pytest.raises(ValueError, match="clip_c must be > 0"):
        policy_loss(lp, mu, adv, mask, mode=mode, clip_c=bad, proximal_logprobs=mu)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("bad", [0, -3, torch.tensor(0), float("nan")])
def test_non_positive_global_counts_are_refused(agg, bad):
    # Was: clamped to 1 without a word (a zero all-reduced count means a bug upstream).
    lp, mu, adv, mask = small_batch()
    with pytest.raises(ValueError, match="global_num_tokens must be a finite count > 0"):
        policy_loss(lp, mu, adv, mask, agg=agg, global_num_tokens=bad)
    with pytest.raises(ValueError, match="global_num_seqs must be a finite count > 0"):
        policy_loss(lp, mu, adv, mask, agg=agg, global_num_seqs=bad)
    with pytest.raises(ValueError, match="eps_clip must be >= 0"):
        policy_loss(lp, mu, adv, mask, mode="ppo_clip", proximal_logprobs=mu, eps_clip=-0.1)


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_nan_in_a_float_mask_is_not_a_valid_token(mode):
    lp, mu, adv, _ = small_batch()
    nan_mask = torch.tensor([[1.0, float("nan")], [1.0, 0.0]])
    zero_mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    a, ma = policy_loss(lp, mu, adv, nan_mask, mode=mode, proximal_logprobs=mu)
    b, mb = policy_loss(lp, mu, adv, zero_mask, mode=mode, proximal_logprobs=mu)
    assert ma["num_tokens"] == mb["num_tokens"] == 2.0
    assert_bitwise_equal(a, b)


# ---- sums in row-local order: a sequence alone, in a batch, at 1 or 2 threads ---------------------------------

LONG = 40_000  # past torch's grain size (32768): torch.sum splits a lone row across threads


def _threads(n, fn):
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_a_long_sequences_seq_ratio_and_loss_do_not_depend_on_the_batch_or_threads(agg):
    # Was (torch.sum): GSPO's sequence log-ratio of a 40,000-token sequence alone at 2 threads was another number than
    # in the batch (2 of 4 rows), so its importance weight and gradient were; the batch loss differed at 1 vs 2 threads.
    g = torch.Generator().manual_seed(5)
    lp = -torch.rand(4, LONG, generator=g) * 3
    mu = lp + torch.randn(4, LONG, generator=g) * 0.05
    adv = torch.randn(4, generator=g)
    mask = torch.ones(4, LONG, dtype=torch.bool)
    mask[1, 30_000:] = False

    def run(rows, threads):
        x = lp[rows].clone().requires_grad_(True)
        loss, _ = _threads(threads, lambda: policy_loss(
            x, mu[rows], adv[rows], mask[rows], mode="seq_tis", clip_c=1e9, agg=agg,
            global_num_tokens=int(mask.sum()), global_num_seqs=4))
        _threads(threads, loss.backward)
        return loss.detach(), x.grad

    loss1, batch1 = run(slice(0, 4), 1)
    loss2, batch2 = run(slice(0, 4), 2)
    assert_bitwise_equal(loss2, loss1)
    assert_bitwise_equal(batch2, batch1)
    for r in range(4):
        assert_bitwise_equal(run(slice(r, r + 1), 2)[1], batch1[r:r + 1])
    # control: the gradient sees the sequence ratio (another rollout log-prob in row 0 moves row 0's gradient only)
    mu[0, 7] += 0.5
    moved = run(slice(0, 4), 2)[1]
    assert not bitwise_equal(moved[0], batch1[0]) and bitwise_equal(moved[1:], batch1[1:])


def test_a_sequences_seq_ratio_does_not_depend_on_the_padding_width():
    # review 133: the first row-local sum's second level was cut into lanes by the number of tiles, so padding the
    # batch to another width (the longest completion of the batch) moved a sequence's GSPO ratio and gradient. The
    # 64-ary tree's tiles start at absolute positions: trailing padding adds exact zeros.
    g = torch.Generator().manual_seed(6)
    n = 1000
    lp = -torch.rand(1, n, generator=g) * 3
    mu = lp + torch.randn(1, n, generator=g) * 0.05
    adv = torch.tensor([0.7])

    def grad_at(width):
        pad = width - n
        x = torch.nn.functional.pad(lp, (0, pad), value=float("nan")).requires_grad_(True)
        m = torch.nn.functional.pad(torch.ones(1, n, dtype=torch.bool), (0, pad))
        loss, _ = policy_loss(x, torch.nn.functional.pad(mu, (0, pad)), adv, m, mode="seq_tis", clip_c=1e9,
                              agg="seq-mean-token-sum")
        loss.backward()
        return loss.detach(), x.grad[:, :n]

    loss0, grad0 = grad_at(n)
    for width in (n + 1, 1024, 1200, 5000, 70_000):
        loss, grad = grad_at(width)
        assert_bitwise_equal(loss, loss0)
        assert_bitwise_equal(grad, grad0)
    # control: the comparison can fail — the two-level row-local sum (lanes cut by the number of tiles) gives the
    # sequence's log-ratio sum other bits at another padding width
    from aligned_ops.ops.moe import row_local_sum

    d = lp - mu
    sums = [row_local_sum(torch.nn.functional.pad(d, (0, w - n))) for w in (1024, 1280, 1536, 5056)]
    assert not all(bitwise_equal(t, sums[0]) for t in sums[1:])
