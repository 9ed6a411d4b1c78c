"""The runner's task: prompts "a+b=" whose answer is the digits of a+b followed by eos, as token ids.

A batch is a pure function of (seed, batch index): any rollout worker can generate batch b, and a run resumed
after a kill regenerates exactly the prompts it had not consumed (nothing lost, nothing counted twice).
"""

from __future__ import annotations

DIGITS = "0123456789"


class AdditionTask:
    """Prompts "a+b=" (a < a_range, b < b_range), answers the digits of a+b followed by eos, as token ids.

    ``a_range`` sets how many distinct prompts there are (a_range * b_range). With few distinct prompts a MoE
    model's few near-tie routing contexts recur from step to step, so a run's kernel-made flips are a handful
    of repeated draws instead of many independent ones (README "The MoE demo")."""

    def __init__(self, tokenizer, a_range: int = 100, b_range: int = 10):
        if a_range < 1 or b_range < 1:
            raise ValueError(f"AdditionTask: a_range and b_range must be >= 1, got {a_range}, {b_range}")
        self.a_range, self.b_range = a_range, b_range
        self.max_answer_tokens = len(str(a_range + b_range - 2)) + 1  # the largest sum's digits and eos
        self.eos = tokenizer.eos_token_id
        ids = {c: tokenizer.convert_tokens_to_ids(c) for c in DIGITS + "+="}
        if any(v is None or v == tokenizer.unk_token_id for v in ids.values()):
            raise ValueError("AdditionTask: the tokenizer needs single-character tokens for digits, '+' and '='")
        self.ids = ids

    def sample(self, gen, n: int) -> list[tuple[list[int], list[int]]]:
        import torch

        a = torch.randint(0, self.a_range, (n,), generator=gen).tolist()
        b = torch.randint(0, self.b_range, (n,), generator=gen).tolist()
        return [self._pair(x, y) for x, y in zip(a, b)]

    def batch(self, seed: int, index: int, prompts: int, samples: int) -> tuple[list[list[int]], list[list[int]]]:
        """Batch ``index`` of a run seeded ``seed``: ``prompts`` draws, each repeated ``samples`` times
        (consecutive: one GRPO group), as (prompt ids, answer ids) lists of length prompts * samples. Each
        (seed, index) has its own random stream (numpy's SeedSequence), not a shared generator's next draws."""
        import numpy as np

        rng = np.random.default_rng([seed, index])
        a = rng.integers(0, self.a_range, prompts).tolist()
        b = rng.integers(0, self.b_range, prompts).tolist()
        drawn = [self._pair(x, y) for x, y in zip(a, b)]
        return ([p for p, _ in drawn for _ in range(samples)], [a for _, a in drawn for _ in range(samples)])

    def _pair(self, x: int, y: int) -> tuple[list[int], list[int]]:
        return [self.ids[c] for c in f"{x}+{y}="], [self.ids[c] for c in str(x + y)] + [self.eos]

    @staticmethod
    def reward(completion: list[int], answer: list[int], kind: str = "exact") -> float:
        """``exact``: 1 if the completion starts with the answer (digits and eos), else 0. ``digits``: the fraction
        of the answer's tokens (digits, then eos) that the completion has at the same position — partial credit,
        a denser signal for a small model."""
        try:
            score = REWARD_KINDS[kind]
        except KeyError:
            raise ValueError(f"AdditionTask.reward: kind must be one of {', '.join(REWARD_KINDS)}, got {kind!r}") from None
        return score(list(completion), answer)


def _exact_match(completion: list[int], answer: list[int]) -> float:
    return 1.0 if completion[: len(answer)] == answer else 0.0


def _digit_credit(completion: list[int], answer: list[int]) -> float:
    return sum(1 for c, a in zip(completion, answer) if c == a) / len(answer)


# the reward kinds (--reward); a table, not string comparisons: "exact" is also a linear profile's name
REWARD_KINDS = {"exact": _exact_match, "digits": _digit_credit}
