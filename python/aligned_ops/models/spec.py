"""The vocabulary both sides of RL share: a model's aligned op sequence (:class:`Step`, :class:`ModelSpec`) and the
per-layer choices of which op runs on which dtype (:class:`LayerRules`).

Both sides of RL read the same model and must run the same op sequence for its log-probs to agree bit for
bit: the trainer patch (:mod:`aligned_ops.integrations.hf`) and the vLLM plugin
(:mod:`aligned_ops.integrations.vllm`). Each supported architecture (:mod:`aligned_ops.models`) writes its decoder
layer once, as a *block function* both sides call, and its expected op sequence (``Architecture.spec``), at the
level where the two sides must agree:

- a *logical* linear is one contraction over the same K with the concatenated output features of its
  parts: vLLM fuses q/k/v (and gate/up) into one weight, the trainer keeps HF's separate modules; since every
  output element of ``aligned::linear`` is its own chain over K, the fused and the split forms give the same
  bits, so the spec records the logical projection (K, total N, bias);
- attention is one logical op: ``attention_varlen`` in training, ``reshape_and_cache`` + ``paged_attention``
  in the engine (the same per-(row, head) function, csrc/common/attention.h);
- the log-prob head is ``token_logprobs`` in training and ``log_softmax`` in the engine (equal bit for bit
  at the sampled id, csrc/common/contract.h).

Both sides also *read* the rules: every per-layer decision (which norm op, residual fusion, norm weight dtype,
rotary style, activation, MoE router profile, attention scale, LM-head dtype) is a field of :class:`LayerRules`,
looked up per architecture with ``rules_for`` / ``rules_of`` (:mod:`aligned_ops.models.registry`) at call time,
and applied through its methods (``apply_norm``, ``rotary``, ...) by the block functions and by every vLLM hook;
neither side writes *those* choices itself. "At call time" holds in eager mode: under vLLM's compiled mode
(torch.compile / CUDA graphs) the lookup runs once, while the forward is traced. The linear numerics profile is
not looked up per call: it is resolved once per model / engine (``LayerRules.linear_profile`` pins one, else
``ALIGNED_OPS_LINEAR``; :mod:`aligned_ops.profiles`) and carried by every patched layer.

``tests/integrations/test_model_spec.py`` traces the aligned ops of one forward on each side
(:func:`aligned_ops.testing.trace.trace_aligned_ops`) and asserts both equal the spec, so a change on one side (an
adapter, a hook) that the other does not make fails there rather than as a silent mismatch; it also changes a
rule and shows both traces follow it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import aligned_ops

from .. import profiles
from ..profiles import Profile


@dataclass(frozen=True)
class Step:
    """One logical aligned op. ``op``: embed-free op name (rms_norm, fused_add_rms_norm, linear — the profile's op:
    linear_exact under the exact profile —, rotary, attention, silu_and_mul, moe_routing, moe_experts, logprobs;
    the names come from LayerRules and the profile); ``role``: where it sits ("L0.qkv_proj", "final_norm", ...);
    ``k``/``n``: contraction and output width of a linear, the normalised width of a norm, the head dim of
    rotary/attention, the vocabulary of the log-prob head; ``bias``: whether a linear adds one."""

    op: str
    role: str
    k: int | None = None
    n: int | None = None
    bias: bool = False


@dataclass(frozen=True)
class LayerRules:
    """How each layer kind runs, for every layer of that kind in an architecture. Both sides call the methods;
    the fields are the only place the choices are written.

    - ``norm`` / ``residual_norm``: the aligned op of a norm without / with a residual input; the residual is
      *fused* (``fused_add_rms_norm`` adds, rounds the sum to the model dtype, normalises the rounded sum and
      returns it as the next residual, which is what vLLM's fused RMSNorm does);
    - ``norm_weight_dtype``: None = the norm weight as stored (the model dtype, no upcast), else cast to it;
    - ``rotary_neox``: NeoX-style rotary (rotate halves; Qwen2/Qwen3/Llama) rather than GPT-J (interleaved);
    - ``activation``: the gated MLP's activation op;
    - ``linear_profile``: None = the profile ``ALIGNED_OPS_LINEAR`` (or an explicit argument) selects; a name or
      a :class:`aligned_ops.profiles.Profile` pins one for the architecture. Read when a model is patched or an
      engine is configured (:meth:`resolve_profile`), never per call;
    - ``router_profile``: the MoE router projection's profile (``fma``: routing is decided on those bits);
    - ``attention_scale``: None = ``head_dim ** -0.5`` (what HF's ``attn.scaling`` and vLLM's
      ``Attention(scale=)`` are for these architectures; :meth:`check_attention_scale` refuses a model whose
      own scale differs), else that number;
    - ``logits_dtype``: None = the LM head's output in the model dtype; the log-probs are then fp32
      (``token_logprobs`` / ``log_softmax`` upcast exactly, per row, at the sampling temperature).

    Profile fields accept a name and hold the :class:`~aligned_ops.profiles.Profile` object.
    """

    norm: str = "rms_norm"
    residual_norm: str = "fused_add_rms_norm"
    norm_weight_dtype: torch.dtype | None = None
    rotary_neox: bool = True
    activation: str = "silu_and_mul"
    linear_profile: Profile | str | None = None
    router_profile: Profile | str = profiles.FMA
    attention_scale: float | None = None
    logits_dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.linear_profile is not None:
            object.__setattr__(self, "linear_profile", profiles.get(self.linear_profile, "LayerRules.linear_profile"))
        object.__setattr__(self, "router_profile", profiles.get(self.router_profile, "LayerRules.router_profile"))

    def resolve_profile(self, requested: Profile | str | None = None) -> Profile:
        """The linear profile a model of these rules runs: the pinned one, else ``requested``, else
        ``ALIGNED_OPS_LINEAR`` (read now: call once per model / engine and carry the result)."""
        return profiles.resolve(requested, pinned=self.linear_profile)

    def norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return weight if self.norm_weight_dtype is None else weight.to(self.norm_weight_dtype)

    def apply_norm(self, x, weight, eps, residual=None):
        """``norm(x)``, or ``(norm(x + residual), x + residual)`` with the residual fused."""
        w = self.norm_weight(weight)
        if residual is None:
            return getattr(aligned_ops, self.norm)(x, w, eps)
        return getattr(aligned_ops, self.residual_norm)(x, residual, w, eps)

    def router_linear(self, x, weight, bias=None):
        """The MoE router's projection (model dtype), under ``router_profile``."""
        return self.router_profile.linear(x, weight, bias)

    def rotary(self, positions, x, cos_sin_cache, rotary_dim: int):
        return aligned_ops.rotary_embedding(positions, x, cos_sin_cache, rotary_dim, self.rotary_neox)

    def activate(self, gate_up):
        return getattr(aligned_ops, self.activation)(gate_up)

    def scale(self, head_dim: int) -> float:
        """The attention softmax scale for heads of ``head_dim``."""
        return float(head_dim) ** -0.5 if self.attention_scale is None else float(self.attention_scale)

    def check_attention_scale(self, head_dim: int, layer_scale: float, where: str) -> None:
        """Refuse a layer whose own scale is not the default rule's (a model we do not describe)."""
        if self.attention_scale is None and float(layer_scale) != self.scale(head_dim):
            raise NotImplementedError(f"aligned_ops ({where}): attention scale {layer_scale} is not "
                                      f"head_dim ** -0.5 = {self.scale(head_dim)}")

    def head_logits(self, profile: Profile, x, weight, bias=None):
        """The LM head's logits (``profile``'s linear, in ``logits_dtype`` or the model dtype)."""
        out = profile.linear(x, weight, bias)
        return out if self.logits_dtype is None else out.to(self.logits_dtype)


DECODER_RULES = LayerRules()


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    qkv_bias: bool
    qk_norm: bool
    eps: float
    steps: tuple[Step, ...]
