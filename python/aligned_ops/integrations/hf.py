"""Trainer side: run a Hugging Face causal LM of a supported architecture through ``torch.ops.aligned.*``.

``patch_model(model)`` replaces the forward of the model and of each decoder layer (instance attributes, the
module tree and parameters are untouched, so ``state_dict``, optimisers and checkpoints keep working) with
the exact op sequence the vLLM plugin runs:

    embedding gather
    per layer:  the architecture's block function (aligned_ops.models: the one the vLLM plugin's decoder
                layers call), with this module's side of it (:class:`TrainerSide`: HF's split projections
                through the model's profile, attention_varlen over packed sequences, the model's RoPE table)
    final fused_add_rms_norm -> LM head linear (tied or not) -> token_logprobs (fp32, temperature)

Which op each layer kind runs, on which dtype (norm ops and residual fusion, rotary style, activation, attention
scale, LM-head dtype) is read from the architecture's rules (``aligned_ops.model_spec.rules_for(arch)``, at call
time), the same rules the vLLM plugin's hooks read. The linear profile is resolved once, by ``patch_model``
(``profile=``, else ``ALIGNED_OPS_LINEAR``; :mod:`aligned_ops.profiles`), and carried by the model and its layers.

Every op is row-invariant, so a sequence's log-probs do not depend on what else is in the batch, on padding,
on packing or on the micro-batch size. Padded batches (``attention_mask``, left or right padding) are
packed internally; packed batches pass ``cu_seqlens``.

FSDP: the patched forwards are instance attributes of the *same* modules and are reached through
``Module.__call__`` (the model, then each decoder layer), so FSDP2's ``fully_shard`` pre-forward hooks
(wrap each decoder layer, then the root) gather the parameters before our code reads them, and the LM head
/ final norm are read inside the root's forward. Call the model (``model(..., completion_mask=...)``) or
:func:`completion_logprobs` (which calls the model) rather than internal helpers.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

import aligned_ops

from .. import profiles
from ..models import ARCHITECTURES, Side, rules_for, rules_of
from ..models import get as get_architecture
from ..profiles import profile_of
from ..rope import cos_sin_cache, rope_spec_from_hf_config
from ..sampling import effective_temperature
from . import check_hf_config, hf_moe

__all__ = ["patch_model", "unpatch_model", "completion_logprobs", "AlignedCausalLMOutput"]


@dataclass
class AlignedCausalLMOutput:
    """What the patched model returns.

    ``logits`` — ``[B, S, V]`` (padded input) or ``[T, V]`` (packed input), model dtype, zeros at padding; only
    computed when ``return_logits`` (the default unless ``completion_mask`` is given).
    ``logprobs`` — fp32 log-probs of the completion tokens, same shape as ``input_ids``, 0 where
    ``completion_mask`` is 0; only when ``completion_mask`` is given.
    """

    logits: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    # MoE models only: ``aux_loss`` — load-balancing loss from the routing's fp32 scores (``output_router_logits``);
    # ``routed_experts`` — int64 expert ids ``[*input_ids.shape, moe_layers, top_k]``, -1 at padding
    # (``return_routing``), for routing-flip diagnostics against the rollout engine.
    aux_loss: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None


# ---- packing -----------------------------------------------------------------------------------------


def _pack(input_ids, attention_mask, position_ids, cu_seqlens):
    """Flatten the batch to the real tokens: ``(flat_index [T], positions [T], cu_seqlens [B+1] int32)``.

    ``flat_index`` indexes ``input_ids.reshape(-1)``. Positions restart at 0 for every sequence (left padding
    is skipped), which is what vLLM does for a prompt.
    """
    dev = input_ids.device
    if cu_seqlens is not None:
        if attention_mask is not None:
            raise ValueError("pass either attention_mask (padded batch) or cu_seqlens (packed batch), not both")
        cu = cu_seqlens.to(device=dev, dtype=torch.int32)
        total = input_ids.numel()
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total:
            raise ValueError(f"cu_seqlens must be 1-D, start at 0 and end at the number of tokens ({total})")
        lens = (cu[1:] - cu[:-1]).to(torch.int64)
        if bool((lens < 0).any()):
            raise ValueError("cu_seqlens must be non-decreasing")
        starts = torch.repeat_interleave(cu[:-1].to(torch.int64), lens)
        flat = torch.arange(total, device=dev)
        positions = flat - starts
        if position_ids is not None:  # packed batches (HF "padding-free") often carry their own positions
            if position_ids.numel() != total:
                raise ValueError(f"position_ids must have one entry per token ({total}), got {position_ids.numel()}")
            positions = position_ids.reshape(-1).to(device=dev, dtype=torch.int64)
        return flat, positions, cu
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq] (or packed with cu_seqlens), got {tuple(input_ids.shape)}")
    B, S = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones(B, S, dtype=torch.bool, device=dev)
    if attention_mask.shape != input_ids.shape:
        raise ValueError("attention_mask must have the shape of input_ids")
    mask = attention_mask.bool()
    # A mask with holes inside a row would silently change positions; only left/right padding is allowed.
    csum = mask.to(torch.int64).cumsum(1)
    lens = csum[:, -1]
    first = torch.where(mask.any(1), mask.to(torch.int8).argmax(1), torch.zeros_like(lens))
    idx = torch.arange(S, device=dev)[None, :]
    contiguous = (idx >= first[:, None]) & (idx < (first + lens)[:, None])
    if not torch.equal(contiguous, mask):
        raise ValueError("attention_mask must mark one contiguous run of tokens per row (left or right padding)")
    flat = mask.reshape(-1).nonzero().squeeze(1)
    positions = (csum - 1).reshape(-1)[flat]
    cu = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    cu[1:] = lens.cumsum(0).to(torch.int32)
    if position_ids is not None:
        positions = position_ids.reshape(-1)[flat].to(torch.int64)
    return flat, positions, cu


# ---- per-model constants -------------------------------------------------------------------------------


def _cos_sin_cache(model, device):
    cache = getattr(model, "_aligned_cos_sin_cache", None)
    if cache is None or cache.device != device:
        # The one table builder the vLLM plugin also uses (aligned_ops.rope); [positions, rotary_dim] fp32.
        spec = rope_spec_from_hf_config(model.config)
        cache = cos_sin_cache(spec).to(device)
        object.__setattr__(model, "_aligned_cos_sin_cache", cache)
    return cache


# ---- patched forwards ----------------------------------------------------------------------------------


class _ForwardPlans:
    """The attention plans of one trainer forward: planned once from the HOST cu_seqlens (per head shape: one
    for every layer of an ordinary model) and reused by every layer, so no layer plans or uploads its work list
    (aligned_ops.AttentionPlan; the backward replans from the same host cu_seqlens)."""

    def __init__(self, cu_host, device):
        self.cu_host, self.device, self.plans = cu_host, device, {}

    def get(self, num_heads, num_kv_heads, head_dim):
        key = (num_heads, num_kv_heads, head_dim)
        if key not in self.plans:
            self.plans[key] = aligned_ops.AttentionPlan(device=self.device).plan_varlen(
                self.cu_host, self.cu_host, num_heads, num_kv_heads, head_dim, True)
        return self.plans[key]


@dataclass
class _ForwardContext:
    """What the trainer side of a block function needs for one forward: the packed tokens' positions, the host
    cu_seqlens, the model's RoPE table, the forward's attention plans, the model's profile."""

    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    cos_sin_cache: torch.Tensor
    plans: _ForwardPlans | None
    profile: profiles.Profile


class TrainerSide(Side):
    """The trainer's side of a block function (:class:`aligned_ops.models.Side`): HF's split projections
    through the model's profile, ``attention_varlen`` over the packed sequences (one plan per head shape per
    forward), the model-level RoPE table, HF sparse MoE blocks through ``models.moe.sparse_moe``."""

    def parts(self, ctx, owner, projection, x):
        lin = ctx.profile.linear
        return tuple(lin(x, m.weight, m.bias) for m in (getattr(owner, name) for name in projection.parts))

    def joined(self, ctx, owner, projection, x):
        parts = self.parts(ctx, owner, projection, x)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def rope(self, ctx, attn):
        return ctx.positions, ctx.cos_sin_cache

    def attention(self, ctx, attn, q, k, v, scale):
        plan = ctx.plans.get(q.shape[1], k.shape[1], q.shape[2]) if ctx.plans is not None else None
        o, _ = aligned_ops.attention_varlen(q, k, v.contiguous(), ctx.cu_seqlens, ctx.cu_seqlens, scale, True,
                                            plan=plan)
        return o.reshape(q.shape[0], q.shape[1] * q.shape[2])

    def is_sparse(self, arch, mlp):
        return hf_moe.is_moe_block(mlp)

    def sparse_mlp(self, arch, ctx, mlp, x, rules):
        return hf_moe.moe_block_forward(mlp, x, rules, weights=arch.hf_moe_weights(mlp))


TRAINER_SIDE = TrainerSide()


def _layer_forward(self, hidden, residual, ctx: _ForwardContext):
    """One decoder layer on packed tokens ``hidden [T, H]``: the architecture's block function with the trainer's
    side; returns ``(mlp_out, residual)`` like vLLM."""
    arch = ARCHITECTURES[self._aligned_arch]  # recorded by patch_model; its rules are looked up per call
    return arch.block(arch, TRAINER_SIDE, ctx, self, hidden, residual)


def _model_forward(
    self,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    completion_mask: torch.Tensor | None = None,
    temperature=1.0,
    return_logits: bool | None = None,
    output_router_logits: bool = False,
    return_routing: bool = False,
    top_k=None,
    top_p=None,
    min_p=None,
    fused_lm_head=False,
    **unused,
) -> AlignedCausalLMOutput:
    """Patched ``forward`` of a ``*ForCausalLM``; see :class:`AlignedCausalLMOutput` and :func:`completion_logprobs`."""
    for key in ("past_key_values", "inputs_embeds"):
        if unused.get(key) is not None:
            raise ValueError(f"aligned_ops patched model: {key} is not supported (full teacher-forced forward only)")
    if unused.get("labels") is not None:
        raise ValueError("aligned_ops patched model: labels= is not supported (no loss is computed); pass "
                         "completion_mask= and compute the loss from the returned logprobs")
    if unused.get("use_cache"):
        raise ValueError("aligned_ops patched model: use_cache=True is not supported")
    if return_logits is None:
        return_logits = completion_mask is None
    flat, positions, cu = _pack(input_ids, attention_mask, position_ids, cu_seqlens)
    ids = input_ids.reshape(-1)[flat]
    inner = self.model
    hidden = inner.embed_tokens(ids)
    cache = _cos_sin_cache(self, hidden.device)
    # The attention planner's metadata on the host, derived once per forward: on a GPU this is the forward's
    # one host sync (a [B+1] int32 copy; _pack's checks read the same offsets); every layer then runs one plan.
    cu_host = cu if cu.device.type == "cpu" else cu.cpu()
    profile = profile_of(self)  # resolved once, by patch_model
    ctx = _ForwardContext(positions, cu_host, cache, _ForwardPlans(cu_host, hidden.device), profile)
    residual = None
    with hf_moe.RoutingRecorder() as routing:
        for layer in inner.layers:
            hidden, residual = layer(hidden, residual, ctx)
    rules = rules_of(self)  # the architecture patch_model recorded on the model and each decoder layer
    hidden, _ = rules.apply_norm(hidden, inner.norm.weight, inner.norm.variance_epsilon, residual)
    head = self.lm_head

    out = AlignedCausalLMOutput()
    if output_router_logits and routing.records:
        cfg = self.config
        # the score rows' width is the expert count (Qwen's num_experts, DeepSeek's n_routed_experts)
        out.aux_loss = hf_moe.load_balancing_loss(routing.records, routing.records[0][1].shape[1],
                                                  cfg.num_experts_per_tok)
    if return_routing and routing.records:
        rids = torch.stack([r[0] for r in routing.records], dim=1)  # [T, layers, k]
        full = rids.new_full((input_ids.numel(), *rids.shape[1:]), -1)
        out.routed_experts = full.index_copy(0, flat, rids).view(*input_ids.shape, *rids.shape[1:])
    if return_logits:
        logits = rules.head_logits(profile, hidden, head.weight, head.bias)
        full = logits.new_zeros((input_ids.numel(), logits.shape[-1]))
        full = full.index_copy(0, flat, logits)
        out.logits = full.view(*input_ids.shape, logits.shape[-1])
    if completion_mask is not None:
        if completion_mask.shape != input_ids.shape:
            raise ValueError("completion_mask must have the shape of input_ids")
        cm_all = completion_mask.reshape(-1).bool()
        cm = cm_all[flat]
        if int(cm.sum()) != int(cm_all.sum()):
            raise ValueError("completion_mask marks padding tokens (attention_mask 0): they have no log-prob")
        # Token j is predicted by the hidden state of token j-1 of the same sequence. Only non-empty sequences
        # have a first token (an all-padding row or an empty packed sequence starts where the next one does).
        lens = (cu[1:] - cu[:-1]).to(torch.int64)
        first_of_seq = torch.zeros_like(cm)
        first_of_seq[cu[:-1].to(torch.int64)[lens > 0]] = True
        if bool((cm & first_of_seq).any()):
            raise ValueError("completion_mask marks the first token of a sequence, which has no prediction")
        targets = cm.nonzero().squeeze(1)
        temps = _per_token_temperature(temperature, input_ids, cu, flat, targets)
        target_ids = ids.index_select(0, targets)
        head_in = hidden.index_select(0, targets - 1)
        if fused_lm_head:
            lp = _fused_head_logprobs(self, head, head_in, target_ids, temps, fused_lm_head, top_k, top_p, min_p,
                                      rules, profile)
        elif top_k is None and top_p is None and min_p is None:
            lp = aligned_ops.token_logprobs(rules.head_logits(profile, head_in, head.weight, head.bias), target_ids,
                                            temps)
        else:
            logits = rules.head_logits(profile, head_in, head.weight, head.bias)
            # The distribution vLLM sampled from with logprobs_mode="processed_logprobs" and the plugin:
            # x = fp32(z) / T, truncated by aligned_ops.sampling (min-p, top-k, top-p), log-softmax at T = 1.
            from ..sampling import scale_logits, truncate_logits

            def per_token(v, dtype):
                return None if v is None else _per_token_value(v, cu, targets, dtype, input_ids.device)

            t = temps if isinstance(temps, torch.Tensor) else torch.full((targets.numel(),), temps)
            x = scale_logits(logits, t)
            x = truncate_logits(x, top_k=per_token(top_k, torch.int64), top_p=per_token(top_p, torch.float32),
                                min_p=per_token(min_p, torch.float32))
            lp = aligned_ops.token_logprobs(x, target_ids, 1.0)
        full = lp.new_zeros(input_ids.numel())
        full = full.index_copy(0, flat.index_select(0, targets), lp)
        out.logprobs = full.view(input_ids.shape)
    return out


def _fused_head_logprobs(model, head, hidden, target_ids, temps, option, top_k, top_p, min_p, rules, profile):
    """completion_logprobs(fused_lm_head=...): aligned_ops.fused_token_logprobs, the same bits as the unfused
    LM head linear -> token_logprobs without the [tokens, vocab] logits. ``option`` is True or a dict of chunk
    sizes (token_chunk=, vocab_chunk=)."""
    if top_k is not None or top_p is not None or min_p is not None:
        raise ValueError("completion_logprobs: fused_lm_head does not score truncated distributions (top_k / top_p "
                         "/ min_p need each row's full sorted logits); use fused_lm_head=False")
    if not profile.capabilities.fused_lm_head or rules.logits_dtype is not None:
        source = getattr(model, "_aligned_profile_source", "patch_model")
        raise ValueError(f"completion_logprobs: fused_lm_head needs a linear profile with a fused LM head "
                         f"({', '.join(p.name for p in profiles.REGISTRY.values() if p.capabilities.fused_lm_head)}) "
                         f"and model-dtype logits; this model runs the {profile.name!r} profile (from {source}) with "
                         f"logits_dtype {rules.logits_dtype}")
    chunks = option if isinstance(option, dict) else {}
    unknown = set(chunks) - {"token_chunk", "vocab_chunk"}
    if unknown:
        raise ValueError(f"completion_logprobs: fused_lm_head keys must be token_chunk / vocab_chunk, got {unknown}")
    return profile.fused_token_logprobs(hidden, head.weight, target_ids, temps, bias=head.bias, **chunks)


def _per_token_value(value, cu, targets, dtype, device):
    """A scalar, or one value per sequence ``[B]``, expanded to the selected tokens."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return torch.full((targets.numel(),), float(value) if dtype.is_floating_point else int(value), dtype=dtype,
                          device=device)
    nseq = cu.numel() - 1
    if value.numel() != nseq:
        raise ValueError(f"per-sequence sampling parameter must have one entry per sequence ({nseq}), got {value.numel()}")
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    return torch.repeat_interleave(value.to(device=device, dtype=dtype), lens).index_select(0, targets)


def _per_token_temperature(temperature, input_ids, cu, flat, targets):
    """A float, or a per-sequence tensor ``[B]`` expanded to the selected tokens (fp32).

    0 <= temperature < 1e-5 is greedy and scored at tau = 1, like the vLLM plugin (vLLM's sampling eps);
    a negative, NaN or infinite temperature is refused."""
    if not isinstance(temperature, torch.Tensor) or temperature.dim() == 0:
        t = float(temperature)
        if not (0.0 <= t < float("inf")):
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {t}")
        return effective_temperature(t)
    temperature = temperature.to(device=input_ids.device, dtype=torch.float32)
    nseq = cu.numel() - 1
    if temperature.numel() != nseq:
        raise ValueError(f"temperature tensor must have one entry per sequence ({nseq}), got {temperature.numel()}")
    if nseq and not bool(((temperature >= 0) & torch.isfinite(temperature)).all()):
        raise ValueError("every temperature must be finite and >= 0 (0 = greedy), got "
                         f"{temperature.tolist()}")
    temperature = effective_temperature(temperature)
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    per_token = torch.repeat_interleave(temperature, lens)
    return per_token.index_select(0, targets).contiguous()


# ---- public API ----------------------------------------------------------------------------------------


def _refuse_adapters(model: torch.nn.Module) -> None:
    # A PEFT/LoRA layer adds its low-rank product inside the wrapped module's forward; the patched layer calls the
    # aligned ops on the base weights only, so the adapter would be dropped silently (and vLLM's LoRA kernels are
    # not aligned either). Merge the adapter (PEFT's merge_and_unload) before patching.
    for name, module in model.named_modules():
        if type(module).__module__.split(".")[0] == "peft" or hasattr(module, "lora_A"):
            raise ValueError(
                f"aligned_ops (patch_model): {name or 'the model'} is a PEFT/LoRA adapter layer "
                f"({type(module).__name__}), which the aligned forward would skip; merge the adapter into the "
                "weights first (peft: model.merge_and_unload())")


def patch_model(model: torch.nn.Module, profile: str | profiles.Profile | None = None) -> torch.nn.Module:
    """Route ``model`` (a HF ``*ForCausalLM`` of a supported architecture, :mod:`aligned_ops.models`) through
    ``torch.ops.aligned``; returns it.

    ``profile``: the linear numerics profile (a name or an :mod:`aligned_ops.profiles` object); None:
    ``ALIGNED_OPS_LINEAR`` (read now, once). An architecture whose rules pin a profile runs that one. The model
    and its layers carry the resolved profile (``aligned_ops.profiles.profile_of(model)``).

    In place and idempotent (patching a patched model again changes nothing; :func:`unpatch_model` first to
    change its profile). Raises ``ValueError`` for an unsupported architecture, RoPE variant, sliding window,
    quantization, dtype or profile. ``unpatch_model`` restores the original forwards.
    """
    if getattr(model, "_aligned_patched", False):
        if profile is not None:
            wanted = rules_for(model._aligned_arch).resolve_profile(profile)
            if wanted is not model._aligned_profile:
                raise ValueError(
                    f"aligned_ops (patch_model): profile={wanted.name!r}, but the model is already patched with "
                    f"profile {model._aligned_profile.name!r}; call unpatch_model(model) first to change it")
        return model
    # The model's own class (or a base class) names the architecture; config.architectures is None for a
    # model built in memory, and only consulted when the class is not one we know.
    known = [c.__name__ for c in type(model).__mro__ if c.__name__ in ARCHITECTURES]
    named = list(getattr(model.config, "architectures", None) or [])
    name = known[0] if known else (named[0] if named else type(model).__name__)
    check_hf_config(model.config, "patch_model", architecture=name)
    arch = get_architecture(name, "patch_model")
    dtypes = {p.dtype for p in model.parameters()}
    bad = dtypes - {torch.float32, torch.bfloat16, torch.float16}
    if bad:
        raise ValueError(f"aligned_ops (patch_model): unsupported parameter dtype(s) {sorted(map(str, bad))}")
    if not hasattr(model, "model") or not hasattr(model.model, "layers") or not hasattr(model, "lm_head"):
        raise ValueError(f"aligned_ops (patch_model): {type(model).__name__} does not have the model.layers / lm_head layout")
    _refuse_adapters(model)
    arch.check_hf_model(model, "patch_model")
    rules = rules_for(arch.name)
    for layer in model.model.layers if not arch.own_attention_scale else ():
        attn = layer.self_attn
        try:
            rules.check_attention_scale(attn.head_dim, attn.scaling, "patch_model")
        except NotImplementedError as e:  # the trainer's refusals are ValueError (patch_model's contract)
            raise ValueError(str(e)) from None
    # Once per model; carried, never re-read. (Where it runs is the ops' concern: a model is often patched on one
    # device and moved to another; FSDP shards it.)
    resolved = rules.resolve_profile(profile)
    source = ("the model's model_spec.RULES entry (linear_profile)" if rules.linear_profile is not None
              else "patch_model(profile=)" if profile is not None else profiles.ENV_VAR)
    for layer in model.model.layers:
        layer._aligned_arch = arch.name  # the layer's rules are looked up per call (model_spec.rules_for)
        layer._aligned_profile = resolved
        layer.forward = types.MethodType(_layer_forward, layer)
    model._aligned_arch = arch.name
    model._aligned_profile = resolved
    model._aligned_profile_source = source
    model.forward = types.MethodType(_model_forward, model)
    model._aligned_patched = True
    return model


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch_model` (the HF forwards come back)."""
    if not getattr(model, "_aligned_patched", False):
        return model
    for layer in model.model.layers:
        for key in ("forward", "_aligned_arch", "_aligned_profile"):
            layer.__dict__.pop(key, None)
    for key in ("forward", "_aligned_arch", "_aligned_profile", "_aligned_profile_source"):
        model.__dict__.pop(key, None)
    model.__dict__.pop("_aligned_cos_sin_cache", None)
    model._aligned_patched = False
    return model


def completion_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    temperature=1.0,
    top_k=None,
    top_p=None,
    min_p=None,
    fused_lm_head=False,
) -> torch.Tensor:
    """Teacher-forced fp32 log-probs of the completion tokens, shaped like ``input_ids`` (0 elsewhere).

    ``input_ids`` is ``[B, S]`` with ``attention_mask`` (left or right padding), or packed ``[T]``/``[1, T]``
    with ``cu_seqlens [B+1]``. ``completion_mask[b, t] = 1`` asks for ``log p(input_ids[b, t] | prefix)``
    (under ``softmax(logits / temperature)`` over the full vocabulary; temperature is a float or one value
    per sequence; 0 means greedy and is scored at 1.0, like the vLLM plugin). Differentiable.

    ``top_k`` / ``top_p`` / ``min_p`` (scalar or one per sequence; default None = full vocabulary): score
    the *truncated* distribution instead — ``log_softmax`` of ``aligned_ops.sampling.truncate_logits(z / T)``,
    what the vLLM plugin returns with ``logprobs_mode="processed_logprobs"`` (bit for bit). A token outside
    the truncated set gets ``-inf``.

    ``fused_lm_head=True`` (or a dict ``{"token_chunk": .., "vocab_chunk": ..}``): compute the LM head and the
    log-probs with :func:`aligned_ops.fused_token_logprobs` — the same bits, forward and gradient, without the
    ``[tokens, vocab]`` logits and their gradient (full-vocabulary scoring and the fma linear profile only).
    """
    if not getattr(model, "_aligned_patched", False):
        raise ValueError("completion_logprobs: call aligned_ops.integrations.hf.patch_model(model) first")
    return model(
        input_ids,
        attention_mask=attention_mask,
        cu_seqlens=cu_seqlens,
        completion_mask=completion_mask,
        temperature=temperature,
        return_logits=False,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        fused_lm_head=fused_lm_head,
    ).logprobs
