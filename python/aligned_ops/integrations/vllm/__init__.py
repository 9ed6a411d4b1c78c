"""The vLLM plugin, one module per concern (the overview: :mod:`.plugin`).

- :mod:`.plugin` entry point (``register``), ``install`` / ``uninstall``;
- :mod:`.compat` the supported vLLM releases (the version gate) and every difference between them;
- :mod:`.patches` the patch registry (every change to vLLM, with its reason; what ``uninstall`` undoes);
- :mod:`.bind` what a built layer records: the architecture and the engine's linear profile;
- :mod:`.config` start-up validation and the engine's profile, resolved once;
- :mod:`.decoders` supported decoder layers -> their architecture's block function (aligned_ops.models);
- :mod:`.layers` norms, activation, rotary, linear and LM-head methods;
- :mod:`.tp` tensor parallelism (row-parallel routes, vocab-parallel embedding, the stock all-reduce guard);
- :mod:`.moe` the router and the fused-MoE runner;
- :mod:`.sampler` the returned log-probs;
- :mod:`.attention` the attention backend (imports vLLM: loaded by ``install``, not by this package);
- :mod:`.mla` the latent MLA backend (vLLM's MLA slot; imports vLLM, loaded by ``install``);
- :mod:`.gpu_platform` CUDA/ROCm backend selection and refusals.

Importing this package does not import vLLM (the entry point runs early in every vLLM process).
``aligned_ops.integrations.vllm_plugin`` is the same API under its former name (the installed entry point).
"""

from __future__ import annotations

from .config import MLA_FORM_ENV, engine_mla_form, installed_profile, mla_form_from_env, validate_vllm_config
from .gpu_platform import GPU_REQUIRED_OPS, gpu_platform_reasons, missing_gpu_kernels
from .plugin import (
    ENV_ALIASES,
    ENV_VAR,
    SUPPORTED_VLLM_VERSIONS,
    check_vllm_version,
    enabled_by_env,
    install,
    is_installed,
    register,
    uninstall,
    vllm_status,
)
from .layers import rope_spec_from_vllm
from .tp import TP_COMBINE_ENV, TP_COMBINES, check_row_parallel_profile, set_tp_combine

__all__ = ["ENV_ALIASES", "ENV_VAR", "GPU_REQUIRED_OPS", "MLA_FORM_ENV", "engine_mla_form", "mla_form_from_env", "SUPPORTED_VLLM_VERSIONS", "TP_COMBINES", "TP_COMBINE_ENV",
           "check_row_parallel_profile", "check_vllm_version", "enabled_by_env", "gpu_platform_reasons",
           "install", "installed_profile", "is_installed", "missing_gpu_kernels", "register", "rope_spec_from_vllm",
           "set_tp_combine", "uninstall", "validate_vllm_config", "vllm_status"]
