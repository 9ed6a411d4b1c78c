"""The MLA form (DeepSeek-V3 / Kimi-K2) both sides run, resolved by ONE function for the trainer
(``patch_model(mla_form=None)``, the TRL / verl / OpenRLHF / FSDP adapters) and the vLLM plugin
(``integrations/vllm/config.py``): ``additional_config["aligned_ops_mla_form"]`` (engine only), else
``ALIGNED_OPS_MLA_FORM`` (or ``VLLM_ALIGNED_OPS_MLA_FORM``), else ``absorbed``. No vLLM import here."""

from __future__ import annotations

import os

MLA_FORMS = ("absorbed", "expanded")
DEFAULT_MLA_FORM = "absorbed"
MLA_FORM_ENV = "ALIGNED_OPS_MLA_FORM"
MLA_FORM_ENV_ALIASES = ("VLLM_ALIGNED_OPS_MLA_FORM",)  # forwarded by vLLM's Ray executor (VLLM_* only)
MLA_FORM_KEY = "aligned_ops_mla_form"  # additional_config key: the engine's form (set at config creation)


def mla_form_from_env() -> str | None:
    """The form ``ALIGNED_OPS_MLA_FORM`` (or its alias) names, None when unset; ``ValueError`` (one line) for
    another value or two different values."""
    seen = {}
    for name in (MLA_FORM_ENV, *MLA_FORM_ENV_ALIASES):
        value = os.environ.get(name, "").strip().lower()
        if value:
            if value not in MLA_FORMS:
                raise ValueError(f"{name} must be 'absorbed' or 'expanded', got {os.environ[name]!r}")
            seen[name] = value
    if len(set(seen.values())) > 1:
        raise ValueError(f"{' and '.join(seen)} disagree ({', '.join(map(repr, seen.values()))}): set one")
    return next(iter(seen.values()), None)


def resolve_mla_form(additional_config=None) -> str:
    """The MLA form: ``additional_config[MLA_FORM_KEY]``, else the environment, else ``absorbed``."""
    requested = additional_config.get(MLA_FORM_KEY) if isinstance(additional_config, dict) else None
    if requested is not None:
        if requested not in MLA_FORMS:
            raise ValueError(f"additional_config[{MLA_FORM_KEY!r}] must be 'absorbed' or 'expanded', got "
                             f"{requested!r}")
        return requested
    return mla_form_from_env() or DEFAULT_MLA_FORM
