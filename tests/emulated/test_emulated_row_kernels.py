"""The latency fixes of the row and column kernels (csrc/gpu/dense_kernels.cuh) keep every bit.

Row kernels: a lane's chain loads kPrefetch elements ahead of its in-order adds, and batches under
kSmallBatchRows rows run 2-group blocks (8-group blocks above). Column chains (rms_norm dW, linear's bias
gradient): 32 columns per block, 7 warps stage 64-row tiles of terms in shared memory one tile ahead while
warp 0 runs the per-column chains in row order. Shapes here cross every boundary: tails of the prefetch
loop, several tiles with a partial last one, column counts not a multiple of 32, both block sizes. The
negative control drops the barriers: the double buffer then reads unwritten tiles.
"""

from __future__ import annotations

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, count_bitwise_equal

ops = torch.ops.aligned
pytestmark = pytest.mark.emulated
WIDTHS = ["sm_90", "gfx942"]


def randn(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(99)


def _both(arch, op, *args):
    ref = op(*args)
    with aligned_ops.emulate(arch) as emu:
        got = op(*args)
    for r, g in zip(ref if isinstance(ref, (tuple, list)) else [ref], got if isinstance(got, (tuple, list)) else [got]):
        if isinstance(r, torch.Tensor):
            assert_bitwise_equal(g, r)
    return emu


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, cols", [(1, 1), (63, 33), (64, 32), (65, 70), (200, 97)])
def test_column_chains_multi_tile(arch, dtype, rows, cols, gen):
    x, g, w = randn(rows, cols, dtype=dtype, gen=gen), randn(rows, cols, dtype=dtype, gen=gen), randn(cols, dtype=dtype, gen=gen)
    emu = _both(arch, ops.rms_norm_backward, g, x, w, 1e-6)
    assert "rms_norm_backward_dw_kernel" in emu.kernels()
    wt = randn(cols, 5, dtype=dtype, gen=gen)
    # dx [rows, 5] = g @ wt, dw [cols, 5], db [cols] = column chains of g
    emu = _both(arch, ops.linear_backward, g, randn(rows, 5, dtype=dtype, gen=gen), wt, True, True, True)
    assert "column_sum_kernel" in emu.kernels()
    col = [l for l in emu.launches if l.kernel.startswith("column_sum_kernel")][0]
    assert col.block == (256, 1, 1) and col.grid == ((cols + 31) // 32, 1, 1)


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("rows, H", [(1, 4096), (3, 263), (2049, 40), (5, 2048 + 77)])
def test_row_kernels_both_block_sizes(arch, rows, H, gen):
    x, w = randn(rows, H, dtype=torch.bfloat16, gen=gen), randn(H, dtype=torch.bfloat16, gen=gen)
    emu = _both(arch, ops.rms_norm, x, w, 1e-6)
    launch = emu.launches[0]
    if rows < 1024 and H >= 2048:  # dense_launch.cuh use_wide_rows: one block per row
        assert launch.kernel_base == "rms_norm_wide_kernel" and launch.block[0] == 256 and launch.grid[0] == rows
    else:
        assert launch.kernel_base == "rms_norm_kernel" and launch.block[0] == (64 if rows < 2048 else 256)
    _both(arch, ops.fused_add_rms_norm, x, x.flip(0), w, 1e-6)
    z = randn(rows if rows < 100 else 7, 2 * H + 301, gen=gen)
    _both(arch, ops.log_softmax, z, 0.7, None)
    _both(arch, ops.token_logprobs, z, torch.arange(z.shape[0]) % z.shape[1], 1.0, None)


@pytest.mark.parametrize("arch", WIDTHS)
def test_negative_control_column_chain_without_barriers(arch, gen):
    args = (randn(200, 70, gen=gen), randn(200, 5, gen=gen), randn(70, 5, gen=gen), False, False, True)
    ref = ops.linear_backward(*args)[2]
    with aligned_ops.emulate(arch, _fault="barrier_noop"):
        bad = ops.linear_backward(*args)[2]
    assert count_bitwise_equal(bad, ref) < ref.numel()


# ---- wide rows (one block per row, dense_kernels.cuh): the same bits as the one-group kernel -------------------

WIDE_H = 2048 + 4096 + 77  # three chunks of terms, the last partial; rows not 16-byte aligned in bf16


def _narrow_batch(x_rows: torch.Tensor, n: int = 1100) -> torch.Tensor:
    """x_rows at the top of a batch of n rows (n >= 1024: the launcher picks the one-group-per-row kernel)."""
    pad = x_rows[-1:].expand(n - x_rows.shape[0], *x_rows.shape[1:])
    return torch.cat([x_rows, pad])


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_rows_equal_the_one_group_kernel_and_cpu(arch, dtype, gen):
    x = randn(3, WIDE_H, dtype=dtype, gen=gen) * 3
    x[1, 5] = 1e-30  # a subnormal square
    w = randn(WIDE_H, dtype=dtype, gen=gen)
    res = randn(3, WIDE_H, dtype=dtype, gen=gen)
    ids = torch.tensor([0, WIDE_H - 1, 77])
    cases = [
        ("rms_norm_wide_kernel", "rms_norm_kernel", lambda a: ops.rms_norm(a, w, 1e-6)),
        ("rms_norm_wide_kernel", "fused_add_rms_norm_kernel",
         lambda a: ops.fused_add_rms_norm(a, torch.cat([res, res[-1:].expand(a.shape[0] - 3, -1)]), w, 1e-6)),
        ("logits_wide_kernel", "logits_row_kernel", lambda a: ops.log_softmax(a, 0.7, None)),
        ("logits_wide_kernel", "logits_row_kernel", lambda a: ops.logsumexp(a, 1.0, None)),
        ("logits_wide_kernel", "logits_row_kernel",
         lambda a: ops.token_logprobs(a, torch.cat([ids, ids[-1:].expand(a.shape[0] - 3)]), 1.0, None)),
        ("logits_wide_kernel", "logits_row_kernel",
         lambda a: ops.token_logprobs_backward(torch.ones(a.shape[0]), a, torch.cat([ids, ids[-1:].expand(a.shape[0] - 3)]),
                                               0.9, None)),
        ("logits_wide_kernel", "logits_row_kernel",
         lambda a: ops.log_softmax_backward(torch.ones(a.shape[0], WIDE_H) * 0.5, a, 1.0, None)
         if hasattr(ops, "log_softmax_backward") else ops.logsumexp(a, 1.0, None)),
    ]
    for wide_kernel, narrow_kernel, fn in cases:
        ref = fn(x)  # CPU backend
        with aligned_ops.emulate(arch) as emu_wide:
            wide = fn(x)
        with aligned_ops.emulate(arch) as emu_narrow:
            narrow = fn(_narrow_batch(x))
        assert wide_kernel in emu_wide.kernels() and narrow_kernel in emu_narrow.kernels()
        for r, a, b in zip(ref if isinstance(ref, tuple) else [ref], wide if isinstance(wide, tuple) else [wide],
                           narrow if isinstance(narrow, tuple) else [narrow]):
            assert_bitwise_equal(a, r)  # wide == CPU
            assert_bitwise_equal(b[:3], a)  # wide == the one-group kernel, row by row


@pytest.mark.parametrize("arch", WIDTHS)
def test_wide_rows_special_rows(arch):
    inf, nan = float("inf"), float("nan")
    z = torch.randn(5, WIDE_H)
    z[1, 3000] = nan
    z[2, 100] = inf
    z[3] = -inf
    z[4, :] = -3e38
    z[4, 4000] = 5.0
    for fn in (lambda a: ops.log_softmax(a, 1.0, None), lambda a: ops.logsumexp(a, 0.5, None)):
        _both(arch, fn, z)


@pytest.mark.parametrize("arch", WIDTHS)
def test_negative_control_wide_rows_without_barriers(arch, gen):
    """Without its barriers the consumer adds chunks the producers have not written: wrong bits, or (when a warp's
    lanes drift apart between the producer and consumer roles) a broken collective — either way not the CPU's."""
    z = randn(2, WIDE_H, gen=gen)
    ref = ops.log_softmax(z, 1.0, None)
    with aligned_ops.emulate(arch, _fault="barrier_noop"):
        try:
            bad = ops.log_softmax(z, 1.0, None)
        except RuntimeError as e:
            assert "logits_wide_kernel" in str(e)
            return
    assert count_bitwise_equal(bad, ref) < ref.numel()
