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

import functools
import operator
import types
from dataclasses import dataclass

import torch

import aligned_ops

from .. import profiles
from ..models import ARCHITECTURES, Side, rules_for, rules_of
from ..models import get as get_architecture
from ..profiles import profile_of
from ..models.mla_form import resolve_mla_form
from ..ops.logits import _temperature_args, refuse_temperature_grad
from ..ops.moe import row_local_sum
from ..rope import cos_sin_cache, rope_spec_from_hf_config
from ..sampling import check_sampling_options, check_temperature, effective_temperature
from . import check_hf_config, hf_moe

# The temperature check reads the vLLM release from package metadata (importlib.metadata, a try/except per
# distribution name): Dynamo cannot trace that (InternalTorchDynamoError under torch.compile of the patched model
# with a completion_mask); it validates Python values only, so it runs outside the graph.
check_temperature = torch.compiler.disable(check_temperature)

__all__ = ["patch_model", "unpatch_model", "completion_logprobs", "AlignedCausalLMOutput"]


try:  # an HF ModelOutput: out["logits"], out[0], out.to_tuple() work as on any HF model's output
    from transformers.utils import ModelOutput as _OutputBase
except ImportError:  # pragma: no cover - without transformers there is no HF model to patch
    _OutputBase = object


@dataclass
class AlignedCausalLMOutput(_OutputBase):
    """What the patched model returns (a ``transformers`` ``ModelOutput``: attribute, key and index access; the
    fields that are None are absent from its keys, as in HF).

    ``loss`` — with ``labels=``: HF's causal-LM loss (``labels`` shifted by one, ``-100`` ignored, mean over the
    counted tokens or sum / ``num_items_in_batch``) on the aligned logits, through ``aligned_ops.token_logprobs``.
    ``logits`` — ``[B, S, V]`` (padded input) or ``[T, V]`` (packed input), model dtype, zeros at padding; only
    computed when ``return_logits`` (the default unless ``completion_mask`` is given).
    ``logprobs`` — fp32 log-probs of the completion tokens, same shape as ``input_ids``, 0 where
    ``completion_mask`` is 0; only when ``completion_mask`` is given.
    ``entropy`` — with ``completion_mask`` and ``return_entropy=True``: fp32 entropy of the distribution each
    completion token was scored under (``softmax(logits / temperature)``), same shape as ``logprobs``.
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    # MoE models only: ``aux_loss`` — load-balancing loss from the routing's fp32 scores (``output_router_logits``,
    # default ``config.output_router_logits`` as HF; with ``labels`` a Qwen-MoE's ``loss`` includes
    # ``router_aux_loss_coef * aux_loss``, as HF's);
    # ``routed_experts`` — int64 expert ids ``[*input_ids.shape, moe_layers, top_k]``, -1 at padding
    # (``return_routing``), for routing-flip diagnostics against the rollout engine.
    aux_loss: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None


# ---- packing -----------------------------------------------------------------------------------------


def _check_mask(mask, name):
    """0/1 masks only (bool, integer or float): ``.bool()`` would count a NaN (or a 0.5, or a 2) as selected."""
    if mask.dtype == torch.bool or mask.numel() == 0:
        return
    bad = ~((mask == 0) | (mask == 1))
    if bool(bad.any()):
        v = mask.reshape(-1)[bad.reshape(-1).nonzero()[0, 0]].item()
        raise ValueError(f"aligned_ops patched model: {name} must hold only 0 and 1 (or be bool), got {v}")


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
            if not torch.equal(_split_at_position_restarts(positions, cu), cu):
                raise ValueError("position_ids restart at 0 inside a sequence of cu_seqlens: mark every packed "
                                 "sequence in cu_seqlens (or pass position_ids without cu_seqlens to split there)")
            _refuse_continuations(positions, cu)
        return flat, positions, cu
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq] (or packed with cu_seqlens), got {tuple(input_ids.shape)}")
    B, S = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones(B, S, dtype=torch.bool, device=dev)
    if attention_mask.shape != input_ids.shape:
        raise ValueError("attention_mask must have the shape of input_ids")
    _check_mask(attention_mask, "attention_mask")
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
        if position_ids.dim() == 2 and position_ids.shape == (1, S):  # one row for the batch: HF broadcasts it
            position_ids = position_ids.expand(B, S)
        if position_ids.numel() != input_ids.numel():
            raise ValueError(f"position_ids must have one entry per token of input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(position_ids.shape)}")
        positions = position_ids.reshape(-1).to(dev)[flat].to(torch.int64)
        # Packed ("padding-free") rows carry no mask: where positions restart at 0, a new sequence begins.
        cu = _split_at_position_restarts(positions, cu)
        _refuse_continuations(positions, cu, padded=(flat, mask))
    return flat, positions, cu


def first_tokens(cu, n: int) -> torch.Tensor:
    """Boolean ``[n]`` over the packed tokens: True at the first token of each non-empty sequence of ``cu`` (an
    all-padding row or an empty packed sequence starts where the next one does, and has no first token). Token j
    is predicted by the hidden state of token j-1 of its sequence, so these tokens have no prediction."""
    cu64 = cu.to(torch.int64)
    lens = cu64[1:] - cu64[:-1]
    first = torch.zeros(n, dtype=torch.bool, device=cu.device)
    first[cu64[:-1][lens > 0]] = True
    return first


def _refuse_continuations(positions, cu, padded=None):
    """Every sequence's first position is 0: the aligned forward, as the vLLM engine, runs whole sequences and has
    no keys of earlier positions, so a sequence given from position p > 0 (a context-parallel / Ulysses shard, a
    continuation chunk) would attend to its own tokens only — other numbers than the whole sequence's, silently.
    ``padded``: ``(flat_index, attention_mask)`` of a padded batch (the error names the row, and hints at left
    padding; read only when raising), else the error names the sequence of ``cu``."""
    start = positions[first_tokens(cu, positions.numel())]
    late = (start != 0).nonzero()
    if late.numel():
        i = int(late[0, 0])  # the i-th non-empty sequence
        seq = int((cu[1:] != cu[:-1]).nonzero()[i, 0])
        p = int(start[i])
        hint = ""
        if padded is None:
            what = f"sequence {seq} starts at position {p}"
        else:
            flat, mask = padded
            what = f"row {int(flat[int(cu[seq])]) // mask.shape[1]}: a sequence starts at position {p}"
            if bool((~mask[:, 0] & mask.any(1)).any()):
                hint = (" With left padding, position_ids must be 0 at each row's first attended token "
                        "(attention_mask.cumsum(-1) - 1, as HF generate makes them), or leave them out.")
        raise ValueError(f"position_ids: {what}, not 0 — the aligned "
                         "forward (as the vLLM engine) scores whole sequences and has no keys of earlier positions "
                         f"(a context-/sequence-parallel shard or a continuation chunk is not supported).{hint}")


def _split_at_position_restarts(positions, cu):
    """``cu`` with a boundary added wherever ``positions`` (of the packed tokens) restart at 0 inside a sequence
    (a packed / padding-free row holds several sequences: verl remove-padding, OpenRLHF packing, TRL
    padding-free, HF ``DataCollatorWithFlattening``). Inside a sequence positions must count up by one; any other
    jump is ambiguous and refused. Empty sequences of ``cu`` are kept."""
    if positions.numel() < 2:
        return cu
    starts = first_tokens(cu, positions.numel())
    jump = (positions[1:] != positions[:-1] + 1) & ~starts[1:]
    if not bool(jump.any()):
        return cu
    cu64 = cu.to(torch.int64)
    at = jump.nonzero().squeeze(1) + 1
    bad = at[positions[at] != 0]
    if bad.numel():
        t = int(bad[0])
        raise ValueError(f"position_ids jump from {int(positions[t - 1])} to {int(positions[t])} at packed token {t}: "
                         "inside a sequence positions count up by one and a packed sequence restarts at 0 (mark "
                         "sequences with cu_seqlens or attention_mask)")
    return torch.sort(torch.cat([cu64, at])).values.to(cu.dtype)


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


class BoundForward:
    """``function`` bound to ``module`` as its instance ``forward``: what ``types.MethodType(function, module)`` is,
    but picklable. A bound method pickles as ``getattr(module, function.__name__)``, an attribute no HF module has,
    so ``torch.save(patched_model)`` wrote a file ``torch.load`` could not read (AttributeError: 'LlamaDecoderLayer'
    object has no attribute '_layer_forward'); this pickles ``function`` by its qualified name and ``module`` by
    reference, so a saved patched model loads patched (``copy.deepcopy`` binds the copy's forward to the copy).
    ``__func__`` / ``__self__`` are a bound method's (accelerate re-binds ``forward.__func__``), and so is its
    signature (HF's Trainer reads ``forward``'s parameters to keep dataset columns)."""

    __slots__ = ("__func__", "__self__")

    def __init__(self, function, module):
        self.__func__, self.__self__ = function, module

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    def __reduce__(self):
        return (type(self), (self.__func__, self.__self__))

    # A bound method's name is its function's: a reader of forward.__name__ must not fail where it read a bound
    # method's. (Only the name: forwarding every attribute, __dict__ included, broke torch.compile's guards; a class
    # body cannot define an instance __qualname__.)
    @property
    def __name__(self):
        return self.__func__.__name__

    @property
    def __signature__(self):
        import inspect

        return inspect.signature(types.MethodType(self.__func__, self.__self__))

    def __repr__(self) -> str:
        return f"<aligned_ops forward {self.__func__.__qualname__} of {type(self.__self__).__name__}>"


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


class _ForwardContext:
    """What the trainer side of a block function needs for one forward: the packed tokens' positions, the host
    cu_seqlens, the model's RoPE table, the forward's attention plans, the model's profile.

    A plain class, not a dataclass: each decoder layer receives it as an argument, and wrappers that rewrite a
    module's tensor arguments recurse into dataclasses (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` casts
    every float tensor it finds, and the fp32 RoPE table cast to bf16 was refused by ``aligned::rotary_embedding``)."""

    def __init__(self, positions: torch.Tensor, cu_seqlens: torch.Tensor, cos_sin_cache: torch.Tensor,
                 plans: _ForwardPlans | None, profile: profiles.Profile, attention_profile: str = "fma"):
        # attention_profile: profile.attention_profile(device), decided once per forward (profiles.py)
        self.positions, self.cu_seqlens, self.cos_sin_cache = positions, cu_seqlens, cos_sin_cache
        self.plans, self.profile, self.attention_profile = plans, profile, attention_profile


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
                                            plan=plan, profile=ctx.attention_profile)
        return o.reshape(q.shape[0], q.shape[1] * q.shape[2])

    def linear(self, ctx, x, weight):
        return ctx.profile.linear(x, weight)

    def mla_attention(self, ctx, attn, q, kv, kv_lora_rank, scale):
        # one KV head of width D = kv_lora_rank + rope_dim: the plan of the latent row (one per forward). The latent
        # op runs fma under every linear profile (no mma MLA kernel is built; Profile.attention_profile(mla=True)),
        # as the vLLM MLA backend does (integrations/vllm/mla.py)
        plan = ctx.plans.get(q.shape[1], 1, q.shape[2]) if ctx.plans is not None else None
        o, _ = aligned_ops.mla_attention_varlen(q, kv, ctx.cu_seqlens, ctx.cu_seqlens, kv_lora_rank, scale, True,
                                                plan=plan)
        return o

    def is_sparse(self, arch, mlp):
        return hf_moe.is_moe_block(mlp)

    def sparse_mlp(self, arch, ctx, mlp, x, rules):
        return hf_moe.moe_block_forward(mlp, x, rules, weights=arch.hf_moe_weights(mlp), profile=ctx.profile)


TRAINER_SIDE = TrainerSide()


def _layer_forward(self, hidden, residual, ctx: _ForwardContext):
    """One decoder layer on packed tokens ``hidden [T, H]``: the architecture's block function with the trainer's
    side; returns ``(mlp_out, residual)`` like vLLM."""
    arch = ARCHITECTURES[self._aligned_arch]  # recorded by patch_model; its rules are looked up per call
    return arch.block(arch, TRAINER_SIDE, ctx, self, hidden, residual)


def _refuse_unsupported(unused, where, config=None):
    for key in ("past_key_values", "inputs_embeds"):
        if unused.get(key) is not None:
            raise ValueError(f"aligned_ops {where}: {key} is not supported (full teacher-forced forward only)")
    if unused.get("use_cache"):
        raise ValueError(f"aligned_ops {where}: use_cache=True is not supported")
    # HF's attention reads is_causal=False as bidirectional (embedding / encoder use); vLLM's and the aligned forward's
    # attention is causal, so that model cannot be run (was: swallowed, causal logits without a word)
    # (the keyword, else the config's, which HF re-reads on every call)
    causal = unused.get("is_causal")
    if causal is None:
        causal = getattr(config, "is_causal", None)
    if causal is not None and not causal:
        raise ValueError(f"aligned_ops {where}: is_causal=False is not supported (the aligned attention is causal, "
                         "as the vLLM engine's)")
    # HF would add these to its output; the aligned forward has none to give (the caller would find no field)
    for key in ("output_hidden_states", "output_attentions"):
        if unused.get(key):
            raise ValueError(f"aligned_ops {where}: {key}=True is not supported (the aligned forward returns no "
                             "per-layer hidden states or attention weights; call model.model(...) for the final "
                             "hidden states)")


def _refuse_dropout(inner, where):
    """A model in training mode with embedding noise (NEFTune) or attention dropout: HF would add the noise / drop
    attention weights, the aligned forward (like the vLLM engine) does neither, so the trainer's numbers would
    silently not be the configured model's."""
    if not inner.training:
        return
    # NEFTune (HF Trainer / TRL's neftune_noise_alpha: transformers.integrations.neftune) adds uniform noise to the
    # embeddings in training mode through a forward hook on embed_tokens, which the engine never adds; its hook also
    # reads a [batch, seq, hidden] output, and failed on the packed [tokens, hidden] one with a bare IndexError
    alpha = getattr(inner.embed_tokens, "neftune_noise_alpha", None)
    if alpha is not None:
        raise ValueError(f"aligned_ops {where}: NEFTune (neftune_noise_alpha={alpha}) in training mode: it adds noise "
                         "to the embeddings that the vLLM engine does not; turn it off (neftune_noise_alpha=None) "
                         "or call model.eval()")
    for i, layer in enumerate(inner.layers):
        p = getattr(getattr(layer, "self_attn", None), "attention_dropout", 0.0)
        if p:
            raise ValueError(f"aligned_ops {where}: attention_dropout={p} (layer {i}) in training mode: the aligned "
                             "forward applies no dropout, as the vLLM engine does not; load the model with "
                             "attention_dropout=0.0 or call model.eval()")


def _without_autocast(forward):
    """The patched forwards run with autocast off on the input's device: the aligned ops fix their own dtypes (an
    autocast region would recast what feeds them; CPU autocast to another 16-bit dtype fails inside torch.cat with
    "Unexpected floating ScalarType in at::autocast::prioritize")."""

    @functools.wraps(forward)
    def run(self, input_ids=None, *args, **kwargs):
        device = input_ids.device.type if isinstance(input_ids, torch.Tensor) else "cpu"
        with torch.autocast(device, enabled=False):
            return forward(self, input_ids, *args, **kwargs)

    return run


def _hf_return_dict(forward):
    """HF's ``return_dict`` convention (``transformers.utils.can_return_tuple``): ``return_dict=False``, or a config
    with ``return_dict=False``, returns ``output.to_tuple()`` (the fields that are not None, in order). Without it
    ``loss, logits = model(..., return_dict=False)`` unpacked the ModelOutput's keys (the strings "loss" and
    "logits") and ``isinstance(out, tuple)`` was False."""

    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(getattr(self, "config", None), "return_dict", True)
        out = forward(self, *args, **kwargs)
        if return_dict:
            return out
        if getattr(self, "router_aux_loss_coef", None) is None and out.get("aux_loss") is not None:
            # HF's DeepSeek-V3 / GLM-4.5 classes return no aux_loss: their tuple's [1] is the logits, as here
            out = type(out)(**{k: v for k, v in out.items() if k != "aux_loss"})
        return out.to_tuple()

    return run


def _hf_packing_kwargs(unused, cu_seqlens, attention_mask, where):
    """``cu_seqlens`` from HF's FlashAttention packing kwargs (``cu_seq_lens_q`` / ``cu_seq_lens_k``, which
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` gives, with or without ``position_ids``): HF's
    varlen attention keeps those sequences apart, and so must the aligned forward (ignored, a row packed without
    position_ids was one sequence attending across its neighbours). ``max_length_q`` / ``max_length_k`` follow from
    them. Returns the ``cu_seqlens`` to pack by (the argument's when neither is given)."""
    q, k = (unused.pop(key, None) for key in ("cu_seq_lens_q", "cu_seq_lens_k"))
    q, k = (None if v is None else torch.as_tensor(v) for v in (q, k))
    unused.pop("max_length_q", None), unused.pop("max_length_k", None)
    given = q if q is not None else k
    if given is None:
        return cu_seqlens
    if q is not None and k is not None and not torch.equal(q.reshape(-1).cpu().to(torch.int64),
                                                           k.reshape(-1).cpu().to(torch.int64)):
        raise ValueError(f"aligned_ops {where}: cu_seq_lens_q and cu_seq_lens_k differ: the aligned forward is causal "
                         "self-attention over each packed sequence (one set of boundaries)")
    if cu_seqlens is not None and not torch.equal(cu_seqlens.reshape(-1).cpu().to(torch.int64),
                                                  given.reshape(-1).cpu().to(torch.int64)):
        raise ValueError(f"aligned_ops {where}: cu_seqlens and cu_seq_lens_q / cu_seq_lens_k differ; pass one of them")
    if attention_mask is not None:
        raise ValueError(f"aligned_ops {where}: pass either attention_mask (padded batch) or cu_seq_lens_q / "
                         "cu_seq_lens_k (packed batch), not both")
    return given.reshape(-1)


def _backbone(owner, inner, input_ids, attention_mask, position_ids, cu_seqlens):
    """Embedding -> decoder layers -> final norm on the packed real tokens, for the causal LM's forward and the
    backbone's (``model.model(...)``). ``owner`` carries the architecture, profile and RoPE table (the causal LM,
    or the backbone itself). Returns ``(hidden [T, H], flat, ids, cu, routing recorder, rules, profile)``."""
    flat, positions, cu = _pack(input_ids, attention_mask, position_ids, cu_seqlens)
    ids = input_ids.reshape(-1)[flat]
    vocab = inner.embed_tokens.weight.shape[0]
    if ids.numel():  # an id outside the embedding would be a bare IndexError (or a device assert) deep inside
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < 0 or hi >= vocab:
            raise ValueError(f"aligned_ops patched model: input_ids must lie in [0, {vocab}) (the embedding's rows), "
                             f"got ids in [{lo}, {hi}]")
    hidden = inner.embed_tokens(ids)
    cache = _cos_sin_cache(owner, hidden.device)
    # The attention planner's metadata on the host, derived once per forward: on a GPU this is the forward's
    # one host sync (a [B+1] int32 copy; _pack's checks read the same offsets); every layer then runs one plan.
    cu_host = cu if cu.device.type == "cpu" else cu.cpu()
    profile = profile_of(owner)  # resolved once, by patch_model
    # the attention profile of this linear profile on this device (mma attention on a GPU / emulated GPU under the
    # mma profile, fma on a plain CPU and for MLA architectures): the vLLM backend decides it the same way
    arch = ARCHITECTURES[owner._aligned_arch]
    attention_profile = profile.attention_profile(hidden.device, mla=bool(arch.mla_forms))
    ctx = _ForwardContext(positions, cu_host, cache, _ForwardPlans(cu_host, hidden.device), profile,
                          attention_profile)
    residual = None
    with hf_moe.RoutingRecorder() as routing:
        for layer in inner.layers:
            hidden, residual = layer(hidden, residual, ctx)
    rules = rules_of(owner)  # the architecture patch_model recorded on the model and each decoder layer
    hidden, _ = rules.apply_norm(hidden, inner.norm.weight, inner.norm.variance_epsilon, residual)
    return hidden, flat, ids, cu, routing, rules, profile


@_hf_return_dict
@_without_autocast
def _backbone_forward(
    self,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values=None,
    inputs_embeds: torch.Tensor | None = None,
    use_cache: bool | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    output_router_logits: bool = False,
    **unused,
):
    """Patched ``forward`` of the backbone (``model.model``, e.g. ``Qwen2Model``), the call frameworks make when
    they apply the LM head themselves (TRL's fused LM head, value heads): HF's ``BaseModelOutputWithPast`` with
    ``last_hidden_state`` (after the final norm) shaped ``[*input_ids.shape, H]``, zeros at padding. The same
    packing rules and the same bits as the causal LM's forward."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    unused.update(past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache)
    cu_seqlens = _hf_packing_kwargs(unused, cu_seqlens, attention_mask, "patched backbone (model.model)")
    _refuse_unsupported(unused, "patched backbone (model.model)", self.config)
    _refuse_dropout(self, "patched backbone (model.model)")
    if input_ids is None:
        raise ValueError("aligned_ops patched backbone (model.model): input_ids is required")
    if output_router_logits:
        raise ValueError("aligned_ops patched backbone (model.model): output_router_logits is not supported; call "
                         "the patched causal LM (output_router_logits=True gives .aux_loss)")
    hidden, flat, _, _, _, _, _ = _backbone(self, self, input_ids, attention_mask, position_ids, cu_seqlens)
    full = hidden.new_zeros((input_ids.numel(), hidden.shape[-1])).index_copy(0, flat, hidden)
    return BaseModelOutputWithPast(last_hidden_state=full.view(*input_ids.shape, hidden.shape[-1]))


@_hf_return_dict
@_without_autocast
def _model_forward(
    self,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values=None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    use_cache: bool | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    completion_mask: torch.Tensor | None = None,
    temperature=1.0,
    return_logits: bool | None = None,
    output_router_logits: bool | None = None,
    return_routing: bool = False,
    top_k=None,
    top_p=None,
    min_p=None,
    fused_lm_head="auto",
    num_items_in_batch=None,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    logits_to_keep: int | torch.Tensor = 0,
    **unused,
) -> AlignedCausalLMOutput:
    """Patched ``forward`` of a ``*ForCausalLM``; see :class:`AlignedCausalLMOutput` and :func:`completion_logprobs`.
    The positional parameters are HF's (``input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
    labels, use_cache``: a caller's positional ``labels`` reaches ``labels``); this library's are keyword-only."""
    unused.update(past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache)
    cu_seqlens = _hf_packing_kwargs(unused, cu_seqlens, attention_mask, "patched model")
    _refuse_unsupported(unused, "patched model", self.config)
    _refuse_dropout(self.model, "patched model")
    if return_logits is None:
        return_logits = completion_mask is None
    if completion_mask is not None:  # refused before the forward runs (vLLM's own rules: aligned_ops.sampling)
        check_temperature(temperature, "completion_logprobs: temperature")
        check_sampling_options(top_k, top_p, min_p, where="completion_logprobs")
        if completion_mask.shape != input_ids.shape:
            raise ValueError("completion_mask must have the shape of input_ids")
        _check_mask(completion_mask, "completion_mask")
    if return_entropy and completion_mask is None:
        raise ValueError("aligned_ops patched model: return_entropy=True needs completion_mask= (the tokens whose "
                         "distribution's entropy is wanted)")
    hidden, flat, ids, cu, routing, rules, profile = _backbone(self, self.model, input_ids, attention_mask,
                                                               position_ids, cu_seqlens)
    head = self.lm_head

    out = AlignedCausalLMOutput()
    if labels is not None:
        out.loss = _causal_lm_loss(hidden, head, input_ids, labels, flat, cu, rules, profile, num_items_in_batch,
                                   shift_labels, ignore_index)
    if output_router_logits is None:  # HF's default: the config's (MoE fine-tuning sets config.output_router_logits)
        output_router_logits = bool(getattr(self.config, "output_router_logits", False))
    if output_router_logits and routing.records:
        if hidden.requires_grad and not all(scores.requires_grad for _, scores in routing.records):
            # reentrant checkpointing runs each layer's forward under no_grad (the backward recomputes it): the
            # scores recorded there carry no graph, so the aux loss would silently give the routers no gradient
            raise ValueError("aligned_ops patched model: output_router_logits=True under reentrant gradient "
                             "checkpointing: the router scores are recorded without autograd, so aux_loss would give "
                             "the routers no gradient; use gradient_checkpointing_kwargs={'use_reentrant': False}")
        cfg = self.config
        # the score rows' width is the expert count (Qwen's num_experts, DeepSeek's n_routed_experts)
        out.aux_loss = hf_moe.load_balancing_loss(routing.records, routing.records[0][1].shape[1],
                                                  cfg.num_experts_per_tok)
        # HF's Qwen-MoE classes (the ones that hold router_aux_loss_coef) add it to the labels' loss; DeepSeek-V3's and
        # GLM-4.5's add nothing (they hold none). Without it a fine-tuning loss silently lost its load-balancing term.
        coef = getattr(self, "router_aux_loss_coef", None)
        if out.loss is not None and coef is not None:
            out.loss = out.loss + coef * out.aux_loss
    if return_routing and routing.records:
        rids = torch.stack([r[0] for r in routing.records], dim=1)  # [T, layers, k]
        full = rids.new_full((input_ids.numel(), *rids.shape[1:]), -1)
        out.routed_experts = full.index_copy(0, flat, rids).view(*input_ids.shape, *rids.shape[1:])
    if return_logits:
        logits = rules.head_logits(profile, hidden, head.weight, head.bias)
        full = logits.new_zeros((input_ids.numel(), logits.shape[-1]))
        full = full.index_copy(0, flat, logits)
        out.logits = _keep_logits(full.view(*input_ids.shape, logits.shape[-1]), logits_to_keep)
    if completion_mask is not None:
        cm_all = completion_mask.reshape(-1).bool()
        cm = cm_all[flat]
        if int(cm.sum()) != int(cm_all.sum()):
            raise ValueError("completion_mask marks padding tokens (attention_mask 0): they have no log-prob")
        if bool((cm & first_tokens(cu, cm.numel())).any()):
            raise ValueError("completion_mask marks the first token of a sequence, which has no prediction")
        targets = cm.nonzero().squeeze(1)
        temps, greedy = _per_token_temperature(temperature, input_ids, cu, flat, targets)
        target_ids = ids.index_select(0, targets)
        head_in = hidden.index_select(0, targets - 1)
        logits = None  # the LM head's logits of the scored rows, computed once where they are needed
        if return_entropy:
            if fused_lm_head is True or isinstance(fused_lm_head, dict):
                raise ValueError("aligned_ops patched model: return_entropy=True needs the logits; use "
                                 "fused_lm_head=False")
            fused_lm_head = False  # "auto": the logits are computed anyway
            logits = rules.head_logits(profile, head_in, head.weight, head.bias)
            ent = _entropy(logits, temps)
            out.entropy = ent.new_zeros(input_ids.numel()).index_copy(0, flat.index_select(0, targets),
                                                                     ent).view(input_ids.shape)
        if fused_lm_head == "auto":  # aligned_ops.ops.lm_head.FUSED_AUTO_MIN_LOGITS_BYTES: same bits either way
            fused_lm_head = _fuse_automatically(head, head_in, top_k, top_p, min_p, rules, profile)
        if not fused_lm_head and logits is None:
            logits = rules.head_logits(profile, head_in, head.weight, head.bias)
        if fused_lm_head:
            lp = _fused_head_logprobs(self, head, head_in, target_ids, temps, fused_lm_head, top_k, top_p, min_p,
                                      rules, profile)
        elif top_k is None and top_p is None and min_p is None:
            lp = aligned_ops.token_logprobs(logits, target_ids, temps)
        else:
            # The distribution vLLM sampled from with logprobs_mode="processed_logprobs" and the plugin:
            # x = fp32(z) / T, truncated by aligned_ops.sampling (min-p, top-k, top-p), log-softmax at T = 1.
            from ..sampling import scale_logits, truncate_logits

            def per_token(v, dtype, off):
                if v is None:
                    return None
                v = _per_token_value(v, cu, targets, dtype, input_ids.device)
                # vLLM resets a greedy request's top_k / top_p / min_p to off (SamplingParams.__post_init__)
                return v if greedy is None else v.masked_fill(greedy, off)

            t = temps if isinstance(temps, torch.Tensor) else torch.full((targets.numel(),), temps)
            x = scale_logits(logits, t)
            x = truncate_logits(x, top_k=per_token(top_k, torch.int64, 0), top_p=per_token(top_p, torch.float32, 1.0),
                                min_p=per_token(min_p, torch.float32, 0.0))
            lp = aligned_ops.token_logprobs(x, target_ids, 1.0)
        full = lp.new_zeros(input_ids.numel())
        full = full.index_copy(0, flat.index_select(0, targets), lp)
        out.logprobs = full.view(input_ids.shape)
    return out


def _keep_logits(logits, logits_to_keep):
    """HF's ``logits_to_keep`` on the returned logits ``[..., S, V]``: an int ``k > 0`` keeps the last ``k``
    positions, 0 keeps all, a tensor indexes the positions (as HF indexes its hidden states); each row's logits are
    its own bits either way."""
    if isinstance(logits_to_keep, torch.Tensor):
        return logits[..., logits_to_keep.to(logits.device), :]
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
        raise ValueError(f"aligned_ops patched model: logits_to_keep must be an int >= 0 or a tensor of positions, "
                         f"got {logits_to_keep!r}")
    return logits[..., -logits_to_keep:, :] if logits_to_keep else logits


def _fuse_automatically(head, hidden, top_k, top_p, min_p, rules, profile) -> bool:
    """``fused_lm_head="auto"``: fuse where the fused head applies (full-vocabulary scoring, a profile with a
    fused LM head, model-dtype logits) and the [tokens, vocab] logits would be large (``lm_head.fused_by_default``)."""
    from ..ops.lm_head import fused_by_default

    if top_k is not None or top_p is not None or min_p is not None:
        return False
    if not profile.capabilities.fused_lm_head or rules.logits_dtype is not None:
        return False
    return fused_by_default(hidden.shape[0], head.weight.shape[0], hidden.dtype)


def _causal_lm_loss(hidden, head, input_ids, labels, flat, cu, rules, profile, num_items_in_batch,
                    shift_labels=None, ignore_index=-100):
    """HF's causal-LM loss (``ForCausalLMLoss``: token j's label is predicted by token j-1, ``ignore_index``
    (-100) is ignored, mean over the counted labels, or their sum / ``num_items_in_batch``) from the aligned logits'
    ``token_logprobs``. A sequence's first token has no prediction: its label is ignored (HF drops
    ``labels[:, 0]``). A label on padding is refused (HF would score a pad position).

    ``shift_labels`` (HF's loss keyword, pre-shifted: position j's entry is what token j's hidden state predicts;
    HF uses it instead of shifting ``labels``, and only when ``labels`` is given): scored as given, each row by its
    own hidden state (was ignored: the loss of the unshifted ``labels`` instead, no error)."""
    given, name = (labels, "labels") if shift_labels is None else (shift_labels, "shift_labels")
    try:
        if isinstance(ignore_index, bool) or (isinstance(ignore_index, torch.Tensor)
                                              and ignore_index.dtype == torch.bool):
            raise TypeError
        ignore_index = operator.index(ignore_index)
    except TypeError:
        raise ValueError(f"aligned_ops patched model: ignore_index must be an integer (HF's default -100), got "
                         f"{ignore_index!r}") from None
    if given.shape != input_ids.shape:
        raise ValueError(f"aligned_ops patched model: {name} must have the shape of input_ids "
                         f"{tuple(input_ids.shape)}, got {tuple(given.shape)}")
    lab_all = given.reshape(-1).to(hidden.device)
    lab = lab_all.index_select(0, flat)
    counted = lab != ignore_index
    if bool(counted.sum() != (lab_all != ignore_index).sum()):  # (one host sync)
        raise ValueError(f"aligned_ops patched model: {name} mark padding tokens (attention_mask 0); set them to "
                         f"{ignore_index} (ignore_index)")
    if shift_labels is None:
        targets = (counted & ~first_tokens(cu, counted.numel())).nonzero().squeeze(1)
        rows = targets - 1  # token j is predicted by the hidden state of token j-1 of its sequence
    else:
        targets = rows = counted.nonzero().squeeze(1)
    head_in = hidden.index_select(0, rows)
    scored = lab.index_select(0, targets)
    vocab = head.weight.shape[0]
    # token_logprobs checks the range too, but names its own argument (token_ids); one host sync to name the caller's
    out_of_range = (scored < 0) | (scored >= vocab)
    if bool(out_of_range.any()):
        bad = int(scored[out_of_range][0])
        raise ValueError(f"aligned_ops patched model: {name} must be token ids in [0, {vocab}) or ignore_index "
                         f"({ignore_index}), got {bad}")
    lp = aligned_ops.token_logprobs(rules.head_logits(profile, head_in, head.weight, head.bias), scored, 1.0)
    denom = targets.numel() if num_items_in_batch is None else num_items_in_batch
    if isinstance(denom, torch.Tensor):
        denom = denom.to(lp.device)
    return -lp.sum() / denom


def _widened(lsm):
    """fp32 log-probs ``[n, v]`` widened to a multiple of 64 columns (log p = 0 there: p log p = 0), so every row
    meets torch's elementwise kernels at the same vector-lane alignment, whatever the number of rows."""
    v = lsm.shape[-1]
    width = -(-v // 64) * 64
    return torch.nn.functional.pad(lsm, (0, width - v)) if width != v else lsm


class _Entropy(torch.autograd.Function):
    """fp32 entropy ``-sum(p * log p)`` of each row of ``softmax(logits / T)``. Forward: ``aligned_ops.log_softmax``,
    widened (:func:`_widened`), ``p * log p`` with a token at log p = -inf (a masked logit) giving 0 (its p is 0;
    0 * -inf was NaN), the row sum in the linear contract's row-local order (``ops.moe.row_local_sum``: 64-term
    tiles, then over the tiles), not ``torch.sum``, which splits a lone row of more than 32768 terms across threads.
    Backward: ``d H / d log p = -p (log p + 1)`` (0 at log p = -inf), on the widened rows, then the log_softmax op's
    own backward. It saves only the logits (which the log-probs' backward keeps anyway; log p is recomputed, as
    log_softmax's own backward does): torch's elementwise graph kept exp(log p), the masked log p and a bool mask,
    9 bytes per logit, until the loss's backward, also for an entropy that is only logged (measured at
    [1024, 151936]: 1,336 MiB, now 0.3; bench/bench_entropy_memory.py). In-place steps keep the transients to two
    fp32 copies and a mask (peak over forward + backward there: 2,522 -> 1,336 MiB; time 5.7 -> 2.8 s)."""

    @staticmethod
    def forward(ctx, logits, temps):
        ctx.save_for_backward(logits, temps if isinstance(temps, torch.Tensor) else None)
        ctx.temperature = None if isinstance(temps, torch.Tensor) else temps
        lsm = _widened(aligned_ops.log_softmax(logits, temps))
        lsm.masked_fill_(lsm == float("-inf"), 0.0)
        return -row_local_sum(lsm.exp().mul_(lsm))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        logits, temps = ctx.saved_tensors
        temps = ctx.temperature if temps is None else temps
        v = logits.shape[-1]
        lsm = _widened(aligned_ops.log_softmax(logits, temps))
        masked = lsm == float("-inf")
        d = lsm + 1.0
        d.mul_(lsm.exp_()).masked_fill_(masked, 0.0).mul_((-g)[:, None])  # -g p (log p + 1)
        del lsm, masked  # (before the narrowing copy of a vocabulary that is not a multiple of 64)
        t, ts = _temperature_args("log_softmax", temps, logits)
        return torch.ops.aligned.log_softmax_backward(d[:, :v].contiguous(), logits, t, ts), None


def _entropy(logits, temps):
    """Per-row fp32 entropy of ``softmax(logits / temps)`` (:class:`_Entropy`): a row's value and gradient depend
    neither on the batch nor on the threads. Differentiable in ``logits``."""
    if torch.is_grad_enabled():
        # log_softmax's own autograd setup, which refuses a temperature tensor that requires grad, does not run
        # inside a Function's forward: refused here, by the same rule (and, as there, not under no_grad)
        refuse_temperature_grad("log_softmax", temps if isinstance(temps, torch.Tensor) else None)
    return _Entropy.apply(logits, temps)


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
    """``(temperatures, greedy)`` of the selected tokens: the temperature a float or a per-sequence tensor
    ``[B]`` expanded to fp32 per token, mapped by ``aligned_ops.sampling.effective_temperature`` (vLLM's rule:
    0 < T < 0.01 samples at 0.01, T = 0 is greedy and scored at 1, like the vLLM plugin); ``greedy`` a bool
    per token (None when no sequence is greedy). Values vLLM refuses raise (``check_temperature``)."""
    if not isinstance(temperature, torch.Tensor) or temperature.dim() == 0:
        t = float(temperature)
        check_temperature(t, "completion_logprobs: temperature")
        greedy = torch.ones(targets.numel(), dtype=torch.bool, device=input_ids.device) if t == 0 else None
        return effective_temperature(t), greedy
    nseq = cu.numel() - 1
    if temperature.numel() != nseq:
        raise ValueError(f"temperature tensor must have one entry per sequence ({nseq}), got {temperature.numel()}")
    check_temperature(temperature, "completion_logprobs: temperature")
    requested = temperature.to(device=input_ids.device).reshape(-1)
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    per_token = torch.repeat_interleave(effective_temperature(requested), lens).index_select(0, targets)
    greedy = torch.repeat_interleave(requested == 0, lens).index_select(0, targets)
    return per_token.contiguous(), (greedy if bool(greedy.any()) else None)


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


def _resolve_mla_form(arch, mla_form, where):
    if mla_form is None:
        return None
    if not arch.mla_forms:
        raise ValueError(f"aligned_ops ({where}): mla_form={mla_form!r}, but {arch.name} has no MLA attention")
    form = arch.mla_forms.get(mla_form) if isinstance(mla_form, str) else mla_form
    if form is None or form not in arch.mla_forms.values():
        raise ValueError(f"aligned_ops ({where}): mla_form must be one of {sorted(arch.mla_forms)}, got {mla_form!r}")
    return form


def architecture_name(model: torch.nn.Module) -> str:
    """The architecture name patch_model looks up: the model's own class (or a base class) names it;
    config.architectures is None for a model built in memory, and only consulted when the class is not one we
    know."""
    known = [c.__name__ for c in type(model).__mro__ if c.__name__ in ARCHITECTURES]
    named = list(getattr(model.config, "architectures", None) or [])
    return known[0] if known else (named[0] if named else type(model).__name__)


def patch_checks(model: torch.nn.Module, profile=None, mla_form=None):
    """Every check :func:`patch_model` makes before it changes the model, changing nothing (a patched model is
    checked as its unpatched self: the checks read its config, parameters and layers' attention modules). Returns
    ``(arch, MLA form or None, the resolved linear profile, where the profile came from)``; raises what patch_model
    raises. Callers that patch several models (the TRL adapter: policy and reference) check all of them first."""
    name = architecture_name(model)
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
    if mla_form is None and arch.mla_forms:  # the one default of trainer and engine (models/mla_form.py)
        mla_form = resolve_mla_form()
    form = _resolve_mla_form(arch, mla_form, "patch_model")
    if form is not None:
        form.check_config(model.config, "patch_model")
    for i, layer in enumerate(model.model.layers if form is not None else ()):
        form.check_hf_layer(layer.self_attn, i, "patch_model")
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
    # What the profile needs of the model and this machine (the mma profile: bf16 and the CPU's unit, or an active
    # aligned_ops.emulate scope): refused now, in one line, in the words the vLLM plugin uses.
    param = next(model.parameters(), None)
    bad = resolved.model_refusals(param.dtype, param.device.type) if param is not None else []
    if bad:
        raise ValueError("aligned_ops (patch_model): " + "; ".join(bad))
    return arch, form, resolved, source


def patch_model(model: torch.nn.Module, profile: str | profiles.Profile | None = None,
                mla_form=None) -> torch.nn.Module:
    """Route ``model`` (a HF ``*ForCausalLM`` of a supported architecture, :mod:`aligned_ops.models`) through
    ``torch.ops.aligned``; returns it.

    ``profile``: the linear numerics profile (a name or an :mod:`aligned_ops.profiles` object); None:
    ``ALIGNED_OPS_LINEAR`` (read now, once). An architecture whose rules pin a profile runs that one. The model
    and its layers carry the resolved profile (``aligned_ops.profiles.profile_of(model)``).

    In place and idempotent (patching a patched model again changes nothing; :func:`unpatch_model` first to
    change its profile). Raises ``ValueError`` for an unsupported architecture, RoPE variant, sliding window,
    quantization, dtype or profile. ``unpatch_model`` restores the original forwards.

    ``mla_form``: for an MLA architecture (DeepSeek-V3 / Kimi-K2), ``"absorbed"`` (one latent row per token, q
    and o through the absorbed kv_b_proj: ``models.deepseek_v3.absorbed_attention``) or ``"expanded"`` (per-head
    k and v from kv_b_proj), or the form object. None (the default): the form the vLLM plugin runs, resolved by the
    same function (``models.mla_form.resolve_mla_form``: ``ALIGNED_OPS_MLA_FORM``, default ``absorbed``); pair
    with a configured engine explicitly by ``mla_form=aligned_ops.integrations.vllm.engine_mla_form(llm)``;
    ignored (None) for an architecture without MLA. Or the form object
    (``Architecture.mla_forms``). The two forms are the same function in exact arithmetic, not the same bits;
    rollout and trainer must run the same one.
    """
    if getattr(model, "_aligned_patched", False):
        if mla_form is not None:
            arch = get_architecture(model._aligned_arch, "patch_model")
            form = _resolve_mla_form(arch, mla_form, "patch_model")
            layers = model.model.layers
            have = layers[0].__dict__.get("_aligned_mla_form", arch.mla_forms["expanded"]) if len(layers) else form
            if form is not have:
                raise ValueError(f"aligned_ops (patch_model): mla_form={form.name!r}, but the model is already "
                                 "patched with another form; call unpatch_model(model) first to change it")
        if profile is not None:
            wanted = rules_for(model._aligned_arch).resolve_profile(profile)
            if wanted is not model._aligned_profile:
                raise ValueError(
                    f"aligned_ops (patch_model): profile={wanted.name!r}, but the model is already patched with "
                    f"profile {model._aligned_profile.name!r}; call unpatch_model(model) first to change it")
        return model
    arch, form, resolved, source = patch_checks(model, profile, mla_form)
    for layer in model.model.layers:
        layer._aligned_arch = arch.name  # the layer's rules are looked up per call (model_spec.rules_for)
        layer._aligned_profile = resolved
        if form is not None:
            layer._aligned_mla_form = form  # read by the architecture's block (models.deepseek_v3.block)
        layer.forward = BoundForward(_layer_forward, layer)
    # The backbone too (model.model(...), which frameworks call when they apply the LM head themselves): HF's
    # backbone forward would call the patched layers with its own keyword arguments.
    inner = model.model
    inner._aligned_arch = arch.name
    inner._aligned_profile = resolved
    inner.forward = BoundForward(_backbone_forward, inner)
    model._aligned_arch = arch.name
    model._aligned_profile = resolved
    model._aligned_profile_source = source
    model.forward = BoundForward(_model_forward, model)
    model._aligned_patched = True
    return model


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch_model` (the HF forwards come back)."""
    if not getattr(model, "_aligned_patched", False):
        return model
    for layer in model.model.layers:
        for key in ("forward", "_aligned_arch", "_aligned_profile", "_aligned_mla_form"):
            layer.__dict__.pop(key, None)
    for key in ("forward", "_aligned_arch", "_aligned_profile", "_aligned_cos_sin_cache"):
        model.model.__dict__.pop(key, None)
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
    fused_lm_head="auto",
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Teacher-forced fp32 log-probs of the completion tokens, shaped like ``input_ids`` (0 elsewhere).

    ``input_ids`` is ``[B, S]`` with ``attention_mask`` (left or right padding), or packed ``[T]``/``[1, T]``
    with ``cu_seqlens [B+1]``. ``completion_mask[b, t] = 1`` asks for ``log p(input_ids[b, t] | prefix)``
    (under ``softmax(logits / temperature)`` over the full vocabulary; temperature is a float or one value
    per sequence, taken as vLLM takes ``SamplingParams.temperature`` (``aligned_ops.sampling``): 0 means greedy
    and is scored at 1.0, 0 < T < 0.01 is raised to 0.01, values vLLM refuses raise). Differentiable.

    ``top_k`` / ``top_p`` / ``min_p`` (scalar or one per sequence; default None = full vocabulary): score
    the *truncated* distribution instead — ``log_softmax`` of ``aligned_ops.sampling.truncate_logits(z / T)``,
    what the vLLM plugin returns with ``logprobs_mode="processed_logprobs"`` (bit for bit). A token outside
    the truncated set gets ``-inf``. Their ranges are vLLM's (``top_p`` in (0, 1], ``min_p`` in [0, 1],
    ``top_k`` an integer, 0 or -1 = off); a greedy sequence (temperature 0) is scored untruncated, as vLLM
    resets its options.

    ``position_ids``: the tokens' positions (default: from 0 in each sequence); in a packed row without
    ``cu_seqlens`` (padding-free), a restart at 0 starts a new sequence.

    ``fused_lm_head=True`` (or a dict ``{"token_chunk": .., "vocab_chunk": ..}``): compute the LM head and the
    log-probs with :func:`aligned_ops.fused_token_logprobs` — the same bits, forward and gradient, without the
    ``[tokens, vocab]`` logits and their gradient (full-vocabulary scoring and the fma linear profile only).
    ``"auto"`` (the default): fused where it applies and the logits would take at least
    ``aligned_ops.ops.lm_head.FUSED_AUTO_MIN_LOGITS_BYTES`` (256 MiB; 4096 tokens x 151,936 bf16 are 1.16 GiB),
    unfused otherwise — the bits are the same either way. ``False``: never fused.
    """
    if not getattr(model, "_aligned_patched", False):
        raise ValueError("completion_logprobs: call aligned_ops.integrations.hf.patch_model(model) first")
    return model(
        input_ids,
        attention_mask=attention_mask,
        cu_seqlens=cu_seqlens,
        position_ids=position_ids,
        completion_mask=completion_mask,
        temperature=temperature,
        return_logits=False,
        output_router_logits=False,  # only the log-probs are returned (not config.output_router_logits' aux loss)
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        fused_lm_head=fused_lm_head,
        return_dict=True,  # the output's fields, whatever the config's return_dict says
    ).logprobs
