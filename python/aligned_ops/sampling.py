"""Truncated sampling (top-k / top-p / min-p) as one fixed recipe, so both sides score the distribution sampled from.

vLLM samples a token from ``softmax(truncate(z / T))``. Its stock truncation (torch ``softmax``/``sort``/
``cumsum``, unstable tie order) is not reproducible by a trainer, so the plugin (with
``logprobs_mode="processed_logprobs"``) replaces it with :func:`truncate_logits` and returns
``log_softmax`` of the truncated, temperature-scaled logits (``aligned::log_softmax``); the trainer calls
the same function (``hf.completion_logprobs(..., top_k=, top_p=, min_p=)``). Same logits bits in, same mask,
same log-prob bits out.

The recipe, per row ``x = fp32(z) / T`` (IEEE division, ``T`` = 1 for greedy rows; what vLLM's
``apply_temperature`` computes), in vLLM's order:

1. **min-p** (``0 < min_p``): ``p = exp_f32(log_softmax(x))`` (the contract's exp and log-softmax); keep
   ``v`` iff ``p_v >= min_p * max(p)`` (fp32 product) — vLLM's rule on the contract's probabilities.
2. **top-k** (``0 < k < V``): keep ``v`` iff ``x_v >=`` the k-th largest of the kept ``x`` (values only,
   exact). Ties at the threshold are all kept (vLLM's rule).
3. **top-p** (``p < 1``): ``q = exp_f32(log_softmax(x'))`` over the tokens kept so far (``x'`` = ``x`` with
   the others at ``-inf``); sort ``q`` descending; for each token, the mass **strictly above** it is the
   float64 sequential prefix sum of ``q`` over all tokens with a larger ``q`` (every token of a tie group
   gets the same value: the mass before the group's first element); keep iff that mass ``< top_p``
   (``top_p`` taken as its float32 value). The most probable group is always kept. Ties are all kept or
   all dropped — the result does not depend on the order of tied tokens. (vLLM keeps the same set in exact
   arithmetic: it drops the ascending prefix whose mass is ``<= 1 - top_p``.)

Dropped tokens get ``-inf``. A row's mask depends only on the row (``torch.sort``/``topk`` values are exact
selections; the float64 prefix sum runs sequentially along the row on CPU).
"""

from __future__ import annotations

import torch

# vLLM's temperature rule per release: written once, torch-free, in sampling_rules (the CLI checks flags with it)
from .sampling_rules import (
    GREEDY_TEMPERATURE_EPS,
    MIN_SAMPLING_TEMPERATURE,
    TEMPERATURE_RULES,
    VLLM_VERSION_ENV,
    TemperatureRule,
    check_temperature,
    effective_temperature_float,
    rollout_vllm_version,
    scoring_temperature_refusal,
    temperature_rule,
)

__all__ = ["GREEDY_TEMPERATURE_EPS", "MIN_SAMPLING_TEMPERATURE", "TemperatureRule", "temperature_rule",
           "check_temperature", "effective_temperature", "check_sampling_options", "truncation_mask",
           "truncate_logits", "scale_logits"]


def effective_temperature(temperature):
    """The temperature a row is scored at — vLLM's mapping (every release read, 0.22 to 0.32):
    ``0 < T < 0.01`` -> 0.01, ``T == 0`` (greedy) -> 1.0, otherwise ``T``.

    Idempotent: the vLLM plugin applies it to the temperatures the engine stored (already raised to 0.01),
    the trainer to the requested ones. A float gives a float; a tensor gives an fp32 tensor of the same shape
    (the comparisons are made in float64, before the one rounding to fp32 that vLLM makes too). No check of
    range or finiteness: callers that accept user input call :func:`check_temperature` first."""
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(torch.float64)
        t = torch.where((t > 0) & (t < MIN_SAMPLING_TEMPERATURE), torch.full_like(t, MIN_SAMPLING_TEMPERATURE), t)
        return torch.where(t < GREEDY_TEMPERATURE_EPS, torch.ones_like(t), t).to(torch.float32)
    return effective_temperature_float(temperature)


# ---- truncation options: vLLM's _verify_args (the same in every release read, 0.22 to 0.32) -------------------
#   top_p in (0, 1] (1 = off); top_k an integer, 0 or -1 = off (vLLM "quietly accepts -1 as disabled"), else
#   >= 1 (>= the vocabulary: off); min_p in [0, 1] (0 = off). NaN is refused by each range test. A greedy
#   request (T = 0 after vLLM's raise of small temperatures) has all three reset to off by vLLM.
def _values(value, name, where):
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1).tolist(), value.dtype
    if isinstance(value, (list, tuple)):
        raise TypeError(f"{where}: {name} must be a number or a tensor (one value per row/sequence), got "
                        f"{type(value).__name__}")
    return [value], None


def check_sampling_options(top_k=None, top_p=None, min_p=None, where: str = "aligned_ops sampling") -> None:
    """Raise ``ValueError`` (naming the argument) for a truncation option vLLM refuses; scalars or tensors."""
    if top_k is not None:
        vals, dtype = _values(top_k, "top_k", where)
        if dtype is not None and (dtype.is_floating_point or dtype.is_complex):
            raise ValueError(f"{where}: top_k must be an integer, got a {dtype} tensor")
        for k in vals:
            if not isinstance(k, int):  # bool is an int, as in vLLM
                raise ValueError(f"{where}: top_k must be an integer, got {type(k).__name__} {k!r}")
            if k < -1:
                raise ValueError(f"{where}: top_k must be 0 or -1 (disable), or at least 1, got {k}")
    if top_p is not None:
        for p in _values(top_p, "top_p", where)[0]:
            if not (0.0 < float(p) <= 1.0):
                raise ValueError(f"{where}: top_p must be in (0, 1] (1 = off), got {p}")
    if min_p is not None:
        for p in _values(min_p, "min_p", where)[0]:
            if not (0.0 <= float(p) <= 1.0):
                raise ValueError(f"{where}: min_p must be in [0, 1] (0 = off), got {p}")


def _per_row(value, R, device, dtype):
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.to(device=device, dtype=dtype).reshape(-1)
        if value.numel() == 1 and R != 1:
            value = value.expand(R)
        if value.numel() != R:
            raise ValueError(f"aligned_ops sampling: expected one value per row ({R}), got {value.numel()}")
        return value
    return torch.full((R,), value, device=device, dtype=dtype)


def _probs(x):
    import aligned_ops

    return torch.ops.aligned._exp_f32(aligned_ops.log_softmax(x.contiguous(), 1.0))


def scale_logits(logits: torch.Tensor, temperature) -> torch.Tensor:
    """``fp32(logits) / T`` per row, greedy rows (:func:`effective_temperature`) at 1 — vLLM's ``apply_temperature``.
    ``temperature``: a number or one per row, each finite in float32 and >= 0 (``ValueError`` otherwise:
    :func:`aligned_ops.sampling_rules.scoring_temperature_refusal`)."""
    if logits.dim() != 2:
        raise ValueError(f"aligned_ops sampling: logits must be 2-D [rows, vocab], got {tuple(logits.shape)}")
    x = logits.to(torch.float32)
    R = x.shape[0]
    requested = _per_row(temperature, R, x.device, torch.float64)
    for value in requested.tolist():  # one host read, as any check of the values needs
        reason = scoring_temperature_refusal(value)
        if reason:
            raise ValueError(f"aligned_ops sampling: temperature {reason}")
    t = effective_temperature(requested)
    return x / t.unsqueeze(1)


def truncation_mask(x: torch.Tensor, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """Boolean ``[R, V]`` keep-mask of the recipe above for scaled fp32 logits ``x`` (module docstring).

    ``top_k`` (int, 0 / -1 or >= V: off), ``top_p`` (float in (0, 1], 1: off), ``min_p`` (float in [0, 1],
    0: off): a scalar or one value per row; values vLLM refuses raise ``ValueError`` (:func:`check_sampling_options`).
    """
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"aligned_ops sampling: x must be 2-D float32 [rows, vocab], got {tuple(x.shape)} {x.dtype}")
    check_sampling_options(top_k, top_p, min_p)
    R, V = x.shape
    keep = torch.ones_like(x, dtype=torch.bool)
    neg_inf = torch.tensor(float("-inf"), device=x.device)
    mp = _per_row(min_p, R, x.device, torch.float32)
    if mp is not None and bool((mp > 0).any()):
        p = _probs(x)
        thresh = p.amax(dim=1) * mp
        keep &= ~((mp > 0).unsqueeze(1) & (p < thresh.unsqueeze(1)))
    k = _per_row(top_k, R, x.device, torch.int64)
    if k is not None:
        on = (k > 0) & (k < V)
        if bool(on.any()):
            xk = torch.where(keep, x, neg_inf)
            kmax = int(k[on].max())
            top = xk.topk(kmax, dim=1, sorted=True).values
            kth = top.gather(1, (k.clamp(1, kmax) - 1).unsqueeze(1))
            keep &= ~(on.unsqueeze(1) & (xk < kth))
    pp = _per_row(top_p, R, x.device, torch.float32)
    if pp is not None:
        on = pp < 1.0
        if bool(on.any()):
            xp = torch.where(keep, x, neg_inf)
            q = _probs(xp)
            s = q.sort(dim=1, descending=True).values  # values only: order of ties is irrelevant
            s64 = s.to(torch.float64)
            before = torch.cat([torch.zeros_like(s64[:, :1]), torch.cumsum(s64, dim=1)[:, :-1]], dim=1)
            # Mass strictly above each sorted element: the prefix sum at the first element of its tie group.
            new_group = torch.ones_like(s, dtype=torch.bool)
            new_group[:, 1:] = s[:, 1:] != s[:, :-1]
            idx = torch.arange(V, device=x.device).expand(R, V)
            first = torch.where(new_group, idx, torch.zeros_like(idx)).cummax(dim=1).values
            above = before.gather(1, first)
            kept_sorted = above < pp.to(torch.float64).unsqueeze(1)
            # The kept elements are a prefix of the sorted order; the threshold is the last kept value.
            n_kept = kept_sorted.sum(dim=1).clamp(min=1)
            thresh = s.gather(1, (n_kept - 1).unsqueeze(1))
            keep &= ~(on.unsqueeze(1) & (q < thresh))
    return keep


def truncate_logits(x: torch.Tensor, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """``x`` with the tokens :func:`truncation_mask` drops set to ``-inf`` (a new tensor)."""
    keep = truncation_mask(x, top_k, top_p, min_p)
    return x.masked_fill(~keep, float("-inf"))
