"""MLA (csrc/common/attention.h "MLA") on the GPU source under emulation, both warp widths.

The MLA ops are the attention ops with one KV head whose keys and values are the latent row, so under
``aligned_ops.emulate(arch)`` they run the GPU attention kernels (the launch records prove it) and must equal the
CPU backend bit for bit: varlen forward and backward, the latent cache write, paged decode / chunked prefill
(per-call and planned forms). Row widths up to the GPU kernels' head_dim limit (256) run here; wider rows (DeepSeek-V3's
576) are refused by name on the GPU path until the kernels take them (the refusal is tested, and the CPU path is
in tests/ops/test_mla.py). Negative control: the emulator's neighbour-first shuffle tree must change the bits."""

from __future__ import annotations

import pytest
import torch

import aligned_ops
from aligned_ops.testing import bitwise_equal

ops = torch.ops.aligned
pytestmark = pytest.mark.emulated

WIDTHS = ["sm_90", "gfx942"]


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def case(dtype, R=96, rope=32, lens=(40, 3), h=3, bs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = R + rope
    q = torch.randn(sum(lens), h, D, generator=g).to(dtype)
    kv = torch.randn(sum(lens), D, generator=g).to(dtype)
    go = torch.randn(sum(lens), h, R, generator=g).to(dtype)
    need = [(n + bs - 1) // bs for n in lens]
    perm = torch.randperm(sum(need) + 2, generator=g).to(torch.int32)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    slots, used = [], 0
    for b, n in enumerate(lens):
        table[b, : need[b]] = perm[used : used + need[b]]
        slots += [int(table[b, j // bs]) * bs + j % bs for j in range(n)]
        used += need[b]
    return q, kv, go, table, torch.tensor(slots, dtype=torch.int64), perm.numel(), list(lens)


def run_all(q, kv, go, table, slots, n_blocks, lens, R, bs=16):
    D, scale = q.shape[-1], q.shape[-1] ** -0.5
    cq = cu(lens)
    out, lse = ops.mla_attention_varlen(q, kv, cq, cq, R, scale, True)
    vplan = aligned_ops.AttentionPlan().plan_varlen(cq, cq, q.shape[1], 1, D)
    out_planned = aligned_ops.mla_attention_varlen(q, kv, cq, cq, R, scale, plan=vplan)[0]
    dq, dkv = ops.mla_attention_varlen_backward(go, q, kv, out, lse, cq, cq, R, scale, True)
    cache = torch.full((n_blocks, bs, D), float("nan"), dtype=q.dtype)
    ops.mla_reshape_and_cache(kv[:, :R], kv[:, R:], cache, slots)
    sl = torch.tensor(lens, dtype=torch.int32)
    # the last 7 rows of sequence 0 (a chunk over a prefix hit) and the last row of sequence 1 (decode)
    qm = torch.cat([q[lens[0] - 7 : lens[0]], q[-1:]])
    ql = cu([7, 1])
    paged = ops.mla_paged_attention(qm, cache, table, sl, ql, R, scale)
    plan = aligned_ops.AttentionPlan().plan_paged(ql, sl, table, q.shape[1], 1, D, n_blocks, bs)
    planned = aligned_ops.mla_paged_attention(qm, cache, kv_lora_rank=R, scale=scale, plan=plan)
    return out, lse, dq, dkv, cache, paged, planned, out_planned


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_emulated_equals_cpu(arch, dtype):
    c = case(dtype)
    R = 96
    cpu = run_all(*c, R)
    with aligned_ops.emulate(arch) as emu:
        gpu = run_all(*c, R)
    assert {"attention_split_kernel", "attention_merge_kernel", "cache_write_kernel", "attention_bwd_dq_kernel",
            "attention_bwd_dkdv_kernel"} <= emu.kernels(), emu.kernels()
    for name, a, b in zip(["out", "lse", "dq", "dkv", "cache", "paged", "planned", "out_planned"], cpu, gpu):
        assert bitwise_equal(a, b), f"{arch} {name}"
    out, lse, *_, paged, planned, out_planned = cpu
    assert bitwise_equal(out_planned, out)
    lens = c[-1]
    want = torch.cat([out[lens[0] - 7 : lens[0]], out[-1:]])
    assert bitwise_equal(paged, want) and bitwise_equal(planned, want)


def test_negative_control_neighbour_tree():
    """A tile sum in another order (the emulator's planted neighbour-first shuffle tree) changes the bits."""
    c = case(torch.float32, lens=(70,), seed=1)
    q, kv = c[0], c[1]
    cq = cu(c[-1])
    args = (q, kv, cq, cq, 96, q.shape[-1] ** -0.5, True)
    cpu = ops.mla_attention_varlen(*args)[0]
    with aligned_ops.emulate("sm_90", _fault="neighbour_tree"):
        bad = ops.mla_attention_varlen(*args)[0]
    assert not bitwise_equal(cpu, bad)


def test_wide_rows_refused_by_name_on_the_gpu_path():
    """DeepSeek-V3's 512 + 64 row is above the GPU kernels' head_dim (256): refused, naming the op, before a launch."""
    c = case(torch.bfloat16, R=512, rope=64, lens=(4,))
    q, kv = c[0], c[1]
    cq = cu(c[-1])
    with aligned_ops.emulate("sm_90") as emu:
        with pytest.raises(RuntimeError, match="mla_attention_varlen: head_dim must be <= 256"):
            ops.mla_attention_varlen(q, kv, cq, cq, 512, 0.04, True)
    assert not emu.launches
