"""The demo's addition task: ``a_range`` sets the number of distinct prompts (the --moe demo uses 1000 so a
model's few near-tie routing contexts do not recur every step) and the rollout length follows the largest sum."""

import pytest
import torch

from aligned_ops.runner.task import AdditionTask
from aligned_ops.testing.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_answer_length_follows_the_largest_sum(tok):
    assert AdditionTask(tok).max_answer_tokens == 4  # dense default: a < 100, b < 10 -> up to 108: 3 digits + eos
    assert AdditionTask(tok, a_range=1000).max_answer_tokens == 5  # up to 1008
    assert AdditionTask(tok, a_range=991).max_answer_tokens == 4  # 990 + 9 = 999
    for a_range in (1, 100, 991, 1000):
        task = AdditionTask(tok, a_range=a_range)
        batch = task.sample(torch.Generator().manual_seed(0), 512)
        assert max(len(ans) for _, ans in batch) <= task.max_answer_tokens
        assert all(ans[-1] == task.eos for _, ans in batch)
    # the largest sum is reached: the bound is tight, not just safe
    big = AdditionTask(tok, a_range=1000).sample(torch.Generator().manual_seed(0), 20000)
    assert max(len(ans) for _, ans in big) == 5


def test_a_range_sets_how_many_prompts_recur(tok):
    draws = 40 * 32  # the --moe demo's logged prompts
    distinct = {r: len({tuple(p) for p, _ in AdditionTask(tok, a_range=r).sample(torch.Generator().manual_seed(0), draws)})
                for r in (100, 1000)}
    assert distinct[100] < 0.7 * draws  # 1000 prompts: ~720 distinct in 1280 draws, the rest recur
    assert distinct[1000] > 0.9 * draws  # 10000 prompts: nearly every prompt is new


def test_bad_range_is_refused(tok):
    with pytest.raises(ValueError, match="AdditionTask: a_range and b_range must be >= 1, got 0, 10"):
        AdditionTask(tok, a_range=0)


def test_rewards_exact_match_and_digit_credit():
    answer = [5, 7, 9]  # two digit tokens, then eos
    assert AdditionTask.reward([5, 7, 9, 3], answer, "exact") == 1.0  # what follows the answer is not scored
    assert AdditionTask.reward([5, 7, 3], answer, "exact") == 0.0  # negative control: one token off
    assert AdditionTask.reward([5, 7, 3], answer, "digits") == pytest.approx(2 / 3)
    assert AdditionTask.reward([4, 7], answer, "digits") == pytest.approx(1 / 3)  # short completion
    with pytest.raises(ValueError, match="AdditionTask.reward: kind must be one of exact, digits, got 'fma'"):
        AdditionTask.reward([5], answer, "fma")
