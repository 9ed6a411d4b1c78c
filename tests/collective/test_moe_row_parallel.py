"""MoE experts at tensor parallelism: ``row_parallel_moe_experts`` over 2 and 4 gloo processes (each rank every
expert's I slice, as vLLM shards FusedMoE, shared expert likewise) equals the unsplit ``aligned::moe_experts`` bit
for bit (integer views) — fma in fp32 and bf16, mma in bf16 where the CPU has the unit, with no, a gated and an
ungated shared expert, a token alone ≡ in the batch. Negative control: the order vLLM's fused-MoE all-reduce takes
(each rank weights and sums its own partial experts into a model-dtype output, then the ranks' outputs are added)
differs. Errors name the op
and the argument on every rank. One 4-process world per module (see _moe_tp_worker.py)."""

import json
import os

import pytest
import torch.distributed as dist

from aligned_ops.testing.distributed import launch

WORKER = os.path.join(os.path.dirname(__file__), "_moe_tp_worker.py")


@pytest.fixture(scope="module")
def records():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    outs = launch(WORKER, 4, timeout=600)
    rec = []
    for o in outs:
        rec += json.loads(o.strip().splitlines()[-1])
    return rec


def _select(records, prefix, t):
    got = [r for r in records if r["check"].startswith(prefix) and r["t"] == t]
    assert got, f"no records for {prefix} (t={t})"
    return got


@pytest.mark.parametrize("t", [2, 4])
def test_row_parallel_moe_experts_equal_unsplit(records, t):
    got = _select(records, "equals_unsplit", t)
    assert len({(r["group"], r["rank"]) for r in got}) == 4  # every rank of every group of size t
    assert {r["check"] for r in got} >= {"equals_unsplit[fma,float32,shared=True]",
                                         "equals_unsplit[fma,float32,shared=ungated]",
                                         "equals_unsplit[fma,bfloat16,shared=False]"}
    bad = [r for r in got if r["value"] is not True]
    assert not bad, bad[:5]
    assert all(r["value"] is True for r in _select(records, "token_alone", t))
    assert all(r["value"] is True for r in _select(records, "no_tokens", t))  # an empty step (T = 0)


@pytest.mark.parametrize("t", [2, 4])
def test_negative_control_late_combine_differs(records, t):
    got = _select(records, "late_combine_differs", t)
    print({r["check"]: r["value"] for r in got if r["rank"] == 0})
    assert all(r["value"] > 0 for r in got), [r for r in got if r["value"] == 0][:5]


@pytest.mark.parametrize("t", [2, 4])
def test_errors_name_op_and_argument_on_every_rank(records, t):
    combine = _select(records, "error[combine]", t)
    assert all("row_parallel_moe_experts" in r["value"] and "combine" in r["value"] for r in combine), combine
    shapes = _select(records, "error[w2]", t)
    assert len(shapes) == 4
    assert all("row_parallel_moe_experts" in r["value"] for r in shapes), shapes
    assert any("w2" in r["value"] for r in shapes), shapes


@pytest.mark.parametrize("t", [2, 4])
def test_intermediate_size_not_whole_lanes_raises_on_every_rank(records, t):
    """I = 11 (5 + 6 at t = 2): the model's whole I, passed as intermediate_size, does not split into whole lanes;
    every rank raises, naming the op and the argument. Negative control: without it each rank's local width passes
    the check (t x width does split) and the result is not the unsplit op's bits."""
    errors = _select(records, "error[intermediate_size]", t)
    assert len(errors) == 4, errors
    assert all("row_parallel_moe_experts" in r["value"] and "intermediate_size" in r["value"]
               and "whole lanes" in r["value"] for r in errors), errors
    control = _select(records, "no_size_equal_unsplit", t)
    assert len(control) == 4 and not any(r["value"] for r in control), control
