"""The plan/run form of GPU attention (aligned::attention_plan + attention_varlen_planned / paged_attention_planned)
under emulation, at both warp widths: bitwise equal to the per-call form and to the CPU backend, and
CUDA-graph safe, proven without a GPU.

CUDA-graph safety = a captured run replays the same launches with the same arguments, reading whatever plan was
written into the same buffers before the replay. So the run form must (a) launch identically for every metadata
of one capacity (its launch records: kernel, grid, block, shared bytes), and (b) copy nothing host-to-device and
read nothing back (the emulated glue records every host-to-device copy, aligned_ops.Emulation.host_copies; the
source scan of the run path is tests/cuda/test_no_host_sync.py). Negative control: the per-call form copies its
work list every call and sizes its grids by the batch.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, bits

ops = torch.ops.aligned
pytestmark = pytest.mark.emulated

WIDTHS = ["sm_90", "gfx942"]  # warp 32 and wave64
HQ, HKV, D, BS = 4, 2, 16, 4


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def paged_batch(ctx_lens, q_lens, seed, order=None):
    """A paged cache holding each sequence's ctx_lens[b] keys (blocks in random order, NaN elsewhere) and q for
    the last q_lens[b] of them: chunked prefill (q_len > 1 with context before) and decode (q_len = 1) mixed."""
    g = torch.Generator().manual_seed(seed)
    order = list(range(len(ctx_lens))) if order is None else order
    ctx_lens = [ctx_lens[b] for b in order]
    q_lens = [q_lens[b] for b in order]
    need = [(n + BS - 1) // BS for n in ctx_lens]
    n_blocks = sum(need) + 3
    perm = torch.randperm(n_blocks, generator=g).to(torch.int32)
    table = torch.full((len(ctx_lens), max(need) + 2), 10**6, dtype=torch.int32)  # garbage past the end
    pos = 0
    for b, nb in enumerate(need):
        table[b, :nb] = perm[pos:pos + nb]
        pos += nb
    k_cache = torch.full((n_blocks, BS, HKV, D), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    for b, n in enumerate(ctx_lens):
        p = torch.arange(n)
        slots = table[b, p // BS].long() * BS + p % BS
        k_cache.view(-1, HKV, D)[slots] = torch.randn(n, HKV, D, generator=g)
        v_cache.view(-1, HKV, D)[slots] = torch.randn(n, HKV, D, generator=g)
    q = torch.randn(sum(q_lens), HQ, D, generator=g)
    return q, k_cache, v_cache, table, torch.tensor(ctx_lens, dtype=torch.int32), cu(q_lens)


def planned_paged(q, kc, vc, table, seq_lens, qsl, plan):
    plan.plan_paged(qsl, seq_lens, table, HQ, HKV, D, kc.shape[0], BS)
    return aligned_ops.paged_attention(q, kc, vc, scale=0.3, plan=plan)


@pytest.mark.parametrize("arch", WIDTHS)
def test_plan_form_equals_per_call_form_and_cpu(arch):
    rng = random.Random(7)
    # varlen (training / one-shot prefill): lengths crossing tile (32) boundaries (splits: the 600-key decode row)
    lens = [1, 37, 70, 3]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(lens), h, D, generator=g) for h in (HQ, HKV, HKV))
    c = cu(lens)
    ref_v = ops.attention_varlen(q, k, v, c, c, 0.3, True)  # CPU backend
    # paged: chunked prefill + decode in one batch, in shuffled orders
    ctx, ql = [5, 40, 9, 600, 1], [5, 7, 1, 1, 1]
    cases = []
    for trial in range(2):
        order = list(range(len(ctx)))
        rng.shuffle(order)
        cases.append(paged_batch(ctx, ql, seed=trial, order=order))
    ref_p = [ops.paged_attention(*case, 0.3) for case in cases]
    with aligned_ops.emulate(arch) as emu:
        plan = aligned_ops.AttentionPlan()
        out_old = ops.attention_varlen(q, k, v, c, c, 0.3, True)
        out_new = aligned_ops.attention_varlen(q, k, v, c, c, 0.3, plan=plan.plan_varlen(c, c, HQ, HKV, D))
        paged_old = [ops.paged_attention(*case, 0.3) for case in cases]
        paged_new = [planned_paged(*case, aligned_ops.AttentionPlan()) for case in cases]
    assert {"attention_split_kernel", "attention_merge_kernel"} <= emu.kernels()
    for i in range(2):
        assert_bitwise_equal(out_new[i], out_old[i])
        assert_bitwise_equal(out_new[i], ref_v[i])
    for new, old, ref in zip(paged_new, paged_old, ref_p):
        assert_bitwise_equal(new, old)
        assert_bitwise_equal(new, ref)


@pytest.mark.parametrize("arch", WIDTHS)
def test_run_form_is_graph_safe(arch):
    # Two different metadata sets (different batch, lengths, orders), one capacity.
    a = paged_batch([5, 40, 9], [5, 7, 1], seed=3)
    b = paged_batch([600, 2], [1, 2], seed=4)
    plan = aligned_ops.AttentionPlan(capacity=64, table_capacity=256, workspace_floats=1 << 16)
    runs = []
    for case in (a, b):
        q, kc, vc, table, seq_lens, qsl = case
        with aligned_ops.emulate(arch) as emu_plan:  # plan: host work + its upload, once per step
            plan.plan_paged(qsl, seq_lens, table, HQ, HKV, D, kc.shape[0], BS, grow=False)
        with aligned_ops.emulate(arch) as emu_run:   # run: what a graph would capture
            out = aligned_ops.paged_attention(q, kc, vc, scale=0.3, plan=plan)
        assert emu_plan.host_copies, "the plan op uploads the plan (positive control of the copy records)"
        assert emu_run.host_copies == [], "the run form must make no host-to-device copy"
        runs.append([(r.kernel, r.grid, r.block, r.shared_bytes) for r in emu_run.launches])
        assert_bitwise_equal(out, ops.paged_attention(q, kc, vc, table, seq_lens, qsl, 0.3))  # CPU
    assert runs[0] == runs[1] and len(runs[0]) == 2, runs
    assert all(grid == (64, 1, 1) for _, grid, _, _ in runs[0])  # the capacity, not the batch

    # Negative control: the per-call form uploads its list every call, and its grids follow the batch.
    per_call = []
    for case in (a, b):
        with aligned_ops.emulate(arch) as emu:
            ops.paged_attention(*case, 0.3)
        assert emu.host_copies, "the per-call form copies its work list (negative control)"
        per_call.append([(r.kernel, r.grid) for r in emu.launches])
    assert per_call[0] != per_call[1]


@pytest.mark.parametrize("arch", WIDTHS)
def test_plan_that_does_not_fit_sets_the_flag_and_gives_nan(arch):
    # The call is checked against the plan's host info (a clear error). The kernels check only what protects
    # memory against the device header (a replayed graph's buffer is rewritten every step, test_graph_replay_*):
    # a buffer holding a plan for more rows than q has sets the error word and writes NaN into every row.
    q, kc, vc, table, seq_lens, qsl = paged_batch([9, 3], [2, 1], seed=5)
    q2, _, _, table2, seq_lens2, qsl2 = paged_batch([7, 5], [3, 2], seed=7)  # 5 query rows > q's 3
    plan, other = aligned_ops.AttentionPlan(), aligned_ops.AttentionPlan()
    with aligned_ops.emulate(arch):
        plan.plan_paged(qsl, seq_lens, table, HQ, HKV, D, kc.shape[0], BS)
        other.plan_paged(qsl2, seq_lens2, table2, HQ, HKV, D, kc.shape[0], BS)
        aligned_ops.check_device_errors(q)  # clean before
        with pytest.raises(RuntimeError, match="aligned::paged_attention_planned: plan addresses more query"):
            aligned_ops.paged_attention(q[:1], kc, vc, scale=0.3, plan=plan)  # fewer q rows than planned
        crossed = SimpleNamespace(plan=other.plan, table=other.table, info=plan.info,
                                  workspace_floats=max(plan.workspace_floats, other.workspace_floats))
        bad = aligned_ops.paged_attention(q, kc, vc, scale=0.3, plan=crossed)
        assert (bits(bad) == bits(torch.full_like(bad, float("nan")))).all()  # every row the canonical NaN
        with pytest.raises(RuntimeError, match="attention plan does not fit"):
            aligned_ops.check_device_errors(q)
        good = aligned_ops.paged_attention(q, kc, vc, scale=0.3, plan=plan)
        aligned_ops.check_device_errors(q)  # cleared, and a fitting run sets nothing
    assert_bitwise_equal(good, ops.paged_attention(q, kc, vc, table, seq_lens, qsl, 0.3))


@pytest.mark.parametrize("arch", WIDTHS)
def test_graph_replay_runs_the_plan_written_for_this_step(arch):
    """What a captured CUDA graph does: the run's host info (and so the captured run dims) stay those of the
    capture step while attention_plan rewrites the buffer for each later step, whose batch is padded to the
    graph's q rows. The kernels run the buffer's plan: every planned row == the CPU per-call result of that
    step, and no error. Negative control: the strict (host) rules applied on the device would refuse it."""
    cap = paged_batch([12, 6, 3], [4, 3, 1], seed=11)    # the capture step: 8 query rows
    step = paged_batch([20, 2], [2, 1], seed=12)          # a later step: 3 rows, padded to 8
    q_cap, kc, vc = cap[0], cap[1], cap[2]
    plan = aligned_ops.AttentionPlan(capacity=64, table_capacity=256, workspace_floats=1 << 16)
    with aligned_ops.emulate(arch):
        plan.plan_paged(cap[5], cap[4], cap[3], HQ, HKV, D, kc.shape[0], BS, grow=False)
        captured = SimpleNamespace(plan=plan.plan, table=plan.table, info=plan.info.clone(),
                                   workspace_floats=plan.workspace_floats)
        first = aligned_ops.paged_attention(q_cap, kc, vc, scale=0.3, plan=captured)
        q_s, kc_s, vc_s, table_s, seq_s, qsl_s = step
        plan.plan_paged(qsl_s, seq_s, table_s, HQ, HKV, D, kc_s.shape[0], BS, grow=False)  # same buffers
        assert not torch.equal(plan.info, captured.info)  # the buffer now holds another plan than the capture's
        padded = torch.cat([q_s, torch.zeros(q_cap.shape[0] - q_s.shape[0], HQ, D)])
        out = aligned_ops.paged_attention(padded, kc_s, vc_s, scale=0.3, plan=captured)  # the captured call
        aligned_ops.check_device_errors(padded)
    assert_bitwise_equal(first, ops.paged_attention(*cap, 0.3))
    assert_bitwise_equal(out[: q_s.shape[0]], ops.paged_attention(*step, 0.3))
    pad = out[q_s.shape[0]:]
    assert (bits(pad) == bits(torch.full_like(pad, float("nan")))).all()  # padding rows NaN, never uninitialised
    # negative control: the step's plan breaks the host's strict rules for the captured call
    with pytest.raises(RuntimeError, match="plan covers fewer query rows than q has|plan buffer holds another plan"):
        with aligned_ops.emulate(arch):
            aligned_ops.paged_attention(padded, kc_s, vc_s, scale=0.3, plan=plan)


def test_plan_capacity_and_metadata_errors_name_the_op():
    q, kc, vc, table, seq_lens, qsl = paged_batch([9, 3], [2, 1], seed=6)
    small = aligned_ops.AttentionPlan(capacity=1, table_capacity=64, workspace_floats=1 << 12)
    with aligned_ops.emulate("sm_90"):
        with pytest.raises(RuntimeError, match=r"aligned::attention_plan: the plan needs \d+ work records but the "
                                               r"plan buffer holds 1"):
            small.plan_paged(qsl, seq_lens, table, HQ, HKV, D, kc.shape[0], BS, grow=False)
        bad_table = table.clone()
        bad_table[0, 0] = kc.shape[0]
        with pytest.raises(RuntimeError, match=r"aligned::attention_plan: block_table\[0, 0\] = \d+ is out of range"):
            aligned_ops.AttentionPlan(64, 64, 1 << 12).plan_paged(qsl, seq_lens, bad_table, HQ, HKV, D, kc.shape[0],
                                                                  BS, grow=False)
