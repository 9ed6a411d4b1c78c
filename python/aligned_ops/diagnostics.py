"""Trainer-vs-rollout log-prob mismatch diagnostics.

Per valid token, with ℓt the trainer log-prob and ℓr the rollout (vLLM) log-prob of the sampled token:

    log ρ = ℓt − ℓr,   ρ = π_trainer / π_rollout

Tokens are sampled from the rollout policy μ, so the KL estimators below estimate KL(μ ‖ π_trainer)
(Schulman's k1/k2/k3 with r = ρ). Everything is computed in float64.
"""

from __future__ import annotations

import statistics
from typing import Optional

import torch
from torch import Tensor

_NEUTRAL_WHEN_EMPTY = {
    "frac_bitwise_equal": 1.0,
    "abs_diff_max": 0.0,
    "abs_diff_mean": 0.0,
    "kl_k1": 0.0,
    "kl_k2": 0.0,
    "kl_k3": 0.0,
    "chi2_token": 0.0,
    "chi2_seq": 0.0,
    "renyi2": 0.0,
    "renyi3": 0.0,
    "ess": 1.0,
    "ratio_mean": 1.0,
    "ratio_min": 1.0,
    "ratio_max": 1.0,
    "frac_ratio_outside_band": 0.0,
    "seq_log_ppl_abs_diff_mean": 0.0,
}


def mismatch_metrics(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Optional[Tensor] = None,
    *,
    band: tuple[float, float] = (0.5, 5.0),
    trainer_experts: Optional[Tensor] = None,
    rollout_experts: Optional[Tensor] = None,
) -> dict[str, float]:
    """Mismatch between trainer and rollout log-probs; a plain dict of python floats.

    MoE models: pass both sides' expert choices (``trainer_experts``, ``rollout_experts``: int ``[B, T, L, k]``
    or ``[T, L, k]``, aligned with the log-probs) to add the routing-flip keys of :func:`routing_flip_metrics`.

    Inputs are [B, T] (sequences, padded; ``mask`` bool or 0/1, default all valid) or [T] (one sequence).
    Means are over the n valid tokens unless stated; n_b is sequence b's valid token count.

    num_tokens                 n
    num_seqs                   sequences with ≥ 1 valid token
    frac_bitwise_equal         fraction of valid tokens with ℓt == ℓr elementwise in the inputs' common dtype
                               (a bf16 value is widened exactly); NaN never equals anything, +0 == −0
    abs_diff_max, _mean        max / mean |ℓt − ℓr|
    kl_k1                      mean(−log ρ)
    kl_k2                      mean(½ (log ρ)²)
    kl_k3                      mean((ρ − 1) − log ρ)   (≥ 0 per token; "D3" in the REINFORCE Zero report)
    chi2_token                 mean(ρ²) − 1
    chi2_seq                   mean over sequences of (Π_t ρ_t)² − 1
    renyi2                     log mean(ρ²)            Rényi-2 divergence D_2(π_trainer ‖ μ), token level
    renyi3                     ½ log mean(ρ³)          Rényi-3 divergence, token level
    ess                        (Σρ)² / (n · Σρ²)       normalised effective sample size, 1 = no mismatch
    ratio_mean, _min, _max     of ρ
    frac_ratio_outside_band    fraction of tokens with ρ < band[0] or ρ > band[1]
    seq_log_ppl_abs_diff_mean  mean over sequences of |Σ_t (ℓt − ℓr) / n_b| (log-perplexity difference)

    A float ``mask`` entry that is NaN marks an invalid token (NaN != 0 must not make it count).
    With no valid token every value is the no-mismatch value (fractions of equality 1, divergences 0,
    ratios and ESS 1) so that loggers never see NaN; real NaN/inf in valid log-probs do propagate.
    These are sample estimates: k1, χ² and Rényi values can come out negative on a finite batch.
    """
    if trainer_logprobs.shape != rollout_logprobs.shape:
        raise ValueError(
            f"trainer_logprobs shape {tuple(trainer_logprobs.shape)} != rollout_logprobs shape "
            f"{tuple(rollout_logprobs.shape)}"
        )
    if trainer_logprobs.dim() not in (1, 2):
        raise ValueError(f"log-probs must be [T] or [B, T], got shape {tuple(trainer_logprobs.shape)}")
    if mask is None:
        valid = torch.ones(trainer_logprobs.shape, dtype=torch.bool, device=trainer_logprobs.device)
    elif mask.shape != trainer_logprobs.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != log-prob shape {tuple(trainer_logprobs.shape)}")
    else:
        valid = mask if mask.dtype == torch.bool else mask != 0
        if mask.is_floating_point():
            valid = valid & ~torch.isnan(mask)  # NaN != 0, but a NaN mask entry is not a valid token
    if trainer_logprobs.dim() == 1:
        trainer_logprobs, rollout_logprobs, valid = trainer_logprobs[None], rollout_logprobs[None], valid[None]
    trainer_logprobs, rollout_logprobs = trainer_logprobs.detach(), rollout_logprobs.detach()

    tokens_per_seq = valid.sum(dim=-1)
    n = int(tokens_per_seq.sum())
    num_seqs = int((tokens_per_seq > 0).sum())
    metrics = {"num_tokens": float(n), "num_seqs": float(num_seqs)}
    if n == 0:
        return {**metrics, **_NEUTRAL_WHEN_EMPTY}

    equal = (trainer_logprobs == rollout_logprobs) & valid
    # Zeroing padding before the subtraction keeps inf/NaN padding out of the sums.
    log_ratio_bt = torch.where(valid, trainer_logprobs.double() - rollout_logprobs.double(), 0.0)
    log_ratio = log_ratio_bt[valid]
    ratio = torch.exp(log_ratio)
    # expm1 keeps k3 and χ² accurate (and k3 ≥ 0) when ρ is within rounding of 1.
    k3 = torch.expm1(log_ratio) - log_ratio
    seq_log_ratio = log_ratio_bt.sum(dim=-1)[tokens_per_seq > 0]
    seq_mean_log_ratio = seq_log_ratio / tokens_per_seq[tokens_per_seq > 0]
    lo, hi = band
    if trainer_experts is not None and rollout_experts is not None:
        metrics.update(routing_flip_metrics(trainer_experts, rollout_experts, log_ratio_bt, valid))
    return {
        **metrics,
        "frac_bitwise_equal": float(equal.sum()) / n,
        "abs_diff_max": float(log_ratio.abs().max()),
        "abs_diff_mean": float(log_ratio.abs().mean()),
        "kl_k1": float((-log_ratio).mean()),
        "kl_k2": float((0.5 * log_ratio * log_ratio).mean()),
        "kl_k3": float(k3.mean()),
        "chi2_token": float(torch.expm1(2 * log_ratio).mean()),
        "chi2_seq": float(torch.expm1(2 * seq_log_ratio).mean()),
        "renyi2": float(torch.log(torch.exp(2 * log_ratio).mean())),
        "renyi3": float(0.5 * torch.log(torch.exp(3 * log_ratio).mean())),
        "ess": float(ratio.sum() ** 2 / (n * (ratio * ratio).sum())),
        "ratio_mean": float(ratio.mean()),
        "ratio_min": float(ratio.min()),
        "ratio_max": float(ratio.max()),
        "frac_ratio_outside_band": float(((ratio < lo) | (ratio > hi)).sum()) / n,
        "seq_log_ppl_abs_diff_mean": float(seq_mean_log_ratio.abs().mean()),
    }


def _is_nan(v: float) -> bool:
    return v != v


def nan_max(values) -> float:
    """max() that returns NaN when any value is NaN (Python's max keeps or drops a NaN depending on where it
    falls in the list; this does not depend on order)."""
    values = list(values)
    return float("nan") if any(map(_is_nan, values)) else max(values)


def nan_min(values) -> float:
    """min() with the same NaN rule as :func:`nan_max`."""
    values = list(values)
    return float("nan") if any(map(_is_nan, values)) else min(values)

def routing_flip_metrics(trainer_experts: Tensor, rollout_experts: Tensor, log_ratio: Tensor,
                         valid: Tensor) -> dict[str, float]:
    """Routing flips between trainer and rollout, and |Δ log-prob| split by whether routing agreed.

    ``*_experts``: int ``[B, T, L, k]`` (or ``[T, L, k]``): for each scored token, the experts each of the L
    MoE layers chose at the position whose hidden state scores it (the previous position). A (token, layer)
    pair is a *flip* when the two sides chose different expert sets (order inside the top-k ignored); a token
    is *flipped* when any layer flipped for it.

    routing_flips                      number of flipped (token, layer) pairs over valid tokens
    num_tokens_routing_flipped         tokens with at least one flip; frac_tokens_routing_flipped their fraction
    abs_diff_mean/max_routing_agreed   |ℓt − ℓr| over tokens whose routing agreed in every layer
    abs_diff_mean/max_routing_flipped  the same over flipped tokens (0 when there is none)
    """
    if trainer_experts.shape != rollout_experts.shape:
        raise ValueError(f"trainer_experts shape {tuple(trainer_experts.shape)} != rollout_experts shape "
                         f"{tuple(rollout_experts.shape)}")
    if trainer_experts.dim() == 3:
        trainer_experts, rollout_experts = trainer_experts[None], rollout_experts[None]
    if trainer_experts.dim() != 4 or tuple(trainer_experts.shape[:2]) != tuple(valid.shape):
        raise ValueError(f"expert choices must be [B, T, L, k] matching the log-probs {tuple(valid.shape)}, "
                         f"got {tuple(trainer_experts.shape)}")
    a = trainer_experts.sort(dim=-1).values
    b = rollout_experts.to(a.dtype).sort(dim=-1).values
    flip_layer = (a != b).any(dim=-1) & valid[..., None]  # [B, T, L]
    flip_token = flip_layer.any(dim=-1)
    agreed = valid & ~flip_token
    diff = log_ratio.abs()

    def stats(sel):
        return (float(diff[sel].mean()), float(diff[sel].max())) if bool(sel.any()) else (0.0, 0.0)

    mean_a, max_a = stats(agreed)
    mean_f, max_f = stats(flip_token)
    n = max(int(valid.sum()), 1)
    return {
        "routing_flips": float(flip_layer.sum()),
        "num_tokens_routing_flipped": float(flip_token.sum()),
        "frac_tokens_routing_flipped": float(flip_token.sum()) / n,
        "abs_diff_mean_routing_agreed": mean_a,
        "abs_diff_max_routing_agreed": max_a,
        "abs_diff_mean_routing_flipped": mean_f,
        "abs_diff_max_routing_flipped": max_f,
    }


def peak_to_median(values: list[float]) -> float:
    """max(values) / median(values), median as ``statistics.median`` (mean of the middle two if even).

    Median 0 (only possible with non-negative values such as k3 when at least half the steps match
    exactly): returns inf if the peak is > 0, else 1.0 (all steps 0: no spike). No values: 1.0.
    Any NaN value: NaN (a NaN step is a broken step; the answer must not depend on where it fell).
    """
    if not values:
        return 1.0
    if any(map(_is_nan, values)):
        return float("nan")
    peak, median = max(values), statistics.median(values)
    if median == 0:
        return float("inf") if peak > 0 else 1.0
    return peak / median


class MismatchTracker:
    """Accumulates ``mismatch_metrics`` per training step and summarises D3 over the run.

    D3 is read as the per-step k3 estimator mean (``kl_k3``) between trainer and rollout log-probs; the
    headline number is its peak-to-median ratio over steps (see ``peak_to_median``). Steps with no valid
    token are returned by ``update`` but not recorded, so they cannot drag the median to 0.

    NaN steps (a NaN log-prob on a valid token) are recorded: they make d3_peak and d3_peak_to_median NaN and
    d3_peak_step the first NaN step, whatever their position; d3_median is the median of the other steps;
    d3_nan_steps counts them. The other max/min summaries follow the same rule (NaN if any step is NaN).
    """

    def __init__(self, band: tuple[float, float] = (0.5, 5.0)) -> None:
        self.band = band
        self.history: list[tuple[int, dict[str, float]]] = []

    def update(
        self, step: int, trainer_logprobs: Tensor, rollout_logprobs: Tensor, mask: Optional[Tensor] = None
    ) -> dict[str, float]:
        """Compute this step's metrics, record them (if any token is valid) and return them."""
        metrics = mismatch_metrics(trainer_logprobs, rollout_logprobs, mask, band=self.band)
        if metrics["num_tokens"] > 0:
            self.history.append((step, metrics))
        return metrics

    @property
    def d3_history(self) -> list[tuple[int, float]]:
        """(step, kl_k3) for every recorded step, in update order."""
        return [(step, m["kl_k3"]) for step, m in self.history]

    def d3_peak_to_median(self) -> float:
        return peak_to_median([d3 for _, d3 in self.d3_history])

    def summary(self) -> dict[str, float]:
        """num_steps; d3_peak, d3_peak_step, d3_median, d3_peak_to_median, d3_last; worst-case and mean
        frac_bitwise_equal, abs_diff_max over steps, chi2_token max, ess min. Empty tracker: the
        no-mismatch values (D3 0, peak-to-median 1.0, equality 1, ESS 1), same keys.
        """
        d3 = [v for _, v in self.d3_history]
        if not d3:
            return {"num_steps": 0.0, "d3_peak": 0.0, "d3_peak_step": 0.0, "d3_median": 0.0,
                    "d3_peak_to_median": 1.0, "d3_last": 0.0, "d3_nan_steps": 0.0, "frac_bitwise_equal_min": 1.0,
                    "frac_bitwise_equal_mean": 1.0, "abs_diff_max": 0.0, "chi2_token_max": 0.0, "ess_min": 1.0}
        nan_idx = [i for i, v in enumerate(d3) if _is_nan(v)]
        finite = [v for v in d3 if not _is_nan(v)]
        if nan_idx:
            peak_index = nan_idx[0]
        else:
            peak_index = max(range(len(d3)), key=d3.__getitem__)  # first of equal peaks
        steps = [m for _, m in self.history]
        return {
            "num_steps": float(len(d3)),
            "d3_peak": d3[peak_index],
            "d3_peak_step": float(self.history[peak_index][0]),
            "d3_median": statistics.median(finite) if finite else float("nan"),
            "d3_peak_to_median": peak_to_median(d3),
            "d3_last": d3[-1],
            "d3_nan_steps": float(len(nan_idx)),
            "frac_bitwise_equal_min": nan_min(m["frac_bitwise_equal"] for m in steps),
            "frac_bitwise_equal_mean": statistics.fmean(m["frac_bitwise_equal"] for m in steps),
            "abs_diff_max": nan_max(m["abs_diff_max"] for m in steps),
            "chi2_token_max": nan_max(m["chi2_token"] for m in steps),
            "ess_min": nan_min(m["ess"] for m in steps),
        }
