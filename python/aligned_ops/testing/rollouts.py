"""Helpers of the rollout-vs-trainer tests: random prompts, padded batches, teacher forcing, bitwise checks.

Every real-vLLM end-to-end test asks the same question — does the trainer, scoring the engine's rollouts in
ONE padded batch, give the engine's log-probs bit for bit? — so the batch builder, the teacher-forced scoring
and the bitwise assertion live here once (the trainer-side tests use the same batch builder for their
padding/packing checks).
"""

from __future__ import annotations

import contextlib
import gc

import torch

from .bits import bits


def random_prompts(lengths, seed: int = 0, vocab: int = 500) -> list[list[int]]:
    """One random token-id list per length (a fixed generator: the same prompts every run)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def random_sequences(lengths, seed: int = 0, vocab: int = 500) -> list[torch.Tensor]:
    """:func:`random_prompts` as int64 tensors (the trainer-side tests' sequences)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def padded_batch(sequences, completion_starts, width: int | None = None, left: bool = False):
    """``(input_ids, attention_mask, completion_mask, offsets)`` int64 ``[B, width]`` tensors.

    Row ``b`` holds ``sequences[b]`` (a list or tensor of ids; ``None`` = an all-padding row) at column
    ``offsets[b]`` (0, or right-aligned with ``left=True``); ``completion_mask`` marks the tokens from
    ``completion_starts[b]`` (an index into the sequence) to its end. ``width`` defaults to the longest
    sequence; padding ids are 0.
    """
    lens = [0 if s is None else len(s) for s in sequences]
    width = max(lens, default=0) if width is None else width
    if width < max(lens, default=0):
        raise ValueError(f"padded_batch: width {width} is shorter than the longest sequence ({max(lens)})")
    ids = torch.zeros(len(lens), width, dtype=torch.long)
    am, cm = torch.zeros_like(ids), torch.zeros_like(ids)
    offsets = []
    for i, (s, st, n) in enumerate(zip(sequences, completion_starts, lens)):
        off = width - n if left else 0
        offsets.append(off)
        if s is None:
            continue
        ids[i, off : off + n] = torch.as_tensor(s, dtype=torch.long)
        am[i, off : off + n] = 1
        cm[i, off + st : off + n] = 1
    return ids, am, cm, offsets


def teacher_forced(trainer, rollouts, return_routing: bool = False, **sampling):
    """The patched trainer's log-probs of every rollout's sampled tokens, computed in ONE right-padded batch
    (so trainer batching is exercised too): a list of fp32 tensors, one per rollout.

    ``rollouts``: objects with ``prompt_token_ids`` and ``token_ids`` (``rollout.Rollout``); ``sampling``:
    ``temperature``, ``top_k``, ``top_p``, ``min_p`` as ``hf.completion_logprobs`` takes them. With
    ``return_routing`` (MoE) also each sequence's chosen experts ``[len, layers, k]``.
    """
    seqs = [list(r.prompt_token_ids) + list(r.token_ids) for r in rollouts]
    starts = [len(r.prompt_token_ids) for r in rollouts]
    ids, am, cm, _ = padded_batch(seqs, starts)
    with torch.no_grad():
        if return_routing:
            out = trainer(ids, attention_mask=am, completion_mask=cm, return_logits=False, return_routing=True,
                          return_dict=True, **sampling)
            lp = out.logprobs
        else:
            from ..integrations.hf import completion_logprobs

            lp = completion_logprobs(trainer, ids, cm, attention_mask=am, **sampling)
    lps = [lp[i, st : st + len(r.token_ids)] for i, (st, r) in enumerate(zip(starts, rollouts))]
    if return_routing:
        return lps, [out.routed_experts[i, : len(s)] for i, s in enumerate(seqs)]
    return lps


def assert_rollouts_bitwise(rollouts, trainer_logprobs, who: str = "trainer") -> None:
    """Every rollout sampled at least one token and its engine log-probs equal ``trainer_logprobs`` bit for bit
    (integer views); the message names the prompt length, how many tokens differ and by how much."""
    rollouts, trainer_logprobs = list(rollouts), list(trainer_logprobs)
    assert len(rollouts) == len(trainer_logprobs), f"{who}: {len(rollouts)} rollouts, {len(trainer_logprobs)} scores"
    for r, lp in zip(rollouts, trainer_logprobs):
        v = r.logprobs_tensor()
        assert len(r.token_ids) > 0, f"{who}: a rollout of prompt length {len(r.prompt_token_ids)} sampled nothing"
        assert v.shape == lp.shape and v.dtype == lp.dtype, f"{who}: {v.shape}/{v.dtype} vs {lp.shape}/{lp.dtype}"
        differ = bits(v) != bits(lp)
        assert not bool(differ.any()), (
            f"{who}, prompt len {len(r.prompt_token_ids)}: {int(differ.sum())}/{v.numel()} differ, "
            f"max |diff| {(v - lp).abs().max().item():.3g}"
        )


# ---- engine parameters of the end-to-end tests: a dtype and a linear profile -----------------------------------
# "bfloat16" / "float32" run the process's profile (ALIGNED_OPS_LINEAR, fma when unset); "bfloat16-mma" runs the
# mma profile (bf16 only) on both sides — skipped on a CPU without its unit (aligned_ops.mma_unit()).
E2E_ENGINE_PARAMS = ("bfloat16", "float32", "bfloat16-mma")


def engine_param(param: str) -> tuple[str, str | None]:
    """``(dtype, profile)`` of an end-to-end engine parameter (profile None: the process's)."""
    dtype, _, profile = param.partition("-")
    return dtype, (profile or None)


class linear_profile_env:
    """``with linear_profile_env("mma"):`` sets ``ALIGNED_OPS_LINEAR`` for the block (the trainer patch and the
    engine config made inside it resolve it, once; mp workers and FSDP2 ranks started inside it inherit it),
    restoring it after; ``None`` leaves it alone. Skips (pytest) a profile this machine cannot run."""

    def __init__(self, profile: str | None):
        self.profile = profile
        self._old = None

    def __enter__(self):
        import os

        if self.profile is None:
            return self
        from .. import profiles

        bad = profiles.get(self.profile).model_refusals("bfloat16")  # the e2e profiles' engines run bf16
        if bad:
            import pytest

            pytest.skip(f"the {self.profile} profile cannot run here: " + "; ".join(bad))
        self._old = os.environ.get("ALIGNED_OPS_LINEAR")
        os.environ["ALIGNED_OPS_LINEAR"] = self.profile
        return self

    def __exit__(self, *exc):
        import os

        if self.profile is not None:
            if self._old is None:
                os.environ.pop("ALIGNED_OPS_LINEAR", None)
            else:
                os.environ["ALIGNED_OPS_LINEAR"] = self._old
        return False


@contextlib.contextmanager
def engine_and_trainer(path, dtype: str = "bfloat16", profile: str | None = None, **engine):
    """``with engine_and_trainer(path, max_model_len=256) as (llm, trainer):`` an aligned vLLM engine of the
    checkpoint at ``path`` (``make_llm(..., aligned=True, **engine)``) and its HF model patched for training, both
    made under :class:`linear_profile_env` ``(profile)``. The engine is shut down on exit, not at garbage
    collection: its process group must not outlive the test module (tests/conftest.py checks)."""
    from transformers import AutoModelForCausalLM

    from ..integrations.hf import patch_model
    from ..integrations.rollout import make_llm, shutdown

    with linear_profile_env(profile):
        llm = make_llm(path, dtype=dtype, aligned=True, **engine)
        try:
            trainer = patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)))
        except BaseException:
            shutdown(llm)
            raise
    try:
        yield llm, trainer
    finally:
        shutdown(llm)
        del llm
        gc.collect()
