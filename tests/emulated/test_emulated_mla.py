"""MLA (csrc/common/attention.h "MLA") on the GPU source under emulation, both warp widths.

The MLA ops are the attention ops with one KV head whose keys and values are the latent row, so under
``aligned_ops.emulate(arch)`` they run the GPU attention kernels (the launch records prove it) and must equal the
CPU backend bit for bit: varlen forward and backward, the latent cache write, paged decode / chunked prefill
(per-call and planned forms). Rows up to 256 wide run the staged kernels; wider rows up to 640 (DeepSeek-V3's
512 + 64) the wide variants (nothing staged in shared memory), forward and backward, also ≡ CPU; wider still is
refused by name. Negative control: the emulator's neighbour-first shuffle tree must change the bits."""

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


@pytest.mark.parametrize("R, rope", [(96, 32), (512, 64)])  # 512 + 64: the wide forward variant
def test_negative_control_neighbour_tree(R, rope):
    """A tile sum in another order (the emulator's planted neighbour-first shuffle tree) changes the bits, in the
    staged and in the wide forward."""
    c = case(torch.float32, R=R, rope=rope, lens=(70,), seed=1)
    q, kv = c[0], c[1]
    cq = cu(c[-1])
    args = (q, kv, cq, cq, R, q.shape[-1] ** -0.5, True)
    cpu = ops.mla_attention_varlen(*args)[0]
    with aligned_ops.emulate("sm_90") as emu:
        good = ops.mla_attention_varlen(*args)[0]
    with aligned_ops.emulate("sm_90", _fault="neighbour_tree"):
        bad = ops.mla_attention_varlen(*args)[0]
    splits = [l for l in emu.launches if l.kernel_base == "attention_split_kernel"]
    assert splits and all((l.shared_bytes == 0) == (R + rope > 256) for l in splits)  # the variant under test ran
    assert bitwise_equal(cpu, good) and not bitwise_equal(cpu, bad)


@pytest.mark.parametrize("arch", WIDTHS)
def test_wide_rows_forward_equals_cpu(arch):
    """DeepSeek-V3 / Kimi-K2's 512 + 64 row (above the staged kernels' 256): the wide forward variant (nothing staged
    in shared memory) — varlen, paged decode / chunk, planned — equals the CPU bit for bit."""
    R, rope, lens = 512, 64, (40, 3)
    q, kv, go, table, slots, n_blocks, lens = case(torch.bfloat16, R=R, rope=rope, lens=lens, h=2, seed=3)
    D, scale = R + rope, (R + rope) ** -0.5
    cq, sl, ql = cu(lens), torch.tensor(lens, dtype=torch.int32), cu([7, 1])
    qm = torch.cat([q[lens[0] - 7 : lens[0]], q[-1:]])

    def forward():
        out, lse = ops.mla_attention_varlen(q, kv, cq, cq, R, scale, True)
        cache = torch.full((n_blocks, 16, D), float("nan"), dtype=q.dtype)
        ops.mla_reshape_and_cache(kv[:, :R], kv[:, R:], cache, slots)
        paged = ops.mla_paged_attention(qm, cache, table, sl, ql, R, scale)
        plan = aligned_ops.AttentionPlan().plan_paged(ql, sl, table, 2, 1, D, n_blocks, 16)
        planned = aligned_ops.mla_paged_attention(qm, cache, kv_lora_rank=R, scale=scale, plan=plan)
        return out, lse, paged, planned

    cpu = forward()
    with aligned_ops.emulate(arch) as emu:
        gpu = forward()
    assert {"attention_split_kernel", "attention_merge_kernel"} <= emu.kernels()
    splits = [l for l in emu.launches if l.kernel_base == "attention_split_kernel"]
    assert splits and all(l.shared_bytes == 0 for l in splits), [(l.kernel, l.shared_bytes) for l in splits]
    for name, a, b in zip(["out", "lse", "paged", "planned"], cpu, gpu):
        assert bitwise_equal(a, b), f"{arch} {name}"
    assert bitwise_equal(cpu[2], torch.cat([cpu[0][lens[0] - 7 : lens[0]], cpu[0][-1:]]))


@pytest.mark.parametrize("arch", WIDTHS)
def test_wide_rows_backward_equals_cpu(arch):
    """The 512 + 64 backward (the trainer's): the wide dq / dk-dv variants equal the CPU bit for bit."""
    q, kv, go, _table, _slots, _n, lens = case(torch.bfloat16, R=512, rope=64, lens=(9, 35), h=2, seed=4)
    cq = cu(lens)
    out, lse = ops.mla_attention_varlen(q, kv, cq, cq, 512, 0.04, True)
    cpu = ops.mla_attention_varlen_backward(go, q, kv, out, lse, cq, cq, 512, 0.04, True)
    with aligned_ops.emulate(arch) as emu:
        gpu = ops.mla_attention_varlen_backward(go, q, kv, out, lse, cq, cq, 512, 0.04, True)
    assert {"attention_bwd_dq_kernel", "attention_bwd_dkdv_kernel"} <= emu.kernels()
    # D = 576: the wide dk/dv runs its tile's elements in two slices (gridDim.y; attention_kernels.cuh)
    assert {l.grid[1] for l in emu.launches if l.kernel_base == "attention_bwd_dkdv_kernel"} == {2}
    assert bitwise_equal(cpu[0], gpu[0]) and bitwise_equal(cpu[1], gpu[1]), arch


def test_rows_above_the_gpu_maximum_refused_by_name():
    """Above 640 the GPU path refuses, naming the op, before a launch."""
    c = case(torch.bfloat16, R=600, rope=48, lens=(4,))
    q, kv = c[0], c[1]
    cq = cu(c[-1])
    with aligned_ops.emulate("sm_90") as emu:
        with pytest.raises(RuntimeError, match="mla_attention_varlen: head_dim must be <= 640 on the GPU"):
            ops.mla_attention_varlen(q, kv, cq, cq, 600, 0.04, True)
    assert not emu.launches


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("dtype, R, rope, lens", [(torch.bfloat16, 268, 32, (600, 5)),  # D = 300: not a multiple of 32
                                                  (torch.float32, 257, 0, (530,))])  # D = 257, fp32
def test_wide_rows_over_several_splits_equal_cpu(arch, dtype, R, rope, lens):
    """Wide rows whose sequences pass one 512-key split: the wide merge over several splits, forward and backward,
    at widths that are no multiple of the vector width, equal the CPU bit for bit."""
    q, kv, go, *_ = case(dtype, R=R, rope=rope, lens=lens, h=2, seed=5)
    cq, scale = cu(list(lens)), (R + rope) ** -0.5

    def run():
        out, lse = ops.mla_attention_varlen(q, kv, cq, cq, R, scale, True)
        return (out, lse, *ops.mla_attention_varlen_backward(go, q, kv, out, lse, cq, cq, R, scale, True))

    cpu = run()
    with aligned_ops.emulate(arch) as emu:
        gpu = run()
    merges = [l for l in emu.launches if l.kernel_base == "attention_merge_kernel"]
    assert merges and {"attention_bwd_dq_kernel", "attention_bwd_dkdv_kernel"} <= emu.kernels()
    assert {l.grid[1] for l in emu.launches if l.kernel_base == "attention_bwd_dkdv_kernel"} == {1}  # D <= 320
    for name, a, b in zip(["out", "lse", "dq", "dkv"], cpu, gpu):
        assert bitwise_equal(a, b), f"{arch} {name}"


@pytest.mark.parametrize("arch", WIDTHS)
# the dk/dv slices split the tile's 32 x D elements at 256 x 40: at 321 the second holds 32 (of key 31), at 328 256
@pytest.mark.parametrize("D, slices", [(264, 1), (321, 2), (328, 2), (640, 2)])
def test_wide_heads_of_ordinary_attention_equal_cpu(arch, D, slices):
    """The wide kernels also serve ordinary attention (several KV heads) at 256 < head_dim <= 640: ≡ CPU."""
    g = torch.Generator().manual_seed(6)
    lens, H, Hkv = [33, 20], 4, 2
    T = sum(lens)
    q, k, v = (torch.randn(T, h, D, generator=g).to(torch.bfloat16) for h in (H, Hkv, Hkv))
    go = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    cq, scale = cu(lens), D ** -0.5

    def run():
        out, lse = ops.attention_varlen(q, k, v, cq, cq, scale, True)
        return (out, lse, *ops.attention_varlen_backward(go, q, k, v, out, lse, cq, cq, scale, True))

    cpu = run()
    with aligned_ops.emulate(arch) as emu:
        gpu = run()
    assert {l.grid[1] for l in emu.launches if l.kernel_base == "attention_bwd_dkdv_kernel"} == {slices}
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], cpu, gpu):
        assert bitwise_equal(a, b), f"{arch} {name}"
