"""The Ray ``runtime_env`` that switches aligned_ops on in every worker of an RL job (verl, OpenRLHF, ...).

Framework-neutral: importing it imports neither verl nor vLLM (``aligned_ops.integrations.verl`` re-exports
:func:`ray_runtime_env`; an OpenRLHF job imports it from here without touching the verl plugin).
"""

from __future__ import annotations

import os

from .. import profiles

__all__ = ["VERL_ENV_VAR", "VERL_EXTERNAL_MODULES_VAR", "VERL_MODULE", "ray_runtime_env"]

# the verl plugin's switch (aligned_ops.integrations.verl.ENV_VAR) and its module
VERL_ENV_VAR = "ALIGNED_OPS_VERL"
VERL_MODULE = "aligned_ops.integrations.verl"
# verl/__init__.py imports each module listed here with a plain importlib.import_module (no try): unlike the
# entry point (errors swallowed at DEBUG), a failing install stops the process
VERL_EXTERNAL_MODULES_VAR = "VERL_USE_EXTERNAL_MODULES"


def ray_runtime_env(profile: str | profiles.Profile | None = None, extra_env: dict | None = None,
                    verl: bool = True) -> dict:
    """The Ray ``runtime_env`` that turns aligned_ops on in every worker of a job: ``{"env_vars": {...}}`` with
    ``ALIGNED_OPS_VERL=1`` (the verl plugin, trainer side), ``ALIGNED_OPS_VLLM=1`` and its ``VLLM_ALIGNED_OPS=1`` alias
    (the vLLM plugin; vLLM's own Ray executor forwards only ``VLLM_*``), ``ALIGNED_OPS_LINEAR`` (one linear profile
    on both sides; default: this process's, else the default profile), and ``VERL_USE_EXTERNAL_MODULES`` with this
    plugin's module appended to the user's own list (``extra_env``'s, else this process's; comma-separated): verl imports
    those without a try, so a failed install stops the worker instead of training unaligned. verl's ``main_ppo`` merges
    ``ray_kwargs.ray_init.runtime_env`` into its own; pass it to ``ray.init`` where the job starts Ray itself.
    ``verl=False``: without ``ALIGNED_OPS_VERL`` (the same job variables for another framework, e.g. OpenRLHF)."""
    from .vllm.plugin import ENV_ALIASES
    from .vllm.plugin import ENV_VAR as VLLM_ENV_VAR

    if profile is None:
        profile = os.environ.get(profiles.ENV_VAR) or profiles.DEFAULT.name
    name = profile.name if isinstance(profile, profiles.Profile) else str(profile)
    profiles.get(name)  # an unknown profile raises here, not in a worker
    env = {VERL_ENV_VAR: "1"} if verl else {}
    env.update({VLLM_ENV_VAR: "1", **{alias: "1" for alias in ENV_ALIASES}, profiles.ENV_VAR: name})
    extra_env = dict(extra_env or {})
    if verl:
        # the user's own list (extra_env, else this process's) keeps its modules; ours is added once
        user = extra_env.pop(VERL_EXTERNAL_MODULES_VAR, None)
        if user is None:
            user = os.environ.get(VERL_EXTERNAL_MODULES_VAR, "")
        mods = [m.strip() for m in user.split(",") if m.strip()]
        env[VERL_EXTERNAL_MODULES_VAR] = ",".join(mods + [VERL_MODULE] if VERL_MODULE not in mods else mods)
    env.update(extra_env)
    return {"env_vars": env}
