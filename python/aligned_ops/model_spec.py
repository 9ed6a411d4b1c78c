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

``tests/integrations/test_model_spec.py`` traces the aligned ops of one forward on each side
(:func:`aligned_ops.testing.trace_aligned_ops`) and asserts both equal this spec, so a change on one side
that the other does not make fails there rather than as a silent mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """One logical aligned op. ``op``: embed-free op name (rms_norm, fused_add_rms_norm, linear, rotary,
    attention, silu_and_mul, logprobs); ``role``: where it sits ("L0.qkv_proj", "final_norm", ...);
    ``k``/``n``: contraction and output width of a linear, the normalised width of a norm, the head dim of
    rotary/attention, the vocabulary of the log-prob head; ``bias``: whether a linear adds one."""

    op: str
    role: str
    k: int | None = None
    n: int | None = None
    bias: bool = False


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
    steps: list[Step] = []
    for i in range(L):
        p = f"L{i}."
        steps.append(Step("rms_norm" if i == 0 else "fused_add_rms_norm", p + "input_norm", n=H))
        steps.append(Step("linear", p + "qkv_proj", k=H, n=(Hq + 2 * Hkv) * D, bias=qkv_bias))
        if qk_norm:
            steps.append(Step("rms_norm", p + "q_norm", n=D))
            steps.append(Step("rms_norm", p + "k_norm", n=D))
        steps.append(Step("rotary", p + "rotary_q", n=D))
        steps.append(Step("rotary", p + "rotary_k", n=D))
        steps.append(Step("attention", p + "attention", n=D))
        steps.append(Step("linear", p + "o_proj", k=Hq * D, n=H, bias=attention_bias and arch not in _QKV_BIAS_ARCHS))
        steps.append(Step("fused_add_rms_norm", p + "post_attention_norm", n=H))
        steps.append(Step("linear", p + "gate_up_proj", k=H, n=2 * inter, bias=mlp_bias))
        steps.append(Step("silu_and_mul", p + "act", n=inter))
        steps.append(Step("linear", p + "down_proj", k=inter, n=H, bias=mlp_bias))
    steps.append(Step("fused_add_rms_norm", "final_norm", n=H))
    steps.append(Step("linear", "lm_head", k=H, n=V))
    steps.append(Step("logprobs", "logprobs", n=V))
    return ModelSpec(arch, H, Hq, Hkv, D, inter, V, L, qkv_bias, qk_norm, float(config.rms_norm_eps), tuple(steps))
