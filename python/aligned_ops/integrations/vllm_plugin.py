"""Compatibility name of the vLLM plugin (moved to :mod:`aligned_ops.integrations.vllm`)."""
import sys

from .vllm import install as _install

sys.modules[__name__] = _install
