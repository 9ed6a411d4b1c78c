"""Policy losses with rollout/trainer importance weights, and advantage estimators.

Plain torch, any device. Notation (per token t of sequence b; tensors are [B, T] with a mask [B, T]):

    ℓθ    current trainer log-prob (carries the gradient)
    ℓμ    behaviour log-prob, as returned by the rollout engine (vLLM)
    ℓprox proximal log-prob (trainer log-prob recomputed at step start; only for ``ppo_clip``)
    A     advantage, per sequence [B] (broadcast) or per token [B, T]
    w     importance weight applied to the policy gradient, always treated as a constant (sg = stop-grad)

The default, REINFORCE Zero, is token-level importance sampling without truncation:

    L_t = −A_t · sg(w_t) · ℓθ_t,   w_t = exp(ℓθ_t − ℓμ_t)   ⇒   ∇L_t = −A_t · w_t · ∇ℓθ_t

which has the same gradient as −A_t · exp(ℓθ_t − ℓμ_t). When trainer and rollout log-probs are bitwise
identical, w_t = 1 exactly at the first optimiser step and the loss is plain on-policy REINFORCE.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from .choices import AGGREGATIONS, LOSS_MODES, SEQ_RATIO_MODES  # torch-free: the CLI checks flags with them

Count = Union[int, float, Tensor]

# Overflow guard of every importance weight: w = exp(min(log ρ, LOG_RATIO_GUARD)). exp(88.7) already
# overflows fp32, and A·inf·ℓθ is NaN when A = 0 (a GRPO group with equal rewards) or ±inf otherwise. The
# guard is verl's (its log-ratio clamp at 20, ρ ≤ e^20 ≈ 4.9e8); below it the IS stays untruncated, and a
# token whose ratio reaches it comes from a broken rollout, not from policy drift (it is counted in the
# ``frac_guarded`` metric).
LOG_RATIO_GUARD = 20.0


def _valid_mask(mask: Tensor) -> Tensor:
    """Boolean view of a bool or 0/1 mask (any nonzero entry counts as valid; NaN never does)."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() or mask.is_complex():
        return (mask != 0) & ~torch.isnan(mask)
    return mask != 0


def _check_count(name: str, count: Optional[Count]) -> None:
    if count is None:
        return
    value = float(count)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a finite count > 0, got {value} (pass None to count this batch)")


def _coef(adv: Tensor, weight: Tensor) -> Tensor:
    """A · w where A ≠ 0, exactly 0 elsewhere (never 0 · inf); detached, so it is also the gradient's factor."""
    return torch.where(adv != 0, adv * weight, 0.0)


def _masked_fp32(x: Tensor, valid: Tensor) -> Tensor:
    # Padding may hold -inf or NaN log-probs; where() keeps them out of both the forward value and the
    # backward (where's gradient to the unselected branch is an exact zero, never 0·inf).
    return torch.where(valid, x.float(), 0.0)


def _row_sums(x: Tensor) -> Tensor:
    """``[B, T]`` fp32 -> ``[B]``: each row's sum as the contract's 64-ary tree (``ops.moe.row_tree_sum``), not
    ``torch.sum``, which splits a lone row of more than 32768 terms across threads and whose order moves with the
    width T: a sequence's sum (GSPO's sequence log-ratio, a sequence's loss) was another number alone than in a batch,
    at 1 thread than at 2, padded to another width. Differentiable (the gradient of a sum: g broadcast). Padding
    after a sequence's tokens changes no bit; tokens that start at another column (left padding) are another sum."""
    from .ops.moe import row_tree_sum  # (lazy: the CLI imports this module's choices before the extension loads)

    return row_tree_sum(x)


def _total(x: Tensor) -> Tensor:
    """The sum of a ``[B, T]`` fp32 tensor as the sum of its rows' sums (:func:`_row_sums`): independent of the
    thread count and of trailing padding (torch.sum of 4 x 40000 values: other bits at 1 and 2 threads)."""
    return _row_sums(_row_sums(x)[None])[0]


def _aggregate(
    per_token: Tensor,
    valid: Tensor,
    agg: str,
    global_num_tokens: Optional[Count],
    global_num_seqs: Optional[Count],
) -> Tensor:
    """Reduce a [B, T] per-token loss (already zero outside the mask) to a scalar.

    token-mean:           Σ_bt L_bt / N,            N = global_num_tokens or Σ m
    seq-mean-token-sum:   Σ_b (Σ_t L_bt) / S,       S = global_num_seqs or #sequences with ≥ 1 valid token
    seq-mean-token-mean:  Σ_b (Σ_t L_bt / n_b) / S, n_b = Σ_t m_bt

    Denominators are clamped to ≥ 1 so an empty batch yields loss 0 with a defined (zero) gradient. A global
    count given by the caller must be > 0 (checked by ``policy_loss``): it is used as it is, never clamped.
    """
    tokens_per_seq = valid.sum(dim=-1)
    if agg == "token-mean":
        denom = tokens_per_seq.sum() if global_num_tokens is None else global_num_tokens
        denom = torch.as_tensor(denom, dtype=torch.float32, device=per_token.device)
        return _total(per_token) / (denom.clamp(min=1) if global_num_tokens is None else denom)
    seq_loss = _row_sums(per_token)
    if agg == "seq-mean-token-mean":
        seq_loss = seq_loss / tokens_per_seq.clamp(min=1)
    denom = (tokens_per_seq > 0).sum() if global_num_seqs is None else global_num_seqs
    denom = torch.as_tensor(denom, dtype=torch.float32, device=per_token.device)
    return _total(seq_loss[None]) / (denom.clamp(min=1) if global_num_seqs is None else denom)


def policy_loss(
    logprobs: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    mode: str = "reinforce_zero",
    agg: str = "token-mean",
    clip_c: Optional[float] = 2.0,
    mask_lo: float = 0.5,
    mask_hi: float = 5.0,
    seq_ratio: str = "product",
    proximal_logprobs: Optional[Tensor] = None,
    eps_clip: float = 0.2,
    global_num_tokens: Optional[Count] = None,
    global_num_seqs: Optional[Count] = None,
) -> tuple[Tensor, dict[str, float]]:
    """Importance-weighted policy-gradient loss; returns (scalar fp32 loss, metrics of python floats).

    Inputs are [B, T] (``advantages`` may also be [B]); ``mask`` is bool or 0/1. Everything is computed in
    fp32 whatever the input dtype. Masked-out positions contribute nothing (their values may be inf/NaN).
    With ρ_t = exp(ℓθ_t − ℓμ_t) (token ratio, detached) the modes are:

    reinforce_zero  L_t = −A_t · sg(ρ_t) · ℓθ_t                       (untruncated token IS)
    tis             L_t = −A_t · sg(min(ρ_t, C)) · ℓθ_t               C = clip_c
    mis, icepop     L_t = −A_t · sg(ρ_t · 1[lo ≤ ρ_t ≤ hi]) · ℓθ_t    lo, hi = mask_lo, mask_hi; the two names
                    are the same token-level masked IS (IcePop is its name in Ring/ling; MIS in verl)
    seq_tis         L_t = −A_t · sg(min(ρ_b, C)) · ℓθ_t
    seq_mis         L_t = −A_t · sg(ρ_b · 1[lo ≤ ρ_b ≤ hi]) · ℓθ_t
                    with the sequence ratio ρ_b = exp(Σ_t m_t (ℓθ_t − ℓμ_t))        (seq_ratio="product")
                                       or ρ_b = exp(Σ_t m_t (ℓθ_t − ℓμ_t) / n_b)  (seq_ratio="geometric")
    ppo_clip        L_t = −w_t · min(r_t A_t, clip(r_t, 1 − ε, 1 + ε) A_t)   (decoupled PPO, AReaL/verl)
                    r_t = exp(ℓθ_t − ℓprox_t) (with gradient), w_t = sg(exp(ℓprox_t − ℓμ_t)), truncated at
                    clip_c unless clip_c is None; ε = eps_clip; requires ``proximal_logprobs``.

    Masked tokens/sequences (mis, icepop, seq_mis) stay in the aggregation denominator with weight 0.

    Finite for finite inputs: every weight is exp(min(log ρ, LOG_RATIO_GUARD = 20)) (verl's overflow guard,
    ρ ≤ 4.9e8; untruncated below it), and A · w is formed only where A ≠ 0 (exactly 0 elsewhere), so a token
    with A = 0 contributes 0 to the loss and the gradient even when its ratio overflows; ppo_clip's r_t is
    guarded the same way (no gradient beyond the guard). clip_c must be > 0, eps_clip ≥ 0, global counts > 0.
    Aggregation ``agg`` (verl names): see ``_aggregate``. For data parallelism pass the all-reduced
    ``global_num_tokens`` (token-mean) or ``global_num_seqs`` (seq-mean-*); each rank's loss is then its
    share of the global mean, so gradients must be *summed* over ranks (multiply by world size if your
    data-parallel wrapper averages them). The count not used by ``agg`` is ignored.

    Metrics (over valid tokens; ratio stats are 1.0 when there are none):
    loss, surrogate (agg(−A·w), same gradient as loss for the IS modes; equals loss for ppo_clip),
    num_tokens, num_seqs, ratio_mean/min/max (ρ_t), weight_mean (w applied, per token),
    frac_truncated (tokens whose weight was cut at C; sequence modes count the sequence's tokens),
    frac_masked (tokens zeroed by the band), clip_frac (ppo_clip: tokens where the clipped branch is taken),
    frac_guarded (tokens whose weight or ratio hit the overflow guard). A NaN in a float ``mask`` is invalid.
    """
    if mode not in LOSS_MODES:
        raise ValueError(f"mode must be one of {LOSS_MODES}, got {mode!r}")
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg must be one of {AGGREGATIONS}, got {agg!r}")
    if seq_ratio not in SEQ_RATIO_MODES:
        raise ValueError(f"seq_ratio must be one of {SEQ_RATIO_MODES}, got {seq_ratio!r}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    shape = logprobs.shape
    for name, t in (("rollout_logprobs", rollout_logprobs), ("mask", mask), ("proximal_logprobs", proximal_logprobs)):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match logprobs shape {tuple(shape)}")
    if advantages.shape == shape[:1]:
        advantages = advantages[:, None].expand(shape)
    elif advantages.shape != shape:
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(shape)}, got {tuple(advantages.shape)}")
    if mode == "ppo_clip" and proximal_logprobs is None:
        raise ValueError("mode='ppo_clip' needs proximal_logprobs")
    if mode in ("tis", "seq_tis") and clip_c is None:
        raise ValueError(f"mode={mode!r} needs clip_c")
    if clip_c is not None and not float(clip_c) > 0:  # also NaN; a negative C would flip the gradient's sign
        raise ValueError(f"clip_c must be > 0 (or None), got {clip_c}")
    if not float(eps_clip) >= 0:
        raise ValueError(f"eps_clip must be >= 0, got {eps_clip}")
    _check_count("global_num_tokens", global_num_tokens)
    _check_count("global_num_seqs", global_num_seqs)
    if mode in ("mis", "icepop", "seq_mis") and not mask_lo <= mask_hi:
        raise ValueError(f"need mask_lo <= mask_hi, got {mask_lo}, {mask_hi}")

    valid = _valid_mask(mask)
    lp = _masked_fp32(logprobs, valid)
    lp_mu = _masked_fp32(rollout_logprobs, valid).detach()
    adv = _masked_fp32(advantages, valid).detach()
    log_ratio = (lp.detach() - lp_mu)
    ratio = torch.exp(log_ratio)  # metrics only: the true ratio (may be inf)
    truncated = torch.zeros_like(valid)
    masked_out = torch.zeros_like(valid)
    clipped = torch.zeros_like(valid)

    if mode == "ppo_clip":
        lp_prox = _masked_fp32(proximal_logprobs, valid).detach()
        log_r = lp - lp_prox
        log_w = lp_prox - lp_mu
        guarded = (log_r.detach() > LOG_RATIO_GUARD) | (log_w > LOG_RATIO_GUARD)
        r = torch.exp(log_r.clamp(max=LOG_RATIO_GUARD))
        weight = torch.exp(log_w.clamp(max=LOG_RATIO_GUARD))
        if clip_c is not None:
            truncated = weight > clip_c
            weight = weight.clamp(max=clip_c)
        nonzero = adv != 0
        unclipped = r * adv
        clipped_obj = r.clamp(1.0 - eps_clip, 1.0 + eps_clip) * adv
        clipped = (clipped_obj < unclipped) & nonzero
        # A = 0: both branches are exactly 0 (r is finite), and the weight multiplies a 0 (weight is finite too)
        per_token = torch.where(nonzero, -weight * torch.minimum(unclipped, clipped_obj), 0.0)
    else:
        if mode in ("seq_tis", "seq_mis"):
            seq_log_ratio = _row_sums(log_ratio)  # already zero outside the mask
            if seq_ratio == "geometric":
                seq_log_ratio = seq_log_ratio / valid.sum(dim=-1).clamp(min=1)
            log_base = seq_log_ratio[:, None].expand(shape)
        else:
            log_base = log_ratio
        guarded = log_base > LOG_RATIO_GUARD
        base = torch.exp(log_base.clamp(max=LOG_RATIO_GUARD))
        weight = base
        if mode in ("tis", "seq_tis"):
            truncated = base > clip_c
            weight = base.clamp(max=clip_c)
        elif mode in ("mis", "icepop", "seq_mis"):
            keep = (base >= mask_lo) & (base <= mask_hi)
            masked_out = ~keep
            weight = torch.where(keep, base, 0.0)
        per_token = -_coef(adv, weight) * lp

    per_token = torch.where(valid, per_token, 0.0)
    loss = _aggregate(per_token, valid, agg, global_num_tokens, global_num_seqs)

    with torch.no_grad():
        num_tokens = int(valid.sum())
        surrogate = (
            loss
            if mode == "ppo_clip"
            else _aggregate(torch.where(valid, -_coef(adv, weight), 0.0), valid, agg, global_num_tokens,
                            global_num_seqs)
        )
        ratios = ratio[valid]
        denom = max(num_tokens, 1)
        metrics = {
            "loss": float(loss),
            "surrogate": float(surrogate),
            "num_tokens": float(num_tokens),
            "num_seqs": float((valid.sum(dim=-1) > 0).sum()),
            "ratio_mean": float(ratios.mean()) if num_tokens else 1.0,
            "ratio_min": float(ratios.min()) if num_tokens else 1.0,
            "ratio_max": float(ratios.max()) if num_tokens else 1.0,
            "weight_mean": float(weight[valid].mean()) if num_tokens else 1.0,
            "frac_truncated": float((truncated & valid).sum()) / denom,
            "frac_masked": float((masked_out & valid).sum()) / denom,
            "clip_frac": float((clipped & valid).sum()) / denom,
            "frac_guarded": float((guarded & valid).sum()) / denom,
        }
    return loss, metrics


def reinforce_zero_loss(
    logprobs: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    agg: str = "token-mean",
    global_num_tokens: Optional[Count] = None,
    global_num_seqs: Optional[Count] = None,
) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE Zero: L = agg(−A · sg(w) · ℓθ), w = exp(ℓθ − ℓμ), no truncation; ∇ = −A · w · ∇ℓθ / denom.

    Thin preset of ``policy_loss(mode="reinforce_zero")``; see there for shapes, aggregation and metrics.
    """
    return policy_loss(
        logprobs,
        rollout_logprobs,
        advantages,
        mask,
        mode="reinforce_zero",
        agg=agg,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
    )


# ---------------------------------------------------------------------------------------------------------
# Advantages. Rewards are per sequence [B]; groups are given either as group ids [B] (any integer labels)
# or as group_size (consecutive blocks of that size). Results are fp32 [B].


def _group_index(rewards: Tensor, group_ids: Optional[Tensor], group_size: Optional[int]) -> tuple[Tensor, int]:
    """Dense group index in [0, G) per sequence, and G."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    if (group_ids is None) == (group_size is None):
        raise ValueError("pass exactly one of group_ids or group_size")
    batch = rewards.shape[0]
    if group_size is not None:
        if group_size < 1 or batch % group_size:
            raise ValueError(f"group_size {group_size} must be ≥ 1 and divide the batch size {batch}")
        return torch.arange(batch, device=rewards.device) // group_size, batch // group_size
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids shape {tuple(group_ids.shape)} does not match rewards {tuple(rewards.shape)}")
    _, index = torch.unique(group_ids, return_inverse=True)
    return index.to(rewards.device), int(index.max()) + 1 if batch else 0


def _group_sum(values: Tensor, index: Tensor, num_groups: int, group_size: Optional[int] = None) -> Tensor:
    """Per-sequence sum of fp32 ``values [B]`` over the sequence's group, added from 0 in batch order (the order
    ``index_add_`` has on a CPU), on every device: the members as the rows of a ``[G, largest group]`` grid (zeros
    after them), folded column by column. Not ``index_add_`` itself, which adds with atomics on a GPU (the order, so
    a partial-credit reward's advantage, changed from run to run). ``group_size`` (consecutive blocks): the grid is
    ``values`` itself (no host sync; compiles); group ids: laid out by a stable sort (one sync: the largest group)."""
    if values.numel() == 0:
        return values
    if group_size is not None:
        grid = values.reshape(num_groups, group_size)
    else:
        order = torch.argsort(index, stable=True)
        counts = torch.bincount(index, minlength=num_groups)
        grouped = index[order]
        slot = torch.arange(index.numel(), device=index.device) - (counts.cumsum(0) - counts)[grouped]
        grid = values.new_zeros(num_groups, int(counts.max()))
        grid[grouped, slot] = values[order]
    total = values.new_zeros(num_groups)
    for column in grid.unbind(1):  # (as many steps as the largest group has members)
        total = total + column
    return total[index]


def group_mean_advantages(
    rewards: Tensor, group_ids: Optional[Tensor] = None, *, group_size: Optional[int] = None
) -> Tensor:
    """A_i = R_i − mean_{j ∈ g(i)} R_j. A group of one gets A = 0."""
    index, num_groups = _group_index(rewards, group_ids, group_size)
    r = rewards.float()
    count = _group_sum(torch.ones_like(r), index, num_groups, group_size)
    return r - _group_sum(r, index, num_groups, group_size) / count


def rloo_advantages(rewards: Tensor, group_ids: Optional[Tensor] = None, *, group_size: Optional[int] = None) -> Tensor:
    """RLOO: A_i = R_i − (Σ_{j∈g} R_j − R_i) / (n_g − 1).

    A group of one has no other sample to form the leave-one-out baseline; its advantage is defined as 0
    (it carries no learning signal), which is also the limit of n/(n−1)·(R_i − mean) read as "no baseline
    information ⇒ no update".
    """
    index, num_groups = _group_index(rewards, group_ids, group_size)
    r = rewards.float()
    count = _group_sum(torch.ones_like(r), index, num_groups, group_size)
    baseline = (_group_sum(r, index, num_groups, group_size) - r) / (count - 1).clamp(min=1)
    return torch.where(count > 1, r - baseline, 0.0)


def grpo_advantages(
    rewards: Tensor,
    group_ids: Optional[Tensor] = None,
    *,
    group_size: Optional[int] = None,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO: A_i = (R_i − mean_g) / (std_g + eps); with scale_by_std=False (Dr.GRPO) A_i = R_i − mean_g.

    std_g is the unbiased (Bessel-corrected) group standard deviation, as ``torch.std`` in TRL and verl.
    A group of one has std defined as 0, so its advantage is 0 (its R − mean is 0 anyway).
    """
    centred = group_mean_advantages(rewards, group_ids, group_size=group_size)
    if not scale_by_std:
        return centred
    index, num_groups = _group_index(rewards, group_ids, group_size)
    count = _group_sum(torch.ones_like(centred), index, num_groups, group_size)
    var = _group_sum(centred * centred, index, num_groups, group_size) / (count - 1).clamp(min=1)
    return centred / (var.sqrt() + eps)


def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor,
    group_ids: Optional[Tensor] = None,
    *,
    group_size: Optional[int] = None,
    baseline: Optional[str] = None,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++: whiten returns over all valid tokens of the batch.

    ``rewards`` is per sequence [B] (each sequence's value repeated over its n_b valid tokens) or per-token
    returns [B, T] (e.g. with a per-token KL penalty already folded in). With x the valid token values:

        A = (x − mean(x)) · rsqrt(var(x) + eps),   var unbiased over tokens (verl ``masked_whiten``)

    baseline="group_mean" (REINFORCE++-baseline) first replaces per-sequence rewards by R_i − mean_g
    (needs group_ids or group_size; only for [B] rewards). Returns the input's shape; sequences or tokens
    with no valid token get 0. For data parallelism call it on the gathered global batch.
    """
    if baseline not in (None, "group_mean"):
        raise ValueError(f"baseline must be None or 'group_mean', got {baseline!r}")
    if mask.dim() != 2 or rewards.shape not in (mask.shape[:1], mask.shape):
        raise ValueError(f"need mask [B, T] and rewards [B] or [B, T]; got {tuple(rewards.shape)}, {tuple(mask.shape)}")
    per_sequence = rewards.dim() == 1
    if baseline == "group_mean":
        if not per_sequence:
            raise ValueError("baseline='group_mean' needs per-sequence rewards [B]")
        rewards = group_mean_advantages(rewards, group_ids, group_size=group_size)
    valid = _valid_mask(mask)
    values = _masked_fp32(rewards[:, None].expand(mask.shape) if per_sequence else rewards, valid)
    n = valid.sum()
    mean = _total(values) / n.clamp(min=1)
    var = _total(torch.where(valid, (values - mean) ** 2, 0.0)) / (n - 1).clamp(min=1)
    scale = torch.rsqrt(var + eps)
    if per_sequence:
        return torch.where(valid.any(dim=-1), (rewards.float() - mean) * scale, 0.0)
    return torch.where(valid, (values - mean) * scale, 0.0)


def broadcast_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence advantages [B] → fp32 [B, T], equal to A_b on valid tokens and 0 elsewhere."""
    if advantages.dim() != 1 or mask.dim() != 2 or advantages.shape[0] != mask.shape[0]:
        raise ValueError(f"need advantages [B] and mask [B, T]; got {tuple(advantages.shape)}, {tuple(mask.shape)}")
    return torch.where(_valid_mask(mask), advantages.float()[:, None], 0.0)
