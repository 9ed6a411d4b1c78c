"""row_parallel_linear under the exact profile over 2 gloo processes equals the unsplit linear_exact bitwise.

The route: the full rows' canonical forms from an all-reduce MAX of the ranks' row scans, each rank's exact
integer partials, an int64 all-reduce SUM, one rounding (ops/collective.py, exact_row_parallel_linear). bf16 /
fp16 / fp32, even and uneven K splits, outlier rows whose form rounds, NaN / inf / zero rows, bias; the weight's
packing cached per version and redone after an update. Negative controls: the fma route on the same slices, and
each rank's own exact linear summed, differ.
"""

import json
import os

import pytest
import torch.distributed as dist

from aligned_ops.testing.distributed import launch

WORKER = os.path.join(os.path.dirname(__file__), "_exact_tp_worker.py")


@pytest.fixture(scope="module")
def records():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    env = dict(os.environ, ALIGNED_OPS_LINEAR="exact")
    outs = launch(WORKER, 2, timeout=600, env=env)
    rec = []
    for o in outs:
        rec += json.loads(o.strip().splitlines()[-1])
    return rec


def _select(records, prefix):
    got = [r for r in records if r["check"].startswith(prefix)]
    assert got, f"no records for {prefix}"
    return got


def test_exact_row_parallel_equals_linear_exact(records):
    got = _select(records, "exact_equals_linear_exact")
    assert len(got) == 2 * 3 * 2 * 2  # ranks x dtypes x splits x bias
    bad = [r for r in got if r["value"] is not True]
    assert not bad, bad


def test_weight_packing_cached_and_redone_after_update(records):
    assert all(r["value"] is True for r in _select(records, "cached_same_bits"))
    assert all(r["value"] is True for r in _select(records, "repacked_after_update"))
    assert all(r["value"] is True for r in _select(records, "one_rank_cleared_same_bits"))


def test_unregistered_weight_slice_sees_writes_behind_the_version_counter(records):
    # issue 21.3: a slice written through .data (no version bump) was served from the old packing
    assert all(r["value"] is True for r in _select(records, "unregistered_data_write_seen"))
    assert all(r["value"] is True for r in _select(records, "unregistered_back"))


@pytest.mark.parametrize("check", ["fma_route_differs", "per_rank_exact_summed_differs"])
def test_negative_controls_differ(records, check):
    got = _select(records, check)
    assert all(r["value"] > 0 for r in got), got
