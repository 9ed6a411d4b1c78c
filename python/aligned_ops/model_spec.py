"""One definition of a decoder-only LM's aligned arithmetic: which op runs, in which order, on which dtype.

Both sides of RL read the same model and must run the same op sequence for its log-probs to agree bit for
bit: the trainer patch (:mod:`aligned_ops.integrations.hf`) and the vLLM plugin
(:mod:`aligned_ops.integrations.vllm_plugin`). :func:`model_spec` turns a Hugging Face config into that
sequence, at the level where the two sides must agree:

- a *logical* linear is one contraction over the same K with the concatenated output features of its
  parts: vLLM fuses q/k/v (and gate/up) into one weight, the trainer keeps HF's separate modules; since every
  output element of ``aligned::linear`` is its own chain over K, the fused and the split forms give the same
  bits, so the spec records the logical projection (K, total N, bias);
- attention is one logical op: ``attention_varlen`` in training, ``reshape_and_cache`` + ``paged_attention``
  in the engine (the same per-(row, head) function, csrc/common/attention.h);
- the log-prob head is ``token_logprobs`` in training and ``log_softmax`` in the engine (equal bit for bit
  at the sampled id, csrc/common/contract.h).

Both sides also *read* it: every per-layer decision (which norm op, residual fusion, norm weight dtype,
rotary style, activation, linear profile, MoE router profile, attention scale, LM-head dtype) is a field
of :class:`LayerRules`, looked up per architecture with :func:`rules_for` at call time, and applied through
its methods (``norm``, ``linear``, ``rotary``, ...) by the trainer patch and by every vLLM hook; neither side
writes *those* choices itself. "At call time" holds in eager mode: under vLLM's compiled mode (torch.compile /
CUDA graphs) the lookup runs once, while the forward is traced, and a rule changed afterwards does not reach
that engine. The rules do not cover the model's structure, which each side still follows from the model it
runs: causal attention (the trainer passes ``causal=True``), whether q/k norms exist (the modules' presence),
the gate/up order of the fused MLP projection, and the layer layout.

``tests/integrations/test_model_spec.py`` traces the aligned ops of one forward on each side
(:func:`aligned_ops.testing.trace_aligned_ops`) and asserts both equal this spec, so a change on one side
that the other does not make fails there rather than as a silent mismatch; it also changes a rule and
shows both traces follow it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import aligned_ops
from .ops.linear_exact import PROFILES, linear_profile


@dataclass(frozen=True)
class Step:
    """One logical aligned op. ``op``: embed-free op name (rms_norm, fused_add_rms_norm, linear — linear_exact
    / linear_mma under the exact / mma profile —, rotary, attention, silu_and_mul, logprobs; the names come from LayerRules); ``role``: where it sits ("L0.qkv_proj", "final_norm", ...);
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
    - ``linear_profile``: ``fma`` | ``exact`` | ``mma``; None = the process's ``ALIGNED_OPS_LINEAR`` (read per
      call); ``mma`` needs a bf16 model and a machine with the profile's unit (the CPU: avx512_bf16);
    - ``router_profile``: the MoE router projection's profile (``fma``: routing is decided on those bits);
    - ``attention_scale``: None = ``head_dim ** -0.5`` (what HF's ``attn.scaling`` and vLLM's
      ``Attention(scale=)`` are for these architectures; :meth:`check_attention_scale` refuses a model whose
      own scale differs), else that number;
    - ``logits_dtype``: None = the LM head's output in the model dtype; the log-probs are then fp32
      (``token_logprobs`` / ``log_softmax`` upcast exactly, per row, at the sampling temperature).
    """

    norm: str = "rms_norm"
    residual_norm: str = "fused_add_rms_norm"
    norm_weight_dtype: torch.dtype | None = None
    rotary_neox: bool = True
    activation: str = "silu_and_mul"
    linear_profile: str | None = None
    router_profile: str = "fma"
    attention_scale: float | None = None
    logits_dtype: torch.dtype | None = None

    def profile(self) -> str:
        """The linear numerics profile these rules run (``fma`` | ``exact`` | ``mma``)."""
        if self.linear_profile is None:
            return linear_profile()
        if self.linear_profile not in PROFILES:
            raise ValueError(f"LayerRules.linear_profile must be one of {PROFILES}, got {self.linear_profile!r}")
        return self.linear_profile

    def norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return weight if self.norm_weight_dtype is None else weight.to(self.norm_weight_dtype)

    def apply_norm(self, x, weight, eps, residual=None):
        """``norm(x)``, or ``(norm(x + residual), x + residual)`` with the residual fused."""
        w = self.norm_weight(weight)
        if residual is None:
            return getattr(aligned_ops, self.norm)(x, w, eps)
        return getattr(aligned_ops, self.residual_norm)(x, residual, w, eps)

    def linear(self, x, weight, bias=None, profile: str | None = None):
        """``x @ weight.T (+ bias)`` under the rules' profile (or ``profile``)."""
        profile = profile or self.profile()
        if profile == "exact":
            return aligned_ops.linear_exact(x, weight, bias)
        if profile == "mma":
            return aligned_ops.linear_mma(x, weight, bias)
        return aligned_ops.linear(x, weight, bias)

    def moe_experts(self, x, topk_weights, topk_ids, w13, w2, shared_w13=None, shared_w2=None, shared_gate=None):
        """The routed experts (+ shared expert) with their projections under the rules' profile: ``mma`` runs the
        matrix unit's; ``fma`` and ``exact`` the fma chains (the exact profile has no expert kernel: its MoE
        experts have always run, on both sides, the fma profile's)."""
        profile = "mma" if self.profile() == "mma" else "fma"
        return aligned_ops.moe_experts(x, topk_weights, topk_ids, w13, w2, shared_w13, shared_w2, shared_gate,
                                       linear_profile=profile)

    def router_linear(self, x, weight, bias=None):
        """The MoE router's projection (model dtype), under ``router_profile``."""
        return self.linear(x, weight, bias, profile=self.router_profile)

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

    def head_logits(self, x, weight, bias=None):
        """The LM head's logits (the profile's linear, in ``logits_dtype`` or the model dtype)."""
        out = self.linear(x, weight, bias)
        return out if self.logits_dtype is None else out.to(self.logits_dtype)


DECODER_RULES = LayerRules()

# Per architecture (the keys of integrations.SUPPORTED_ARCHITECTURES + MOE_ARCHITECTURES); the dense and MoE
# decoders share one set today. Looked up at call time by both sides (in vLLM's compiled mode: once, when the
# forward is traced), so a change here reaches both.
RULES: dict[str, LayerRules] = {
    arch: DECODER_RULES
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM",
                 "Qwen2MoeForCausalLM")
}


def rules_for(architecture: str | None) -> LayerRules:
    """The :class:`LayerRules` of ``architecture`` (None: a layer whose model is not known, the decoder rules)."""
    if architecture is None:
        return DECODER_RULES
    try:
        return RULES[architecture]
    except KeyError:
        raise ValueError(f"aligned_ops.model_spec: no layer rules for architecture {architecture!r}") from None


def rules_of(layer) -> LayerRules:
    """The rules of a layer (a patched trainer module or a hooked vLLM layer), looked up now from the
    architecture recorded on it (``_aligned_arch``; none recorded: the decoder rules). In vLLM's compiled mode
    "now" is when the forward is traced, once."""
    return rules_for(getattr(layer, "_aligned_arch", None))


def architecture_of(config) -> str:
    """The architecture name of a HF config (``architectures[0]``, or derived from the config class)."""
    return _architecture(config)


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


_QK_NORM_ARCHS = ("Qwen3ForCausalLM",)
_QKV_BIAS_ARCHS = ("Qwen2ForCausalLM",)


def _architecture(config) -> str:
    archs = list(getattr(config, "architectures", None) or [])
    if archs:
        return archs[0]
    name = type(config).__name__  # a config built in memory: Qwen2Config -> Qwen2ForCausalLM
    return name[: -len("Config")] + "ForCausalLM" if name.endswith("Config") else name


def model_spec(config) -> ModelSpec:
    """The aligned op sequence of one forward of a dense Qwen2/Qwen3/Llama causal LM (HF config)."""
    arch = _architecture(config)
    H = config.hidden_size
    Hq = config.num_attention_heads
    Hkv = getattr(config, "num_key_value_heads", None) or Hq
    D = getattr(config, "head_dim", None) or H // Hq
    inter = config.intermediate_size
    V = config.vocab_size
    L = config.num_hidden_layers
    attention_bias = bool(getattr(config, "attention_bias", False))
    qkv_bias = arch in _QKV_BIAS_ARCHS or attention_bias  # Qwen2: q/k/v always biased, o_proj never
    qk_norm = arch in _QK_NORM_ARCHS
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    rules = rules_for(arch)
    # The op names come from the rules (the linear's from its profile: "linear", "linear_exact", "linear_mma").
    norm, res_norm, act = rules.norm, rules.residual_norm, rules.activation
    lin = {"fma": "linear", "exact": "linear_exact", "mma": "linear_mma"}[rules.profile()]
    steps: list[Step] = []
    for i in range(L):
        p = f"L{i}."
        steps.append(Step(norm if i == 0 else res_norm, p + "input_norm", n=H))
        steps.append(Step(lin, p + "qkv_proj", k=H, n=(Hq + 2 * Hkv) * D, bias=qkv_bias))
        if qk_norm:
            steps.append(Step(norm, p + "q_norm", n=D))
            steps.append(Step(norm, p + "k_norm", n=D))
        steps.append(Step("rotary", p + "rotary_q", n=D))
        steps.append(Step("rotary", p + "rotary_k", n=D))
        steps.append(Step("attention", p + "attention", n=D))
        steps.append(Step(lin, p + "o_proj", k=Hq * D, n=H, bias=attention_bias and arch not in _QKV_BIAS_ARCHS))
        steps.append(Step(res_norm, p + "post_attention_norm", n=H))
        steps.append(Step(lin, p + "gate_up_proj", k=H, n=2 * inter, bias=mlp_bias))
        steps.append(Step(act, p + "act", n=inter))
        steps.append(Step(lin, p + "down_proj", k=inter, n=H, bias=mlp_bias))
    steps.append(Step(res_norm, "final_norm", n=H))
    steps.append(Step(lin, "lm_head", k=H, n=V))
    steps.append(Step("logprobs", "logprobs", n=V))
    return ModelSpec(arch, H, Hq, Hkv, D, inter, V, L, qkv_bias, qk_norm, float(config.rms_norm_eps), tuple(steps))
