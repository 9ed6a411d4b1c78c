"""MoE (Qwen3-MoE, Qwen2-MoE): the router projection and the fused-MoE layer through the shared op sequence.

``MoERunner.forward`` (the ``FusedMoE`` layer, unquantized) -> :func:`aligned_ops.models.moe.sparse_moe`: router
linear (the rules' router profile on the gate weight) -> ``aligned::moe_routing`` -> ``aligned::moe_experts``
with the shared expert and its sigmoid gate folded in (the same function the trainer's HF blocks run);
``GateLinear.forward`` -> the rules' router linear. The experts' CPU weight pre-packing is skipped
(``w13_weight``/``w2_weight`` stay plain ``[E, 2I, H]`` / ``[E, H, I]``, so refit works). vLLM's routed-experts
capture hook still sees the chosen ids. At tensor parallelism (vLLM gives each rank every expert's I slice and
the shared expert's; router and shared gate replicated) the experts run the profile's
``row_parallel_moe_experts``: each expert's down-projection sub-trees meet in the tree all-reduce before moe.h's
combine, so the block's bits are the single-device ones (vLLM would all-reduce the combined outputs).
Anything else in a MoE layer (quantized experts, expert/data/sequence parallelism, other activations, ...)
raises ``NotImplementedError`` when the layer first runs.
"""

from __future__ import annotations

import torch

from ...models import rules_of
from ...profiles import profile_of
from ...models.moe import MoEWeights, sparse_moe
from .layers import keep_weight_after_loading


def _gate_linear_forward(self, x):
    # GateLinear (the MoE router projection): the rules' router linear in the model dtype, whatever tier vLLM
    # picked; a router whose weight vLLM keeps in fp32 (GLM-4.5: params_dtype fp32, fp32 logits) takes x widened
    # exactly to fp32 — linear(x.float(), W.float()), what the trainer's grouped block computes (models.moe)
    weight = self.weight
    if weight.dtype == torch.float32 and x.dtype != torch.float32:
        # HF (and so the trainer) holds this weight in the model dtype: a checkpoint that stores it in fp32 is
        # rounded at load there, kept whole here. Round it the same way (once per weight version; a checkpoint in
        # the model dtype round-trips exactly), or an fp32 checkpoint would route by other logits than the trainer's
        from ...ops.linear_exact import cached_derivation

        weight = cached_derivation(weight, ("router_through", x.dtype), lambda w: w.to(x.dtype).float())
        x = x.float()
    out = rules_of(self).router_linear(x, weight, getattr(self, "bias", None))
    return (out, None) if getattr(self, "return_bias", True) else out


def _moe_layer_spec(runner):
    """(top_k, scoring, renormalize) of a vLLM MoE runner, after checking we can reproduce it (cached)."""
    spec = getattr(runner, "_aligned_moe_spec", None)
    if spec is not None:
        return spec
    reasons = []
    router = runner.router
    # DeepSeek-V3's noaux_tc routing (grouped top-k on sigmoid + correction bias, routed scaling): the grouped
    # op (aligned::moe_grouped_routing) on fp32 router logits, as the trainer's DeepSeek block runs it
    grouped = bool(getattr(router, "use_grouped_topk", False))
    if type(router).__name__ not in ("FusedTopKRouter", "CPURouter"):
        reasons.append(f"router {type(router).__name__} (only plain or CPU top-k routing)")
    if getattr(router, "custom_routing_function", None) is not None:
        reasons.append("a custom routing function")
    bias = getattr(router, "e_score_correction_bias", None)
    if grouped:
        if getattr(router, "scoring_func", "softmax") != "sigmoid":
            reasons.append("grouped top-k with softmax scores")
        if bias is not None and bias.dtype != torch.float32:
            reasons.append(f"e_score_correction_bias in {bias.dtype} (must stay float32)")
        # without the gate module (GLM-4.5 runs its GateLinear before the layer) the router logits come in: they
        # must be the fp32 ones of the hooked GateLinear (checked per call, _moe_runner_forward)
    else:
        if bias is not None:
            reasons.append("e_score_correction_bias")
        if getattr(router, "routed_scaling_factor", 1.0) not in (None, 1.0):
            reasons.append("routed_scaling_factor != 1")
    if getattr(router, "_hash_indices_table", None) is not None:
        reasons.append("hash routing")
    scoring = getattr(router, "scoring_func", "softmax")
    if scoring not in ("softmax", "sigmoid"):
        reasons.append(f"scoring_func {scoring!r}")
    re = runner.routed_experts
    qm = type(re.quant_method).__name__
    if qm not in ("UnquantizedFusedMoEMethod", "AlignedUnquantizedFusedMoEMethod"):
        reasons.append(f"quantized experts ({qm})")
    if not grouped and (getattr(re, "routed_scaling_factor", 1.0) != 1.0
                        or getattr(runner, "routed_scaling_factor", 1.0) != 1.0):
        reasons.append("routed_scaling_factor != 1")
    if getattr(re, "num_fused_shared_experts", 0) or getattr(router, "num_fused_shared_experts", 0):
        reasons.append("shared experts fused into the routed ones")
    if getattr(re, "apply_router_weight_on_input", False):
        reasons.append("apply_router_weight_on_input")
    re_bias = getattr(re, "e_score_correction_bias", None)
    if re_bias is not None and not (grouped and re_bias is bias):
        reasons.append("e_score_correction_bias (on the experts, not the router)")
    mc = runner.moe_config
    if str(getattr(mc, "activation", "silu")).split(".")[-1].lower() not in ("silu",):
        reasons.append(f"activation {mc.activation}")
    if getattr(mc, "has_bias", False):
        reasons.append("expert biases")
    if runner.routed_input_transform is not None or runner.routed_output_transform is not None:
        reasons.append("routed input/output transforms")
    if runner.shared_expert_gate is not None:
        reasons.append("a runner-level shared_expert_gate")
    if re.w13_weight.dim() != 3 or re.w2_weight.dim() != 3 or re.w13_weight.shape[1] != 2 * re.w2_weight.shape[2]:
        reasons.append("padded or re-packed expert weights")
    else:
        # Backends that pad I per rank (vLLM rounds it up for FLASHINFER_TRTLLM / AITER) or H pad w13 and w2 alike, so
        # the shapes agree with each other: compare with the model's sizes, or the lane cut (and the TP slices'
        # lanes) would silently move.
        tp = max(int(getattr(mc, "tp_size", 1) or 1), 1)
        inter = getattr(mc, "intermediate_size", None)
        unpadded = getattr(mc, "intermediate_size_per_partition_unpadded", None)
        width = int(re.w2_weight.shape[2])
        if (inter is not None and width * tp != int(inter)) or (unpadded is not None and width != int(unpadded)):
            reasons.append(f"expert intermediate size padded per rank ({width} held, the model's "
                           f"{inter} over {tp} ranks)")
        hidden = getattr(mc, "hidden_dim_unpadded", None)
        if hidden is not None and int(re.w2_weight.shape[1]) != int(hidden):
            reasons.append(f"expert hidden size padded ({int(re.w2_weight.shape[1])} held, the model's {hidden})")
    # Tensor parallelism (every expert's I sliced per rank, the router and the shared gate replicated) is covered:
    # the experts' down-projection sub-trees meet in the tree all-reduce before moe.h's combine
    # (_moe_runner_forward). Expert and data parallel MoE (experts placed per rank, all-to-all dispatch) are not.
    if getattr(mc, "ep_size", 1) != 1 or getattr(mc, "use_ep", False):
        reasons.append("expert parallel MoE (enable_expert_parallel): use tensor parallelism")
    if getattr(mc, "dp_size", 1) != 1:
        reasons.append("data parallel MoE (experts shared across data-parallel ranks)")
    if getattr(mc, "is_sequence_parallel", False):
        reasons.append("sequence parallel MoE")
    if getattr(mc, "skip_final_all_reduce", False):
        reasons.append("a fused-MoE layer whose all-reduce is deferred to the model (reduce_results=False)")
    if reasons:
        raise NotImplementedError("aligned_ops: this MoE layer cannot be kept aligned: " + "; ".join(reasons))
    spec = (int(router.top_k), "sigmoid_grouped" if grouped else scoring, bool(getattr(router, "renormalize", True)))
    runner._aligned_moe_spec = spec
    return spec


def _grouped_fields(runner) -> dict:
    """MoEWeights' grouped-routing fields of a runner whose router is grouped (the scaling factor sits on the router
    or, with apply_routed_scale_to_output, on the runner: the other one is 1)."""
    router = runner.router
    scale = float(getattr(router, "routed_scaling_factor", 1.0) or 1.0) * float(
        getattr(runner, "routed_scaling_factor", 1.0) or 1.0)
    return dict(correction_bias=router.e_score_correction_bias, n_group=int(router.num_expert_group or 1),
                topk_group=int(router.topk_group or 1), routed_scaling_factor=scale, router_dtype=torch.float32)


def _shared_expert_weights(runner):
    shared = getattr(runner, "_shared_experts", None)
    if shared is None:
        return None, None, None
    layer = shared._layer
    gate = getattr(layer, "expert_gate", None)
    return layer.gate_up_proj.weight, layer.down_proj.weight, (gate.weight if gate is not None else None)


def _shared_intermediate_size(runner) -> int | None:
    """The shared expert's whole I (its down projection's input size before the TP split); None without one."""
    shared = getattr(runner, "_shared_experts", None)
    return None if shared is None else int(shared._layer.down_proj.input_size)


def runner_weights(runner) -> MoEWeights:
    """A vLLM fused-MoE runner's routing and weights, after checking we can reproduce them."""
    top_k, scoring, renormalize = _moe_layer_spec(runner)
    sw13, sw2, sgate = _shared_expert_weights(runner)
    re = runner.routed_experts
    router = runner.gate.weight if runner.gate is not None else None
    extra = _grouped_fields(runner) if scoring == "sigmoid_grouped" else {}
    return MoEWeights(router, top_k, scoring, renormalize, re.w13_weight, re.w2_weight, sw13, sw2, sgate, **extra)


_moe_trace: list | None = None


def _moe_runner_forward(self, hidden_states, router_logits, input_ids=None, shared_experts_input=None):
    """FusedMoE through :func:`aligned_ops.models.moe.sparse_moe` (the op sequence the trainer's blocks run)."""
    weights = runner_weights(self)
    x = hidden_states.contiguous()
    capture = getattr(self.router, "capture_fn", None)

    def record(ids, scores):
        if capture is not None:  # vLLM's routed-experts output (enable_return_routed_experts)
            capture(ids.to(torch.int32))
        if _moe_trace is not None:
            _moe_trace.append((self.layer_name, ids))

    profile = profile_of(self)
    if self.gate is None and weights.scoring == "sigmoid_grouped" and router_logits.dtype != torch.float32:
        raise NotImplementedError(f"aligned_ops: grouped MoE routing needs fp32 router logits (a GateLinear with an "
                                  f"fp32 weight, as GLM-4.5's); got {router_logits.dtype}")
    experts = None
    if self.moe_config.tp_size > 1:
        # TP: this rank holds every expert's I slice; the replicated router routes identically on every rank (x is
        # the same there: the attention's row-parallel route gave every rank the single-device bits)
        from .tp import _tp_group, moe_combine

        group = _tp_group().device_group
        combine = moe_combine()

        sizes = dict(intermediate_size=self.moe_config.intermediate_size,  # the model's whole I: its slices
                     shared_intermediate_size=_shared_intermediate_size(self))  # must be whole lanes

        def experts(*args):  # check=False: the ranks hold one configured model's shards (tp.py, row-parallel)
            return profile.row_parallel_moe_experts(*args, group=group, combine=combine, check=False, **sizes)

    # Qwen3-MoE hands the router to the runner (router_logits is then the hidden state): routed here;
    # Qwen2-MoE runs its gate (GateLinear, hooked) before the layer and passes the logits in.
    return sparse_moe(rules_of(self), x, weights, router_logits=None if self.gate is not None else router_logits,
                      record=record, profile=profile, experts=experts)


def oot_hooks() -> dict:
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    return {
        GateLinear: dict(forward=_gate_linear_forward),                    # PluggableLayer (MoE router)
        MoERunner: dict(forward=_moe_runner_forward),                      # PluggableLayer (FusedMoE's runner)
        UnquantizedFusedMoEMethod: dict(process_weights_after_loading=keep_weight_after_loading),  # CustomOp
    }
