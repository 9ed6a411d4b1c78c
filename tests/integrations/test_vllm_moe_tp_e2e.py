"""MoE at tensor parallelism end to end: real vLLM-CPU with the aligned_ops plugin at tensor_parallel_size=2 (mp
workers) vs the patched HF trainer (one process: TP = 1), bitwise (integer views), for a tiny Qwen2-MoE (gated
shared expert, qkv bias; the router runs before the fused-MoE layer) and a tiny DeepSeek-V3 (expanded MLA, grouped
sigmoid routing with the fp32 correction bias, routed scaling 2.5, shared expert, a dense first layer; the router
runs inside the layer) and a tiny GLM-4.5 (q/k norms, partial rotary, DeepSeek-V3's routing with the fp32 router
run before the layer), all bf16.

vLLM shards every expert's intermediate dimension (and the shared expert's) over the ranks; the plugin's fused-MoE
hook finishes each expert's down-projection tree across the ranks before moe.h's combine
(collective.row_parallel_moe_experts), so the block's bits are the single-device ones. One engine per model
(module-scoped, run once): sampled rollouts with chunked prefill (a 100-token prompt, 64-token budget) ≡ trainer;
greedy rollouts ≡ trainer; DeepSeek-V3 also after a refit from the trainer's in-memory state dict (HF's fused
experts split and sharded by vLLM's loader, the fp32 bias kept). Negative control on the same running engine: the
MoE blocks' experts combined in vLLM's order (each rank's weighted sum as a model-dtype output, then the ranks'
sum: "moe-late") differ
from the tree's rollouts and the trainer's; switched back, equal again.
"""

import gc
import os

import pytest
import torch

pytest.importorskip("vllm")

from _vllm_moe_checks import PROMPT_LENS, train_like_step  # noqa: E402

from aligned_ops.integrations import vllm_plugin  # noqa: E402
from aligned_ops.integrations.hf import patch_model  # noqa: E402
from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, refit, shutdown  # noqa: E402
from aligned_ops.testing import bits  # noqa: E402
from aligned_ops.testing.rollouts import assert_rollouts_bitwise, random_prompts, teacher_forced  # noqa: E402

pytestmark = pytest.mark.slow

DSV3_SHAPE = dict(qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=32)
MODELS = ("qwen2_moe", "deepseek_v3", "glm4_moe")


def _build(name, tiny_checkpoint):
    """The session's tiny checkpoints (the DeepSeek-V3 and GLM-4.5 ones are those of their single-device e2e tests)."""
    if name == "qwen2_moe":
        return tiny_checkpoint("moe", torch.bfloat16, seed=3, arch="qwen2_moe", num_hidden_layers=2)
    if name == "glm4_moe":
        return tiny_checkpoint("glm4_moe", torch.bfloat16, seed=0)
    return tiny_checkpoint("deepseek_v3", torch.bfloat16, seed=0, **DSV3_SHAPE)


def _differing(a, b):
    """(log-probs with other bits, sequences with other tokens) between two rollout lists of the same prompts."""
    lp = sum(int((bits(x.logprobs_tensor()) != bits(y.logprobs_tensor())).sum()) for x, y in zip(a, b)
             if x.token_ids == y.token_ids)
    return lp, sum(x.token_ids != y.token_ids for x, y in zip(a, b))


def _run(name, path):
    from transformers import AutoModelForCausalLM

    r = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # refit ships tensors to the mp workers
        mp.setenv("ALIGNED_OPS_MLA_FORM", "expanded")  # DeepSeek-V3 here: the expanded form (the absorbed one: TP 1)
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # auto binding wants one NUMA node per rank
            ncpu = os.cpu_count() or 1
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(rank % ncpu) for rank in range(2)))
        llm = make_llm(path, dtype="bfloat16", aligned=True, max_num_batched_tokens=64, max_model_len=512,
                       tensor_parallel_size=2, distributed_executor_backend="mp")
        trainer = patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
        try:
            r["tp_size"] = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
            r["sampled"] = generate_with_logprobs(llm, random_prompts(PROMPT_LENS, 0), temperature=0.8, max_tokens=6)
            r["sampled_trainer"] = teacher_forced(trainer, r["sampled"], temperature=0.8)
            greedy = random_prompts([25, 60, 9], 1)
            r["greedy"] = generate_with_logprobs(llm, greedy, temperature=0.0, max_tokens=6)
            r["greedy_trainer"] = teacher_forced(trainer, r["greedy"], temperature=1.0)
            vllm_plugin.set_tp_combine(llm, "moe-late")  # negative control
            r["late"] = generate_with_logprobs(llm, greedy, temperature=0.0, max_tokens=6)
            vllm_plugin.set_tp_combine(llm, "tree")
            r["again"] = generate_with_logprobs(llm, greedy, temperature=0.0, max_tokens=6)
            if name == "deepseek_v3":  # (GLM-4.5's refit: the same code path, test_vllm_glm4_moe_e2e.py)
                refit(llm, train_like_step(trainer))
                r["after"] = generate_with_logprobs(llm, random_prompts(PROMPT_LENS, 2), temperature=0.8,
                                                    max_tokens=6)
                r["after_trainer"] = teacher_forced(trainer, r["after"], temperature=0.8)
        finally:
            shutdown(llm)
            del llm
            gc.collect()
    return r


@pytest.fixture(scope="module")
def runs(tiny_checkpoint):
    done = {}

    def get(name):
        if name not in done:
            done[name] = _run(name, _build(name, tiny_checkpoint))
        return done[name]

    return get


@pytest.mark.parametrize("name", MODELS)
def test_moe_tp2_rollouts_bitwise_equal_trainer(runs, name):
    r = runs(name)
    assert r["tp_size"] == 2
    assert [len(x.prompt_token_ids) for x in r["sampled"]] == PROMPT_LENS
    assert_rollouts_bitwise(r["sampled"], r["sampled_trainer"], f"{name} TP=2 vs TP=1 trainer, sampled")
    assert_rollouts_bitwise(r["greedy"], r["greedy_trainer"], f"{name} TP=2 vs TP=1 trainer, greedy")
    if "after" in r:
        assert_rollouts_bitwise(r["after"], r["after_trainer"], f"{name} TP=2 vs trainer, after refit")


@pytest.mark.parametrize("name", MODELS)
def test_negative_control_moe_late_combine_differs(runs, name):
    """vLLM's combine order for the MoE blocks (the linears keep the tree) changes the rollouts; the tree again
    gives the same ones."""
    r = runs(name)
    lp, seqs = _differing(r["late"], r["greedy"])
    print(f"[{name}, TP=2] moe-late negative control: {lp} log-probs and {seqs} sequences differ")
    assert lp + seqs > 0
    assert _differing(r["again"], r["greedy"]) == (0, 0)
