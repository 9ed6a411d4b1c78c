"""The tiny checkpoint builders under their former name (tests, benchmarks): :mod:`aligned_ops.models.tiny`, which
the shipped CLI uses, so that it imports no test fixture."""

from ..models.tiny import (  # noqa: F401
    DEFAULT_CONFIG,
    DEFAULT_DEEPSEEK_V3_CONFIG,
    DEFAULT_GLM4_MOE_CONFIG,
    DEFAULT_MOE_CONFIG,
    LLAMA3_ROPE,
    _save_random,
    _tokenizer_and_config,
    build_tiny_deepseek_v3,
    build_tiny_glm4_moe,
    build_tiny_llama,
    build_tiny_moe,
    build_tiny_qwen2,
    build_tokenizer,
)
