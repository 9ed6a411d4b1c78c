import math

import pytest
import torch

from aligned_ops.testing import assert_bitwise_equal, bitwise_equal
from aligned_ops.rl import (
    broadcast_to_tokens,
    group_mean_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)

# Group 5 = rewards [1, 2, 6] (interleaved with a singleton group 1), so group ids need not be contiguous.
REWARDS = torch.tensor([1.0, 7.0, 2.0, 6.0])
GROUP_IDS = torch.tensor([5, 1, 5, 5])


def test_group_mean():
    torch.testing.assert_close(group_mean_advantages(REWARDS, GROUP_IDS), torch.tensor([-2.0, 0.0, -1.0, 3.0]))
    torch.testing.assert_close(
        group_mean_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), group_size=2), torch.tensor([-0.5, 0.5, -1.5, 1.5])
    )


def test_rloo_leave_one_out_and_singleton_zero():
    # group [1, 2, 6], sum 9: 1 − 8/2, 2 − 7/2, 6 − 3/2; the singleton gets 0 by definition
    torch.testing.assert_close(rloo_advantages(REWARDS, GROUP_IDS), torch.tensor([-3.0, 0.0, -1.5, 4.5]))
    torch.testing.assert_close(rloo_advantages(torch.tensor([3.0, 4.0]), group_size=1), torch.zeros(2))


def test_grpo_unbiased_std_and_dr_grpo():
    std = math.sqrt((4 + 1 + 9) / 2)  # unbiased std of [1, 2, 6]
    eps = 1e-6
    expected = torch.tensor([-2.0 / (std + eps), 0.0, -1.0 / (std + eps), 3.0 / (std + eps)])
    torch.testing.assert_close(grpo_advantages(REWARDS, GROUP_IDS), expected)
    torch.testing.assert_close(
        grpo_advantages(REWARDS, GROUP_IDS, scale_by_std=False), torch.tensor([-2.0, 0.0, -1.0, 3.0])
    )


def test_grpo_constant_and_singleton_groups_are_zero_not_nan():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 0.5]), torch.tensor([0, 0, 0, 1]))
    assert bitwise_equal(adv, torch.zeros(4))


def test_reinforce_pp_token_whitening_hand_values():
    rewards = torch.tensor([1.0, 0.0, 5.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])  # last sequence has no valid token
    # token values [1, 1, 1, 0, 0]: mean 0.6, unbiased var (3·0.16 + 2·0.36)/4 = 0.3
    scale = 1 / math.sqrt(0.3 + 1e-8)
    adv = reinforce_pp_advantages(rewards, mask)
    torch.testing.assert_close(adv, torch.tensor([0.4 * scale, -0.6 * scale, 0.0]))
    per_token = reinforce_pp_advantages(broadcast_to_tokens(rewards, mask), mask)
    torch.testing.assert_close(per_token, broadcast_to_tokens(adv, mask))
    valid = per_token[mask.bool()]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert valid.var().item() == pytest.approx(1.0, rel=1e-6)


def test_reinforce_pp_with_group_mean_baseline():
    rewards = torch.tensor([1.0, 0.0, 2.0, 3.0])
    # after the baseline: [0.5, −0.5, −0.5, 0.5]; 8 tokens, mean 0, unbiased var 8·0.25/7
    scale = 1 / math.sqrt(2.0 / 7 + 1e-8)
    adv = reinforce_pp_advantages(rewards, torch.ones(4, 2), group_size=2, baseline="group_mean")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5]) * scale)
    with pytest.raises(ValueError, match="per-sequence"):
        reinforce_pp_advantages(torch.ones(4, 2), torch.ones(4, 2), group_size=2, baseline="group_mean")
    with pytest.raises(ValueError, match="baseline"):
        reinforce_pp_advantages(rewards, torch.ones(4, 2), baseline="rloo")


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0], dtype=torch.bfloat16), torch.tensor([[1, 0], [1, 1]]))
    assert out.dtype == torch.float32
    assert bitwise_equal(out, torch.tensor([[2.0, 0.0], [-1.0, -1.0]]))
    with pytest.raises(ValueError):
        broadcast_to_tokens(torch.ones(3), torch.ones(2, 2))


@pytest.mark.parametrize("fn", [group_mean_advantages, rloo_advantages, grpo_advantages])
def test_group_argument_validation(fn):
    with pytest.raises(ValueError, match="exactly one"):
        fn(REWARDS)
    with pytest.raises(ValueError, match="exactly one"):
        fn(REWARDS, GROUP_IDS, group_size=2)
    with pytest.raises(ValueError, match="divide"):
        fn(REWARDS, group_size=3)
    with pytest.raises(ValueError, match="group_ids shape"):
        fn(REWARDS, GROUP_IDS[:2])
    with pytest.raises(ValueError, match=r"\[B\]"):
        fn(REWARDS[None], group_size=1)


def test_group_sums_add_in_batch_order_from_zero():
    # The order is written down (rl._group_sum): each group's members added from 0 in batch order, on every device
    # (index_add_, which it replaced, adds with atomics on a GPU). Checked against that left fold, bit for bit, with
    # groups interleaved by ids; control: the reverse order gives other bits for these rewards.
    from aligned_ops.rl import _group_sum

    g = torch.Generator().manual_seed(7)
    r = torch.rand(40, generator=g) * 3 - 1
    ids = torch.randint(0, 6, (40,), generator=g)
    index = torch.unique(ids, return_inverse=True)[1]
    want, backwards = torch.zeros(40), torch.zeros(40)
    for i in range(40):
        acc, rev = torch.zeros(()), torch.zeros(())
        members = [j for j in range(40) if index[j] == index[i]]
        for j in members:
            acc = acc + r[j]
        for j in reversed(members):
            rev = rev + r[j]
        want[i], backwards[i] = acc, rev
    got = _group_sum(r, index, int(index.max()) + 1)
    assert_bitwise_equal(got, want)
    assert not bitwise_equal(backwards, want)


def test_group_advantages_compile_fullgraph_with_group_size():
    # review 133: the group-id grid (a host sync for the largest group) broke torch.compile(fullgraph=True) of
    # grpo_advantages(group_size=...); consecutive groups are the values' own [G, size] grid
    from aligned_ops.rl import grpo_advantages

    r = torch.rand(16, generator=torch.Generator().manual_seed(8))
    want = grpo_advantages(r, group_size=4)
    got = torch.compile(lambda x: grpo_advantages(x, group_size=4), fullgraph=True)(r)
    assert_bitwise_equal(got, want)
