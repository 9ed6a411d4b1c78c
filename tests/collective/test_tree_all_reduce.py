"""tree_all_reduce over 2/4/8 gloo processes equals the unsplit 8-lane tree bitwise; refusals name op and argument.

One 8-process gloo world (launched once per module, ~10-20 s on 2 cores) holds pairs, quads, the world, a group
of 3 and a group without rank 0; every rank checks every group it belongs to (see _tree_worker.py).
Negative controls: a rank-sequential combine (t >= 4) and a lane-sequential combine of the same lane sums differ.
"""

import json
import os

import pytest
import torch.distributed as dist

import aligned_ops
from aligned_ops.testing.distributed import launch

WORKER = os.path.join(os.path.dirname(__file__), "_tree_worker.py")


@pytest.fixture(scope="module")
def records():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    outs = launch(WORKER, 8, timeout=600)
    rec = []
    for o in outs:
        rec += json.loads(o.strip().splitlines()[-1])
    return rec


def _select(records, prefix, t=None):
    got = [r for r in records if r["check"].startswith(prefix) and (t is None or r["t"] == t)]
    assert got, f"no records for {prefix} (t={t})"
    return got


@pytest.mark.parametrize("t", [2, 4, 8])
def test_tree_all_reduce_equals_unsplit_tree(records, t):
    got = _select(records, "tree_equals_unsplit", t)
    ranks = {(r["group"], r["rank"]) for r in got}
    assert len(ranks) == 8  # every rank of every group of size t
    bad = [r for r in got if r["value"] is not True]
    assert not bad, bad[:5]
    assert all(r["value"] for r in _select(records, "partial_untouched", t))


def test_group_without_rank_zero_and_both_algorithms(records):
    got = [r for r in _select(records, "tree_equals_unsplit", 4) if r["group"] == "quad1"]
    assert {r["rank"] for r in got} == {0, 1, 2, 3}
    assert {r["check"].split("[")[1].split(",")[0] for r in got} == {"auto", "halving", "allgather"}
    assert all(r["value"] for r in got)


@pytest.mark.parametrize("t", [4, 8])
def test_negative_control_rank_sequential_combine_differs(records, t):
    assert all(r["value"] > 0 for r in _select(records, "rank_sequential_differs", t))


@pytest.mark.parametrize("t", [2, 4, 8])
def test_negative_control_lane_sequential_combine_differs(records, t):
    assert all(r["value"] > 0 for r in _select(records, "lane_sequential_differs", t))


@pytest.mark.skipif(not hasattr(aligned_ops, "linear_partial"), reason="needs the 8-lane linear (linear_partial)")
@pytest.mark.parametrize("t", [2, 4, 8])
def test_row_parallel_linear_equals_linear(records, t):
    got = _select(records, "row_parallel_equals_linear", t)
    bad = [r for r in got if r["value"] is not True]
    assert not bad, bad[:5]
    assert all(r["value"] > 0 for r in _select(records, "per_rank_linear_differs", t))
    assert all(r["value"] is True for r in _select(records, "lane_sums_tree_equals_partial8", t))


@pytest.mark.parametrize("t", [2, 4, 8])
def test_vocab_sharded_embedding_combine_is_exact_and_keeps_negative_zero(records, t):
    assert all(r["value"] is True for r in _select(records, "embedding_exact", t))
    # Negative control: vLLM's +0.0 fill turns the owner's -0.0 into +0.0.
    assert all(r["value"] > 0 for r in _select(records, "embedding_plus_zero_fill_loses_sign", t))


def test_refusals(records):
    (msg,) = {r["value"] for r in _select(records, "refuse_tp_degree", 3)}
    assert msg.startswith("aligned_ops.tree_all_reduce: TP degree 3 is not supported")
    assert "1, 2, 4, 8" in msg
    (msg,) = {r["value"] for r in _select(records, "refuse_dtype")}
    assert msg == "aligned_ops.tree_all_reduce: partial must be float32 (the fp32 sub-tree of linear_partial), got torch.bfloat16"
    (msg,) = {r["value"] for r in _select(records, "refuse_algorithm")}
    assert "algorithm must be one of" in msg
    msgs = {r["value"] for r in _select(records, "refuse_slice")}
    assert len(msgs) == 8 and all(
        m.startswith("aligned_ops.row_parallel_linear: K = 200 does not split into whole lanes over 8 ranks as this "
                     "rank's weight does: rank ") and m.endswith("(25 features), it holds 12") for m in msgs), msgs
    msgs = {r["value"] for r in _select(records, "refuse_lanes", 2)}
    assert all(m.startswith("aligned_ops.row_parallel_linear: K = 13 does not split into whole lanes over 2 ranks (")
               and "cannot be split 2 ways into whole lanes" in m for m in msgs), msgs


def test_refuses_without_process_group():
    import torch

    from aligned_ops.ops.collective import tree_all_reduce

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="aligned_ops.tree_all_reduce: torch.distributed is not initialized"):
        tree_all_reduce(torch.zeros(3))
