"""aligned_grpo on a real trl.GRPOTrainer, in process and without an engine (use_vllm=False): the policy's forward
is ours (over TRL's fused LM head), TRL's per-token log-prob method returns the aligned bits for TRL's batch
layout (left-padded prompts + right-padded completions) whatever its micro-batch size, REINFORCE Zero lands on
TRL's options, and every refusal names its reason. The end-to-end run with vLLM is test_trl.py. Slow: building
GRPOTrainers (accelerate, datasets) takes tens of seconds on the 2 shared cores."""

import math
import types

import pytest
import torch

pytest.importorskip("trl")

pytestmark = pytest.mark.slow

from aligned_ops import profiles  # noqa: E402
from aligned_ops.integrations import hf  # noqa: E402
from aligned_ops.integrations.hf import completion_logprobs, patch_model  # noqa: E402
from aligned_ops.integrations.trl import aligned_grpo  # noqa: E402
from aligned_ops.testing import assert_bitwise_equal, bitwise_equal  # noqa: E402


def _trainer(model_dir, tmp_path, patch_first=False, **overrides):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    if patch_first:  # the README's flow: patch, then build the trainer (which wraps our forward)
        patch_model(model)
    args = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, max_steps=1, per_device_train_batch_size=4,
                num_generations=4, max_completion_length=8, temperature=0.8, report_to="none", save_strategy="no",
                use_vllm=False)
    args.update(overrides)
    return GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                       args=GRPOConfig(**args), train_dataset=Dataset.from_dict({"prompt": ["a b", "c"] * 4}),
                       processing_class=AutoTokenizer.from_pretrained(model_dir))


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen2", torch.bfloat16, seed=0)


def _trl_batch(seed=0):
    """TRL's layout: prompts left-padded, completions right-padded, concatenated."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, completion_lens, P, C = [3, 6, 1, 5], [8, 2, 5, 8], 6, 8
    ids = torch.zeros(4, P + C, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b, (p, c) in enumerate(zip(prompt_lens, completion_lens)):
        ids[b, P - p:P + c] = torch.randint(0, 500, (p + c,), generator=g)
        am[b, P - p:P + c] = 1
    return ids, am, C


def test_trl_logps_are_the_aligned_bits_for_any_micro_batch(model_dir, tmp_path):
    trainer = _trainer(model_dir, tmp_path, patch_first=True)
    policy = trainer.model
    ids, am, keep = _trl_batch()
    # With the backbone patched, TRL's own fused LM head now runs on the patched model (it crashed with
    # "_layer_forward() got an unexpected keyword argument 'attention_mask'"), but with its own log-softmax.
    with torch.no_grad():
        stock, stock_ent, _ = trainer._get_per_token_logps_and_entropies(policy, ids, am, keep, compute_entropy=True)
    assert aligned_grpo(trainer) is trainer
    assert policy.forward.__func__ is hf._model_forward  # TRL's fused-head wrapper is gone
    cm = am.clone()
    cm[:, :-keep] = 0
    with torch.no_grad():
        want = completion_logprobs(policy, ids, cm, attention_mask=am, temperature=0.8)[:, -keep:]
        full, ent, aux = trainer._get_per_token_logps_and_entropies(policy, ids, am, keep, compute_entropy=True)
        one, ent1, _ = trainer._get_per_token_logps_and_entropies(policy, ids, am, keep, batch_size=1,
                                                                  compute_entropy=True)
    assert aux is None and full.shape == ent.shape == (4, keep)
    assert_bitwise_equal(full, want)
    assert_bitwise_equal(one, want)
    assert_bitwise_equal(ent1, ent)
    torch.testing.assert_close(stock, full, atol=0.05, rtol=0)  # TRL's head on our backbone: the same numbers
    torch.testing.assert_close(stock_ent, ent, atol=0.05, rtol=0)
    # control: the comparison sees a change of TRL's temperature
    trainer.temperature = 0.9
    with torch.no_grad():
        hotter, _, _ = trainer._get_per_token_logps_and_entropies(policy, ids, am, keep)
    trainer.temperature = 0.8
    assert not bitwise_equal(hotter, want)
    # a gradient flows through the aligned path (TRL's loss calls it with grad)
    lp, _, _ = trainer._get_per_token_logps_and_entropies(policy, ids, am, keep)
    (lp * cm[:, -keep:]).sum().backward()
    assert policy.model.layers[0].self_attn.q_proj.weight.grad is not None
    # idempotent, the profile kept
    aligned_grpo(trainer)
    assert policy.forward.__func__ is hf._model_forward and profiles.profile_of(policy) is profiles.from_env()


@pytest.fixture(scope="module")
def plain(model_dir, tmp_path_factory):
    """A trainer built from the unpatched model (TRL's fused LM head on HF's forward); tests reset what they set."""
    return _trainer(model_dir, tmp_path_factory.mktemp("grpo"))


def test_reinforce_zero_maps_onto_trls_options(plain):
    trainer = aligned_grpo(plain, reinforce_zero=False)
    assert trainer.vllm_importance_sampling_mode == "sequence_mask" and trainer.epsilon_low == 0.2  # TRL's defaults
    aligned_grpo(trainer)
    assert trainer.vllm_importance_sampling_correction is True
    assert trainer.vllm_importance_sampling_mode == "token_truncate"
    assert trainer.vllm_importance_sampling_clip_min is None and trainer.vllm_importance_sampling_clip_max == math.inf
    assert trainer.epsilon_low == math.inf and trainer.epsilon_high == math.inf
    # TRL's loss: clamp(1 - inf, 1 + inf) clips nothing; token IS ratio: clamp(max=inf) truncates nothing
    r = torch.tensor([1e-30, 0.5, 1.0, 7.0, 1e30])
    assert_bitwise_equal(torch.clamp(r, 1 - trainer.epsilon_low, 1 + trainer.epsilon_high), r)
    assert_bitwise_equal(torch.clamp(r, min=trainer.vllm_importance_sampling_clip_min,
                                     max=trainer.vllm_importance_sampling_clip_max), r)


def _adapter_state(trainer):
    """Part of what aligned_grpo changes, enough to see any change before a refusal: the policy's patch (its
    forward, a new object at every patch — the first thing aligned_grpo changes — and profile), the log-prob
    method, the sync wrapper and TRL's IS options (the last three already set once the module's trainer was
    adapted by an earlier test)."""
    policy = trainer.accelerator.unwrap_model(trainer.model)
    vg = getattr(trainer, "vllm_generation", None)
    return (vars(trainer).get("_get_per_token_logps_and_entropies"), getattr(vg, "sync_weights", None),
            getattr(policy, "_aligned_patched", False), getattr(policy, "_aligned_profile", None),
            vars(policy).get("forward"), getattr(trainer, "vllm_importance_sampling_mode", None),
            getattr(trainer, "epsilon_low", None))


def test_refusals_name_their_reason(plain, monkeypatch):
    with pytest.raises(TypeError, match="aligned_grpo: expected a trl.GRPOTrainer, got SimpleNamespace"):
        aligned_grpo(types.SimpleNamespace())
    for where, name, value, match in ((plain.args, "cast_lm_head_to_fp32", True, "cast_lm_head_to_fp32=True"),
                                      (plain, "repetition_penalty", 1.1, "repetition_penalty=1.1"),
                                      (plain, "loss_type", "cispo", "loss_type 'cispo'"),
                                      (plain.args, "importance_sampling_level", "sequence",
                                       "importance_sampling_level='sequence'"),
                                      # the entropy mask zeroed 16 of 32 completion tokens' loss weight (not 1)
                                      (plain, "top_entropy_quantile", 0.5,
                                       r"top_entropy_quantile=0.5 zeroes the loss .* leave it at 1.0 "
                                       r"\(or reinforce_zero=False\)")):
        with monkeypatch.context() as m:
            m.setattr(where, name, value)
            before = _adapter_state(plain)
            with pytest.raises(ValueError, match=match):
                aligned_grpo(plain)
            # refused before anything changed (review 133: the reinforce_zero refusals came after the patching):
            # a caller that catches the error keeps TRL's trainer as it was
            assert _adapter_state(plain) == before, name
    with monkeypatch.context() as m:  # control: TRL's own loss options keep the entropy mask
        m.setattr(plain, "top_entropy_quantile", 0.5)
        assert aligned_grpo(plain, reinforce_zero=False) is plain
    trainer = aligned_grpo(plain)
    ids, am, keep = _trl_batch()
    with pytest.raises(ValueError, match="multimodal inputs are not supported .got pixel_values"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, am, keep, pixel_values=torch.zeros(1))


def _engine_side(trainer, generation_kwargs=None, structured_outputs_regex=None, **copied):
    """TRL's VLLMGeneration as aligned_grpo reads it: the generation options it copied at build time, its
    generation_kwargs (laid over them in every SamplingParams) and the structured-outputs regex."""
    base = dict(temperature=trainer.temperature, top_k=trainer.top_k, top_p=trainer.top_p, min_p=trainer.min_p,
                repetition_penalty=trainer.repetition_penalty)
    base.update(copied)
    return types.SimpleNamespace(mode="colocate", llm=None, sync_weights=lambda: None,
                                 generation_kwargs=generation_kwargs or {},
                                 structured_outputs_regex=structured_outputs_regex, **base)


def test_sampling_options_the_trainer_does_not_reproduce_are_refused_by_name(plain, monkeypatch):
    """vLLM samples (and, under TRL's processed_logprobs, scores) with the options TRL copied, then
    generation_kwargs over them: a penalty, logit bias, min_tokens, token mask or grammar there, or a temperature /
    truncation other than the trainer's, made TRL's sampling_logp_difference/max 0.036 (repetition_penalty=1.5 in
    generation_kwargs) with no error, while repetition_penalty in GRPOConfig was refused."""
    refused = (
        ({"repetition_penalty": 1.5}, {}, r"generation_kwargs\['repetition_penalty'\]=1.5 changes the distribution"),
        ({"presence_penalty": 0.5}, {}, r"generation_kwargs\['presence_penalty'\]=0.5 .*use 0.0"),
        ({"frequency_penalty": -0.2}, {}, r"generation_kwargs\['frequency_penalty'\]=-0.2"),
        ({"min_tokens": 4}, {}, r"generation_kwargs\['min_tokens'\]=4 .*use 0"),
        ({"logit_bias": {7: 2.0}}, {}, r"generation_kwargs\['logit_bias'\]=\{7: 2.0\} .*unset it"),
        ({"allowed_token_ids": [1, 2]}, {}, r"generation_kwargs\['allowed_token_ids'\]"),
        ({"bad_words": ["x"]}, {}, r"generation_kwargs\['bad_words'\]"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, {}, r"generation_kwargs\['structured_outputs'\]"),
        ({"top_k": 3}, {}, r"generation_kwargs\['top_k'\]=3 makes vLLM sample with top_k=3 but the trainer "
                           r"scores with top_k=None; set it in GRPOConfig"),
        ({"top_p": 0.9}, {}, r"generation_kwargs\['top_p'\]=0.9 makes vLLM sample with top_p=0.9"),
        ({"min_p": 0.1}, {}, r"generation_kwargs\['min_p'\]=0.1"),
        ({"temperature": 1.0}, {}, r"generation_kwargs\['temperature'\]=1.0 makes vLLM sample with "
                                   r"temperature=1.0 but the trainer scores with temperature=0.8"),
        ({}, {"structured_outputs_regex": "[a-z]+"}, r"vllm_structured_outputs_regex='\[a-z\]\+' masks"),
        ({}, {"repetition_penalty": 1.2}, r"aligned_grpo: repetition_penalty=1.2 changes"),
        ({}, {"temperature": 0.7}, r"aligned_grpo: temperature=0.7 makes vLLM sample with temperature=0.7"),
    )
    for kwargs, engine, match in refused:
        with monkeypatch.context() as m:
            m.setattr(plain, "vllm_generation", _engine_side(plain, kwargs, **engine), raising=False)
            with pytest.raises(ValueError, match=match) as err:
                aligned_grpo(plain, reinforce_zero=False)
            assert "\n" not in str(err.value)
    # the same checks without vLLM read GRPOConfig.generation_kwargs
    with monkeypatch.context() as m:
        m.setattr(plain.args, "generation_kwargs", {"presence_penalty": 0.5})
        with pytest.raises(ValueError, match=r"generation_kwargs\['presence_penalty'\]=0.5"):
            aligned_grpo(plain, reinforce_zero=False)
    # control: options that leave the distribution alone, and the trainer's own values repeated, pass
    fine = {"seed": 3, "stop": ["\n"], "max_tokens": 8, "ignore_eos": True, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0, "min_tokens": 0, "logit_bias": {}, "bad_words": [],
            "top_k": -1, "top_p": 1.0, "min_p": 0.0, "temperature": 0.8}
    with monkeypatch.context() as m:
        m.setattr(plain, "vllm_generation", _engine_side(plain, fine), raising=False)
        assert aligned_grpo(plain, reinforce_zero=False) is plain
    with monkeypatch.context() as m:
        m.setattr(plain, "top_k", 3)  # set in GRPOConfig: TRL gives it to both sides
        m.setattr(plain, "vllm_generation", _engine_side(plain, {"top_k": 3}), raising=False)
        assert aligned_grpo(plain, reinforce_zero=False) is plain


def test_kl_to_the_reference_with_a_truncated_distribution_is_refused(plain, monkeypatch):
    """beta != 0 with top-k / top-p / min-p: the trainer scores the truncated distribution (vLLM's
    processed_logprobs), so a sampled token outside the reference's truncated set has ref log-prob -inf and TRL's
    KL term exp(ref - logp) - (ref - logp) - 1 is inf, NaN once the policy's own set moves (GRPOConfig beta=0.04,
    top_k=5, temperature=0.7, 3 steps with vLLM: kl logged 0.0, inf, NaN; all 26 weights NaN after step 2 while
    TRL's sampling_logp_difference/max still logged 0.0, its nan_to_num)."""
    for truncation, match in (({"top_k": 5}, "beta=0.04 with top_k=5: "), ({"top_p": 0.9}, "with top_p=0.9"),
                              ({"min_p": 0.05, "top_k": 3}, "with top_k=3, min_p=0.05")):
        with monkeypatch.context() as m:
            m.setattr(plain, "beta", 0.04)
            for name, value in truncation.items():
                m.setattr(plain, name, value)
            with pytest.raises(ValueError, match=match + ".*TRL's KL term is then inf or NaN.*use beta=0.0") as err:
                aligned_grpo(plain, reinforce_zero=False)
            assert "\n" not in str(err.value)
    # the arithmetic it prevents: a -inf log-prob in TRL's KL estimator
    ref, logp = torch.tensor([float("-inf"), -1.0]), torch.tensor([-1.0, float("-inf")])
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    assert kl[0] == float("inf") and torch.isnan(kl[1])
    # controls: the KL without truncation, truncation without the KL, and greedy (scored untruncated) pass
    for settings in ({"beta": 0.04}, {"top_k": 5, "top_p": 0.9}, {"beta": 0.04, "top_k": 5, "temperature": 0.0}):
        with monkeypatch.context() as m:
            for name, value in settings.items():
                m.setattr(plain, name, value)
            assert aligned_grpo(plain, reinforce_zero=False) is plain


def test_engine_without_the_plugin_or_with_another_profile_is_refused(plain, monkeypatch):
    from aligned_ops.integrations.vllm import plugin

    trainer = plain
    engine_model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(model_executor=types.SimpleNamespace(
        driver_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=engine_model)))))
    monkeypatch.setattr(trainer, "use_vllm", True)
    monkeypatch.setattr(trainer, "vllm_generation", types.SimpleNamespace(mode="colocate", llm=llm,
                                                                         sync_weights=lambda: None), raising=False)
    monkeypatch.setattr(plugin, "is_installed", lambda: False)
    before = _adapter_state(trainer)  # review 134: the engine refusals came after the policy was (re)patched
    with pytest.raises(ValueError, match="does not run the aligned_ops vLLM plugin; set ALIGNED_OPS_VLLM=1"):
        aligned_grpo(trainer, profile="fma")
    assert _adapter_state(trainer) == before
    monkeypatch.setattr(plugin, "is_installed", lambda: True)
    other = next(p for p in profiles.REGISTRY.values() if p is not profiles.REGISTRY["fma"])
    engine_model[0]._aligned_profile = other
    with pytest.raises(ValueError, match=f"engine runs the '{other.name}' linear profile and the trainer 'fma'"):
        aligned_grpo(trainer, profile="fma")
    assert _adapter_state(trainer) == before
    engine_model[0]._aligned_profile = profiles.REGISTRY["fma"]
    aligned_grpo(trainer, profile="fma")
    assert _adapter_state(trainer) != before  # control: an accepted call re-patches (the state check can fail)
    # a refusal of patch_model's own (here: what the profile needs of the model and machine) comes before the first
    # change too (review 136: it came after the policy was unpatched, which was left unpatched)
    before = _adapter_state(trainer)
    with monkeypatch.context() as m:
        m.setattr(type(profiles.REGISTRY["exact"]), "model_refusals",
                  lambda self, dtype, device: ["exact needs what this test says it lacks"])
        engine_model[0]._aligned_profile = profiles.REGISTRY["exact"]
        with pytest.raises(ValueError, match=r"aligned_ops \(patch_model\): exact needs what this test says it "
                                             r"lacks"):
            aligned_grpo(trainer, profile="exact")
    assert _adapter_state(trainer) == before
    engine_model[0]._aligned_profile = profiles.REGISTRY["fma"]
    # the sync now clears the exact profile's packed weights
    from aligned_ops.ops import linear_exact

    w = torch.randn(16, 64)
    linear_exact.cache_exact_weights(w)  # only registered weights are cached (the engine registers its own)
    linear_exact.packed_weight(w)
    assert linear_exact.exact_weight_cache_bytes() > 0
    trainer.vllm_generation.sync_weights()
    assert linear_exact.exact_weight_cache_bytes() == 0


def test_reference_model_is_patched_with_the_policys_profile(model_dir, tmp_path):
    trainer = _trainer(model_dir, tmp_path, beta=0.04)
    assert trainer.ref_model is not None
    aligned_grpo(trainer, profile="exact")
    ref = trainer.ref_model
    assert ref.forward.__func__ is hf._model_forward
    assert profiles.profile_of(ref) is profiles.profile_of(trainer.model) is profiles.REGISTRY["exact"]
    ids, am, keep = _trl_batch(1)
    with torch.no_grad():
        ref_lp, _, _ = trainer._get_per_token_logps_and_entropies(ref, ids, am, keep)
        pol_lp, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, am, keep)
    assert_bitwise_equal(ref_lp, pol_lp)  # same weights before any step: the KL term starts at exactly 0


def test_an_engines_mla_form_does_not_reach_a_model_without_mla(plain):
    # review 137: the plan passed a colocated engine's MLA form (additional_config can set one on any engine) to a
    # model without MLA attention: "mla_form='absorbed', but Qwen2ForCausalLM has no MLA attention", an option the
    # user never gave the trainer. Control: the plan of the same model without an engine form.
    from aligned_ops.integrations.trl import _repatch_plan

    policy = plain.accelerator.unwrap_model(plain.model)
    assert _repatch_plan(policy, "fma", "absorbed")[1] is None
    assert _repatch_plan(policy, "fma", None)[1] is None
