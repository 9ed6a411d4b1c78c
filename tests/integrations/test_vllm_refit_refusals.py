"""refit with a state dict that is not a whole update of each engine layer: refused before any engine weight
changes, and partial updates that are whole per layer stay bitwise.

vLLM 0.32's in-place reload rebuilds each layer from ``torch.empty`` with the weights it is sent. Before the dry run
in ``rollout._check_refit_items`` (measured on this tiny bf16 Qwen2):
  - ``q_proj.weight`` alone (or ``gate_proj.weight`` alone, or only ``q_proj.bias``): no error, k/v (up) filled
    with uninitialised memory, the engine's log-probs NaN (0 % bitwise);
  - an unknown name or a wrong shape: vLLM's error half-way, every layer left on the meta device (the next
    generate raised "Cannot copy out of meta tensor").
Negative controls: a refit of a whole fused group (q/k/v with their biases) plus only the LM head, and q/k/v's
weights without their biases (vLLM keeps a bias live), are applied and bitwise (and changed the engine); after
each refusal the engine still equals the unchanged trainer bit for bit.
One real engine (bf16, untied LM head, eager, chunked prefill).
"""

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

pytestmark = pytest.mark.slow

PROMPT_LENS = [9, 70, 3]


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    path = tiny_checkpoint("qwen2", torch.bfloat16, seed=4, tie_word_embeddings=False)
    with engine_and_trainer(path, max_num_batched_tokens=64, max_model_len=256) as pair:
        yield pair


def _changed(trainer, names, seed):
    """The trainer's ``names`` plus a perturbation (the trainer itself unchanged)."""
    g = torch.Generator().manual_seed(seed)
    sd = trainer.state_dict()
    return {k: sd[k] + (0.05 * torch.randn(sd[k].shape, generator=g)).to(sd[k].dtype) for k in names}


def _engine_equals_trainer(llm, trainer, seed):
    rollouts = generate_with_logprobs(llm, random_prompts(PROMPT_LENS, seed), temperature=1.0, max_tokens=5)
    assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=1.0))
    return rollouts


L0 = "model.layers.0."


@pytest.mark.parametrize("names, layer", [
    ([L0 + "self_attn.q_proj.weight"], "qkv_proj"),
    ([L0 + "mlp.gate_proj.weight"], "gate_up_proj"),
    ([L0 + "self_attn.q_proj.bias"], "qkv_proj"),
    ([L0 + f"self_attn.{p}_proj.bias" for p in "qkv"], "qkv_proj"),  # the biases without the weights
])
def test_part_of_a_fused_layer_is_refused_and_nothing_changes(setup, names, layer):
    llm, trainer = setup
    with pytest.raises(ValueError, match=rf"refit: state_dict engine layer '{L0}[a-z_]+\.{layer}' .*"
                                         rf"{names[0].replace('.', '[.]')}.*no engine weight was changed"):
        refit(llm, _changed(trainer, names, seed=1))
    _engine_equals_trainer(llm, trainer, seed=2)  # the trainer was not changed: neither was the engine


@pytest.mark.parametrize("bad", ["unknown", "transposed", "short", "long_rows", "long_columns"])
def test_unknown_or_misshapen_weight_is_refused_and_the_engine_still_runs(setup, bad):
    llm, trainer = setup
    sd = _changed(trainer, list(trainer.state_dict()), seed=3)  # a whole update, but for one entry
    # long_rows / long_columns: 8 more q_proj rows / o_proj columns than the engine's (another model's shape); vLLM's
    # loaders slice them to the engine's size and check only the slice: applied, cut, without a word (measured)
    name = {"unknown": L0 + "mlp.foo.weight", "transposed": "model.layers.1.mlp.down_proj.weight",
            "short": "model.norm.weight", "long_rows": L0 + "self_attn.q_proj.weight",
            "long_columns": L0 + "self_attn.o_proj.weight"}[bad]
    sd[name] = {"unknown": lambda: torch.zeros(3, dtype=torch.bfloat16),
                "transposed": lambda: sd[name].t().contiguous(), "short": lambda: sd[name][:-1],
                "long_rows": lambda: torch.cat([sd[name], sd[name][:8] * 0]),
                "long_columns": lambda: torch.cat([sd[name], sd[name][:, :8] * 0], dim=1)}[bad]()
    why = "would reach the engine as" if bad.startswith("long") else "could not be loaded"
    with pytest.raises(ValueError, match=rf"refit: state_dict '{name.replace('.', '[.]')}' \(shape \[.*{why}"
                                         r".*no engine weight was changed"):
        refit(llm, sd)
    _engine_equals_trainer(llm, trainer, seed=4)


def _applied_bitwise(llm, trainer, new, before):
    """Refit ``new``, apply it to the trainer too: the engine's log-probs are the trainer's, and they changed."""
    refit(llm, new)
    with torch.no_grad():
        for k, v in new.items():
            trainer.get_parameter(k).copy_(v)
    after = generate_with_logprobs(llm, [r.prompt_token_ids for r in before], temperature=1.0, max_tokens=5)
    assert_rollouts_bitwise(after, teacher_forced(trainer, after, temperature=1.0))
    assert any(not bitwise_equal(a.logprobs_tensor()[:1], b.logprobs_tensor()[:1]) for a, b in zip(before, after))


def test_whole_fused_group_and_lm_head_alone_are_applied_bitwise(setup):
    """The negative control of the refusals: a partial update that is whole per engine layer is applied."""
    llm, trainer = setup
    before = _engine_equals_trainer(llm, trainer, seed=5)
    names = [L0 + f"self_attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")] + ["lm_head.weight"]
    new = _changed(trainer, names, seed=6)
    _applied_bitwise(llm, trainer, new, before)


def test_fused_weights_without_their_biases_are_applied_bitwise(setup):
    """q/k/v weights without their biases are a whole update of what vLLM rebuilds: the bias is never moved to the
    meta device (vLLM's SKIP_TENSORS), so it keeps its value, and the weights are applied (measured on the engine
    before the dry run: qkv_proj.weight bitwise the new q|k|v, the bias the old one, engine == trainer bitwise). The
    dry run used to count the bias as missing and refuse it."""
    llm, trainer = setup
    before = _engine_equals_trainer(llm, trainer, seed=7)
    new = _changed(trainer, [L0 + f"self_attn.{p}_proj.weight" for p in "qkv"], seed=8)
    _applied_bitwise(llm, trainer, new, before)
