"""One definition of a decoder-only LM's aligned arithmetic, shared by the trainer patch and the vLLM plugin.

The definitions live in :mod:`aligned_ops.models` (one module per architecture; the shared vocabulary in
:mod:`aligned_ops.models.spec`, the registry and per-call rule lookup in :mod:`aligned_ops.models.registry`);
this module is their stable public name. ``RULES`` is the registry's dict itself: a changed entry reaches both
sides.
"""

from __future__ import annotations

from .models.registry import RULES, architecture_of, model_spec, rules_for, rules_of
from .models.spec import DECODER_RULES, LayerRules, ModelSpec, Step

__all__ = ["DECODER_RULES", "RULES", "LayerRules", "ModelSpec", "Step", "architecture_of", "model_spec", "rules_for",
           "rules_of"]
