"""Trainer side, DeepSeek-V3 (issue 23 items 2-3): HF ``DeepseekV3ForCausalLM`` patched through aligned_ops —
expanded MLA (q/kv LoRA, rope on the rope slice, DeepSeek YaRN + mscale), grouped sigmoid routing with the fp32
correction bias, routed + shared experts, a dense first layer — is close to float64 stock HF, and a sequence's
log-probs are the same bits alone, in a padded batch, packed, and chunked (a prefix scored alone). The invariance
and float64 checks are the MoE tests' (_hf_moe_checks.py); this file adds what DeepSeek-V3 brings."""

import pytest
import torch
from _hf_moe_checks import check_batch_padding_packing_chunking, check_close_to_float64_stock_hf, single

from aligned_ops.integrations.hf import completion_logprobs, patch_model
from aligned_ops.testing import assert_bitwise_equal, bits
from aligned_ops.testing.rollouts import random_sequences
from aligned_ops.testing.tiny_model import build_tiny_deepseek_v3

CASES = {
    "fp32": (torch.float32, {}),
    "bf16": (torch.bfloat16, {}),
    "fp32-no-q-lora-kimi-groups": (torch.float32, {"q_lora_rank": None, "n_group": 1, "topk_group": 1,
                                                   "routed_scaling_factor": 2.827, "num_experts_per_tok": 3}),
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    dtype, over = CASES[request.param]
    d = build_tiny_deepseek_v3(tmp_path_factory.mktemp("ds") / "m", dtype, seed=3, **over)
    # pinned: this module covers the expanded form (patch_model's default follows ALIGNED_OPS_MLA_FORM, absorbed;
    # the absorbed form's tests: test_hf_deepseek_v3_absorbed.py)
    return patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=dtype), mla_form="expanded")


LENS = [5, 33, 2, 47, 9]


def test_checkpoint_as_vllm_reads_it(model, tmp_path):
    cfg = model.config
    assert cfg.architectures == ["DeepseekV3ForCausalLM"]
    d = build_tiny_deepseek_v3(tmp_path / "c", torch.bfloat16, seed=1)
    import json

    raw = json.load(open(d + "/config.json"))
    assert raw["scoring_func"] == "sigmoid" and raw["topk_method"] == "noaux_tc"
    from safetensors.torch import load_file

    sd = load_file(d + "/model.safetensors")
    biases = [k for k in sd if k.endswith("e_score_correction_bias")]
    assert len(biases) == 2 and all(sd[k].dtype == torch.float32 for k in biases)
    assert float(sd[biases[0]].abs().max()) > 0  # random, not HF's zeros: the bias takes part in the routing
    layers = model.model.layers
    assert not hasattr(layers[0].mlp, "experts") and hasattr(layers[1].mlp, "experts")
    assert layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_batch_padding_packing_chunking_invariance(model):
    check_batch_padding_packing_chunking(model, LENS, pad=3)


def test_negative_control_bias_and_scale_reach_the_bits(model):
    """The invariance above can fail: the same sequence with the correction bias of one layer changed, or a
    different routed scaling factor, gives other bits (the routing inputs really are used)."""
    s = random_sequences([24], 7)[0]
    ref, ex = single(model, s, 1)
    gate = model.model.layers[2].mlp.gate
    old_bias, old_scale = gate.e_score_correction_bias.clone(), gate.routed_scaling_factor
    try:
        with torch.no_grad():
            gate.e_score_correction_bias.add_(torch.linspace(-0.5, 0.5, old_bias.numel()))
        lp_b, ex_b = single(model, s, 1)
        gate.e_score_correction_bias.copy_(old_bias)
        gate.routed_scaling_factor = old_scale * 1.01
        lp_s, _ = single(model, s, 1)
    finally:
        gate.e_score_correction_bias.copy_(old_bias)
        gate.routed_scaling_factor = old_scale
    assert not torch.equal(ex_b[:, 1], ex[:, 1])  # the bias changed layer 2's choices
    assert not torch.equal(bits(lp_b), bits(ref)) and not torch.equal(bits(lp_s), bits(ref))
    assert_bitwise_equal(single(model, s, 1)[0], ref)  # restored: the same bits again


def test_close_to_float64_stock_hf(model):
    check_close_to_float64_stock_hf(model)


def test_backward_runs_and_bias_gets_no_gradient(model):
    if next(model.parameters()).dtype != torch.float32:
        pytest.skip("fp32 model only")
    s = random_sequences([20], 4)[0]
    cm = torch.zeros(1, 20, dtype=torch.long)
    cm[0, 5:] = 1
    model.zero_grad()
    lp = completion_logprobs(model, s[None], cm)
    lp.sum().backward()
    router = model.model.layers[1].mlp.gate
    attn = model.model.layers[1].self_attn
    assert router.weight.grad is not None and torch.isfinite(router.weight.grad).all()
    assert float(router.weight.grad.abs().max()) > 0  # the routing weights' gradient reaches the router
    for name in ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        mod = getattr(attn, name, None)
        if mod is not None:
            assert mod.weight.grad is not None and float(mod.weight.grad.abs().max()) > 0, name
    assert router.e_score_correction_bias.grad is None  # a buffer; moe.h: it only selects
    model.zero_grad()


def test_refusals(tmp_path):
    from transformers import AutoModelForCausalLM

    d = build_tiny_deepseek_v3(tmp_path / "m", torch.float32, seed=2)
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    m.model.layers[1].mlp.gate.e_score_correction_bias.data = m.model.layers[1].mlp.gate.e_score_correction_bias.bfloat16()
    with pytest.raises(ValueError, match="e_score_correction_bias is torch.bfloat16; it must stay float32"):
        patch_model(m)
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    m.model.layers[0].self_attn.scaling *= 2
    with pytest.raises(ValueError, match="attention scale .* is not DeepSeek's"):
        patch_model(m)
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    m.config.scoring_func = "softmax"
    with pytest.raises(ValueError, match="scoring_func must be 'sigmoid'"):
        patch_model(m)
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float16)
    with pytest.raises(ValueError, match="in float16 is not supported"):
        patch_model(m)
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    m.config.rope_scaling = dict(m.config.rope_parameters or m.config.rope_scaling or {}, attention_factor=1.0)
    m.config.rope_parameters = dict(m.config.rope_scaling)
    with pytest.raises(ValueError, match="rope_scaling attention_factor=1.0 is not supported"):
        patch_model(m)
    # positive control: the untouched checkpoint patches
    patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32))


def test_trainer_runs_the_spec(model):
    """The patched forward runs exactly the architecture's op sequence (models/deepseek_v3.py spec): MLA's
    projections and norms, rotary on the rope slice (GPT-J pairing), the DeepSeek scale, the fp32 router,
    moe_grouped_routing, moe_experts; dense MLP only in layer 0."""
    from aligned_ops.model_spec import model_spec
    from aligned_ops.rope import deepseek_attention_scale
    from aligned_ops.testing.trace import logical_steps, op_scalars, spec_steps, trace_aligned_ops

    ids = torch.arange(3, 9)[None]
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with trace_aligned_ops() as t, torch.no_grad():
        model(input_ids=ids, completion_mask=mask)
    spec = model_spec(model.config)
    assert logical_steps(t.calls) == spec_steps(spec)
    ops = [s.op for s in spec.steps]
    assert ops.count("moe_grouped_routing") == 2 and ops.count("silu_and_mul") == 1
    cfg = model.config
    assert op_scalars(t.calls, "rotary_embedding") == {(cfg.qk_rope_head_dim, False)}
    scale = deepseek_attention_scale(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg)
    assert scale != (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5  # YaRN's mscale^2 is in it
    scales = {s[1] for s in op_scalars(t.calls, "attention_varlen_planned")} | {
        s[0] for s in op_scalars(t.calls, "attention_varlen")}
    assert scales == {scale}
    routers = [c for c in t.calls if c.name == "aligned::linear" and c.shapes[1][0] == cfg.n_routed_experts]
    assert len(routers) == 2 and all(c.dtypes[:2] == (torch.float32, torch.float32) for c in routers)


def test_tuple_output_indexes_as_hf_s(model):
    # HF's DeepSeek-V3 returns no aux_loss: with return_dict=False its tuple is (loss, logits, ...). Was: the patched
    # tuple put aux_loss at [1] when output_router_logits=True, so out[1] was a scalar where HF has the logits.
    # Control: a Qwen-MoE's HF class does return it at [1] (test_hf_moe.py), and the dict form keeps the field.
    s = random_sequences([11], 6)[0][None]
    with torch.no_grad():
        full = model(s, labels=s, output_router_logits=True)
        tup = model(s, labels=s, output_router_logits=True, return_dict=False)
    assert full.aux_loss is not None
    assert len(tup) == 2
    assert_bitwise_equal(tup[0], full.loss)
    assert_bitwise_equal(tup[1], full.logits)
