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
@pytest.mark.parametrize("rows, H", [(1, 4096), (3, 263), (2049, 40)])
def test_row_kernels_both_block_sizes(arch, rows, H, gen):
    x, w = randn(rows, H, dtype=torch.bfloat16, gen=gen), randn(H, dtype=torch.bfloat16, gen=gen)
    emu = _both(arch, ops.rms_norm, x, w, 1e-6)
    block = emu.launches[0].block[0]
    assert block == (64 if rows < 2048 else 256)
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
