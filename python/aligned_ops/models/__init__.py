"""Model definitions shared by the trainer patch and the vLLM plugin: one module per architecture.

Each module holds one :class:`~aligned_ops.models.base.Architecture`: the block function of its decoder layer
(the op sequence both sides call), its logical projections, its expected op sequence (the test oracle), the vLLM
decoder-layer class the plugin overrides, and its config checks. :data:`ARCHITECTURES` (filled below, from the
one list of supported architectures) is what the trainer patch, the vLLM plugin's validation and decoder
overrides, ``aligned_ops.model_spec`` and the CLI read.

Adding an architecture: write ``models/<arch>.py`` defining ``ARCHITECTURE`` (reuse :mod:`.decoder`'s block if it
is a Llama-family layer, else write its own block, projections and spec next to it), and add it to the tuple
below. See :mod:`.base` for what a block receives.

- :mod:`.base` the Architecture object and the Side interface (what the trainer and the engine supply);
- :mod:`.spec` the shared vocabulary: Step, ModelSpec, LayerRules;
- :mod:`.registry` the registry, per-call rule lookup (``rules_of``), ``model_spec``;
- :mod:`.decoder` the Llama-family decoder block (Llama, Qwen2, Qwen3 and their MoE variants);
- :mod:`.moe` the sparse MoE block's op sequence;
- :mod:`.deepseek_v3` DeepSeek-V3 / Kimi-K2: its MLA attention (expanded form) inside the shared pre-norm block,
  grouped sigmoid routing, shared experts;
- :mod:`.glm4_moe` GLM-4.5: the Llama-family block (partial rotary, optional q/k norms) with DeepSeek-V3's MoE;
- :mod:`.tiny` tiny random-weight checkpoints (the CLI's default model, tests).
"""

from __future__ import annotations

from . import deepseek_v3, glm4_moe, llama, qwen2, qwen2_moe, qwen3, qwen3_moe
from .base import Architecture, Projection, Side
from .registry import (
    ARCHITECTURES,
    RULES,
    architecture_of,
    get,
    model_spec,
    register,
    rules_for,
    rules_of,
    supported,
)
from .spec import DECODER_RULES, LayerRules, ModelSpec, Step

# The supported architectures: this tuple is the one list (in this order in error messages).
for _arch in (qwen2.ARCHITECTURE, qwen3.ARCHITECTURE, llama.ARCHITECTURE, qwen3_moe.ARCHITECTURE,
              qwen2_moe.ARCHITECTURE, deepseek_v3.ARCHITECTURE, glm4_moe.ARCHITECTURE):
    register(_arch)
del _arch

__all__ = ["ARCHITECTURES", "RULES", "Architecture", "DECODER_RULES", "LayerRules", "ModelSpec", "Projection", "Side",
           "Step", "architecture_of", "get", "model_spec", "register", "rules_for", "rules_of", "supported"]
