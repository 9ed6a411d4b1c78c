"""The pre-norm decoder layer of the Llama family (Llama, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE): its block function
and its expected op sequence. Each architecture module names it with its own flags (q/k norms, biases, which
layers are sparse).

One decoder layer, on packed tokens ``hidden [T, H]`` (``residual``: None for the first layer)::

    input norm:       rms_norm (layer 0) / fused_add_rms_norm (later: normalises the *rounded* sum)
    qkv projection:   one logical linear (HF: q_proj, k_proj, v_proj; vLLM: qkv_proj), + bias per architecture
    [q_norm, k_norm]: per-head rms_norm before rotary (Qwen3, Qwen3-MoE; GLM-4.5 when use_qk_norm)
    rotary:           q, then k, with the shared fp32 cos/sin table (aligned_ops.rope; its width: GLM-4.5 rotates
                      the first half of each head)
    attention:        causal; varlen in training, paged in the engine (the same per-(row, head) function)
    o_proj:           linear (row-parallel in the engine at TP > 1: the profile's route)
    post-attn norm:   fused_add_rms_norm
    MLP:              gate_up linear (HF: gate_proj, up_proj; vLLM: gate_up_proj) -> silu_and_mul -> down linear
      or sparse MoE:  router linear -> moe_routing -> moe_experts (aligned_ops.models.moe)

Returns ``(mlp_out, residual)`` like vLLM's decoder layers; the model's final norm folds the last residual in.
Everything but the attention (qkv through the attention op) is :func:`pre_norm_block`, which DeepSeek-V3's block
(models/deepseek_v3.py, MLA attention) runs too: the norms, residuals, o_proj and MLP / MoE are written once.
"""

from __future__ import annotations

from .base import Projection
from .moe import num_experts
from .registry import rules_of
from .spec import Step

QKV = Projection(("q_proj", "k_proj", "v_proj"), fused="qkv_proj")
O_PROJ = Projection(("o_proj",))
GATE_UP = Projection(("gate_proj", "up_proj"), fused="gate_up_proj")
DOWN = Projection(("down_proj",))
PROJECTIONS = {"qkv": QKV, "o_proj": O_PROJ, "gate_up": GATE_UP, "down": DOWN}


def _head_norm(rules, norm, x):
    return rules.apply_norm(x, norm.weight, norm.variance_epsilon)


def pre_norm_block(arch, side, ctx, layer, hidden, residual, attention):
    """One pre-norm decoder layer around ``attention`` — the part every architecture shares (the Llama family
    and DeepSeek-V3): input norm, ``attention(arch, side, ctx, layer.self_attn, x, rules)`` (``[T, Hq * d_v]``)
    then o_proj, post-attention norm, then the MLP or the sparse MoE block; returns ``(mlp_out, residual)``.
    ``layer``: the side's decoder-layer module (HF's or vLLM's); its norms and attention/MLP submodules are read by
    the names both sides share."""
    rules = rules_of(layer)
    norm = layer.input_layernorm
    if residual is None:
        residual = hidden
        x = rules.apply_norm(hidden, norm.weight, norm.variance_epsilon)
    else:
        x, residual = rules.apply_norm(hidden, norm.weight, norm.variance_epsilon, residual)
    attn = layer.self_attn
    (h,) = side.parts(ctx, attn, O_PROJ, attention(arch, side, ctx, attn, x, rules))
    post = layer.post_attention_layernorm
    x, residual = rules.apply_norm(h, post.weight, post.variance_epsilon, residual)
    mlp = layer.mlp
    if arch.moe and side.is_sparse(arch, mlp):
        return side.sparse_mlp(arch, ctx, mlp, x, rules), residual
    gate_up = side.joined(ctx, mlp, GATE_UP, x)
    (out,) = side.parts(ctx, mlp, DOWN, rules.activate(gate_up))
    return out, residual


def attention(arch, side, ctx, attn, x, rules):
    """The Llama family's attention on ``x [T, H]`` (module docstring: qkv, q/k norms, rotary, causal attention):
    ``[T, Hq * D]`` before o_proj."""
    q, k, v = side.parts(ctx, attn, QKV, x)
    T, D = x.shape[0], attn.head_dim
    # Head counts from the widths, not view(T, -1, D): a batch with no real token has T = 0.
    q, k, v = (t.view(T, t.shape[-1] // D, D) for t in (q, k, v))
    if arch.qk_norm or getattr(attn, "use_qk_norm", False):  # per-head RMSNorm before RoPE (GLM: per config)
        q, k = _head_norm(rules, attn.q_norm, q), _head_norm(rules, attn.k_norm, k)
    positions, cos_sin_cache = side.rope(ctx, attn)
    rotary_dim = cos_sin_cache.shape[-1]  # the table's width
    q = rules.rotary(positions, q, cos_sin_cache, rotary_dim)
    k = rules.rotary(positions, k, cos_sin_cache, rotary_dim)
    return side.attention(ctx, attn, q, k, v, rules.scale(D))


def block(arch, side, ctx, layer, hidden, residual):
    """One decoder layer of the Llama family (module docstring)."""
    return pre_norm_block(arch, side, ctx, layer, hidden, residual, attention)


def spec(arch, config, rules, profile) -> list[Step]:
    """The logical op sequence of one forward (embedding excluded) under ``rules`` and ``profile``."""
    H = config.hidden_size
    Hq = config.num_attention_heads
    Hkv = getattr(config, "num_key_value_heads", None) or Hq
    D = getattr(config, "head_dim", None) or H // Hq
    V = config.vocab_size
    qkv_bias, o_bias = arch.attention_biases(config)
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    sparse = set(arch.sparse_layers(config)) if arch.sparse_layers is not None else set()
    # The op names come from the rules and the profile ("linear" or "linear_exact"; the router's profile).
    norm, res_norm, act, lin = rules.norm, rules.residual_norm, rules.activation, profile.op
    steps: list[Step] = []
    for i in range(config.num_hidden_layers):
        p = f"L{i}."
        steps.append(Step(norm if i == 0 else res_norm, p + "input_norm", n=H))
        steps.append(Step(lin, p + "qkv_proj", k=H, n=(Hq + 2 * Hkv) * D, bias=qkv_bias))
        if arch.qk_norm or getattr(config, "use_qk_norm", False):
            steps.append(Step(norm, p + "q_norm", n=D))
            steps.append(Step(norm, p + "k_norm", n=D))
        steps.append(Step("rotary", p + "rotary_q", n=D))
        steps.append(Step("rotary", p + "rotary_k", n=D))
        steps.append(Step("attention", p + "attention", n=D))
        steps.append(Step(lin, p + "o_proj", k=Hq * D, n=H, bias=o_bias))
        steps.append(Step(res_norm, p + "post_attention_norm", n=H))
        if i in sparse:
            steps.append(Step(rules.router_profile.op, p + "router", k=H, n=num_experts(config)))
            steps.append(Step("moe_grouped_routing" if arch.grouped_routing else "moe_routing", p + "moe_routing"))
            steps.append(Step("moe_experts", p + "moe_experts"))
        else:
            steps.append(Step(lin, p + "gate_up_proj", k=H, n=2 * config.intermediate_size, bias=mlp_bias))
            steps.append(Step(act, p + "act", n=config.intermediate_size))
            steps.append(Step(lin, p + "down_proj", k=config.intermediate_size, n=H, bias=mlp_bias))
    steps.append(Step(res_norm, "final_norm", n=H))
    steps.append(Step(profile.op, "lm_head", k=H, n=V))
    steps.append(Step("logprobs", "logprobs", n=V))
    return steps
