"""The SIMT runtime itself (csrc/emu): warp width, votes, shuffle variants, async copies, and the GPU rules it
enforces, on small self-test kernels (csrc/emu/selftest_kernels.cuh) in each vendor spelling."""

from __future__ import annotations

import pytest
import torch

import aligned_ops

pytestmark = pytest.mark.emulated
selftest = torch.ops.aligned._emulate_selftest


def expected_warp_row(t: int, warp: int) -> list[int]:
    """What CUDA / HIP document for thread t (block of 128, width-16 shuffles, v = 1000 + t)."""
    lane = t % warp
    seg = lane & ~15
    base = t - lane  # first thread of the warp
    val = lambda src_lane: 1000 + base + src_lane  # noqa: E731
    odd = sum(1 << i for i in range(1, warp, 2))
    ballot = odd if warp == 32 else odd - (1 << 64)  # int64 view of the 64-bit mask
    up = lane - 2 if lane - 2 >= seg else lane
    down = lane + 5 if lane + 5 < seg + 16 else lane
    xor = lane ^ 9 if (lane ^ 9) < seg + 16 else lane
    return [warp, ballot, val(seg + 3), val(up), val(down), val(xor)]


@pytest.mark.parametrize("arch", aligned_ops.emulation.ARCHS)
def test_warp_width_votes_and_shuffles(arch):
    warp = 64 if arch.startswith("gfx") else 32
    with aligned_ops.emulate(arch) as emu:
        out = selftest("warp")
    rows = [out[6 * t: 6 * t + 6] for t in range(128)]
    assert rows == [expected_warp_row(t, warp) for t in range(128)]
    assert emu.launches[0].kernel == "selftest_warp" and emu.launches[0].block == (128, 1, 1)


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_async_copy_lands_at_the_wait(arch):
    with aligned_ops.emulate(arch):
        before, after = selftest("async_copy")[:2]
    assert (before, after) == (-1, 42)  # reading before __pipeline_wait_prior sees the old value


@pytest.mark.parametrize("arch,case,msg", [
    ("sm_90", "exited_lane", r"lanes 0x20 named in the _sync mask 0xffffffff of warp 0 did not arrive"),
    ("gfx942", "exited_lane", r"lane 4 of warp 0 reads lane 5, which is not at this collective"),
    ("sm_100", "barrier_vs_shuffle", r"mask 0xffffffff of warp 2 did not arrive"),
    ("gfx950", "barrier_vs_shuffle", r"lane 1 of warp 1 reads lane 0, which is not at this collective"),
    ("sm_90", "too_many_threads", r"invalid block \(2048,1,1\)"),
])
def test_broken_gpu_rules_fail_the_launch(arch, case, msg):
    with aligned_ops.emulate(arch):
        with pytest.raises(RuntimeError, match=msg):
            selftest(case)
        # the runtime recovers: the next launch on the same fibers is fine
        assert selftest("warp")[0] == (64 if arch.startswith("gfx") else 32)


def test_selftest_needs_an_active_arch():
    with pytest.raises(RuntimeError, match="needs aligned_ops.emulate"):
        selftest("warp")
