"""What an architecture is, as an object, and what each side (trainer, engine) supplies to its block function.

An :class:`Architecture` carries, for one ``*ForCausalLM`` architecture name:

- ``block(arch, side, ctx, layer, hidden, residual) -> (hidden, residual)`` — the op sequence of ONE decoder layer
  (norms, projections, q/k norms, rotary, attention, MLP or MoE, residuals) applying the layer's
  :class:`~aligned_ops.models.spec.LayerRules`. The trainer patch (:mod:`aligned_ops.integrations.hf`) and the
  vLLM plugin (:mod:`aligned_ops.integrations.vllm.decoders`) both call it: the sequence is written once.
- ``projections`` — its logical linears (:class:`Projection`): the HF modules a logical projection is split
  into, and the vLLM module that holds them fused;
- ``spec(arch, config, rules, profile)`` — the expected logical op sequence of a whole forward (the test oracle
  both sides' traces are compared with, ``tests/integrations/test_model_spec.py``);
- ``vllm_decoder_layer`` — the vLLM class whose ``forward`` the plugin replaces by the block;
- config checks (``check_config``) and HF-model checks (``check_hf_model``) for what the ops do not reproduce.

What differs between the sides is supplied by a :class:`Side` (one object per side, shared by every
architecture): how a logical projection is computed from the modules it has (split in the trainer, fused in
the engine — the same bits, every output element being its own chain over K), where positions and the RoPE
table come from, how attention runs (``attention_varlen`` over packed sequences in training;
``reshape_and_cache`` + ``paged_attention`` through vLLM's attention layer in the engine), and how a sparse MoE
block runs. Module names both sides share (``input_layernorm``, ``post_attention_layernorm``,
``self_attn.q_norm`` ...) are read by the block directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .spec import DECODER_RULES, LayerRules


@dataclass(frozen=True)
class Projection:
    """One logical linear. ``parts``: the HF modules it is split into (the trainer runs each, in order);
    ``fused``: the vLLM module holding them concatenated along N (None: one module of the same name on both
    sides). The fused and the split forms give the same bits (every output element is one chain over K)."""

    parts: tuple[str, ...]
    fused: str | None = None

    @property
    def engine_module(self) -> str:
        return self.fused or self.parts[0]


class Side:
    """What one side supplies to a block function (the trainer: ``integrations.hf``; the engine:
    ``integrations.vllm.decoders``). ``ctx`` is the side's per-forward context, opaque to the block."""

    def parts(self, ctx, owner, projection: Projection, x):
        """The outputs of ``projection``'s parts (2-D ``[T, n_i]`` each, in ``projection.parts`` order)."""
        raise NotImplementedError

    def joined(self, ctx, owner, projection: Projection, x):
        """The output of ``projection`` as one ``[T, sum n_i]`` tensor (its parts concatenated)."""
        raise NotImplementedError

    def rope(self, ctx, attn):
        """``(positions [T] int64, cos_sin_cache [P, rotary_dim] fp32)`` for attention module ``attn``."""
        raise NotImplementedError

    def attention(self, ctx, attn, q, k, v, scale: float):
        """Causal attention of ``q [T, Hq, D]`` over ``k``/``v [T, Hkv, D]`` at ``scale``: ``[T, Hq * D]``."""
        raise NotImplementedError

    def linear(self, ctx, x, weight):
        """``x [T, K] · weight [N, K]ᵀ`` through the side's linear profile, for a weight no module holds (MLA's
        absorbed per-head projections, derived from ``kv_b_proj``)."""
        raise NotImplementedError

    def mla_attention(self, ctx, attn, q, kv, kv_lora_rank: int, scale: float):
        """Causal absorbed MLA of ``q [T, Hq, D]`` over each token's latent row ``kv [T, D]`` at ``scale``:
        ``o_latent [T, Hq, kv_lora_rank]`` (:func:`aligned_ops.mla_attention_varlen`'s contract)."""
        raise NotImplementedError

    def is_sparse(self, arch, mlp) -> bool:
        """Whether the layer's MLP module is a sparse MoE block."""
        raise NotImplementedError

    def sparse_mlp(self, arch, ctx, mlp, x, rules):
        """The sparse MoE block on ``x [T, H]`` (router, routing, experts: :func:`aligned_ops.models.moe.sparse_moe`)."""
        raise NotImplementedError


def _no_checks(*args, **kwargs) -> None:
    return None


def config_attention_biases(config) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias) where both follow ``config.attention_bias`` (Llama, Qwen3, Qwen3-MoE)."""
    b = bool(getattr(config, "attention_bias", False))
    return b, b


def check_head_dim_is_derived(config, where: str, name: str) -> None:
    """Refuses a ``head_dim`` other than ``hidden_size // num_attention_heads`` for an architecture whose vLLM
    attention derives the head size and ignores ``config.head_dim`` (Qwen2, Qwen2-MoE), while HF's reads it: the
    two would run different models (found loading a Qwen2 with head_dim 64 at hidden 128 / 4 heads: 0 % bitwise)."""
    head_dim = getattr(config, "head_dim", None)
    derived = config.hidden_size // config.num_attention_heads
    if head_dim is not None and head_dim != derived:
        raise ValueError(f"aligned_ops ({where}): {name} with head_dim {head_dim} (not hidden_size // "
                         f"num_attention_heads = {derived}) is not supported: vLLM's {name} attention ignores "
                         f"config.head_dim, HF's reads it")


@dataclass(frozen=True)
class Architecture:
    name: str                               # config.architectures[0], e.g. "Qwen2ForCausalLM"
    block: Callable                         # block(arch, side, ctx, layer, hidden, residual) -> (hidden, residual)
    spec: Callable                          # spec(arch, config, rules, profile) -> list[Step]
    vllm_decoder_layer: str                 # "module:Class" of vLLM's decoder layer (its forward becomes the block)
    projections: dict = field(default_factory=dict)  # logical name -> Projection
    qk_norm: bool = False                   # per-head RMSNorm of q and k before rotary (Qwen3)
    moe: bool = False                       # has sparse MoE layers
    attention_biases: Callable = config_attention_biases  # config -> (q/k/v bias, o_proj bias)
    sparse_layers: Callable | None = None   # config -> tuple of the layer indices whose MLP is a sparse MoE block
    hf_moe_weights: Callable | None = None  # HF sparse block -> aligned_ops.models.moe.MoEWeights
    check_config: Callable = _no_checks     # (config, where) -> None; raises ValueError for what it cannot run
    check_hf_model: Callable = _no_checks   # (model, where) -> None; raises ValueError (trainer patch)
    # config fields check_config reads without a default of its own: HF's config class fills each from a default
    # that differs between architectures, so a raw config.json (``--model``) without one is refused by name
    # (integrations.check_config_fields) instead of failing inside the check
    required_config: tuple = ()
    # the config.json model_type(s) of this architecture: transformers (AutoModelForCausalLM) picks the model class by
    # model_type, vLLM by architectures[0], so a config whose two name different architectures runs a different model
    # on each side (integrations.check_same_architecture refuses it)
    model_types: tuple = ()
    rules: LayerRules = DECODER_RULES
    # True: the block takes the attention layer's own scale (DeepSeek's YaRN mscale), which check_hf_model checks;
    # False: LayerRules.scale(head_dim), checked against the layer by patch_model
    own_attention_scale: bool = False
    # environment the vLLM plugin sets before vLLM builds the engine config (DeepSeek: VLLM_MLA_DISABLE=1, the
    # expanded attention the trainer runs); said in the log
    vllm_env: dict = field(default_factory=dict)
    refuse_fp16: bool = False               # the vLLM decoder layer rescales hidden states in fp16 (DeepSeek)
    # the config field without which the HF config class drops ``sliding_window`` (Qwen's: ``use_sliding_window``,
    # default False); None: the class keeps ``sliding_window`` as given (Llama's, whose HF forward then ignores it while
    # vLLM windows every layer by it). Read by integrations.sliding_window_setting.
    sliding_window_switch: str | None = None
    # True: rotary on the first partial_rotary_factor * head_dim dims of each head (GLM-4.5: HF's and vLLM's forward
    # rotate that slice, NeoX halves, the rest passes); False: a config asking for it is refused
    partial_rotary: bool = False
    grouped_routing: bool = False           # the Llama-family spec's sparse layers route with moe_grouped_routing
    # refit (integrations.rollout.refit): the HF trainer's in-memory state dict -> the checkpoint names vLLM's
    # loader takes (None: as is), and the weight-name suffixes that stay float32 in any model dtype
    refit_weights: Callable | None = None
    fp32_weights: tuple = ()
    # MLA architectures: the attention forms the trainer patch can select by name (patch_model(mla_form=...)),
    # name -> form object (models.deepseek_v3.MlaForm); empty: no choice. The block's default is the expanded form.
    mla_forms: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"<aligned_ops architecture {self.name}>"
