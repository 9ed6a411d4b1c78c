"""The vLLM plugin's MLA form switch (issue 26 item 3), at engine-config level (no engine is started).

What it proves: ``ALIGNED_OPS_MLA_FORM`` (alias ``VLLM_ALIGNED_OPS_MLA_FORM``) and
``additional_config["aligned_ops_mla_form"]`` are validated with one-line errors and resolved in that order, default
``absorbed``; for a DeepSeek-V3 folder the absorbed form builds vLLM's MLA config (``use_mla``) with chunked prefill,
prefix caching and the token budget as asked (negative control: vLLM's own CPU platform update turns them off on the
same config), the expanded form builds the non-MLA one; the form is recorded for the trainer to pair with; what the
absorbed form does not cover yet (compiled mode) and a conflicting ``VLLM_MLA_DISABLE`` are refused by
message; the TRL adapter patches an MLA policy in the plugin's form and refuses a policy patched in the other.
"""

import copy
import os

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.integrations import vllm_plugin  # noqa: E402
from aligned_ops.integrations.vllm import config as vconfig  # noqa: E402
from aligned_ops.testing.tiny_model import build_tiny_deepseek_v3  # noqa: E402

pytestmark = pytest.mark.slow  # builds vLLM engine configs (vLLM import, model config): ~15 s on a quiet machine


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("ALIGNED_OPS_MLA_FORM", "VLLM_ALIGNED_OPS_MLA_FORM", "VLLM_MLA_DISABLE"):
        monkeypatch.delenv(name, raising=False)  # restored after the test, whatever the plugin wrote
    monkeypatch.setattr(vconfig, "_env_written", {})


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    return build_tiny_deepseek_v3(tmp_path_factory.mktemp("mlaform") / "m", torch.bfloat16, seed=0,
                                  num_hidden_layers=2, kv_lora_rank=512, qk_rope_head_dim=64)


def _engine_config(model_dir, **kw):
    from vllm.engine.arg_utils import EngineArgs

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm_plugin.install()
    args = dict(model=model_dir, tokenizer=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=256,
                enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=32,
                kv_cache_memory_bytes=32 << 20)
    args.update(kw)
    return EngineArgs(**args).create_engine_config()


def test_form_from_env_and_precedence(monkeypatch):
    assert vconfig.mla_form_from_env() is None and vconfig.resolve_mla_form() == "absorbed"
    monkeypatch.setenv("ALIGNED_OPS_MLA_FORM", " Expanded ")
    assert vconfig.mla_form_from_env() == "expanded" == vconfig.resolve_mla_form({})
    assert vconfig.resolve_mla_form({"aligned_ops_mla_form": "absorbed"}) == "absorbed"  # the engine's own choice
    monkeypatch.setenv("VLLM_ALIGNED_OPS_MLA_FORM", "expanded")  # the alias, agreeing
    assert vconfig.mla_form_from_env() == "expanded"
    monkeypatch.setenv("VLLM_ALIGNED_OPS_MLA_FORM", "absorbed")
    with pytest.raises(ValueError, match=r"^ALIGNED_OPS_MLA_FORM and VLLM_ALIGNED_OPS_MLA_FORM disagree"):
        vconfig.mla_form_from_env()
    monkeypatch.delenv("VLLM_ALIGNED_OPS_MLA_FORM")
    monkeypatch.setenv("ALIGNED_OPS_MLA_FORM", "latent")
    with pytest.raises(ValueError, match=r"^ALIGNED_OPS_MLA_FORM must be 'absorbed' or 'expanded', got 'latent'$"):
        vconfig.mla_form_from_env()
    with pytest.raises(ValueError, match=r"additional_config\['aligned_ops_mla_form'\] must be 'absorbed' or "):
        vconfig.resolve_mla_form({"aligned_ops_mla_form": "both"})


def test_absorbed_default_keeps_chunked_prefill_and_prefix_caching(ds_dir):
    from vllm.platforms.cpu import CpuPlatform

    from aligned_ops.integrations.vllm import patches

    cfg = _engine_config(ds_dir)
    assert os.environ["VLLM_MLA_DISABLE"] == "0" and cfg.model_config.use_mla
    assert vllm_plugin.engine_mla_form(cfg) == "absorbed"
    assert cfg.scheduler_config.enable_chunked_prefill and cfg.cache_config.enable_prefix_caching
    assert cfg.scheduler_config.max_num_batched_tokens == 32
    # negative control: vLLM's own CPU platform update on the same config, for its reference CPU MLA backend, turns
    # both off. (On a CPU with AMX tiles vLLM picks its AMX_MLA backend instead, which keeps both: the control
    # names CPU_MLA, so it means the same on every machine.)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    stock = copy.deepcopy(cfg)
    stock.attention_config.backend = AttentionBackendEnum.CPU_MLA
    patches.original(CpuPlatform, "check_and_update_config")(stock)
    assert not stock.scheduler_config.enable_chunked_prefill and not stock.cache_config.enable_prefix_caching
    assert stock.scheduler_config.max_num_batched_tokens > 32


def test_expanded_form_selects_the_non_mla_path(ds_dir, monkeypatch):
    monkeypatch.setenv("ALIGNED_OPS_MLA_FORM", "expanded")
    cfg = _engine_config(ds_dir)
    assert os.environ["VLLM_MLA_DISABLE"] == "1" and not cfg.model_config.use_mla
    assert vllm_plugin.engine_mla_form(cfg) == "expanded"
    # the engine's own choice wins over the environment, and a second engine in the process may change it
    cfg = _engine_config(ds_dir, additional_config={"aligned_ops_mla_form": "absorbed"})
    assert cfg.model_config.use_mla and vllm_plugin.engine_mla_form(cfg) == "absorbed"


def test_expanded_form_refuses_v_head_dim_above_the_qk_head(tmp_path, monkeypatch):
    """v_head_dim > qk_nope_head_dim + qk_rope_head_dim: vLLM's non-MLA attention (the expanded form) pads v to the
    q/k head and failed reshaping its output (a traceback from the first forward); refused at engine config,
    naming the fields. Control: the absorbed form (vLLM's MLA modules) of the same folder is accepted."""
    d = build_tiny_deepseek_v3(tmp_path / "m", torch.bfloat16, seed=0, num_hidden_layers=2, qk_nope_head_dim=16,
                               qk_rope_head_dim=16, v_head_dim=64)
    monkeypatch.setenv("ALIGNED_OPS_MLA_FORM", "expanded")
    with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM v_head_dim 64 > qk_nope_head_dim \+ "
                                         r"qk_rope_head_dim = 32 is not supported in the expanded MLA form"):
        _engine_config(d)
    monkeypatch.setenv("ALIGNED_OPS_MLA_FORM", "absorbed")
    vllm_plugin.validate_vllm_config(_engine_config(d))


def test_refusals(ds_dir, monkeypatch):
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")  # the user's, conflicting with the default (absorbed) form
    with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM needs VLLM_MLA_DISABLE=0 \(the absorbed MLA form; "
                                         r"ALIGNED_OPS_MLA_FORM selects the form\), the environment has '1'"):
        _engine_config(ds_dir)
    monkeypatch.delenv("VLLM_MLA_DISABLE")
    cfg = _engine_config(ds_dir)
    tp2 = copy.deepcopy(cfg)
    tp2.parallel_config.tensor_parallel_size = 2
    vllm_plugin.validate_vllm_config(tp2)  # accepted (test_vllm_deepseek_v3_mla_e2e.py runs it)
    compiled = copy.deepcopy(cfg)
    compiled.model_config.enforce_eager = False
    with pytest.raises(ValueError, match="absorbed MLA form runs in eager mode only so far"):
        vllm_plugin.validate_vllm_config(compiled)
    # the form asked for is not the one vLLM built (a hub id, whose config the plugin does not read)
    asked = copy.deepcopy(cfg)
    asked.additional_config["aligned_ops_mla_form"] = "expanded"
    with pytest.raises(ValueError, match=r"the MLA form asked for is 'expanded' .* vLLM builds the absorbed form"):
        vllm_plugin.validate_vllm_config(asked)


def test_trl_adapter_pairs_with_the_plugin_form(ds_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from aligned_ops.integrations.hf import patch_model
    from aligned_ops.integrations.trl import _repatch

    model = AutoModelForCausalLM.from_pretrained(ds_dir, dtype=torch.bfloat16)
    _repatch(model, None)  # unpatched: the plugin's form (absorbed by default)
    assert model.model.layers[0]._aligned_mla_form.name == "absorbed"
    monkeypatch.setenv("ALIGNED_OPS_MLA_FORM", "expanded")
    with pytest.raises(ValueError, match=r"patched with mla_form='absorbed', but the vLLM plugin runs the "
                                         r"'expanded' MLA form \(ALIGNED_OPS_MLA_FORM\)"):
        _repatch(model, None)
    other = patch_model(AutoModelForCausalLM.from_pretrained(ds_dir, dtype=torch.bfloat16), mla_form="expanded")
    _repatch(other, None)
    assert other.model.layers[0]._aligned_mla_form.name == "expanded"


def test_attention_factor_one_refused_at_engine_config(ds_dir, tmp_path):
    # vLLM runs a scaled RoPE with attention_factor == 1.0 as deepseek_llama_scaling (no YaRN mscale**2 on the
    # softmax scale; HF applies it): the plugin refuses it before any layer is built, naming the field
    import json
    import shutil

    d = shutil.copytree(ds_dir, tmp_path / "af1")
    with open(d / "config.json") as f:
        cfg = json.load(f)
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    cfg[key] = dict(cfg[key], attention_factor=1.0)
    with open(d / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="rope_scaling attention_factor=1.0 is not supported"):
        _engine_config(str(d))
    _engine_config(ds_dir)  # positive control: the untouched folder builds its config
