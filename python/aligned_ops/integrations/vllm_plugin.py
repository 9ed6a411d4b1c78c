"""The vLLM plugin under its former name: the installed ``vllm.general_plugins`` entry point of older wheels, and
users' configurations, name ``aligned_ops.integrations.vllm_plugin:register``. The plugin lives in
:mod:`aligned_ops.integrations.vllm` (one module per concern); this module re-exports its public API.
"""

from __future__ import annotations

from .vllm import *  # noqa: F401,F403
from .vllm import __all__  # noqa: F401
