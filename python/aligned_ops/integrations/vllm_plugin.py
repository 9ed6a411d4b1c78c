"""vLLM plugin: route a Qwen2/Qwen3/Llama model through ``torch.ops.aligned`` inside vLLM.

Activation: the package declares the entry point ``vllm.general_plugins: aligned_ops =
aligned_ops.integrations.vllm_plugin:register``. vLLM calls :func:`register` in every process it starts
(API process, engine core, workers); it does nothing unless ``ALIGNED_OPS_VLLM=1`` is set in the
environment. (``aligned_ops.integrations.rollout.make_llm(aligned=True)`` sets it and calls
:func:`install` directly, which also works where the package is not pip-installed.)

What it replaces (for every model vLLM builds in the process afterwards). Where vLLM 0.32 offers an
out-of-tree hook the layer is replaced through it (``register_oot`` of a ``CustomOp`` or ``PluggableLayer``:
RMSNorm, SiluAndMul, RowParallelLinear, VocabParallelEmbedding, GateLinear, MoERunner,
UnquantizedFusedMoEMethod); the rest are class patches, each listed with the reason in ``_patched_classes()``.
Every hook applies the layer rules of :mod:`aligned_ops.model_spec` (``rules_for(arch)``, looked up per call
in eager mode — once, at tracing, in compiled mode — for the architecture recorded when vLLM built the layer):
the same rules the trainer patch applies.

- ``RMSNorm`` (plain and fused residual) -> ``aligned::rms_norm`` / ``aligned::fused_add_rms_norm``
- ``SiluAndMul`` -> ``aligned::silu_and_mul``
- ``RotaryEmbedding`` (plain, llama3, yarn, linear, dynamic NTK) -> ``aligned::rotary_embedding`` with the table
  of ``aligned_ops.rope.cos_sin_cache`` (the same builder and spec the trainer uses), built when vLLM
  constructs the module
- ``UnquantizedLinearMethod`` (QKV, o_proj, gate_up, down) and ``UnquantizedEmbeddingMethod.apply`` (LM head)
  -> ``aligned::linear`` (the layer rules' profile: ``linear_exact`` under ``exact``, ``linear_mma`` under ``mma``); their CPU weight re-packing is skipped, so ``layer.weight`` stays a plain tensor
  and ``load_weights`` (refit) keeps working
- tensor parallelism (TP = 2, 4, 8): ``RowParallelLinear.forward`` (o_proj, down_proj) -> each rank's
  8-lane sub-tree (``aligned::linear_partial``) finished by ``aligned_ops.ops.collective.tree_all_reduce``, bias
  once after (the ``mma`` profile: the same tree over ``aligned::linear_mma_partial``; the ``exact`` profile:
  integer partials and an exact int64 all-reduce, ``aligned_ops.ops.collective.exact_row_parallel_linear``,
  eager mode); ``VocabParallelEmbedding.forward`` ->
  an exact owner-copy combine that keeps -0.0; vLLM's own
  TP all-reduce (shared memory on CPU) raises if anything else reaches it
- the attention backend -> :class:`~aligned_ops.integrations.vllm_attention.AlignedAttentionBackend`
  (overrides ``CPU_ATTN`` on CPU; registered as ``CUSTOM`` and selected on CUDA/ROCm)
- MoE (Qwen3-MoE, Qwen2-MoE): ``MoERunner.forward`` (the ``FusedMoE`` layer, unquantized) -> router linear
  (``aligned::linear`` on the gate weight) -> ``aligned::moe_routing`` -> ``aligned::moe_experts`` with the
  shared expert and its sigmoid gate folded in (the same ops ``hf_moe.py`` runs); ``GateLinear.forward`` ->
  ``aligned::linear``. The experts' CPU weight pre-packing is skipped (``w13_weight``/``w2_weight`` stay plain
  ``[E, 2I, H]`` / ``[E, H, I]``, so refit works). vLLM's routed-experts capture hook still sees the chosen ids.
  Anything else in a MoE layer (grouped top-k, score-correction bias, routed scaling, quantized experts,
  expert parallelism, other activations) raises ``NotImplementedError`` when the layer first runs.
- ``Sampler.compute_logprobs`` -> ``aligned::log_softmax`` over the full vocabulary in fp32 at the
  request's sampling temperature (greedy / temperature 0 is scored at 1.0): the default
  (``logprobs_mode="raw_logprobs"``) returns the log-prob of the *untruncated* tempered distribution.
- with ``logprobs_mode="processed_logprobs"``: min-p (``MinPLogitsProcessor.apply``) and top-k/top-p
  (``TopKTopPSampler``) use ``aligned_ops.sampling``'s recipe, vLLM samples from those truncated logits, and
  the returned log-prob is ``aligned::log_softmax`` of them — the distribution actually sampled from;
  ``hf.completion_logprobs(..., top_k=, top_p=, min_p=)`` gives the same bits.

Covered (tested end to end, ``tests/integrations/test_vllm_rl_features.py``): prefix caching (a cache hit is
one more chunk boundary: attention tiles are aligned to absolute positions), ``n`` samples per prompt,
eviction/preemption, compiled mode (``enforce_eager=False``; vLLM-CPU's inductor compile; bitwise equal to
eager), chunked prefill.

At engine start-up (``EngineArgs.create_engine_config``) it refuses, with one ``ValueError`` listing every
reason, configurations it cannot keep aligned: other architectures or RoPE variants (and partial rotary),
quantization, a non-``auto`` KV-cache dtype, speculative decoding, a tensor-parallel size other than 1, 2,
4 or 8, pipeline parallelism, and
``logprobs_mode`` ``raw_logits`` / ``processed_logits``.
"""

from __future__ import annotations

import contextvars
import os

import torch

import aligned_ops
import aligned_ops.ops.collective

from ..model_spec import architecture_of, rules_for, rules_of
from ..sampling import effective_temperature
from . import MOE_ARCHITECTURES, SUPPORTED_DTYPES, check_hf_config

ENV_VAR = "ALIGNED_OPS_VLLM"
SUPPORTED_VLLM_VERSIONS = ("0.32.0",)

_installed = False
_MISSING = object()
_originals: dict = {}
_current_temperature: contextvars.ContextVar = contextvars.ContextVar("aligned_ops_temperature", default=None)
_processed_mode: contextvars.ContextVar = contextvars.ContextVar("aligned_ops_processed_logprobs", default=False)
SUPPORTED_LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def enabled_by_env() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """Entry point for ``vllm.general_plugins``: inert unless ``ALIGNED_OPS_VLLM=1``."""
    if enabled_by_env():
        install()


def is_installed() -> bool:
    return _installed


def check_vllm_version() -> str:
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    base = version.split("+")[0]
    if base not in SUPPORTED_VLLM_VERSIONS:
        raise RuntimeError(
            f"aligned_ops vLLM plugin supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}; found {version}. "
            f"Install the pinned version or unset {ENV_VAR}."
        )
    return version


# ---- layer hooks ---------------------------------------------------------------------------------------


def record_architecture(layer) -> None:
    # vllm_attention.record_architecture (that module imports vLLM; this one only when a hook runs)
    from .vllm_attention import record_architecture as record

    record(layer)


# Every hook reads its layer's rules with model_spec.rules_of (looked up per call; at tracing in compiled mode).


def _rms_norm_forward(self, x, residual=None):
    if not getattr(self, "has_weight", True) or getattr(self, "variance_size_override", None) is not None:
        raise NotImplementedError("aligned_ops: RMSNorm without weight or with var_hidden_size is not supported")
    return rules_of(self).apply_norm(x, self.weight.data, self.variance_epsilon, residual)


def _silu_and_mul_forward(self, x):
    return rules_of(self).activate(x)


def rope_spec_from_vllm(rot):
    """The :class:`aligned_ops.rope.RopeSpec` of a rotary module vLLM built (``get_rope``).

    Raises ``NotImplementedError`` for rotary classes whose table we do not reproduce (mrope, DeepSeek YaRN,
    LongRoPE, NTK-alpha, several linear factors, ...). The trainer describes the same RoPE from the HF config
    (``aligned_ops.rope.rope_spec_from_hf_config``); both feed ``aligned_ops.rope.cos_sin_cache``.
    """
    from vllm.model_executor.layers.rotary_embedding import (
        DynamicNTKScalingRotaryEmbedding,
        Llama3RotaryEmbedding,
        LinearScalingRotaryEmbedding,
        RotaryEmbedding,
        YaRNScalingRotaryEmbedding,
    )

    from ..rope import RopeSpec

    kind = type(rot)
    common = dict(rotary_dim=int(rot.rotary_dim), base=float(rot.base), max_position=int(rot.max_position_embeddings))
    if kind is RotaryEmbedding:
        return RopeSpec(**common)
    if kind is Llama3RotaryEmbedding:
        return RopeSpec(**common, rope_type="llama3", factor=float(rot.scaling_factor),
                        low_freq_factor=float(rot.low_freq_factor), high_freq_factor=float(rot.high_freq_factor),
                        original_max_position=int(rot.orig_max_position))
    if kind is LinearScalingRotaryEmbedding:
        if len(rot.scaling_factors) != 1:
            raise NotImplementedError("aligned_ops: linear RoPE with several scaling factors (LoRA) is not supported")
        return RopeSpec(**common, rope_type="linear", factor=float(rot.scaling_factors[0]))
    if kind is DynamicNTKScalingRotaryEmbedding:
        return RopeSpec(**common, rope_type="dynamic", factor=float(rot.scaling_factor),
                        max_trained_positions=int(rot.max_trained_positions))
    if kind is YaRNScalingRotaryEmbedding:
        # vLLM's yarn module keeps original_max_position in max_position_embeddings.
        return RopeSpec(**common, rope_type="yarn", factor=float(rot.scaling_factor),
                        original_max_position=int(rot.max_position_embeddings), beta_fast=float(rot.beta_fast),
                        beta_slow=float(rot.beta_slow), truncate=bool(rot.truncate),
                        attention_factor=float(rot.mscale))
    raise NotImplementedError(f"aligned_ops: {kind.__name__} (this RoPE variant) is not supported")


def _rotary_init(self, *args, **kwargs):
    """After vLLM's own init: build the shared table once (outside any traced forward, so compiled mode sees a
    plain buffer). Unsupported variants keep ``None`` and raise when called."""
    _originals["RotaryEmbedding.__init__"](self, *args, **kwargs)
    from ..rope import cos_sin_cache

    record_architecture(self)
    try:
        spec = rope_spec_from_vllm(self)
    except NotImplementedError as e:
        self._aligned_unsupported = str(e)
        return
    if bool(self.is_neox_style) != rules_of(self).rotary_neox:
        self._aligned_unsupported = (f"aligned_ops: rotary is_neox_style={self.is_neox_style} is not the model "
                                     "spec's rotary style")
        return
    self._aligned_unsupported = None
    self.register_buffer("_aligned_cos_sin_cache", cos_sin_cache(spec), persistent=False)


def _rotary_forward(self, positions, query, key=None):
    reason = getattr(self, "_aligned_unsupported", "aligned_ops: rotary module built before the plugin was installed")
    if reason:
        raise NotImplementedError(reason)
    cache = self._aligned_cos_sin_cache
    if cache.device != query.device:  # pragma: no cover - vLLM moves buffers with the module
        cache = cache.to(query.device)
    positions = positions.flatten().to(torch.int64)
    T = positions.shape[0]

    rules = rules_of(self)

    def rot(x):
        shape = x.shape
        y = rules.rotary(positions, x.reshape(T, -1, self.head_size).contiguous(), cache, self.rotary_dim)
        return y.view(shape)

    return rot(query), (rot(key) if key is not None else None)


def _linear_apply(self, layer, x, bias=None):
    # The rules' linear profile (fma|exact; ALIGNED_OPS_LINEAR unless the spec names one), as in the trainer.
    return rules_of(layer).linear(x, layer.weight, bias)


def _lm_head_apply(self, layer, x, bias=None):
    # UnquantizedEmbeddingMethod.apply is the LM head's logits (LogitsProcessor); the rules' head dtype.
    return rules_of(layer).head_logits(x, layer.weight, bias)


def _make_create_weights(key):
    def create_weights(self, layer, *args, **kwargs):
        """vLLM's own, then record the model architecture on the layer (its rules are looked up per call)."""
        out = _originals[key](self, layer, *args, **kwargs)
        record_architecture(layer)
        return out

    return create_weights


# ---- tensor parallelism (TP = 1, 2, 4, 8) ----------------------------------------------------------------
# Column-parallel layers (QKV, gate_up), the attention heads and the LM head's vocab shards compute whole
# output elements over the full K: already exact. Row-parallel layers (o_proj, down_proj) hold 1/t of K =
# 8/t whole lanes of the linear's 8-lane tree: each rank computes its sub-tree (linear_partial, fp32) and
# tree_all_reduce finishes the same tree; the bias is added once, after. Under the exact profile (the layer's
# rules, as every linear hook) they run collective.exact_row_parallel_linear instead: integer partials over
# the full rows' canonical forms, an exact int64 all-reduce SUM, one rounding (docs/exact_linear.md, "TP";
# eager mode only, refused by name in a traced forward). The vocab-parallel embedding's
# ranks own disjoint rows: the others contribute -0.0 (x + -0.0 == x for every x, -0.0 included), so the sum
# is an exact copy. vLLM-CPU's shared-memory all-reduce is never reached from these layers (a stock TP
# all-reduce of floating data raises while the plugin is installed, so nothing can bypass this silently).

TP_COMBINES = ("tree", "sequential", "fma")
TP_COMBINE_ENV = "ALIGNED_OPS_TP_COMBINE"  # "sequential", "fma": NEGATIVE CONTROLS ONLY (break the contract)
_tp_combine = "tree"


def _warn_negative_control(mode):
    if mode != "tree":
        import warnings

        warnings.warn(f"aligned_ops vLLM plugin: row-parallel combine {mode!r} is a NEGATIVE CONTROL: it breaks the "
                      "contract (and overrides the exact profile's integer route); log-probs will differ from the "
                      "trainer's", RuntimeWarning, stacklevel=3)


def _set_tp_combine_in_worker(worker, mode):
    global _tp_combine
    if mode not in TP_COMBINES:
        raise ValueError(f"tp combine must be one of {TP_COMBINES}, got {mode!r}")
    _warn_negative_control(mode)
    _tp_combine = mode
    return mode


def set_tp_combine(llm, mode: str) -> None:
    """NEGATIVE CONTROLS ONLY: switch a running engine's row-parallel combine ("tree", "sequential" or "fma")
    in every worker. "sequential" adds the same 8 lane sums left to right, which breaks the contract (tests show
    the log-probs then differ from the trainer's); "fma" runs the fma profile's tree whatever the layer's profile
    (the route the exact profile took at TP > 1 before it had its own: its log-probs differ from an exact
    trainer's). "tree": the layer's profile's own route (fma: the tree; exact: integer partials)."""
    llm.collective_rpc(_set_tp_combine_in_worker, args=(mode,))


def _tp_group():
    from vllm.distributed import get_tp_group

    return get_tp_group()


def _sequential_lane_combine(x, weight, group_coordinator, profile="fma"):
    """Negative control: the same lane sums (the layer's profile's: fma or mma chains) combined left to right
    (((l0+l1)+l2)+...) instead of the tree."""
    t = group_coordinator.world_size
    k = weight.shape[-1]
    lanes = aligned_ops.ops.collective.LINEAR_LANES // t
    lane_sum = aligned_ops.linear_mma_partial if profile == "mma" else aligned_ops.linear_partial
    sums = []
    for j in range(lanes):
        lo, hi = (j * k) // lanes, ((j + 1) * k) // lanes
        sums.append(lane_sum(x[..., lo:hi].contiguous(), weight[:, lo:hi].contiguous(), 1))
    local = torch.stack(sums)
    gathered = [torch.empty_like(local) for _ in range(t)]
    torch.distributed.all_gather(gathered, local, group=group_coordinator.device_group)
    all_lanes = [s for g in gathered for s in g]
    acc = all_lanes[0]
    for s in all_lanes[1:]:
        acc = acc + s
    return acc


def check_row_parallel_profile(layer, tp_size: int) -> str:
    """The linear profile a row-parallel layer runs at ``tp_size`` (its rules' profile, as every other linear
    hook); refuses a combination without an exact cross-rank route (so no layer can silently run another
    profile than the trainer): the exact profile's TP route inside a compiled (traced) forward."""
    profile = rules_of(layer).profile()
    if tp_size > 1 and profile == "exact" and torch.compiler.is_compiling():
        raise NotImplementedError(
            f"aligned_ops vLLM plugin: the 'exact' linear profile (ALIGNED_OPS_LINEAR=exact) at tensor "
            f"parallelism {tp_size} runs its row-parallel layers ({type(layer).__name__}) in eager mode only (its "
            f"weight packing and integer all-reduces are not traced): start the engine with enforce_eager=True, "
            f"or use tensor_parallel_size=1, or ALIGNED_OPS_LINEAR=fma on both sides.")
    return profile


def _row_parallel_forward(self, input_):
    if self.tp_size == 1:
        return self._aligned_base.forward(self, input_)
    profile = check_row_parallel_profile(self, self.tp_size)
    if not self.reduce_results:
        raise NotImplementedError("aligned_ops: a row-parallel layer without reduce_results is not supported")
    if not self.input_is_parallel:
        from vllm.distributed import split_tensor_along_last_dim

        input_ = split_tensor_along_last_dim(input_, num_partitions=self.tp_size)[self.tp_rank].contiguous()
    group = _tp_group()
    bias = None if self.skip_bias_add else self.bias
    if _tp_combine == "sequential":
        out = _sequential_lane_combine(input_, self.weight, group, profile)
        if bias is not None:
            out = out + bias.to(torch.float32)
        out = out.to(input_.dtype)
    else:
        if _tp_combine == "fma":
            profile = "fma"  # negative control only
        out = aligned_ops.ops.collective.row_parallel_linear(input_, self.weight, bias, group.device_group,
                                                         in_features=self.input_size, profile=profile)
    if not self.return_bias:
        return out
    return out, (self.bias if self.skip_bias_add else None)


def _vocab_embedding_forward(self, input_):
    if self.tp_size == 1:
        return self._aligned_base.forward(self, input_)
    from vllm.model_executor.layers.vocab_parallel_embedding import get_masked_input_and_mask

    si = self.shard_indices
    masked_input, not_owned = get_masked_input_and_mask(
        input_, si.org_vocab_start_index, si.org_vocab_end_index, si.num_org_vocab_padding,
        si.added_vocab_start_index, si.added_vocab_end_index)
    local = self.quant_method.embedding(self, masked_input.long())
    if not self.reduce_results:
        return local.masked_fill(not_owned.unsqueeze(-1), 0)
    group = self.parallel_group if self.parallel_group is not None else _tp_group()
    return aligned_ops.ops.collective.sharded_rows_all_reduce(local, not_owned, group.device_group)


def _stock_all_reduce(self, input_):
    if (self.world_size > 1 and self.unique_name.startswith("tp") and isinstance(input_, torch.Tensor)
            and input_.is_floating_point()):
        raise RuntimeError(
            "aligned_ops vLLM plugin: a stock tensor-parallel all-reduce (vLLM's shared-memory/NCCL SUM, not "
            "the 8-lane tree) was reached from a layer the plugin does not cover"
        )
    return _originals["GroupCoordinator.all_reduce"](self, input_)


def _keep_weight_after_loading(self, layer, *args, **kwargs):
    # Skip vLLM's CPU GEMM dispatch: it may re-pack or delete layer.weight (oneDNN / sgl / zentorch);
    # aligned::linear reads the plain [N, K] weight, and refit (load_weights) needs it in place.
    # A (re)load may have rewritten weights in place: the exact profile's packed digits are redone.
    aligned_ops.clear_exact_weight_cache()
    return None


def _gate_linear_forward(self, x):
    # GateLinear (the MoE router projection): the rules' router linear in the model dtype, whatever tier vLLM
    # picked.
    out = rules_of(self).router_linear(x, self.weight, getattr(self, "bias", None))
    return (out, None) if getattr(self, "return_bias", True) else out


def _moe_layer_spec(runner):
    """(top_k, scoring, renormalize) of a vLLM MoE runner, after checking we can reproduce it (cached)."""
    spec = getattr(runner, "_aligned_moe_spec", None)
    if spec is not None:
        return spec
    reasons = []
    router = runner.router
    if type(router).__name__ not in ("FusedTopKRouter", "CPURouter"):
        reasons.append(f"router {type(router).__name__} (only plain top-k routing)")
    if getattr(router, "use_grouped_topk", False):
        reasons.append("grouped top-k")
    if getattr(router, "custom_routing_function", None) is not None:
        reasons.append("a custom routing function")
    if getattr(router, "e_score_correction_bias", None) is not None:
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
    if getattr(re, "routed_scaling_factor", 1.0) != 1.0 or getattr(runner, "routed_scaling_factor", 1.0) != 1.0:
        reasons.append("routed_scaling_factor != 1")
    if getattr(re, "apply_router_weight_on_input", False):
        reasons.append("apply_router_weight_on_input")
    if getattr(re, "e_score_correction_bias", None) is not None:
        reasons.append("e_score_correction_bias")
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
    if getattr(mc, "ep_size", 1) != 1 or getattr(mc, "tp_size", 1) != 1 or getattr(mc, "dp_size", 1) != 1:
        reasons.append("expert/tensor/data parallel MoE")
    if reasons:
        raise NotImplementedError("aligned_ops: this MoE layer cannot be kept aligned: " + "; ".join(reasons))
    spec = (int(router.top_k), scoring, bool(getattr(router, "renormalize", True)))
    runner._aligned_moe_spec = spec
    return spec


def _shared_expert_weights(runner):
    shared = getattr(runner, "_shared_experts", None)
    if shared is None:
        return None, None, None
    layer = shared._layer
    gate = getattr(layer, "expert_gate", None)
    return layer.gate_up_proj.weight, layer.down_proj.weight, (gate.weight if gate is not None else None)


def _moe_runner_forward(self, hidden_states, router_logits, input_ids=None, shared_experts_input=None):
    """FusedMoE through aligned::moe_routing + moe_experts (the op sequence of hf_moe.moe_block_forward)."""
    top_k, scoring, renormalize = _moe_layer_spec(self)
    x = hidden_states.contiguous()
    if self.gate is not None:  # Qwen3-MoE hands the router to the runner (router_logits is the hidden state)
        router_logits = rules_of(self).router_linear(x, self.gate.weight)
    w, ids, _ = aligned_ops.moe_routing(router_logits.contiguous(), top_k, scoring, renormalize)
    capture = getattr(self.router, "capture_fn", None)
    if capture is not None:  # vLLM's routed-experts output (enable_return_routed_experts)
        capture(ids.to(torch.int32))
    if _moe_trace is not None:
        _moe_trace.append((self.layer_name, ids))
    sw13, sw2, sgate = _shared_expert_weights(self)
    re = self.routed_experts
    return rules_of(self).moe_experts(x, w, ids, re.w13_weight, re.w2_weight, sw13, sw2, sgate)


_moe_trace: list | None = None


def _sampler_forward(self, logits, sampling_metadata, *args, **kwargs):
    mode = kwargs.get("logprobs_mode_override") or self.logprobs_mode
    token = _current_temperature.set(sampling_metadata.temperature)
    token_p = _processed_mode.set(mode == "processed_logprobs")
    try:
        return _originals["Sampler.forward"](self, logits, sampling_metadata, *args, **kwargs)
    finally:
        _processed_mode.reset(token_p)
        _current_temperature.reset(token)


def _min_p_apply(self, logits):
    """min-p of ``aligned_ops.sampling`` (contract probabilities) in processed_logprobs mode; stock otherwise."""
    if not _processed_mode.get() or not self.min_p_count:
        return _originals["MinPLogitsProcessor.apply"](self, logits)
    from ..sampling import truncation_mask

    keep = truncation_mask(logits, min_p=self.min_p.reshape(-1))
    return logits.masked_fill_(~keep, float("-inf"))


def _make_topk_topp_forward(name):
    def forward(self, logits, generators, k, p):
        """processed_logprobs: truncate with ``aligned_ops.sampling`` (top-k, then top-p), sample from the
        truncated logits with vLLM's own sampler, return ``aligned::log_softmax`` of the truncated logits."""
        original = _originals[f"TopKTopPSampler.{name}"]
        if self.logprobs_mode != "processed_logprobs":
            return original(self, logits, generators, k, p)
        from ..sampling import truncate_logits

        x = truncate_logits(logits.to(torch.float32).contiguous(), top_k=k, top_p=p)
        sampled, _ = original(self, x, generators, None, None)  # no further truncation: x is final
        return sampled, aligned_ops.log_softmax(x, 1.0)

    forward.__name__ = name
    return forward


def _compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary fp32 log-softmax at the sampling temperature (per request row)."""
    temp = _current_temperature.get()
    logits = logits.contiguous()
    if temp is None or temp.numel() != logits.shape[0]:
        # All-greedy batch (vLLM passes no temperatures) or a call outside sampling (prompt log-probs).
        return aligned_ops.log_softmax(logits, 1.0)
    temp = temp.to(device=logits.device, dtype=torch.float32)
    temp = effective_temperature(temp)  # greedy rows are scored at tau = 1
    return aligned_ops.log_softmax(logits, temp.contiguous())


# ---- start-up validation ---------------------------------------------------------------------------------


def validate_vllm_config(vllm_config) -> None:
    """Raise ``ValueError`` listing every reason the configuration cannot be kept aligned."""
    reasons = []
    mc = vllm_config.model_config
    try:
        check_hf_config(mc.hf_config, "vLLM plugin")
    except ValueError as e:
        reasons.append(str(e).split(": ", 1)[-1])
    dtype = str(mc.dtype).replace("torch.", "")
    if dtype not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {dtype} is not supported ({', '.join(SUPPORTED_DTYPES)})")
    if getattr(mc, "quantization", None) or getattr(vllm_config, "quant_config", None) is not None:
        reasons.append(f"quantization ({mc.quantization}) is not supported")
    cc = vllm_config.cache_config
    # Prefix caching is allowed: a cache hit is one more chunk boundary for aligned::paged_attention, whose key
    # tiles are aligned to absolute positions (tests/integrations/test_vllm_rl_features.py).
    if str(getattr(cc, "cache_dtype", "auto")) != "auto":
        reasons.append(f"kv_cache_dtype {cc.cache_dtype} is not supported (use 'auto')")
    if getattr(vllm_config, "speculative_config", None) is not None:
        reasons.append("speculative decoding is not covered")
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size not in aligned_ops.ops.collective.TP_DEGREES:
        reasons.append(
            f"tensor_parallel_size {pc.tensor_parallel_size} is not supported (1, 2, 4 or 8: each rank of a "
            "row-parallel layer must hold whole lanes of the 8-lane linear tree)"
        )
    if pc.pipeline_parallel_size != 1:
        reasons.append("pipeline parallelism is not covered; use pipeline_parallel_size=1 (TP 1/2/4/8 and "
                       "data-parallel replicas are fine)")
    # Compiled mode (enforce_eager=False) is allowed, dense, MoE and TP 2: every arithmetic op of the model is
    # an opaque aligned custom op with a fake impl, so inductor only moves data around them (tested bitwise
    # against eager and the trainer: test_vllm_rl_features.py dense, test_vllm_moe_compiled.py MoE,
    # test_vllm_tp_compiled.py TP = 2 with the tree all-reduce).
    mode = str(getattr(mc, "logprobs_mode", "raw_logprobs"))
    if mode not in SUPPORTED_LOGPROBS_MODES:
        reasons.append(f"logprobs_mode {mode!r} is not supported (use 'raw_logprobs', the default, or "
                       "'processed_logprobs')")
    reasons.extend(gpu_platform_reasons(vllm_config))
    reasons.extend(mma_reasons(vllm_config))
    if reasons:
        raise ValueError("aligned_ops vLLM plugin refuses this configuration: " + "; ".join(reasons))


def mma_reasons(vllm_config, platform=None) -> list:
    """Start-up refusals of the ``mma`` linear profile (when the served model's rules run it): a CPU without the
    unit ("mma needs avx512_bf16; use ALIGNED_OPS_LINEAR=fma"), a non-bf16 model, a GPU (no mma kernels yet)."""
    mc = vllm_config.model_config
    try:
        profile = rules_for(architecture_of(mc.hf_config)).profile()
    except ValueError as e:  # a bad ALIGNED_OPS_LINEAR: say so with the other reasons
        return [str(e)]
    if profile != "mma":
        return []
    if platform is None:
        from vllm.platforms import current_platform as platform
    from ..ops.linear_mma import mma_profile_reasons

    return mma_profile_reasons(mc.dtype, "cpu" if platform.is_cpu() else str(platform.device_type))


def _clear_rope_cache() -> None:
    """Empty vLLM's get_rope cache (``_ROPE_DICT``): it is keyed by the rotary module's shape parameters, not by
    model, so without this a second engine in one process would reuse the first model's rotary module and the
    architecture recorded on it (whose rules the rotary hook reads)."""
    from vllm.model_executor.layers import rotary_embedding

    rotary_embedding._ROPE_DICT.clear()


def _create_engine_config(self, *args, **kwargs):
    global installed_linear_profile
    config = _originals["EngineArgs.create_engine_config"](self, *args, **kwargs)
    validate_vllm_config(config)
    _clear_rope_cache()
    # The profile of the model this engine serves (`aligned-ops verify` compares it with the trainer's).
    hf = getattr(getattr(config, "model_config", None), "hf_config", None)
    installed_linear_profile = rules_for(architecture_of(hf) if hf is not None else None).profile()
    return config


# ---- install / uninstall ---------------------------------------------------------------------------------


def _block_table_get_device_tensor(self, num_reqs):
    from .vllm_attention import tag_host_block_table

    return tag_host_block_table(self, _originals["BlockTable.get_device_tensor"](self, num_reqs), num_reqs)


def _patch(cls, name, new, key=None):
    if cls.__name__ not in _patched_classes():
        raise AssertionError(f"aligned_ops: {cls.__name__} is patched but not listed in _patched_classes()")
    key = key or f"{cls.__name__}.{name}"
    if key not in _originals:
        _originals[key] = cls.__dict__.get(name, _MISSING)  # _MISSING: inherited, delete on uninstall
    setattr(cls, name, new)


def _register_oot(base, **methods) -> None:
    """Hook a vLLM ``CustomOp`` or ``PluggableLayer`` the way vLLM offers: ``base.register_oot`` of a subclass
    with our ``methods``, so every ``base(...)`` vLLM builds afterwards is that subclass (their ``__new__``
    looks the exact class name up in ``op_registry_oot``). A ``forward`` is overridden (not ``forward_cpu``):
    the op must run whatever vLLM's custom-op enablement says. The subclass's ``__init__`` runs vLLM's, then
    records the model's architecture (the layer's rules are model_spec's); ``_aligned_base`` is vLLM's class."""
    from vllm.model_executor.custom_op import op_registry_oot

    if base.__name__ in _oot_registered:
        return
    if base.__name__ in op_registry_oot:
        raise RuntimeError(f"aligned_ops vLLM plugin: {base.__name__} already has an out-of-tree replacement "
                           f"({op_registry_oot[base.__name__]}); two plugins cannot both own it")

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        record_architecture(self)

    body = {"__init__": __init__, "_aligned_base": base, "__module__": __name__, **methods}
    hooked = type(f"Aligned{base.__name__}", (base,), body)
    base.register_oot(hooked)
    _oot_registered.append(base.__name__)


_oot_registered: list = []


def _oot_hooks() -> dict:
    """The layers hooked through vLLM's own out-of-tree registry (``register_oot``), with our methods.

    ``register_oot`` matches the exact class name: a subclass of one of these is built stock (not hooked). None
    is used by the supported architectures (RotaryEmbedding, whose variants are subclasses, is a class patch for
    that reason, see ``_patched_classes``)."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return {
        RMSNorm: dict(forward=_rms_norm_forward),                          # CustomOp
        SiluAndMul: dict(forward=_silu_and_mul_forward),                   # CustomOp
        RowParallelLinear: dict(forward=_row_parallel_forward),            # PluggableLayer (TP tree)
        VocabParallelEmbedding: dict(forward=_vocab_embedding_forward),    # PluggableLayer (TP exact copy)
        GateLinear: dict(forward=_gate_linear_forward),                    # PluggableLayer (MoE router)
        MoERunner: dict(forward=_moe_runner_forward),                      # PluggableLayer (FusedMoE's runner)
        UnquantizedFusedMoEMethod: dict(process_weights_after_loading=_keep_weight_after_loading),  # CustomOp
    }


def _patched_classes() -> dict:
    """Every vLLM class install() patches (by name), for uninstall(): only those vLLM 0.32 offers no
    out-of-tree hook for (the others: ``_oot_hooks``). One reason each:"""
    from vllm.distributed.parallel_state import GroupCoordinator
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.block_table import BlockTable

    return {c.__name__: c for c in (
        EngineArgs,                  # start-up refusals: a config object, no hook
        UnquantizedLinearMethod,     # a QuantizeMethodBase, not a CustomOp: no registry (every Linear's apply)
        UnquantizedEmbeddingMethod,  # the same, for the embedding / LM head
        RotaryEmbedding,             # a CustomOp, but register_oot matches the exact class name: the llama3/
                                     # yarn/linear/NTK subclasses inherit this patch, and unsupported ones raise
        Sampler,                     # plain nn.Module (the temperature reaches compute_logprobs through it)
        MinPLogitsProcessor,         # a logits processor class, no hook
        TopKTopPSampler,             # plain nn.Module
        GroupCoordinator,            # not a layer: the stock TP all-reduce guard
        BlockTable,                  # not a layer: its device view carries the host mirror the planner reads
    )}


def install() -> None:
    """Install every hook (idempotent). Raises ``RuntimeError`` on an unsupported vLLM version."""
    global _installed, _tp_combine
    if _installed:
        return
    combine = os.environ.get(TP_COMBINE_ENV, "tree").strip().lower() or "tree"
    if combine not in TP_COMBINES:
        raise ValueError(f"{TP_COMBINE_ENV} must be one of {TP_COMBINES}, got {combine!r}")
    check_vllm_version()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.sample.sampler import Sampler

    for base, methods in _oot_hooks().items():
        _register_oot(base, **methods)
    _patch(RotaryEmbedding, "forward", _rotary_forward)
    _patch(RotaryEmbedding, "__init__", _rotary_init)
    for cls, apply in ((UnquantizedLinearMethod, _linear_apply), (UnquantizedEmbeddingMethod, _lm_head_apply)):
        _patch(cls, "apply", apply)
        _patch(cls, "create_weights", _make_create_weights(f"{cls.__name__}.create_weights"))
        _patch(cls, "process_weights_after_loading", _keep_weight_after_loading)
    _patch(Sampler, "forward", _sampler_forward)
    _patch(Sampler, "compute_logprobs", staticmethod(_compute_logprobs))
    _patch(MinPLogitsProcessor, "apply", _min_p_apply)
    for name in ("forward_native", "forward_cpu", "forward_cuda"):
        _patch(TopKTopPSampler, name, _make_topk_topp_forward(name))
    _patch(EngineArgs, "create_engine_config", _create_engine_config)
    from vllm.distributed.parallel_state import GroupCoordinator

    _warn_negative_control(combine)
    _tp_combine = combine
    _patch(GroupCoordinator, "all_reduce", _stock_all_reduce)

    # The attention metadata builder plans from host metadata: the block table's device view carries its CPU
    # mirror (vllm_attention.tag_host_block_table).
    from vllm.v1.worker.block_table import BlockTable

    _patch(BlockTable, "get_device_tensor", _block_table_get_device_tensor)
    path = "aligned_ops.integrations.vllm_attention.AlignedAttentionBackend"
    if current_platform.is_cpu():
        _originals.setdefault("backend.CPU_ATTN", AttentionBackendEnum.CPU_ATTN.get_path())
        register_backend(AttentionBackendEnum.CPU_ATTN, path)
    else:  # CUDA/ROCm: registered as CUSTOM and selected by the platform itself (or refused)
        register_backend(AttentionBackendEnum.CUSTOM, path)
        install_gpu_attention_selection(current_platform)
    _installed = True


# The linear profile of the model the last engine config was created for (set in _create_engine_config;
# `aligned-ops verify` compares it with the trainer's). None: no engine created in this process.
installed_linear_profile = None


def uninstall() -> None:
    """Restore vLLM's original classes (engines built while installed keep their aligned layers)."""
    global _installed
    uninstall_gpu_attention_selection()
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    classes = _patched_classes()
    while _oot_registered:
        op_registry_oot.pop(_oot_registered.pop(), None)
    for key, orig in list(_originals.items()):
        if key == "backend.CPU_ATTN":
            register_backend(AttentionBackendEnum.CPU_ATTN, orig)
        else:
            cls_name, attr = key.split(".", 1)
            if orig is _MISSING:
                delattr(classes[cls_name], attr)
            else:
                setattr(classes[cls_name], attr, orig)
        del _originals[key]
    _installed = False


# ---- CUDA / ROCm: the platform selects the aligned attention backend, or vLLM refuses to start ---------------
# vLLM picks an attention backend per layer through ``current_platform.get_attn_backend_cls`` (selector.py); on
# CUDA that is FlashAttention / FlashInfer / Triton, on ROCm its own kernels -- none of them batch-invariant or
# equal to the trainer's aligned::attention_varlen. Registering the CUSTOM slot is not enough (vLLM would only
# use it with attention_backend="CUSTOM", and silently keep FlashAttention otherwise), so the platform class's
# selector is replaced: it returns the aligned backend, or raises. It never calls the stock selector, so no
# stock backend can be chosen while the plugin is installed. validate_vllm_config refuses the same cases at
# engine start-up, in the process that builds the config.

# The ops a vLLM engine calls through the plugin's hooks (TP adds linear_partial; MoE adds moe_*).
GPU_REQUIRED_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "linear",
                    "log_softmax", "reshape_and_cache", "paged_attention")
# GPUs on which .ci/gpu_check.sh has proven GPU == CPU bit for bit. Empty: nothing was run on a real GPU yet.
GPU_VERIFIED_ON_HARDWARE: tuple = ()
GPU_UNVERIFIED_WARNING = (
    "aligned_ops vLLM plugin on {device}: the GPU path has NOT been verified on a real GPU. What was verified, "
    "and how: the CPU backend end to end (vLLM-CPU 0.32.0 log-probs equal to the patched HF trainer bit for "
    "bit, tests/integrations); the csrc/gpu kernels only under emulation (aligned_ops.emulate, the same kernel "
    "source run by a SIMT runtime on the CPU at warp widths 32 and 64, equal to the CPU backend bit for bit, "
    "tests/emulated); the attention-backend selection with vLLM's platform mocked. Run .ci/gpu_check.sh on this "
    "GPU (GPU == CPU bitwise per op) before trusting rollouts from it."
)
_platform_originals: dict = {}


def missing_gpu_kernels(dispatch_key: str = "CUDA", ops=GPU_REQUIRED_OPS) -> list:
    """The ``aligned::`` ops of ``ops`` with no kernel for ``dispatch_key`` in the loaded extension (ROCm
    builds of torch register HIP kernels under the CUDA key too)."""
    import aligned_ops  # noqa: F401  (loads _C)

    return [f"aligned::{op}" for op in ops
            if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aligned::{op}", dispatch_key)]


def _gpu_attention_refusals(platform) -> list:
    """Reasons the aligned attention backend cannot run on this (non-CPU) platform."""
    missing = missing_gpu_kernels()
    if missing:
        return [f"this aligned_ops build has no {platform.device_name or platform.device_type} kernels for "
                f"{', '.join(missing)} (build the extension against a CUDA/ROCm torch; see docs/wheels.md)"]
    return []


def _check_requested_backend(backend) -> list:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if backend is None or backend == AttentionBackendEnum.CUSTOM:
        return []
    name = getattr(backend, "name", str(backend))
    return [f"attention_backend={name} is not batch-invariant nor equal to the trainer's attention; leave "
            "attention_backend unset (the plugin selects its own, registered as CUSTOM)"]


def _aligned_get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
    """Replacement of ``Platform.get_attn_backend_cls`` on CUDA/ROCm: the aligned backend or a ValueError."""
    from .vllm_attention import AlignedAttentionBackend

    reasons = _check_requested_backend(selected_backend) + _gpu_attention_refusals(cls)
    if not reasons:
        fields = attn_selector_config._asdict()
        try:
            capability = cls.get_device_capability()
        except Exception:  # pragma: no cover - a platform that cannot report it
            capability = None
        reasons = list(AlignedAttentionBackend.validate_configuration(device_capability=capability, **fields))
    if reasons:
        raise ValueError("aligned_ops vLLM plugin refuses this attention layer on "
                         f"{cls.device_name or cls.device_type} (it never falls back to a stock backend such "
                         f"as FlashAttention): {'; '.join(reasons)}; layer: {attn_selector_config!r}")
    return "aligned_ops.integrations.vllm_attention.AlignedAttentionBackend"


def install_gpu_attention_selection(platform) -> None:
    """On a non-CPU platform: replace its attention selector (idempotent) and warn what was verified."""
    import logging
    import warnings

    pcls = type(platform)
    if pcls not in _platform_originals:
        _platform_originals[pcls] = pcls.__dict__.get("get_attn_backend_cls", _MISSING)
        pcls.get_attn_backend_cls = classmethod(_aligned_get_attn_backend_cls)
    try:  # vLLM caches selections; entries made before the plugin was installed must not survive
        from vllm.v1.attention.selector import _cached_get_attn_backend

        _cached_get_attn_backend.cache_clear()
    except (ImportError, AttributeError):  # pragma: no cover
        pass
    device = platform.device_name or platform.device_type
    if device not in GPU_VERIFIED_ON_HARDWARE:
        message = GPU_UNVERIFIED_WARNING.format(device=device)
        logging.getLogger("aligned_ops").warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


def uninstall_gpu_attention_selection() -> None:
    for pcls, orig in list(_platform_originals.items()):
        if orig is _MISSING:
            del pcls.get_attn_backend_cls
        else:
            pcls.get_attn_backend_cls = orig
        del _platform_originals[pcls]
    try:
        from vllm.v1.attention.selector import _cached_get_attn_backend

        _cached_get_attn_backend.cache_clear()
    except (ImportError, AttributeError):  # pragma: no cover
        pass


def gpu_platform_reasons(vllm_config, platform=None) -> list:
    """Start-up refusals on CUDA/ROCm (empty on CPU): missing GPU kernels, a stock attention backend asked for."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    if platform.is_cpu():
        return []
    reasons = _gpu_attention_refusals(platform)
    ac = getattr(vllm_config, "attention_config", None)
    if ac is not None:
        reasons += _check_requested_backend(getattr(ac, "backend", None))
        for kind, backend in (getattr(ac, "backend_per_kind", None) or {}).items():
            reasons += [f"{r} (backend_per_kind[{kind!r}])" for r in _check_requested_backend(backend)]
    return reasons
