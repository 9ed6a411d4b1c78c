import math

import pytest
import torch

from aligned_ops.diagnostics import MismatchTracker, mismatch_metrics, peak_to_median

LN2 = math.log(2.0)


def test_identical_inputs_are_a_perfect_match():
    lp = -torch.rand(3, 8, generator=torch.Generator().manual_seed(0)) * 5
    mask = torch.ones(3, 8)
    mask[2, 5:] = 0
    m = mismatch_metrics(lp, lp.clone(), mask)
    assert m["frac_bitwise_equal"] == 1.0
    for key in ("kl_k1", "kl_k2", "kl_k3", "chi2_token", "chi2_seq", "renyi2", "renyi3", "abs_diff_max",
                "abs_diff_mean", "frac_ratio_outside_band", "seq_log_ppl_abs_diff_mean"):
        assert m[key] == 0.0, key
    assert m["ess"] == m["ratio_mean"] == m["ratio_min"] == m["ratio_max"] == 1.0
    assert m["num_tokens"] == 21.0 and m["num_seqs"] == 3.0
    assert all(type(v) is float for v in m.values())


def test_hand_computed_estimators():
    # log ρ = ℓt − ℓr: seq0 = [ln2, 0], seq1 = [−ln2, pad]  →  ρ = {2, 1, 0.5}
    trainer = torch.tensor([[-1.0, -2.0], [-0.5, float("nan")]], dtype=torch.float64)
    rollout = torch.tensor([[-1.0 - LN2, -2.0], [-0.5 + LN2, 0.0]], dtype=torch.float64)
    m = mismatch_metrics(trainer, rollout, torch.tensor([[True, True], [True, False]]), band=(0.75, 1.5))
    approx = lambda v: pytest.approx(v, rel=1e-12, abs=1e-12)  # noqa: E731
    assert m["num_tokens"] == 3.0 and m["num_seqs"] == 2.0
    assert m["frac_bitwise_equal"] == approx(1 / 3)
    assert m["abs_diff_max"] == approx(LN2)
    assert m["abs_diff_mean"] == approx(2 * LN2 / 3)
    assert m["kl_k1"] == approx(0.0)
    assert m["kl_k2"] == approx(LN2**2 / 3)
    assert m["kl_k3"] == approx(((1 - LN2) + (-0.5 + LN2) + 0) / 3)  # = 1/6
    assert m["chi2_token"] == approx((4 + 0.25 + 1) / 3 - 1)  # = 0.75
    assert m["chi2_seq"] == approx((4 + 0.25) / 2 - 1)  # Π ρ per sequence = 2, 0.5
    assert m["renyi2"] == approx(math.log(1.75))
    assert m["renyi3"] == approx(0.5 * math.log((8 + 0.125 + 1) / 3))
    assert m["ess"] == approx(3.5**2 / (3 * 5.25))  # = 7/9
    assert m["ratio_mean"] == approx(3.5 / 3)
    assert m["ratio_min"] == approx(0.5)
    assert m["ratio_max"] == approx(2.0)
    assert m["frac_ratio_outside_band"] == approx(2 / 3)
    assert m["seq_log_ppl_abs_diff_mean"] == approx((LN2 / 2 + LN2) / 2)


def test_bitwise_equality_rules():
    nan = float("nan")
    trainer = torch.tensor([nan, 0.0, -1.5, -1.0])
    rollout = torch.tensor([nan, -0.0, -1.5, -1.0 + 2**-20])
    # NaN never equal; +0 == −0; exact value equal; one-ulp-ish difference unequal
    m = mismatch_metrics(trainer, rollout, torch.tensor([1, 1, 1, 1]))
    assert m["frac_bitwise_equal"] == 0.5
    # a bf16 value widened to fp32 compares equal to the same fp32 value
    bf = torch.tensor([-1.5, -0.3]).bfloat16()
    assert mismatch_metrics(bf.float(), bf)["frac_bitwise_equal"] == 1.0


def test_one_dimensional_input_is_one_sequence():
    m = mismatch_metrics(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0 - LN2, -2.0]))
    assert m["num_seqs"] == 1.0
    assert m["chi2_seq"] == pytest.approx(3.0, rel=1e-6)  # (Πρ)² − 1 = 4 − 1


def test_empty_mask_returns_neutral_values():
    m = mismatch_metrics(torch.zeros(2, 3), torch.full((2, 3), float("nan")), torch.zeros(2, 3))
    assert m["num_tokens"] == 0.0
    assert m["ess"] == 1.0 and m["kl_k3"] == 0.0 and m["frac_bitwise_equal"] == 1.0
    assert not any(math.isnan(v) for v in m.values())


def test_shape_validation():
    with pytest.raises(ValueError, match="shape"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="mask shape"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3))
    with pytest.raises(ValueError, match=r"\[T\] or \[B, T\]"):
        mismatch_metrics(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3))


def test_peak_to_median_definition():
    assert peak_to_median([1.0, 2.0, 3.0, 100.0]) == 40.0  # median of an even count: mean of the middle two
    assert peak_to_median([3.0, 1.0, 2.0]) == 1.5
    assert peak_to_median([0.0, 0.0, 5.0]) == math.inf
    assert peak_to_median([0.0, 0.0]) == 1.0
    assert peak_to_median([]) == 1.0


def test_tracker_d3_history_and_peak_to_median():
    tracker = MismatchTracker()
    rollout = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    shifts = {10: 0.01, 11: 0.02, 12: 0.5, 13: 0.03}  # one log-prob off by x at each step
    for step, x in shifts.items():
        tracker.update(step, rollout + torch.tensor([[x, 0.0]], dtype=torch.float64), rollout)
    tracker.update(14, rollout, rollout, torch.zeros(1, 2))  # no valid token: not recorded

    d3 = {step: (math.expm1(x) - x) / 2 for step, x in shifts.items()}  # k3 mean over the 2 tokens
    assert [s for s, _ in tracker.d3_history] == list(d3)
    for (_, got), want in zip(tracker.d3_history, d3.values()):
        assert got == pytest.approx(want, rel=1e-12)
    median = (d3[11] + d3[13]) / 2
    assert tracker.d3_peak_to_median() == pytest.approx(d3[12] / median, rel=1e-12)
    summary = tracker.summary()
    assert summary["num_steps"] == 4.0
    assert summary["d3_peak_step"] == 12.0
    assert summary["d3_peak"] == pytest.approx(d3[12], rel=1e-12)
    assert summary["d3_median"] == pytest.approx(median, rel=1e-12)
    assert summary["d3_last"] == pytest.approx(d3[13], rel=1e-12)
    assert summary["frac_bitwise_equal_min"] == 0.5


def test_tracker_aligned_run_and_empty_tracker():
    tracker = MismatchTracker()
    lp = torch.tensor([[-0.3, -1.2, -4.0]])
    for step in range(3):
        tracker.update(step, lp, lp.clone())
    s = tracker.summary()
    assert s["d3_peak_to_median"] == 1.0 and s["d3_peak"] == 0.0 and s["frac_bitwise_equal_min"] == 1.0
    assert MismatchTracker().summary().keys() == s.keys()
    assert MismatchTracker().d3_peak_to_median() == 1.0


# ---- issue 8: NaN steps and NaN masks -------------------------------------------------------------------------


def _tracker_with(values):
    from aligned_ops.diagnostics import MismatchTracker

    t = MismatchTracker()
    for step, v in enumerate(values):
        # one token with log ratio r: k3 = expm1(r) - r; NaN log-prob -> NaN k3
        lt = torch.tensor([[v]], dtype=torch.float64)
        t.update(step, lt, torch.zeros(1, 1, dtype=torch.float64))
    return t


@pytest.mark.parametrize("position", [0, 1, 2, 3])
def test_tracker_nan_step_does_not_depend_on_its_position(position):
    # Was: Python's max() keeps or drops a NaN depending on where it falls, so d3_peak / peak-to-median
    # changed with the NaN step's position.
    values = [0.1, 0.3, 0.2]
    values.insert(position, float("nan"))
    s = _tracker_with(values).summary()
    assert math.isnan(s["d3_peak"]) and math.isnan(s["d3_peak_to_median"])
    assert s["d3_peak_step"] == float(position) and s["d3_nan_steps"] == 1.0
    finite = [math.expm1(v) - v for v in (0.1, 0.3, 0.2)]
    assert s["d3_median"] == pytest.approx(sorted(finite)[1])
    assert math.isnan(s["abs_diff_max"])


def test_peak_to_median_with_nan_is_nan_in_any_order():
    from aligned_ops.diagnostics import peak_to_median

    for values in ([1.0, float("nan"), 3.0], [float("nan"), 1.0, 3.0], [1.0, 3.0, float("nan")]):
        assert math.isnan(peak_to_median(values))


def test_nan_in_a_float_mask_is_not_valid():
    from aligned_ops.diagnostics import mismatch_metrics

    t = torch.tensor([[-1.0, -2.0, -3.0]])
    r = torch.tensor([[-1.0, -2.5, -3.0]])
    m_nan = mismatch_metrics(t, r, torch.tensor([[1.0, float("nan"), 1.0]]))
    m_zero = mismatch_metrics(t, r, torch.tensor([[1.0, 0.0, 1.0]]))
    assert m_nan["num_tokens"] == 2.0
    assert m_nan == m_zero
