"""TRL: run ``trl.GRPOTrainer`` with the policy's log-probs bitwise equal to the aligned vLLM engine's.

    os.environ["ALIGNED_OPS_VLLM"] = "1"          # before the trainer builds its vLLM engine (colocate mode)
    trainer = GRPOTrainer(model=..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...), ...)
    aligned_grpo(trainer)                          # profile: ALIGNED_OPS_LINEAR, or profile="exact" / "fma" / ...
    trainer.train()

:func:`aligned_grpo` (one call, on the built trainer):

- patches the policy (and the reference model, when ``beta != 0``) with :func:`~aligned_ops.integrations.hf.
  patch_model`, replacing the fused LM head TRL installed on its forward (its log-softmax is not the engine's);
- routes TRL's per-token log-prob computation (``GRPOTrainer._get_per_token_logps_and_entropies``: the "old"
  log-probs TRL compares with vLLM's, and the loss's) through the patched model's forward: the completion
  tokens' ``token_logprobs`` at TRL's temperature, over the distribution vLLM sampled from (its top-k / top-p /
  min-p truncation, ``logprobs_mode="processed_logprobs"``, which TRL sets), plus the per-token entropy TRL asks
  for;
- clears every derived weight cache (the ``exact`` profile's packed weights) after each TRL weight sync: TRL
  writes the engine's weights with ``load_weights``, which does not bump their version counters (the vLLM
  plugin also clears them in every model's ``load_weights``, which covers ``vllm_mode="server"``);
- (``reinforce_zero=True``, the default) maps REINFORCE Zero (:mod:`aligned_ops.rl`) onto TRL's options:
  token-level vLLM importance sampling without truncation (``token_truncate`` with no bounds) and no PPO
  clipping (``epsilon = inf``), so the loss weight of a token is ``exp(logp_theta - logp_vllm)`` exactly (an
  option that would zero or cap it is refused: ``delta``, ``off_policy_mask_threshold``, ``top_entropy_quantile``,
  sequence-level IS, a loss type of its own rule);
- checks that the colocated engine runs the aligned_ops vLLM plugin with the trainer's profile.

Needs ``use_vllm=True``: the patched model has no KV cache, so HF's ``generate`` (TRL without vLLM) is refused by
the model (``use_cache=True is not supported``). Refused by name (each would make the two sides compute
different numbers): ``cast_lm_head_to_fp32``,
``repetition_penalty != 1``, sampling options in ``generation_kwargs`` the trainer does not apply (a presence /
frequency / repetition penalty, ``logit_bias``, ``min_tokens``, ``allowed_token_ids``, ``bad_words``, structured
outputs) or that differ from the trainer's (``temperature`` / ``top_k`` / ``top_p`` / ``min_p``: set them in
``GRPOConfig``), ``vllm_structured_outputs_regex``, ``beta != 0`` with top-k / top-p / min-p (the truncated
distributions give a sampled token log-prob -inf outside the reference's set: the KL term is inf / NaN),
multimodal inputs, a colocated engine without the plugin or with another profile.
With ``vllm_mode="server"`` the server is another process: start it with ``ALIGNED_OPS_VLLM=1`` and the same
``ALIGNED_OPS_LINEAR`` (a warning says so; TRL's ``sampling/sampling_logp_difference/max`` shows it).
"""

from __future__ import annotations

import logging
import math
import types

import torch

import aligned_ops

from .. import profiles
from ..profiles import profile_of
from ..sampling_rules import PROCESSED_LOGPROBS_UNREPRODUCED, sampling_option_set
from .hf import architecture_name, patch_checks, patch_model, unpatch_model

__all__ = ["aligned_grpo", "aligned_logps_and_entropies"]

log = logging.getLogger("aligned_ops.integrations.trl")

_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
               "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _truncation(top_k, top_p, min_p) -> dict:
    """Sampling truncation as completion_logprobs' arguments (None where it is off, in vLLM's sense)."""
    return dict(top_k=None if top_k in (None, 0, -1) else int(top_k),
                top_p=None if top_p in (None, 1.0) else float(top_p),
                min_p=None if min_p in (None, 0.0) else float(min_p))


def _sampling_truncation(trainer) -> dict:
    """TRL's sampling truncation as completion_logprobs' arguments (None where it is off)."""
    return _truncation(*(getattr(trainer, name, None) for name in ("top_k", "top_p", "min_p")))


# vLLM SamplingParams that change the distribution vLLM samples from and, under TRL's
# logprobs_mode="processed_logprobs", the log-probs it returns (vllm/v1/sample/sampler.py: allowed-token mask, bad
# words, min-tokens and logit-bias processors, penalties; the model runner's grammar bitmask), none of which the
# trainer's forward applies: (name, its neutral value). Temperature / top-k / top-p / min-p the trainer reproduces.
# One list with the vLLM plugin's admission check (which refuses them per request in processed mode).
_NOT_REPRODUCED = PROCESSED_LOGPROBS_UNREPRODUCED


def _check_sampling(trainer) -> None:
    """The sampling parameters TRL's engine runs with (colocate and server mode: the generation options TRL
    copied at build time, then ``generation_kwargs`` over them, then ``vllm_structured_outputs_regex``; the
    trainer's own without vLLM) must give the distribution the trainer scores: refused by name otherwise."""
    vg = getattr(trainer, "vllm_generation", None)
    source = vg if vg is not None else trainer
    params = {name: getattr(source, name, getattr(trainer, name, None))
              for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")}
    kwargs = dict(getattr(vg, "generation_kwargs", None) or getattr(trainer.args, "generation_kwargs", None) or {})
    params.update(kwargs)
    regex = getattr(vg, "structured_outputs_regex", None) if vg is not None else None
    regex = regex if regex is not None else getattr(trainer.args, "vllm_structured_outputs_regex", None)

    def named(name):
        return f"generation_kwargs[{name!r}]={kwargs[name]!r}" if name in kwargs else f"{name}={params[name]!r}"

    if regex is not None:
        raise ValueError(f"aligned_grpo: vllm_structured_outputs_regex={regex!r} masks vLLM's logits by a grammar "
                         "and vLLM returns the masked distribution's log-probs (processed_logprobs), which the "
                         "trainer does not score; unset it")
    for name, neutral in _NOT_REPRODUCED:
        if not sampling_option_set(params.get(name), neutral):
            continue
        raise ValueError(f"aligned_grpo: {named(name)} changes the distribution vLLM samples from and scores "
                         "(processed_logprobs) by rules the trainer does not apply; "
                         + (f"use {neutral!r}" if neutral is not None else "unset it"))
    engine = _truncation(params.get("top_k"), params.get("top_p"), params.get("min_p"))
    engine["temperature"] = 1.0 if params.get("temperature") is None else float(params["temperature"])
    scored = dict(_sampling_truncation(trainer), temperature=float(trainer.temperature))
    for name in ("temperature", "top_k", "top_p", "min_p"):
        if engine[name] != scored[name]:
            raise ValueError(f"aligned_grpo: {named(name)} makes vLLM sample with {name}={engine[name]!r} but the "
                             f"trainer scores with {name}={scored[name]!r}; set it in GRPOConfig (one value for "
                             "both)")
    truncation = {name: value for name, value in _sampling_truncation(trainer).items() if value is not None}
    beta = getattr(trainer, "beta", 0.0)
    if beta and truncation and float(trainer.temperature) != 0.0:  # (greedy rows are scored untruncated)
        given = ", ".join(f"{name}={value!r}" for name, value in truncation.items())
        raise ValueError(f"aligned_grpo: beta={beta!r} with {given}: the trainer scores the truncated distribution "
                         "vLLM samples from, where a token outside the reference model's (or, after an update, the "
                         "policy's) truncated set has log-prob -inf, and TRL's KL term is then inf or NaN (NaN "
                         "weights after the step); use beta=0.0 or no truncation")


def aligned_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                compute_entropy=False, compute_aux_loss=False, **multimodal):
    """Drop-in for ``GRPOTrainer._get_per_token_logps_and_entropies`` (same arguments and returns:
    ``(logps [B, logits_to_keep], entropies or None, aux_loss or None)``) through the aligned model's forward.

    Every op is row-invariant, so the micro-batch size TRL chunks with does not change a bit."""
    given = sorted(k for k, v in multimodal.items() if v is not None)
    if given:
        raise ValueError(f"aligned_grpo: multimodal inputs are not supported (got {', '.join(given)})")
    batch_size = batch_size or input_ids.size(0)
    truncation = _sampling_truncation(self)
    logps, entropies, aux = [], [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids = input_ids[start:start + batch_size]
        mask = attention_mask[start:start + batch_size]
        completion = mask.clone()
        completion[:, :-logits_to_keep] = 0  # only the completion tokens are scored (TRL's labels = -100 elsewhere)
        # (the patched forward turns TRL's autocast off itself: the aligned ops fix their own dtypes)
        out = model(ids, attention_mask=mask, completion_mask=completion, temperature=self.temperature,
                    return_logits=False, return_entropy=compute_entropy, output_router_logits=compute_aux_loss,
                    return_dict=True, **truncation)
        logps.append(out.logprobs[:, -logits_to_keep:])
        if compute_entropy:
            entropies.append(out.entropy[:, -logits_to_keep:])
        if compute_aux_loss:
            aux.append(out.aux_loss)
    return (torch.cat(logps, dim=0), torch.cat(entropies, dim=0) if compute_entropy else None,
            torch.stack(aux).mean() if compute_aux_loss else None)


def _repatch_plan(model, profile, engine_form=None, who="policy"):
    """What :func:`_repatch` will do, checked without changing anything — every check ``patch_model`` makes
    (``hf.patch_checks``) and the MLA form: ``(profile to patch with, MLA form, the linear profile the model will
    run)``. An MLA model (DeepSeek-V3 / Kimi-K2) is patched in the MLA form the vLLM plugin runs
    (``ALIGNED_OPS_MLA_FORM``, default ``absorbed``; ``engine_form``: the colocated engine's own,
    ``engine_mla_form(llm)``, which wins); a model already patched in the other form is refused (its bits would never
    match)."""
    from ..models import ARCHITECTURES
    from ..models.mla_form import MLA_FORM_ENV

    where = "the colocated vLLM engine runs" if engine_form else "the vLLM plugin runs"
    if getattr(model, "_aligned_patched", False) and profile is None:
        profile = model._aligned_profile
    arch = ARCHITECTURES.get(architecture_name(model))  # the engine's MLA form reaches MLA models only
    _, form, resolved, _ = patch_checks(model, profile, engine_form if arch is not None and arch.mla_forms else None)
    if getattr(model, "_aligned_patched", False) and form is not None:
        layers = getattr(getattr(model, "model", None), "layers", None) or ()
        have = layers[0].__dict__.get("_aligned_mla_form") if len(layers) else None
        if have is not None and have.name != form.name:
            raise ValueError(f"aligned_ops.integrations.trl: the {who} is patched with mla_form={have.name!r}, but "
                             f"{where} the {form.name!r} MLA form ({MLA_FORM_ENV}); patch with "
                             f"mla_form={form.name!r}")
    return profile, form, resolved


def _repatch(model, profile=None, engine_form=None, *, plan=None):
    """patch_model, with our forward on top: TRL wraps the forward it finds with its fused LM head, so a model
    patched before ``GRPOTrainer(...)`` carries TRL's wrapper around ours (and its ``fused_lm_head`` keyword).
    ``plan``: :func:`_repatch_plan`'s, made earlier (else made now from ``profile`` and ``engine_form``)."""
    profile, form, _ = plan if plan is not None else _repatch_plan(model, profile, engine_form)
    if getattr(model, "_aligned_patched", False):
        unpatch_model(model)
    return patch_model(model, profile, mla_form=form)


def _engine_form(trainer):
    """The MLA form the colocated engine runs (recorded by the plugin at engine config), None otherwise."""
    if not getattr(trainer, "use_vllm", False):
        return None
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    if llm is None:  # server mode: the server's form follows ALIGNED_OPS_MLA_FORM like the trainer's default
        return None
    from .vllm.config import engine_mla_form

    return engine_mla_form(llm)


def _engine_model(trainer):
    """The colocated vLLM engine's model (this process), or None in server mode / without vLLM."""
    vg = getattr(trainer, "vllm_generation", None)
    llm = getattr(vg, "llm", None)
    if llm is None:
        return None
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def _engine_profile(engine_model):
    for module in engine_model.modules():
        p = getattr(module, "_aligned_profile", None)
        if isinstance(p, profiles.Profile):
            return p
    return None


def _check_engine(trainer, profile) -> None:
    from .vllm import plugin

    mode = getattr(trainer.vllm_generation, "mode", None) if hasattr(trainer, "vllm_generation") else None
    if mode == "server":  # the server's plugin clears its caches in load_weights (TRL's sync): only a check is
        log.warning("aligned_grpo: vllm_mode='server': start the server with ALIGNED_OPS_VLLM=1 and "
                    "ALIGNED_OPS_LINEAR=%s; TRL's sampling/sampling_logp_difference/max must log 0.0", profile.name)
        return
    engine = _engine_model(trainer)
    if engine is None:
        return
    engine_profile = _engine_profile(engine)
    if not plugin.is_installed() or engine_profile is None:
        raise ValueError("aligned_grpo: the colocated vLLM engine does not run the aligned_ops vLLM plugin; set "
                         f"{plugin.ENV_VAR}=1 before building the GRPOTrainer")
    if engine_profile is not profile:
        raise ValueError(f"aligned_grpo: the vLLM engine runs the {engine_profile.name!r} linear profile and the "
                         f"trainer {profile.name!r}; set {profiles.ENV_VAR}={profile.name} before building the "
                         "GRPOTrainer (or pass profile=" + repr(engine_profile.name) + ")")


def _check_reinforce_zero(trainer) -> None:
    """The options REINFORCE Zero cannot be mapped onto: refused before aligned_grpo changes anything (a caller
    that catches the error keeps an unchanged trainer)."""
    args = trainer.args
    if trainer.loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        raise ValueError(f"aligned_grpo(reinforce_zero=True): loss_type {trainer.loss_type!r} reweights tokens by "
                         "its own rule; use one of grpo, bnpo, dr_grpo, dapo, luspo (or reinforce_zero=False)")
    for name, off in (("importance_sampling_level", "token"), ("delta", None), ("off_policy_mask_threshold", None)):
        if getattr(args, name, off) != off:
            raise ValueError(f"aligned_grpo(reinforce_zero=True): {name}={getattr(args, name)!r} truncates or "
                             f"reweights the IS ratio; leave it at {off!r} (or reinforce_zero=False)")
    quantile = getattr(trainer, "top_entropy_quantile", 1.0)  # (what TRL's loss reads)
    if quantile != 1.0:
        raise ValueError(f"aligned_grpo(reinforce_zero=True): top_entropy_quantile={quantile!r} zeroes the loss of the "
                         "tokens below that entropy quantile, so a token's loss weight is no longer "
                         "exp(logp_theta - logp_vllm); leave it at 1.0 (or reinforce_zero=False)")


def _map_reinforce_zero(trainer) -> None:
    """REINFORCE Zero on TRL's options: untruncated token-level IS against vLLM's log-probs, no PPO clip."""
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = "token_truncate"
    trainer.vllm_importance_sampling_clip_min = None
    trainer.vllm_importance_sampling_clip_max = math.inf
    trainer.epsilon_low = math.inf
    trainer.epsilon_high = math.inf


def aligned_grpo(trainer, profile: str | profiles.Profile | None = None, reinforce_zero: bool = True):
    """Make a built ``trl.GRPOTrainer`` compute its policy log-probs with aligned_ops (module docstring).

    ``profile``: the linear numerics profile (None: the policy's, if already patched, else
    ``ALIGNED_OPS_LINEAR``); the colocated engine must run the same one. ``reinforce_zero``: map REINFORCE
    Zero onto TRL's loss options. Returns the trainer. Idempotent."""
    if not hasattr(trainer, "_get_per_token_logps_and_entropies") or not hasattr(trainer, "accelerator"):
        raise TypeError(f"aligned_grpo: expected a trl.GRPOTrainer, got {type(trainer).__name__}")
    args = trainer.args
    if getattr(args, "cast_lm_head_to_fp32", False):
        raise ValueError("aligned_grpo: cast_lm_head_to_fp32=True replaces the LM head with an fp32 one vLLM does "
                         "not run; the aligned LM head already returns fp32 log-probs (set it to False)")
    _check_sampling(trainer)
    if reinforce_zero:
        _check_reinforce_zero(trainer)
    # every check before the first change (a caller that catches a refusal keeps TRL's trainer as it was)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    ref = trainer.accelerator.unwrap_model(trainer.ref_model) if trainer.ref_model is not None else None
    engine_form = _engine_form(trainer)
    plan = _repatch_plan(policy, profile, engine_form)
    resolved = plan[2]
    ref_plan = _repatch_plan(ref, resolved, engine_form, who="reference model") if ref is not None else None
    if getattr(trainer, "use_vllm", False):
        _check_engine(trainer, resolved)
    _repatch(policy, plan=plan)
    if ref is not None:
        _repatch(ref, plan=ref_plan)
    trainer._get_per_token_logps_and_entropies = types.MethodType(aligned_logps_and_entropies, trainer)

    vg = getattr(trainer, "vllm_generation", None)
    if vg is not None and not getattr(vg.sync_weights, "_aligned_clears_caches", False):
        sync = vg.sync_weights

        def sync_weights():
            sync()
            # load_weights writes through param.data (no version bump): every packing of the old weights goes
            aligned_ops.clear_exact_weight_cache()

        sync_weights._aligned_clears_caches = True
        sync_weights.__wrapped__ = sync
        vg.sync_weights = sync_weights
    if reinforce_zero:
        _map_reinforce_zero(trainer)
    log.info("aligned_ops: GRPOTrainer runs aligned (profile %s, reinforce_zero=%s)", resolved.name, reinforce_zero)
    return trainer
