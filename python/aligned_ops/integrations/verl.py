"""verl: the FSDP actor's log-probs bitwise equal to the aligned vLLM rollout's (verl 0.9.1's engine workers).

Turn it on for the whole Ray job (every worker: the actor/ref FSDP workers and verl's vLLM servers)::

    from aligned_ops.integrations.verl import config_path, ray_runtime_env
    # python -m verl.trainer.main_ppo --config-path <dir of config_path()> --config-name verl_aligned ...
    # or, where the job calls ray.init itself:
    ray.init(runtime_env=ray_runtime_env(profile="fma"))

- **Plugin**: aligned_ops declares a ``verl.plugins`` entry point (``aligned_ops = aligned_ops.integrations.verl``).
  ``import verl`` loads every such entry point in every process (``verl/__init__.py``; ``VERL_USE_EXTERNAL_PLUGINS``
  = ``auto`` / ``none`` / a list of names) and swallows a failing one at DEBUG level. With ``ALIGNED_OPS_VERL=1``
  this module installs its hook on import (:func:`install`); if that fails it logs the error and re-raises, and
  :func:`ray_runtime_env` / the shipped config also list it in ``VERL_USE_EXTERNAL_MODULES``, which verl imports
  without a try: the worker stops rather than train unaligned. Without the switch the import does nothing.
- **Build time**: the hook wraps ``FSDPEngine._build_module`` (verl/workers/engine/fsdp/transformer_impl.py): a
  ``language_model`` (actor, reference) is checked first (:func:`check_engine` on its configs: one ``ValueError``
  listing every refusal, before the model is loaded); after verl loaded the HF model and applied its own monkey
  patch it is patched (:func:`patch_actor`): aligned_ops'
  forward (``hf.patch_model``) with verl's fused-kernel interface on top. Its ``forward`` takes ``cu_seqlens``, so
  verl's ``_build_model_optimizer`` sets ``pass_packed_cu_seqlens`` and the remove-padding path passes the packed
  sequences' boundaries (``input_ids.offsets()``, plus the static pad segment); without them a packed row is split
  where ``position_ids`` restart at 0. Logs one line per patched model.
- **Fused-kernel interface** (verl's ``use_fused_kernels=True``; ``forward_with_torch_backend`` in
  verl/models/transformers/dense_common.py): ``temperature`` in, ``.log_probs`` / ``.entropy`` out, where
  ``log_probs[i] = log softmax(z_i / T)[shift_labels[i]]`` — the token after ``i`` scored by row ``i``. Here it is
  the aligned model's ``completion_logprobs`` (the function the TRL adapter and the vLLM plugin's sampler share:
  ``aligned_ops.token_logprobs`` of the aligned LM head at ``T``), so each response token's log-prob is the vLLM
  plugin's bit for bit. A sequence's last position predicts the next sequence's first token (verl's roll): it is 0
  here; verl never reads it (the response slice ends one before).
- **Refused by name** (each would make the trainer compute other numbers than the rollout, silently): Ulysses
  sequence parallelism > 1 (a rank sees a slice of each sequence), Liger kernels (replace the norms / SwiGLU),
  ``use_fused_kernels=False`` (verl then divides bf16 logits by T and runs its own log-softmax: 0/118 tokens bitwise
  on aligned logits), LoRA (applied after the build: the aligned forward would skip the adapters), the vLLM plugin's
  switch missing in the worker (the rollout would run stock vLLM), an FSDP compute dtype
  (``mixed_precision.param_dtype``) other than the rollout's bf16 (fp32 compute: log-probs off by up to 0.016), QAT
  (``qat.enable``), a training engine other than FSDP (Megatron, VeOmni, TorchTitan, ...: ``EngineRegistry.new``
  refuses it, they are not patched). :func:`check_engine` runs on the configs before verl loads the model. The
  rollout's ``top_k`` / ``top_p`` / ``logprobs_mode`` the actor does not score (:func:`check_rollout`, where verl's
  ``ActorRolloutRefWorker.init_model`` starts: the vLLM server returns the truncated distribution's log-probs, the
  actor scores the full vocabulary).
- **Versions**: installs on verl ``TESTED_VERL_VERSIONS`` (0.9.1) only; ``ALIGNED_OPS_VERL_ANY_VERSION=1`` lets
  another release through with a warning (unproven).
- **Config**: ``verl_aligned.yaml`` (:func:`config_path`), a Hydra config on top of verl's ``ppo_trainer``:
  rollout log-probs reused as the old policy (``algorithm.rollout_correction.bypass_mode``), REINFORCE loss with
  token-level IS ``exp(logp_theta - logp_vllm)`` and no truncation (``rollout_is_threshold: .inf``) -- the actor's
  loss is chosen by ``actor.policy_loss.loss_mode: bypass_mode`` fed ``${algorithm.rollout_correction}`` (verl's
  trainer never hands that section to the actor; stock ``vanilla`` is PPO-clip), the fused
  log-prob interface, full-vocabulary sampling, and the Ray ``runtime_env`` switches.

The verl trainer side is tested in a venv with verl 0.9.1 + transformers 5.10.4 (``scripts/verl_check.sh``) against
log-probs saved from the vLLM plugin; verl's GPU-only Ray/FSDP job itself needs a GPU machine.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from .. import profiles
from .runtime_env import VERL_EXTERNAL_MODULES_VAR as EXTERNAL_MODULES_VAR  # noqa: F401  (re-exported)
from .runtime_env import ray_runtime_env  # noqa: F401  (re-exported; framework-neutral home)

__all__ = ["ENV_VAR", "TESTED_VERL_VERSIONS", "AlignedPPOOutput", "check_engine", "check_rollout", "config_path",
           "enabled_by_env", "install", "is_installed", "patch_actor", "ray_runtime_env", "uninstall",
           "version_refusal"]

ENV_VAR = "ALIGNED_OPS_VERL"
# The verl releases the proof (scripts/verl_check.sh) ran on: the hooks read FSDPEngine._build_module,
# ActorRolloutRefWorker.init_model, EngineRegistry.new and the fused-kernel interface of these releases only. Another
# release is refused at install; ALIGNED_OPS_VERL_ANY_VERSION=1 lets it through with a warning (nothing is proven).
TESTED_VERL_VERSIONS = ("0.9.1",)
ANY_VERSION_ENV = "ALIGNED_OPS_VERL_ANY_VERSION"
# the rollout computes in bf16 (vLLM dtype bfloat16): the trainer's FSDP compute dtype must be the same
ROLLOUT_DTYPE = torch.bfloat16
CONFIG_NAME = "verl_aligned"

log = logging.getLogger("aligned_ops.integrations.verl")
# verl configures the root logger at WARNING; our one "active" line is INFO and must still show
log.setLevel(logging.INFO)

_installed: dict = {}


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def enabled_by_env() -> bool:
    return _truthy(ENV_VAR)


def config_path() -> str:
    """The Hydra config file shipped with the package (``verl_aligned.yaml``; ``--config-path`` its folder,
    ``--config-name verl_aligned``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{CONFIG_NAME}.yaml")


# ---- build time -------------------------------------------------------------------------------------------


def _get(cfg, name, default=None):
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def check_engine(engine) -> None:
    """Raise one ``ValueError`` naming every setting of a verl FSDP engine the aligned actor cannot honour."""
    from .vllm.plugin import ENV_ALIASES, enabled_by_env as vllm_enabled
    from .vllm.plugin import ENV_VAR as VLLM_ENV_VAR

    model_config = getattr(engine, "model_config", None)
    engine_config = getattr(engine, "engine_config", None)
    reasons = []
    sp = int(_get(engine_config, "ulysses_sequence_parallel_size", 1) or 1)
    if sp > 1:
        reasons.append(f"Ulysses sequence parallelism (ulysses_sequence_parallel_size={sp}) splits every sequence "
                       "across ranks; set actor_rollout_ref.actor.ulysses_sequence_parallel_size=1 (and ref's)")
    if _get(model_config, "use_liger", False):
        reasons.append("Liger kernels (use_liger=True) replace the norms and SwiGLU with their own; set "
                       "actor_rollout_ref.model.use_liger=False")
    if not _get(model_config, "use_fused_kernels", False):
        reasons.append("use_fused_kernels=False makes verl compute log-probs from the logits itself (bf16 division "
                       "by the temperature, its own log-softmax); set actor_rollout_ref.model.use_fused_kernels=True")
    if getattr(engine, "_is_lora", False) or int(_get(model_config, "lora_rank", 0) or 0) > 0:
        reasons.append("LoRA adapters are added after the build and the aligned forward would skip them; merge "
                       "them or set actor_rollout_ref.model.lora_rank=0")
    mixed_precision = _get(engine_config, "mixed_precision", None)
    param_dtype = _get(mixed_precision, "param_dtype", "bf16") if mixed_precision is not None else "bf16"
    if _dtype_of(param_dtype) != ROLLOUT_DTYPE:
        reasons.append(f"FSDP mixed_precision.param_dtype={param_dtype!r} makes the trainer compute in another dtype "
                       "than the bf16 rollout (fp32 compute: log-probs off by up to 0.016, not bitwise); set "
                       "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16 (and ref's)")
    qat = _get(engine_config, "qat", None)
    if _get(qat, "enable", False):
        reasons.append("QAT (qat.enable=True) fake-quantizes the weights in the trainer's forward, which the rollout "
                       "does not; set actor_rollout_ref.actor.fsdp_config.qat.enable=False")
    if not vllm_enabled():
        reasons.append(f"{ENV_VAR}=1 but {VLLM_ENV_VAR} / {ENV_ALIASES[0]} is not set in this worker: verl's vLLM "
                       "rollout would run stock vLLM; pass aligned_ops.integrations.verl.ray_runtime_env() as the "
                       "job's runtime_env")
    if reasons:
        raise ValueError("aligned_ops verl plugin: refused: " + "; ".join(reasons))


# verl's rollout.logprobs_mode values whose numbers the actor's fused forward (full vocabulary, log-softmax at T)
# reproduces: with the vLLM plugin both are aligned::log_softmax of the tempered logits; they differ only under
# truncation (processed: the truncated distribution's), which check_rollout refuses. raw_logits / processed_logits
# return logits, not log-probs.
ROLLOUT_LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


def check_rollout(rollout) -> None:
    """Raise one ``ValueError`` naming every setting of verl's rollout config (``actor_rollout_ref.rollout``) whose
    sampled log-probs the actor cannot reproduce. verl's vLLM server samples with ``top_k`` / ``top_p`` (its
    ``agent_loop`` sampling params); verl hands the actor only the temperature, and its fused forward scores the
    full vocabulary. With ``logprobs_mode=processed_logprobs`` (the shipped config) the rollout's log-probs are the
    truncated, renormalised distribution's: top_p=0.9 at T = 0.7 gave 0/40 tokens bitwise, up to 0.105 apart (the IS
    weight is the kept mass, not 1); with ``raw_logprobs`` they equal the actor's but are not the distribution
    sampled from. ``logprobs_mode`` raw_logits / processed_logits: logits, not log-probs. ``val_kwargs``
    (validation only, never trained on) is not checked."""
    if rollout is None:
        return
    reasons = []
    top_k = _get(rollout, "top_k", -1)
    if top_k is not None and int(top_k) not in (-1, 0):
        reasons.append(f"rollout top_k={top_k} samples from the top-k tokens, while verl's actor scores the full "
                       "vocabulary; set actor_rollout_ref.rollout.top_k=-1")
    top_p = _get(rollout, "top_p", 1.0)
    if top_p is not None and float(top_p) < 1.0:
        reasons.append(f"rollout top_p={top_p} samples from the nucleus, while verl's actor scores the full "
                       "vocabulary; set actor_rollout_ref.rollout.top_p=1.0")
    mode = _get(rollout, "logprobs_mode", ROLLOUT_LOGPROBS_MODES[0])
    if mode is not None and str(mode) not in ROLLOUT_LOGPROBS_MODES:
        reasons.append(f"rollout logprobs_mode={mode!r} returns logits, not the log-probs the actor computes; set "
                       f"actor_rollout_ref.rollout.logprobs_mode={ROLLOUT_LOGPROBS_MODES[0]}")
    if reasons:
        raise ValueError("aligned_ops verl plugin: refused: " + "; ".join(reasons))


def _dtype_of(value):
    """verl's precision names (``PrecisionType``: bf16 / bfloat16 / fp32 / 32 / fp16 / 16 / ...) or a torch dtype ->
    the torch dtype; None for a name it does not know (then refused)."""
    if isinstance(value, torch.dtype):
        return value
    name = str(value).strip().lower().removeprefix("torch.")
    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
            "16": torch.float16, "half": torch.float16, "fp32": torch.float32, "float32": torch.float32,
            "32": torch.float32, "float": torch.float32}.get(name)


@dataclass
class _OutputFields:
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


try:  # verl reads output.log_probs / output.entropy; an HF ModelOutput also indexes like a dict
    from transformers.utils import ModelOutput as _OutputBase

    @dataclass
    class AlignedPPOOutput(_OutputBase):
        """What the patched actor returns to verl's fused-kernel path: fp32 ``log_probs`` and ``entropy`` shaped like
        ``input_ids`` (row ``i`` scores the token after ``i``)."""

        log_probs: torch.Tensor | None = None
        entropy: torch.Tensor | None = None
except ImportError:  # pragma: no cover - without transformers there is no HF model to patch
    AlignedPPOOutput = _OutputFields


def _verl_forward(self, input_ids, attention_mask=None, position_ids=None, temperature=1.0, shift_labels=None,
                  labels=None, cu_seqlens=None, cu_seqlens_cpu=None, return_dict=True, use_cache=False,
                  past_key_values=None, inputs_embeds=None, **unused):
    """verl's fused-kernel forward (``temperature`` in, ``.log_probs`` / ``.entropy`` out) through the aligned model."""
    from . import hf

    if inputs_embeds is not None or past_key_values is not None or use_cache:
        raise ValueError("aligned_ops verl actor: inputs_embeds / past_key_values / use_cache=True are not supported "
                         "(the trainer scores token ids without a KV cache)")
    if return_dict is False:
        raise ValueError("aligned_ops verl actor: return_dict=False is not supported (verl's fused path reads "
                         "output.log_probs)")
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() != 1:
            raise ValueError("aligned_ops verl actor: one temperature per batch (verl's fused kernels take a scalar)")
        temperature = float(temperature)
    if position_ids is not None and position_ids.dim() == 3:
        raise ValueError("aligned_ops verl actor: 3-D (mRoPE) position_ids are not supported")
    flat, _, cu = hf._pack(input_ids, attention_mask, position_ids, cu_seqlens)
    cu = cu.to(torch.int64)
    first = hf.first_tokens(cu, flat.numel())
    # row k scores the token k+1 when both are in one sequence
    scored = ~first[1:]
    completion = torch.zeros(input_ids.numel(), dtype=torch.bool, device=input_ids.device)
    completion[flat[1:][scored]] = True
    completion = completion.view(input_ids.shape)
    ids = input_ids.reshape(-1)
    if shift_labels is None and labels is not None:
        shift_labels = torch.roll(labels, shifts=-1, dims=-1)
    if shift_labels is not None:
        if shift_labels.numel() != input_ids.numel():
            raise ValueError(f"aligned_ops verl actor: shift_labels {tuple(shift_labels.shape)} must have one entry per "
                             f"token of input_ids {tuple(input_ids.shape)}")
        want = ids.index_select(0, flat[1:][scored])
        got = shift_labels.reshape(-1).to(ids.device).index_select(0, flat[:-1][scored])
        if not torch.equal(want, got):
            raise ValueError("aligned_ops verl actor: shift_labels are not the next token of each sequence (a "
                             "sequence-parallel slice?); the aligned actor scores each sequence's own next tokens")
    # (the patched forward turns verl's forward_step autocast off itself: the aligned ops fix their own dtypes)
    out = self._aligned_hf_forward(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   cu_seqlens=cu_seqlens, completion_mask=completion, temperature=temperature,
                                   return_logits=False, return_entropy=True, return_dict=True,
                                   output_router_logits=unused.pop("output_router_logits", False), **unused)
    src = flat[1:][scored]  # where the model put the log-prob of token k+1 ...
    dst = flat[:-1][scored]  # ... and where verl wants it: row k
    lp = out.logprobs.reshape(-1)
    ent = out.entropy.reshape(-1)
    log_probs = lp.new_zeros(input_ids.numel()).index_copy(0, dst, lp.index_select(0, src))
    entropy = ent.new_zeros(input_ids.numel()).index_copy(0, dst, ent.index_select(0, src))
    return AlignedPPOOutput(log_probs=log_probs.view(input_ids.shape), entropy=entropy.view(input_ids.shape))


def patch_actor(module: torch.nn.Module, profile: str | profiles.Profile | None = None) -> torch.nn.Module:
    """Patch a HF causal LM for verl's actor: ``hf.patch_model`` (profile: ``profile`` or ``ALIGNED_OPS_LINEAR``),
    then verl's fused-kernel ``forward`` on top (takes ``cu_seqlens``). An MLA model is patched in the vLLM plugin's
    form (``ALIGNED_OPS_MLA_FORM``, default ``absorbed``: ``patch_model``'s default). Idempotent; returns the module."""
    from .hf import BoundForward, patch_model, unpatch_model

    if getattr(module, "_aligned_verl", False):
        return module
    if getattr(module, "_aligned_patched", False):
        unpatch_model(module)
    patch_model(module, profile)
    module._aligned_hf_forward = module.forward
    module.forward = BoundForward(_verl_forward, module)
    module._aligned_verl = True
    return module


def _build_module_hook(original):
    @functools.wraps(original)
    def _build_module(self, *args, **kwargs):
        model_config = getattr(self, "model_config", None)
        if _get(model_config, "model_type", "language_model") != "language_model":
            return original(self, *args, **kwargs)  # the critic's value head: no log-probs
        check_engine(self)  # the configs suffice: refuse before the (possibly large) model is loaded
        module = original(self, *args, **kwargs)
        patch_actor(module)
        from ..profiles import profile_of

        log.info("aligned_ops verl plugin active: %s runs aligned (linear profile %r, fused log-prob/entropy "
                 "interface, packed sequences by cu_seqlens; replaced: the model's and its %d decoder layers' "
                 "forward)", type(module).__name__, profile_of(module).name,
                 len(getattr(getattr(module, "model", None), "layers", ())))
        return module

    _build_module._aligned_original = original
    return _build_module


def _init_model_hook(original):
    # functools.wraps keeps verl's @register dispatch attribute (MAGIC_ATTR, in the function's __dict__)
    @functools.wraps(original)
    def init_model(self, *args, **kwargs):
        role = str(getattr(self, "role", ""))
        if "actor" in role or "rollout" in role:  # the ref-only worker samples nothing
            check_rollout(_get(getattr(self, "config", None), "rollout", None))
        return original(self, *args, **kwargs)

    init_model._aligned_original = original
    return init_model


_PATCHED_BACKENDS = ("fsdp", "fsdp2")


def _engine_new_hook(original_new):
    def new(cls, model_type, backend, *args, **kwargs):
        if model_type == "language_model" and backend not in _PATCHED_BACKENDS:
            raise ValueError(f"aligned_ops verl plugin: refused: the {backend!r} training engine is not patched (only "
                             f"verl's FSDP engine is: strategy {' / '.join(_PATCHED_BACKENDS)}); its log-probs would "
                             f"not be the rollout's. Use actor_rollout_ref.actor.strategy=fsdp2, or unset {ENV_VAR}")
        return original_new.__func__(cls, model_type, backend, *args, **kwargs)

    new._aligned_original = original_new
    return classmethod(new)


def is_installed() -> bool:
    return bool(_installed)


def version_refusal(version: str) -> str | None:
    """None if ``version`` is a tested verl release (the local part ignored: ``0.9.1+cpu`` is ``0.9.1``), else the
    one-line reason."""
    from .vllm.compat import release_order

    try:
        v = release_order(version)
    except ValueError:
        return f"aligned_ops verl plugin: cannot read the verl version {version!r}"
    if any(v == release_order(t) for t in TESTED_VERL_VERSIONS):
        return None
    return (f"aligned_ops verl plugin: verl {version} is not a tested release (tested: "
            f"{', '.join(TESTED_VERL_VERSIONS)}); its engine internals are unread. Install verl "
            f"{TESTED_VERL_VERSIONS[-1]}, or set {ANY_VERSION_ENV}=1 to try it unproven")


def install() -> None:
    """Wrap verl's ``FSDPEngine._build_module`` (the actor/ref models patched at build time),
    ``ActorRolloutRefWorker.init_model`` (:func:`check_rollout`) and ``EngineRegistry.new`` (:func:`check_engine`);
    idempotent. Imports the three verl modules first, so a failed import leaves nothing installed. Refuses a verl
    release other than ``TESTED_VERL_VERSIONS`` unless ``ALIGNED_OPS_VERL_ANY_VERSION=1``."""
    if _installed:
        return
    import verl

    refusal = version_refusal(getattr(verl, "__version__", "?"))
    if refusal is not None:
        if not _truthy(ANY_VERSION_ENV):
            raise RuntimeError(refusal)
        import warnings

        warnings.warn(f"{refusal.split('. Install')[0]}; {ANY_VERSION_ENV}=1: trying it anyway (nothing is proven)",
                      stacklevel=2)
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine_workers import ActorRolloutRefWorker

    # every original read before the first hook goes in: a release without one installs nothing
    originals = [(cls, name, cls.__dict__[name], hook) for cls, name, hook in (
        (FSDPEngine, "_build_module", _build_module_hook), (ActorRolloutRefWorker, "init_model", _init_model_hook),
        (EngineRegistry, "new", _engine_new_hook))]
    for cls, name, original, hook in originals:
        setattr(cls, name, hook(original))
        _installed[f"{cls.__name__}.{name}"] = (cls, original)
    log.info("aligned_ops verl plugin installed (verl %s): FSDP actor/ref models are patched at build time, the "
             "rollout's sampling checked at the actor/rollout worker's init_model",
             getattr(verl, "__version__", "?"))


def uninstall() -> None:
    for key, (cls, original) in list(_installed.items()):
        setattr(cls, key.split(".")[1], original)
        del _installed[key]


def _load_from_verl() -> None:
    """The entry point's body: ``import verl`` imports this module in every process."""
    if not enabled_by_env():
        return
    try:
        install()
    except Exception:
        # verl swallows an entry point's error at DEBUG level: say it where it shows, and raise so that a job that
        # asked for aligned training never trains unaligned (through VERL_USE_EXTERNAL_MODULES, which ray_runtime_env
        # sets, verl imports this module without a try: the worker stops)
        log.exception("aligned_ops verl plugin: %s=1 but the plugin could not install", ENV_VAR)
        raise


_load_from_verl()
