"""The vLLM plugin's MoE layer check: what aligned::moe_* cannot reproduce raises, naming the reason (no engine)."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.integrations.vllm import moe as vllm_moe  # noqa: E402


class CPURouter(SimpleNamespace):
    pass


class UnquantizedFusedMoEMethod:
    pass


def _runner(**router_kw):
    router = CPURouter(top_k=2, scoring_func="softmax", renormalize=True, use_grouped_topk=False,
                       custom_routing_function=None, e_score_correction_bias=None, routed_scaling_factor=1.0,
                       _hash_indices_table=None)
    for k, v in router_kw.items():
        setattr(router, k, v)
    experts = SimpleNamespace(quant_method=UnquantizedFusedMoEMethod(), routed_scaling_factor=1.0,
                              apply_router_weight_on_input=False, w13_weight=torch.zeros(4, 16, 8),
                              w2_weight=torch.zeros(4, 8, 8))
    return SimpleNamespace(router=router, routed_experts=experts, routed_scaling_factor=1.0,
                           moe_config=SimpleNamespace(activation="silu", has_bias=False, ep_size=1, tp_size=1,
                                                      dp_size=1),
                           routed_input_transform=None, routed_output_transform=None, shared_expert_gate=None)


def test_plain_topk_accepted_and_cached():
    r = _runner()
    assert vllm_moe._moe_layer_spec(r) == (2, "softmax", True)
    assert r._aligned_moe_spec == (2, "softmax", True)
    assert vllm_moe._moe_layer_spec(_runner(scoring_func="sigmoid", renormalize=False)) == (2, "sigmoid", False)


def test_grouped_sigmoid_with_fp32_bias_accepted_as_the_grouped_op():
    """DeepSeek-V3's noaux_tc routing: grouped top-k on sigmoid + fp32 bias, routed scaling on the router or the
    runner (apply_routed_scale_to_output) -> aligned::moe_grouped_routing with the product of the two."""
    bias = torch.zeros(4)
    r = _runner(use_grouped_topk=True, scoring_func="sigmoid", e_score_correction_bias=bias, routed_scaling_factor=2.5,
                num_expert_group=2, topk_group=1)
    r.routed_experts.e_score_correction_bias = bias  # vLLM hands the same tensor to both
    r.gate = SimpleNamespace(weight=torch.zeros(4, 8))
    assert vllm_moe._moe_layer_spec(r) == (2, "sigmoid_grouped", True)
    f = vllm_moe._grouped_fields(r)
    assert f["correction_bias"] is bias and (f["n_group"], f["topk_group"], f["routed_scaling_factor"]) == (2, 1, 2.5)
    assert f["router_dtype"] == torch.float32
    r2 = _runner(use_grouped_topk=True, scoring_func="sigmoid", e_score_correction_bias=bias.bfloat16(),
                 num_expert_group=2, topk_group=1)
    r2.gate = r.gate
    with pytest.raises(NotImplementedError, match="e_score_correction_bias in torch.bfloat16 \\(must stay float32\\)"):
        vllm_moe._moe_layer_spec(r2)


@pytest.mark.parametrize("change, reason", [
    (dict(use_grouped_topk=True), "grouped top-k"),
    (dict(e_score_correction_bias=torch.zeros(4)), "e_score_correction_bias"),
    (dict(routed_scaling_factor=2.5), "routed_scaling_factor != 1"),
    (dict(scoring_func="sqrtsoftplus"), "scoring_func 'sqrtsoftplus'"),
    (dict(custom_routing_function=lambda *a: None), "a custom routing function"),
])
def test_unsupported_routing_refused(change, reason):
    with pytest.raises(NotImplementedError, match="this MoE layer cannot be kept aligned: .*" + reason):
        vllm_moe._moe_layer_spec(_runner(**change))


def test_quantized_or_padded_experts_refused():
    r = _runner()
    r.routed_experts.quant_method = object()
    with pytest.raises(NotImplementedError, match="quantized experts"):
        vllm_moe._moe_layer_spec(r)
    r = _runner()
    r.routed_experts.w2_weight = torch.zeros(4, 8, 16)  # intermediate padded to 16 while w13 holds 2 x 8
    with pytest.raises(NotImplementedError, match="padded or re-packed expert weights"):
        vllm_moe._moe_layer_spec(r)
    r = _runner()
    r.moe_config.activation = "gelu"
    with pytest.raises(NotImplementedError, match="activation gelu"):
        vllm_moe._moe_layer_spec(r)


def test_consistently_padded_experts_refused():
    """Backends that round I per rank up (vLLM: FLASHINFER_TRTLLM, AITER) pad w13 and w2 alike: the shapes agree
    with each other, so the model's sizes decide (otherwise the lane cut would silently move)."""
    r = _runner()
    r.moe_config.intermediate_size, r.moe_config.tp_size = 16, 2  # 8 per rank: what the fake holds
    r.moe_config.hidden_dim_unpadded = 8
    assert vllm_moe._moe_layer_spec(r) == (2, "softmax", True)  # control: unpadded passes
    r = _runner()
    r.moe_config.intermediate_size, r.moe_config.tp_size = 12, 2  # 6 per rank, padded to 8 in both weights
    with pytest.raises(NotImplementedError, match="expert intermediate size padded per rank \\(8 held, the model's 12 "
                                                  "over 2 ranks\\)"):
        vllm_moe._moe_layer_spec(r)
    r = _runner()
    r.moe_config.intermediate_size_per_partition_unpadded = 6
    with pytest.raises(NotImplementedError, match="expert intermediate size padded per rank"):
        vllm_moe._moe_layer_spec(r)
    r = _runner()
    r.moe_config.hidden_dim_unpadded = 6
    with pytest.raises(NotImplementedError, match="expert hidden size padded \\(8 held, the model's 6\\)"):
        vllm_moe._moe_layer_spec(r)


def test_tensor_parallel_moe_accepted_expert_data_sequence_parallel_refused():
    """TP (every expert's I slice per rank) runs the experts' TP route; placements it does not cover refuse."""
    r = _runner()
    r.moe_config.tp_size = 2
    assert vllm_moe._moe_layer_spec(r) == (2, "softmax", True)
    for field, value, reason in (("ep_size", 2, "expert parallel MoE"), ("use_ep", True, "expert parallel MoE"),
                                 ("dp_size", 2, "data parallel MoE"), ("is_sequence_parallel", True,
                                                                       "sequence parallel MoE"),
                                 ("skip_final_all_reduce", True, "all-reduce is deferred to the model")):
        r = _runner()
        setattr(r.moe_config, field, value)
        with pytest.raises(NotImplementedError, match="this MoE layer cannot be kept aligned: .*" + reason):
            vllm_moe._moe_layer_spec(r)
