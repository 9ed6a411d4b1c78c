"""One MLA form default for trainer and engine (DeepSeek-V3 / Kimi-K2): ``patch_model(mla_form=None)`` and every
adapter that calls it (verl ``patch_actor``, OpenRLHF ``aligned_actor``, FSDP2 ``shard_aligned``) resolve the form
through the vLLM plugin's own resolver (``models.mla_form.resolve_mla_form``: ``ALIGNED_OPS_MLA_FORM``, alias
``VLLM_ALIGNED_OPS_MLA_FORM``, default ``absorbed``); an explicit ``mla_form=`` still wins; a non-MLA model gets no
form (negative control). Plus the softmax-scale refusal: a scaled RoPE with ``attention_factor == 1.0`` (vLLM then
skips YaRN's mscale**2, HF applies it) is refused at config level, by message. No vLLM import, no engine."""

import pytest
import torch

from aligned_ops.integrations import check_hf_config
from aligned_ops.integrations.hf import patch_model
from aligned_ops.models.mla_form import resolve_mla_form
from aligned_ops.testing.tiny_model import build_tiny_deepseek_v3, build_tiny_qwen2

ENV = ("ALIGNED_OPS_MLA_FORM", "VLLM_ALIGNED_OPS_MLA_FORM")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    return build_tiny_deepseek_v3(tmp_path_factory.mktemp("mladefault") / "m", torch.float32, seed=0,
                                  num_hidden_layers=2)


def _load(d):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)


def _form(model):
    forms = {layer.__dict__.get("_aligned_mla_form") for layer in model.model.layers}
    assert len(forms) == 1, forms
    form = forms.pop()
    return None if form is None else form.name


def _patch_plain(model):
    return patch_model(model)


def _patch_verl(model):
    from aligned_ops.integrations.verl import patch_actor

    return patch_actor(model)


def _patch_openrlhf(model):
    from aligned_ops.integrations.openrlhf import aligned_actor

    class ActorStandIn(torch.nn.Module):  # what aligned_actor needs of openrlhf.models.Actor
        def __init__(self, m):
            super().__init__()
            self.model, self.temperature, self.packing_samples = m, 1.0, False

    return aligned_actor(ActorStandIn(model)).model


def _patch_fsdp(model, monkeypatch):
    # shard_aligned's own patch_model call, without a process group: fully_shard is replaced by a no-op (the FSDP2
    # sharding itself: _fsdp2_mla_worker.py); what is tested is which form the trainer is patched in
    import torch.distributed.fsdp as fsdp_mod

    from aligned_ops.integrations import fsdp

    monkeypatch.setattr(fsdp_mod, "fully_shard", lambda module, **kw: module)
    return fsdp.shard_aligned(model, sum_gradients=False)


ADAPTERS = {"patch_model": _patch_plain, "verl.patch_actor": _patch_verl, "openrlhf.aligned_actor": _patch_openrlhf,
            "fsdp.shard_aligned": _patch_fsdp}


def _apply(name, model, monkeypatch):
    fn = ADAPTERS[name]
    return fn(model, monkeypatch) if name == "fsdp.shard_aligned" else fn(model)


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_adapter_form_follows_the_plugin_resolver(ds_dir, adapter, monkeypatch):
    assert resolve_mla_form() == "absorbed"
    assert _form(_apply(adapter, _load(ds_dir), monkeypatch)) == "absorbed"  # the plugin's default
    monkeypatch.setenv("ALIGNED_OPS_MLA_FORM", "expanded")
    assert _form(_apply(adapter, _load(ds_dir), monkeypatch)) == "expanded" == resolve_mla_form()
    monkeypatch.delenv("ALIGNED_OPS_MLA_FORM")
    monkeypatch.setenv("VLLM_ALIGNED_OPS_MLA_FORM", "expanded")  # the alias Ray forwards
    assert _form(_apply(adapter, _load(ds_dir), monkeypatch)) == "expanded"


def test_explicit_form_wins_and_bad_env_refused(ds_dir, monkeypatch):
    monkeypatch.setenv("ALIGNED_OPS_MLA_FORM", "expanded")
    assert _form(patch_model(_load(ds_dir), mla_form="absorbed")) == "absorbed"
    monkeypatch.setenv("ALIGNED_OPS_MLA_FORM", "absorbed")
    assert _form(patch_model(_load(ds_dir), mla_form="expanded")) == "expanded"
    monkeypatch.setenv("ALIGNED_OPS_MLA_FORM", "latent")
    with pytest.raises(ValueError, match="ALIGNED_OPS_MLA_FORM must be 'absorbed' or 'expanded', got 'latent'"):
        patch_model(_load(ds_dir))


def test_non_mla_model_gets_no_form(tmp_path, monkeypatch):
    # negative control: the env is ignored for an architecture without MLA (no form recorded, no refusal)
    monkeypatch.setenv("ALIGNED_OPS_MLA_FORM", "absorbed")
    from transformers import AutoModelForCausalLM

    d = build_tiny_qwen2(tmp_path / "q", torch.float32, num_hidden_layers=1)
    assert _form(patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32))) is None


@pytest.mark.parametrize("field", ["rope_parameters", "rope_scaling"])
def test_attention_factor_one_is_refused(ds_dir, field):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(ds_dir)
    check_hf_config(cfg, "test")  # positive control: the tiny DeepSeek YaRN config passes
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    assert rope.get("rope_type", rope.get("type")) == "yarn"
    for name in ("rope_parameters", "rope_scaling"):
        if hasattr(cfg, name):
            setattr(cfg, name, dict(rope))
    setattr(cfg, field, dict(rope, attention_factor=1.0))
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM rope_scaling attention_factor=1.0 is not supported"):
        check_hf_config(cfg, "test")
    # another attention_factor: vLLM keeps deepseek_yarn but its table ignores attention_factor (HF's uses it;
    # found: 1.2 on the tiny model, 0 % bitwise, max |diff| 2.3 nats)
    setattr(cfg, field, dict(rope, attention_factor=1.1))
    with pytest.raises(ValueError, match=r"rope_scaling with mscale=1.0, mscale_all_dim=1.0, attention_factor=1.1 is "
                                         r"not supported: HF's YaRN scales cos/sin by 1.1, vLLM's DeepSeek YaRN by 1.0"):
        check_hf_config(cfg, "test")


def test_trl_colocated_engine_form_wins_and_mismatch_refused(ds_dir):
    # S1: in colocate mode the policy follows the engine's recorded form (not the environment); S2: the form is
    # read from an AsyncLLM-like engine (.vllm_config) as well as from an LLM (.llm_engine.vllm_config)
    pytest.importorskip("vllm")
    import types

    from aligned_ops.integrations.trl import _engine_form, _repatch
    from aligned_ops.integrations.vllm.config import engine_mla_form

    cfg = types.SimpleNamespace(additional_config={"aligned_ops_mla_form": "expanded"})
    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(vllm_config=cfg))
    assert engine_mla_form(llm) == engine_mla_form(types.SimpleNamespace(vllm_config=cfg)) == "expanded"
    assert engine_mla_form(cfg) == "expanded"
    assert engine_mla_form(types.SimpleNamespace(vllm_config=types.SimpleNamespace(additional_config={}))) is None
    trainer = types.SimpleNamespace(use_vllm=True, vllm_generation=types.SimpleNamespace(mode="colocate", llm=llm))
    assert _engine_form(trainer) == "expanded"
    assert _engine_form(types.SimpleNamespace(use_vllm=False)) is None
    model = _load(ds_dir)
    _repatch(model, None, _engine_form(trainer))  # env unset (default absorbed): the engine's expanded wins
    assert _form(model) == "expanded"
    absorbed = patch_model(_load(ds_dir))  # the default form, which this engine does not run
    with pytest.raises(ValueError, match="patched with mla_form='absorbed', but the colocated vLLM engine runs the "
                                         "'expanded' MLA form"):
        _repatch(absorbed, None, "expanded")
