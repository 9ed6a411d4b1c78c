"""Tiny random-weight checkpoints (Qwen2, Qwen3-MoE / Qwen2-MoE, Llama) and a byte-level BPE tokenizer, built
offline into a folder.

Used by the CLI (``aligned-ops verify`` / ``demo`` build their default model here), the end-to-end tests and
the benchmarks (``aligned_ops.testing.tiny_model`` is this module under its former name): no network,
deterministic for a given seed, loadable by both Hugging Face ``transformers`` and vLLM. Default shape: hidden
128, intermediate 256, 2 layers, 4 query heads, 2 KV heads, head_dim 32, vocabulary 512 (a multiple of 64, so
vLLM does not pad the LM head), tied embeddings like the small Qwen2 models.
"""

from __future__ import annotations

import json
import os

import torch

# Local training text for the tokenizer: a few hundred characters of varied English and digits are
# enough for a 512-entry byte-level BPE; the base 256 byte tokens cover any input.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.",
    "Reinforcement learning from verifiable rewards samples completions, scores them and updates the policy.",
    "A rollout engine and a trainer must agree on every log-probability, bit for bit, or the ratio drifts.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 3.14159 2.71828 -7 +13.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n",
    "Question: what is 17 plus 25? Answer: 42. Question: what is 9 times 8? Answer: 72.",
    "Attention over a paged key-value cache reads blocks of tokens; prefill and decode share one kernel.",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
]

DEFAULT_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)


def build_tokenizer(vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on the built-in corpus; returns a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )


def build_tiny_qwen2(path: str | os.PathLike, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> str:
    """Write a random-weight Qwen2 causal LM and its tokenizer to ``path``; returns ``str(path)``.

    ``dtype`` is the checkpoint dtype (``torch.float32`` or ``torch.bfloat16``). The weights depend only on
    ``seed`` and the config: the model is initialised in fp32 on the CPU with a fixed generator, then cast.
    ``overrides`` change entries of the default config (e.g. ``num_hidden_layers=1``).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"build_tiny_qwen2: unsupported dtype {dtype}; use float32, bfloat16 or float16")
    path = str(path)
    os.makedirs(path, exist_ok=True)
    cfg = dict(DEFAULT_CONFIG)
    cfg.update(overrides)
    tokenizer, eos, config = _tokenizer_and_config(Qwen2Config, cfg)
    return _save_random(Qwen2ForCausalLM(config), tokenizer, path, dtype, seed, eos)


def _tokenizer_and_config(config_cls, cfg):
    """The tiny tokenizer, its eos id, and a ``config_cls`` of ``cfg`` with the fields every tiny checkpoint
    fixes: silu, eos as bos/pad, no sliding window, no attention dropout."""
    tokenizer = build_tokenizer(cfg["vocab_size"])
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = config_cls(**cfg, hidden_act="silu", bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                        use_sliding_window=False, attention_dropout=0.0)
    return tokenizer, eos, config


# ---- tiny mixture-of-experts checkpoints -------------------------------------------------------------------

DEFAULT_MOE_CONFIG = dict(
    DEFAULT_CONFIG,  # the dense shape; intermediate_size serves dense MLP layers (mlp_only_layers), if any
    moe_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    head_dim=32,
    router_aux_loss_coef=0.001,
)


def build_tiny_moe(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    arch: str = "qwen3_moe",
    router_scale: float = 0.08,
    **overrides,
) -> str:
    """Write a random-weight Qwen3-MoE (``arch="qwen3_moe"``) or Qwen2-MoE (``"qwen2_moe"``, with a gated shared
    expert) causal LM and its tokenizer to ``path``; returns ``str(path)``.

    Default: 8 experts, top-2, renormalised, every layer sparse. ``router_scale`` is the std of the router
    weights: larger values make routing decisive, small ones put tokens near routing boundaries (many close
    scores, so small kernel differences flip experts). ``overrides`` change the default config.
    """
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"build_tiny_moe: unsupported dtype {dtype}; use float32, bfloat16 or float16")
    if arch not in ("qwen3_moe", "qwen2_moe"):
        raise ValueError(f"build_tiny_moe: arch must be 'qwen3_moe' or 'qwen2_moe', got {arch!r}")
    path = str(path)
    os.makedirs(path, exist_ok=True)
    cfg = dict(DEFAULT_MOE_CONFIG)
    if arch == "qwen2_moe":
        cfg.update(shared_expert_intermediate_size=64, qkv_bias=True)
        cfg.pop("head_dim")
    cfg.update(overrides)
    config_cls, model_cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if arch == "qwen3_moe" else (Qwen2MoeConfig,
                                                                                              Qwen2MoeForCausalLM)
    tokenizer, eos, config = _tokenizer_and_config(config_cls, cfg)
    return _save_random(model_cls(config), tokenizer, path, dtype, seed, eos, router_scale=router_scale)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256, "rope_theta": 500000.0}


def build_tiny_llama(path: str | os.PathLike, dtype: torch.dtype = torch.float32, seed: int = 0,
                     rope_parameters: dict | None = None, **overrides) -> str:
    """A random-weight Llama causal LM (Llama-3 style: ``rope_type`` llama3 by default, untied LM head, no
    biases) and its tokenizer; same shapes as :func:`build_tiny_qwen2` unless ``overrides`` change them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .llama import ARCHITECTURE as LLAMA

    path = str(path)
    os.makedirs(path, exist_ok=True)
    cfg = dict(DEFAULT_CONFIG)
    cfg.pop("rope_theta")
    cfg.update(tie_word_embeddings=False, head_dim=cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.update(overrides)
    tokenizer = build_tokenizer(cfg["vocab_size"])
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(**cfg, hidden_act="silu", bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                         attention_bias=False, mlp_bias=False,
                         rope_parameters=dict(rope_parameters or LLAMA3_ROPE))
    config.architectures = [LLAMA.name]
    return _save_random(LlamaForCausalLM(config), tokenizer, path, dtype, seed, eos)


DEFAULT_DEEPSEEK_V3_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,            # the dense layers' MLP (first_k_dense_replace)
    moe_intermediate_size=64,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    vocab_size=512,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 512, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                     "mscale_all_dim": 1.0},
)


# Named config changes of the tiny DeepSeek-V3 (``build_tiny_deepseek_v3(..., variant=NAME)``). "dv-ne-dn": the
# value head dim differs from the nope query/key dim (and from d_nope + d_rope), and 5 heads — the default's
# v_head_dim == qk_nope_head_dim (as DeepSeek-V3's own 128 / 128) would hide a W_UK / W_UV slice or a reshape
# that reads one dim for the other; an odd head count puts a 2-rank FSDP2 shard boundary of kv_b_proj
# ((24 + 36) * 5 = 300 rows, 150 per rank) inside a head (head 2's W_UV), not on a head boundary.
DEEPSEEK_V3_VARIANTS = {
    "default": {},
    "dv-ne-dn": dict(num_attention_heads=5, num_key_value_heads=5, qk_nope_head_dim=24, v_head_dim=36),
}


def build_tiny_deepseek_v3(path: str | os.PathLike, dtype: torch.dtype = torch.float32, seed: int = 0,
                           router_scale: float = 0.08, bias_scale: float = 0.05, variant: str = "default",
                           **overrides) -> str:
    """A random-weight DeepSeek-V3 causal LM (MLA, grouped sigmoid routing with a correction bias, a shared expert,
    dense first layer, DeepSeek YaRN) and its tokenizer. Default: 3 layers (``first_k_dense_replace=1``), 8 routed
    experts top-2 in 4 groups keeping 2, 1 shared expert, ``routed_scaling_factor=2.5``; ``config.json`` carries
    ``scoring_func: sigmoid`` and ``topk_method: noaux_tc`` (what vLLM reads). ``e_score_correction_bias`` is random
    (``bias_scale``) and stays float32 in the checkpoint whatever ``dtype``. ``overrides`` change the config
    (e.g. ``q_lora_rank=None``, ``n_group=1, topk_group=1`` for Kimi-K2's single group); ``variant`` first applies
    one of :data:`DEEPSEEK_V3_VARIANTS` (``"dv-ne-dn"``: v_head_dim != qk_nope_head_dim)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from .deepseek_v3 import NAME

    if variant not in DEEPSEEK_V3_VARIANTS:
        raise ValueError(f"build_tiny_deepseek_v3: variant must be one of {sorted(DEEPSEEK_V3_VARIANTS)}, got "
                         f"{variant!r}")
    overrides = dict(DEEPSEEK_V3_VARIANTS[variant], **overrides)
    path = _build_grouped_moe("build_tiny_deepseek_v3", DeepseekV3Config, DeepseekV3ForCausalLM, NAME,
                              DEFAULT_DEEPSEEK_V3_CONFIG, overrides, path, dtype, seed, router_scale, bias_scale,
                              attention_bias=False, attention_dropout=0.0, rope_interleave=True)
    # HF's config class does not declare these; vLLM reads them (without them it uses softmax and no bias).
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        written = json.load(f)
    written.update(scoring_func="sigmoid", topk_method="noaux_tc")
    with open(cfg_path, "w") as f:
        json.dump(written, f, indent=2)
    return path


DEFAULT_GLM4_MOE_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,            # the dense layers' MLP (first_k_dense_replace)
    moe_intermediate_size=64,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    use_qk_norm=True,
    attention_bias=True,
    vocab_size=512,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)


def build_tiny_glm4_moe(path: str | os.PathLike, dtype: torch.dtype = torch.float32, seed: int = 0,
                        router_scale: float = 0.08, bias_scale: float = 0.05, **overrides) -> str:
    """A random-weight GLM-4.5-style causal LM (``Glm4MoeForCausalLM``: q/k/v biases, per-head q/k norms, NeoX
    rotary on half of each head, DeepSeek-V3's grouped sigmoid routing with a random fp32 correction bias, routed
    scaling 2.5, one shared expert, a dense first layer) and its tokenizer. ``overrides`` change the config (e.g.
    ``use_qk_norm=False`` as GLM-4.5 itself, ``n_group=1, topk_group=1``)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from .glm4_moe import NAME

    return _build_grouped_moe("build_tiny_glm4_moe", Glm4MoeConfig, Glm4MoeForCausalLM, NAME,
                              DEFAULT_GLM4_MOE_CONFIG, overrides, path, dtype, seed, router_scale, bias_scale,
                              attention_dropout=0.0)


def _build_grouped_moe(builder, config_cls, model_cls, arch_name, defaults, overrides, path, dtype, seed,
                       router_scale, bias_scale, **fixed):
    """The grouped-sigmoid-routing builders' common body (DeepSeek-V3, GLM-4.5): dtype check, ``defaults`` with
    ``overrides``, the tiny tokenizer and its eos as bos/pad, ``fixed`` config fields, random weights and a random
    float32 ``e_score_correction_bias`` (``bias_scale``, kept float32 in any ``dtype``); returns ``str(path)``."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{builder}: unsupported dtype {dtype}; use float32 or bfloat16")
    path = str(path)
    os.makedirs(path, exist_ok=True)
    cfg = dict(defaults)
    cfg.update(overrides)
    tokenizer = build_tokenizer(cfg["vocab_size"])
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = config_cls(**cfg, hidden_act="silu", bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, **fixed)
    config.architectures = [arch_name]
    model = model_cls(config)
    gen = torch.Generator().manual_seed(seed + 1)
    biases = {name: bias_scale * torch.randn(b.shape, generator=gen)
              for name, b in sorted(model.named_buffers()) if name.endswith("e_score_correction_bias")}
    return _save_random(model, tokenizer, path, dtype, seed, eos, router_scale=router_scale, fp32_buffers=biases)


def _save_random(model, tokenizer, path, dtype, seed, eos, router_scale=None, fp32_buffers=None):
    """Overwrite every parameter from a generator seeded with ``seed`` (norm weights near 1, biases 0.02,
    MoE router weights ``router_scale``, the rest 0.08: larger than the usual 0.02 so logits are spread),
    cast to ``dtype``, save with the tokenizer and a neutral generation config."""
    torch.manual_seed(seed)
    model = model.to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            elif router_scale is not None and name.endswith("mlp.gate.weight"):
                p.copy_(router_scale * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    model = model.to(dtype)
    if fp32_buffers:  # buffers that stay float32 in any dtype (DeepSeek's e_score_correction_bias)
        bufs = dict(model.named_buffers())
        for name, value in fp32_buffers.items():
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner).register_buffer(leaf, value.to(torch.float32).clone(),
                                                       persistent=name in bufs)
    model.config.dtype = dtype
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos}, f)
    return path
