"""DeepSeek-V3 / Kimi-K2 (``DeepseekV3ForCausalLM``): MLA attention in its EXPANDED form, grouped sigmoid routing
with a correction bias (``aligned::moe_grouped_routing``), routed + shared experts, dense layers first.

One decoder layer, on packed tokens ``hidden [T, H]`` (``residual``: None for the first layer)::

    input norm:      rms_norm (layer 0) / fused_add_rms_norm (later)
    down-projections of x, one logical linear:  [q_a_proj | kv_a_proj_with_mqa]   (q_lora_rank set)   or
                     [q_proj | kv_a_proj_with_mqa]   (q_lora_rank None); each module runs on its own
    q:               q_b_proj(rms_norm(q_a, q_a_layernorm))   (or q_proj's output)  -> [T, Hq, d_nope + d_rope]
    kv latent:       kv_a_proj_with_mqa's output = [c (kv_lora_rank) | k_pe (d_rope)];  c = rms_norm(c, kv_a_layernorm)
    k, v:            kv_b_proj(c) -> [T, Hq, d_nope + d_v] -> k_nope | v
    rotary:          on the d_rope slice only (q_pe per head, the one shared k_pe), GPT-J pairing (DeepSeek's
                     interleaved layout: pairs (x0, x1), (x2, x3), ... rotated by one frequency each, results
                     left in place — vLLM's is_neox_style=False); table and YaRN factor from aligned_ops.rope
    attention:       q = [q_nope | q_pe], k = [k_nope | k_pe], v zero-padded from d_v to d_nope + d_rope (every
                     output element is its own chain over the keys, so the padding changes no bit of the real
                     columns); causal; scale = (d_nope + d_rope) ** -0.5 * mscale(factor, mscale_all_dim)^2
                     (aligned_ops.rope.deepseek_attention_scale, HF's and vLLM's DeepSeek rule)
    o_proj:          over the first d_v columns of each head
    post-attn norm:  fused_add_rms_norm
    MLP (layer < first_k_dense_replace):  gate_up -> silu_and_mul -> down
    MoE (later):     router logits in fp32 (linear(x.float(), W.float()), as HF computes them)
                     -> moe_grouped_routing(logits, e_score_correction_bias (fp32), top_k, n_group, topk_group,
                                            norm_topk_prob, routed_scaling_factor)
                     -> moe_experts(x, w, ids, experts, shared expert (n_shared_experts * moe_intermediate, no gate))

HF (``rope_interleave=True``) rotates the same pairs but writes each head's rope slice de-interleaved (evens'
results, then odds'): the same q.k up to a fixed permutation of the summed dims, i.e. equal in exact arithmetic,
not in bits — both sides of aligned_ops use the layout above. In vLLM the plugin selects the non-MLA path
(``VLLM_MLA_DISABLE=1``, set by the plugin for this form): ``DeepseekV2Attention`` with the standard ``Attention``
layer, whose decoder layer runs this block.

The ABSORBED form (issue 26; the vLLM plugin's default: vLLM's MLA modules, ``integrations/vllm/mla.py``): ``patch_model(model,
mla_form="absorbed")`` records :data:`ABSORBED` (an :class:`MlaForm`) on each decoder layer and the block runs
:func:`absorbed_attention` instead — the same q, latent c, k_pe and rope; per head q_nope·W_UK, one latent row
``[c || rope(k_pe)]`` per token as the only KV head (``aligned::mla_attention_varlen``), o_latent·W_UV; W_UK and
W_UV are contiguous copies of slices of kv_b_proj's weight (``W[:, :dn, :]`` transposed, ``W[:, dn:, :]``; exact,
and autograd carries their gradients back to kv_b_proj), made per forward unless the weight is registered with
``cache_exact_weights``. Both forms compute the same function; their bits differ (other sums), so
rollout and trainer must run the same form. Under FSDP2 (``integrations.fsdp.shard_aligned(model,
mla_form="absorbed")``) W_UK / W_UV are derived from the gathered kv_b_proj inside each forward; compiled
(torch.compile) the form gives eager's bits, forward and backward — tested with the CPU inductor backend only
(tests/integrations/test_hf_deepseek_v3_absorbed.py); GPU inductor is untested. The spec below (and ``model_spec``) describe the
expanded form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..rope import _yarn_mscale, deepseek_attention_scale, hf_rope_params, rope_type_of, yarn_attention_factor
from .base import Architecture, Projection
from .decoder import DOWN, GATE_UP, O_PROJ, pre_norm_block
from .moe import MoEWeights
from .spec import LayerRules, Step

NAME = "DeepseekV3ForCausalLM"

Q = Projection(("q_proj",))
KV_A = Projection(("kv_a_proj_with_mqa",))
# q_lora_rank set: q_a_proj then kv_a_proj_with_mqa, both of x (one logical linear in the spec; vLLM's non-MLA
# DeepseekV2Attention keeps them as two modules, its MLA path fuses them as fused_qkv_a_proj)
Q_A = Projection(("q_a_proj",))
Q_B = Projection(("q_b_proj",))
QKV_A = Projection(("q_a_proj", "kv_a_proj_with_mqa"), fused="fused_qkv_a_proj")  # vLLM's MLA path only
KV_B = Projection(("kv_b_proj",))
PROJECTIONS = {"q": Q, "kv_a": KV_A, "q_a": Q_A, "q_b": Q_B, "kv_b": KV_B, "o_proj": O_PROJ, "gate_up": GATE_UP,
               "down": DOWN}

# GPT-J (interleaved) rotary pairing; everything else as the Llama-family decoder rules.
RULES = LayerRules(rotary_neox=False)


def _dims(attn):
    """(heads, d_nope, d_rope, d_v, kv_lora_rank) of an attention module (HF's and vLLM's share these names; vLLM's
    num_local_heads is this rank's share at TP > 1)."""
    return getattr(attn, "num_local_heads", attn.num_heads), attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim, attn.kv_lora_rank


def _norm(rules, norm, x):
    return rules.apply_norm(x, norm.weight, norm.variance_epsilon)


def _q_and_latent(side, ctx, attn, x, rules):
    """What both forms share: ``(q [T, Hq, d_nope + d_rope], c = kv_a_layernorm(latent) [T, kv_lora_rank],
    k_pe [T, 1, d_rope])`` — the down-projections of x, q's up-projection, the latent's norm (rope not applied)."""
    T = x.shape[0]
    Hq, dn, dr, dv, rank = _dims(attn)
    if getattr(attn, "q_lora_rank", None) is None:
        (q,) = side.parts(ctx, attn, Q, x)
        (kva,) = side.parts(ctx, attn, KV_A, x)
    elif hasattr(attn, "fused_qkv_a_proj"):  # vLLM's MLA modules hold the two down-projections fused
        qa, kva = side.parts(ctx, attn, QKV_A, x)
        (q,) = side.parts(ctx, attn, Q_B, _norm(rules, attn.q_a_layernorm, qa))
    else:
        (qa,) = side.parts(ctx, attn, Q_A, x)
        (kva,) = side.parts(ctx, attn, KV_A, x)
        (q,) = side.parts(ctx, attn, Q_B, _norm(rules, attn.q_a_layernorm, qa))
    c = _norm(rules, attn.kv_a_layernorm, kva[:, :rank].contiguous())
    return q.view(T, Hq, dn + dr), c, kva[:, rank:].contiguous().view(T, 1, dr)


def attention(arch, side, ctx, attn, x, rules):
    """Expanded MLA on ``x [T, H]`` (module docstring): ``[T, Hq * d_v]`` before o_proj."""
    T = x.shape[0]
    Hq, dn, dr, dv, rank = _dims(attn)
    dqk = dn + dr
    q, c, k_pe = _q_and_latent(side, ctx, attn, x, rules)
    (kv,) = side.parts(ctx, attn, KV_B, c)
    kv = kv.view(T, Hq, dn + dv)
    positions, cos_sin_cache = side.rope(ctx, attn)
    q_pe = rules.rotary(positions, q[..., dn:].contiguous(), cos_sin_cache, dr)
    k_pe = rules.rotary(positions, k_pe, cos_sin_cache, dr)
    q = torch.cat([q[..., :dn], q_pe], dim=-1)
    k = torch.cat([kv[..., :dn], k_pe.expand(T, Hq, dr)], dim=-1)
    v = kv[..., dn:]
    if dv < dqk:
        v = torch.nn.functional.pad(v, (0, dqk - dv))
    o = side.attention(ctx, attn, q.contiguous(), k.contiguous(), v.contiguous(), float(attn.scaling))
    return o.view(T, Hq, dqk)[..., :dv].reshape(T, Hq * dv)


def absorbed_attention(arch, side, ctx, attn, x, rules):
    """Absorbed (latent) MLA on ``x [T, H]``: ``[T, Hq * d_v]`` before o_proj. The same q, latent c and k_pe as
    the expanded form (:func:`_q_and_latent`, the same rope), then per head ``q_latent = q_nope · W_UK``
    (:func:`aligned_ops.mla_absorb_q`, the side's profile linear), the row ``[q_latent || q_pe]`` against each
    token's one latent row ``[c || k_pe]`` (:func:`aligned_ops.mla_attention_varlen`: scores over all
    kv_lora_rank + d_rope dims, values = c), ``o = o_latent · W_UV`` per head (:func:`aligned_ops.mla_absorb_out`).
    W_UK / W_UV are views of ``kv_b_proj.weight`` (gradients reach it). The scale is the layer's own (DeepSeek's
    1/sqrt(d_nope + d_rope) · mscale², as the expanded form)."""
    from ..ops.mla import mla_absorb_out, mla_absorb_q, mla_absorbed_weights

    T = x.shape[0]
    Hq, dn, dr, dv, rank = _dims(attn)
    q, c, k_pe = _q_and_latent(side, ctx, attn, x, rules)
    positions, cos_sin_cache = side.rope(ctx, attn)
    q_pe = rules.rotary(positions, q[..., dn:].contiguous(), cos_sin_cache, dr)
    k_pe = rules.rotary(positions, k_pe, cos_sin_cache, dr)
    w = mla_absorbed_weights(attn.kv_b_proj.weight, Hq, dn, dv)

    def linear(a, weight):
        return side.linear(ctx, a, weight)

    q_latent = mla_absorb_q(q[..., :dn], w, linear)
    q_row = torch.cat([q_latent, q_pe], dim=-1).contiguous()
    kv_row = torch.cat([c, k_pe.view(T, dr)], dim=-1).contiguous()
    o_latent = side.mla_attention(ctx, attn, q_row, kv_row, rank, float(attn.scaling))
    return mla_absorb_out(o_latent, w, linear).reshape(T, Hq * dv)


@dataclass(frozen=True)
class MlaForm:
    """How a DeepSeek-V3 layer computes its attention: ``expanded`` (k, v per head from kv_b_proj) or ``absorbed``
    (one latent row per token): the default of both the trainer patch and the vLLM plugin, one resolver
    (:func:`aligned_ops.models.mla_form.resolve_mla_form`, ``ALIGNED_OPS_MLA_FORM`` selects either). Chosen once, by ``patch_model(model, mla_form=...)``, and carried by each patched
    decoder layer (``layer._aligned_mla_form``); the block reads that object, never a string."""

    name: str
    attention: Callable

    def check_config(self, config, where):
        """What the form needs of the config (trainer patch and vLLM plugin): the expanded form pads v to the q/k
        head (``d_nope + d_rope``), as vLLM's non-MLA DeepseekV2Attention does, so v_head_dim must not exceed it
        (larger: vLLM fails reshaping the attention output, the trainer's attention op on k / v shapes)."""
        if self.name != "expanded":
            return
        dqk = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
        if int(config.v_head_dim) > dqk:
            raise ValueError(f"aligned_ops ({where}): {NAME} v_head_dim {config.v_head_dim} > qk_nope_head_dim + "
                             f"qk_rope_head_dim = {dqk} is not supported in the expanded MLA form (vLLM's non-MLA "
                             "attention pads v to the q/k head size): use the absorbed form")

    def check_hf_layer(self, attn, i, where):
        if self.name == "absorbed" and getattr(attn.kv_b_proj, "bias", None) is not None:
            raise ValueError(f"aligned_ops ({where}): layer {i} kv_b_proj has a bias; the absorbed MLA form folds "
                             "kv_b_proj into q and o (no bias term): use mla_form='expanded'")

    def __repr__(self) -> str:
        return f"<aligned_ops MLA form {self.name}>"

    # A form is a registered singleton, as a linear profile is: copies (deepcopy of a patched model) and pickles
    # (torch.save of one) are the registered object itself, so the ``is`` comparisons of patch_model and the TRL
    # adapter hold for them (review 137: a deep-copied patched DeepSeek-V3 was "patched with another form").
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (_registered_form, (self.name,))


def _registered_form(name: str) -> MlaForm:
    return MLA_FORMS[name]


EXPANDED = MlaForm("expanded", attention)
ABSORBED = MlaForm("absorbed", absorbed_attention)
MLA_FORMS = {f.name: f for f in (EXPANDED, ABSORBED)}


def block(arch, side, ctx, layer, hidden, residual):
    """One DeepSeek-V3 decoder layer (module docstring): the shared pre-norm layer (norms, residuals, o_proj, MLP
    or MoE: models/decoder.py) around the layer's MLA form (:class:`MlaForm`; expanded unless the trainer patch
    chose another); returns ``(mlp_out, residual)`` like vLLM."""
    form = layer.__dict__.get("_aligned_mla_form", EXPANDED)
    return pre_norm_block(arch, side, ctx, layer, hidden, residual, form.attention)


# ---- config ------------------------------------------------------------------------------------------------


def num_routed_experts(config) -> int:
    return int(getattr(config, "n_routed_experts", None) or getattr(config, "num_local_experts", 0) or 0)


def sparse_layers(config) -> tuple[int, ...]:
    """HF's rule: every layer from ``first_k_dense_replace`` on is sparse (``moe_layer_freq`` must be 1)."""
    if num_routed_experts(config) == 0:
        return ()
    return tuple(range(int(config.first_k_dense_replace or 0), config.num_hidden_layers))


def check_grouped_moe(config, where: str, name: str = NAME) -> None:
    """What the aligned ops reproduce of a grouped-sigmoid-routing config (DeepSeek-V3 and GLM-4.5, ``name``), and
    what vLLM's two model classes read as HF's do; ValueError naming the field otherwise."""
    scoring = getattr(config, "scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"aligned_ops ({where}): {name} scoring_func must be 'sigmoid', got {scoring!r}")
    method = getattr(config, "topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise ValueError(f"aligned_ops ({where}): {name} topk_method must be 'noaux_tc', got {method!r}")
    E = num_routed_experts(config)
    ng, tg, k = int(config.n_group or 1), int(config.topk_group or 1), int(config.num_experts_per_tok)
    if E and (E % ng or not 1 <= tg <= ng or not 1 <= k <= tg * (E // ng)):
        raise ValueError(f"aligned_ops ({where}): {name} routing needs n_group | n_routed_experts, 1 <= topk_group "
                         f"<= n_group and 1 <= num_experts_per_tok <= topk_group * n_routed_experts / n_group; got "
                         f"E={E}, n_group={ng}, topk_group={tg}, top_k={k}")
    if int(getattr(config, "moe_layer_freq", 1) or 1) != 1:
        raise ValueError(f"aligned_ops ({where}): {name} moe_layer_freq != 1 is not supported (HF ignores it)")
    # vLLM's DeepseekV2ForCausalLM / Glm4MoeForCausalLM always build their own lm_head (never the embedding's);
    # a tied checkpoint has no lm_head.weight, so vLLM's stays unloaded (found: NaN log-probs, no warning) while
    # HF's is the embedding.
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError(f"aligned_ops ({where}): {name} with tie_word_embeddings=True is not supported: vLLM's "
                         f"{name} never ties lm_head to the embedding (its lm_head stays unloaded); HF's does")


def check_config(config, where: str) -> None:
    """What the aligned ops reproduce of a DeepSeek-V3 config, and what vLLM's DeepseekV2 classes read as HF's
    does; ValueError naming the field otherwise."""
    # HF's DeepseekV3Config declares neither field (its model always routes with sigmoid + the correction bias);
    # vLLM's DeepSeek reads them with its own defaults, softmax and no bias (found: a config.json without them
    # fails in vLLM's loader, KeyError 'layers.1.mlp.gate.e_score_correction_bias', a traceback after start-up).
    for field, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if num_routed_experts(config) and getattr(config, field, None) is None:
            raise ValueError(f"aligned_ops ({where}): {NAME} config needs {field}={want!r} (vLLM's DeepSeek reads it "
                             "and defaults to softmax routing without the correction bias; HF's always uses sigmoid "
                             "and the bias): add it to config.json")
    check_grouped_moe(config, where)
    # Kimi-K2's checkpoints say model_type "kimi_k2": vLLM reads it as DeepSeek-V3 (DeepseekV3Config); transformers
    # 5.19 has no such type (it loads only after vLLM registered it in the process, or with remote code) and then
    # converts no per-expert checkpoint weights into its fused experts (its conversion is keyed by model_type):
    # the trainer's routed experts stay randomly initialised (found: aligned-ops verify, 0 % bitwise, 3.6 nats).
    model_type = getattr(config, "model_type", None)
    if model_type is not None and model_type != "deepseek_v3":
        raise ValueError(f"aligned_ops ({where}): {NAME} with model_type {model_type!r} is not supported: "
                         "transformers loads its experts only for model_type 'deepseek_v3' (Kimi-K2's architecture "
                         "is DeepSeek-V3's: set model_type to 'deepseek_v3' in config.json)")
    # num_nextn_predict_layers (MTP) only matters to speculative decoding, which the plugin refuses on its own;
    # the main model (HF's and vLLM's) does not run those layers.
    # vLLM's DeepseekV2Attention builds q_a_proj / q_proj / kv_a_proj_with_mqa / o_proj without biases (a
    # checkpoint's are skipped at load); HF's biases q_a_proj, kv_a_proj_with_mqa and o_proj per attention_bias
    # (found: 0 % bitwise, max |diff| 1.6 to 3.6 nats, no warning).
    if getattr(config, "attention_bias", False):
        raise ValueError(f"aligned_ops ({where}): {NAME} with attention_bias=True is not supported: vLLM's "
                         "DeepSeek attention has no q_a_proj / kv_a_proj_with_mqa / o_proj biases; HF's adds them")
    # vLLM (DeepseekV2Attention) runs a scaled RoPE with attention_factor == 1.0 as "deepseek_llama_scaling": it
    # skips YaRN's mscale**2 on the softmax scale (and the YaRN table), which HF and the aligned block apply
    # (rope.deepseek_attention_scale): rollout and trainer would score with different scales.
    params = hf_rope_params(config)
    rope_type = rope_type_of(params)
    if rope_type != "default" and params.get("attention_factor") == 1.0:
        raise ValueError(f"aligned_ops ({where}): {NAME} rope_scaling attention_factor=1.0 is not supported (vLLM "
                         "then skips the YaRN mscale of the softmax scale that HF applies); remove attention_factor")
    if rope_type not in ("default", "yarn"):  # vLLM's DeepseekV2Attention runs every scaled RoPE as DeepSeek YaRN
        raise ValueError(f"aligned_ops ({where}): {NAME} rope_type {rope_type!r} is not supported: vLLM's DeepSeek "
                         "attention runs every scaled RoPE as DeepSeek YaRN (use 'yarn' or 'default')")
    if rope_type == "yarn":
        _check_deepseek_yarn(params, where)
    if getattr(config, "rope_interleave", True) is False:
        raise ValueError(f"aligned_ops ({where}): {NAME} with rope_interleave=False (NeoX halves on the rope "
                         "slice) is not described; DeepSeek checkpoints use the interleaved layout")


def _check_deepseek_yarn(params: dict, where: str) -> None:
    """vLLM's DeepSeek YaRN table (DeepseekScalingRotaryEmbedding, whose numbers the plugin takes) multiplies cos /
    sin by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` (absent: 1 and 0), ignores
    ``attention_factor`` and always truncates the correction range; HF's YaRN table (the trainer's) uses
    ``attention_factor`` when set, the ratio only when both mscale and mscale_all_dim are set (else
    ``mscale(factor)``), and honours ``truncate`` (found: mscale_all_dim alone, 0 % bitwise, max |diff| 1.8
    nats)."""
    if params.get("truncate", True) is False:
        raise ValueError(f"aligned_ops ({where}): {NAME} rope_scaling truncate=False is not supported: vLLM's "
                         "DeepSeek YaRN always truncates the correction range; HF's does not then")
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        return  # (the rope check names a missing / non-numeric factor)
    try:
        hf = yarn_attention_factor(float(factor), params.get("attention_factor"), params.get("mscale"),
                                   params.get("mscale_all_dim"))
        vllm = float(_yarn_mscale(float(factor), float(params.get("mscale", 1)))
                     / _yarn_mscale(float(factor), float(params.get("mscale_all_dim", 0))))
    except (TypeError, ValueError):
        raise ValueError(f"aligned_ops ({where}): {NAME} rope_scaling mscale / mscale_all_dim / attention_factor "
                         f"must be numbers, got {params.get('mscale')!r} / {params.get('mscale_all_dim')!r} / "
                         f"{params.get('attention_factor')!r}") from None
    if hf != vllm:
        raise ValueError(f"aligned_ops ({where}): {NAME} rope_scaling with mscale={params.get('mscale')!r}, "
                         f"mscale_all_dim={params.get('mscale_all_dim')!r}, attention_factor="
                         f"{params.get('attention_factor')!r} is not supported: HF's YaRN scales cos/sin by {hf!r}, "
                         f"vLLM's DeepSeek YaRN by {vllm!r} (it reads mscale / mscale_all_dim, default 1 / 0, and "
                         "ignores attention_factor); set both mscale and mscale_all_dim, without attention_factor")


def check_hf_model(model, where: str) -> None:
    """The HF model's own numbers the block relies on: the fp32 correction bias, the attention scale."""
    if any(p.dtype == torch.float16 for p in model.parameters()):
        raise ValueError(f"aligned_ops ({where}): {NAME} in float16 is not supported (vLLM's DeepSeek decoder "
                         "layer rescales hidden states for fp16); use bfloat16 or float32")
    cfg = model.config
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        want = deepseek_attention_scale(attn.qk_nope_head_dim + attn.qk_rope_head_dim, cfg)
        if float(attn.scaling) != want:
            raise ValueError(f"aligned_ops ({where}): layer {i} attention scale {attn.scaling} is not DeepSeek's "
                             f"{want}")
        gate = getattr(layer.mlp, "gate", None)
        bias = getattr(gate, "e_score_correction_bias", None)
        if gate is not None and bias is not None and bias.dtype != torch.float32:
            raise ValueError(f"aligned_ops ({where}): layer {i} e_score_correction_bias is {bias.dtype}; it must "
                             "stay float32 (a rounded bias changes the routing; HF keeps it fp32 when loading)")


def hf_moe_weights(mlp) -> MoEWeights:
    """A HF DeepseekV3MoE block's routing and weights (the shared experts as one ungated shared expert)."""
    g = mlp.gate
    sh = getattr(mlp, "shared_experts", None)
    sw13 = sw2 = None
    if sh is not None:
        sw13 = torch.cat([sh.gate_proj.weight, sh.up_proj.weight], dim=0)
        sw2 = sh.down_proj.weight
    return MoEWeights(g.weight, int(g.top_k), "sigmoid_grouped", bool(g.norm_topk_prob), mlp.experts.gate_up_proj,
                      mlp.experts.down_proj, sw13, sw2, None, correction_bias=g.e_score_correction_bias,
                      n_group=int(g.num_group), topk_group=int(g.topk_group),
                      routed_scaling_factor=float(g.routed_scaling_factor), router_dtype=torch.float32)


def refit_weights(state_dict):
    """HF 5.19 keeps a sparse block's experts fused in memory (``mlp.experts.gate_up_proj [E, 2I, H]``,
    ``mlp.experts.down_proj [E, H, I]``); checkpoints and vLLM's DeepSeek loader name them per expert
    (``mlp.experts.{e}.{gate,up,down}_proj.weight``). Yields ``(name, tensor)`` in the checkpoint's names (views,
    no copy); everything else passes as it is."""
    for name, value in state_dict.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                yield f"{base}{e}.gate_proj.weight", value[e, :inter]
                yield f"{base}{e}.up_proj.weight", value[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(value.shape[0]):
                yield f"{base}{e}.down_proj.weight", value[e]
        else:
            yield name, value


def spec(arch, config, rules, profile) -> list[Step]:
    """The logical op sequence of one forward (embedding excluded)."""
    H, Hq, V = config.hidden_size, config.num_attention_heads, config.vocab_size
    dn, dr, dv, rank = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank
    qr = config.q_lora_rank
    sparse = set(sparse_layers(config))
    norm, res_norm, act, lin = rules.norm, rules.residual_norm, rules.activation, profile.op
    bias = bool(getattr(config, "attention_bias", False))
    steps: list[Step] = []
    for i in range(config.num_hidden_layers):
        p = f"L{i}."
        steps.append(Step(norm if i == 0 else res_norm, p + "input_norm", n=H))
        if qr is None:
            steps.append(Step(lin, p + "q_proj|kv_a_proj_with_mqa", k=H, n=Hq * (dn + dr) + rank + dr, bias=bias))
        else:
            steps.append(Step(lin, p + "q_a_proj|kv_a_proj_with_mqa", k=H, n=qr + rank + dr, bias=bias))
            steps.append(Step(norm, p + "q_a_layernorm", n=qr))
            steps.append(Step(lin, p + "q_b_proj", k=qr, n=Hq * (dn + dr)))
        steps.append(Step(norm, p + "kv_a_layernorm", n=rank))
        steps.append(Step(lin, p + "kv_b_proj", k=rank, n=Hq * (dn + dv)))
        steps.append(Step("rotary", p + "rotary_q", n=dr))
        steps.append(Step("rotary", p + "rotary_k", n=dr))
        steps.append(Step("attention", p + "attention", n=dn + dr))
        steps.append(Step(lin, p + "o_proj", k=Hq * dv, n=H, bias=bias))
        steps.append(Step(res_norm, p + "post_attention_norm", n=H))
        if i in sparse:
            steps.append(Step(rules.router_profile.op, p + "router", k=H, n=num_routed_experts(config)))
            steps.append(Step("moe_grouped_routing", p + "moe_routing"))
            steps.append(Step("moe_experts", p + "moe_experts"))
        else:
            steps.append(Step(lin, p + "gate_up_proj", k=H, n=2 * config.intermediate_size))
            steps.append(Step(act, p + "act", n=config.intermediate_size))
            steps.append(Step(lin, p + "down_proj", k=config.intermediate_size, n=H))
    steps.append(Step(res_norm, "final_norm", n=H))
    steps.append(Step(profile.op, "lm_head", k=H, n=V))
    steps.append(Step("logprobs", "logprobs", n=V))
    return steps


ARCHITECTURE = Architecture(
    name=NAME,
    # Kimi-K2: its own model_type, DeepSeek-V3's class (named here so a kimi_k2 config naming another architecture is
    # a mismatch; check_config refuses it: transformers 5.19 loads no experts for it)
    model_types=("deepseek_v3", "kimi_k2"),
    block=block,
    spec=spec,
    vllm_decoder_layer="vllm.model_executor.models.deepseek_v2:DeepseekV2DecoderLayer",
    projections=PROJECTIONS,
    moe=True,
    sparse_layers=sparse_layers,
    hf_moe_weights=hf_moe_weights,
    check_config=check_config,
    check_hf_model=check_hf_model,
    required_config=("n_group", "topk_group", "num_experts_per_tok", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim"),
    rules=RULES,
    own_attention_scale=True,
    refuse_fp16=True,
    refit_weights=refit_weights,
    fp32_weights=("e_score_correction_bias",),
    mla_forms=MLA_FORMS,
)
