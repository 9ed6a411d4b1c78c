"""The `mma` profile on an AMX CPU: the unit is AMX-BF16 tdpbf16ps (csrc/cpu/gemm_amx_mma_kernels.cpp, mma.h).

The instruction's internal order over its 32 products has no model, so the kernel is held to the instruction
itself, used the plainest way: one element per instruction on 1 x 1 tiles, the activation row and the weight
column in the other operand roles, each block copied into zero-padded buffers (``_linear_mma_reference`` on this
unit). Bits compared through integer views, NaN positions only (the unit's NaN payloads are its own).

- kernel == that reference: every tile path of the kernel (row tails 1..47 and several row groups, column tails,
  lanes that end in a partial block and lanes of whole blocks, K < 8, K = 1), lanes 1, 2, 4, 8, random and
  adversarial values (subnormals, overflow, inf, NaN, signed zeros), weights read in place with an odd row stride
  and a base that is not 4-byte aligned;
- a lane's partial last block is padded with +0 weights, not read on into the next lane (an inf there would make
  inf * 0 = NaN);
- the unit is not vdpbf16ps: its bits differ from mma.h's vdpbf16ps model (the control that the AMX unit runs);
- the vdpbf16ps model tests of test_linear_mma.py pass under ALIGNED_CPU_ISA=avx512 on this CPU (that level's
  unit), and that unit's bits differ from this one's.
The invariance, TP, backward, MoE, compile and opcheck tests of test_linear_mma.py run on this unit as they are.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal

sys.path.insert(0, os.path.dirname(__file__))
from test_linear_mma import adversarial, numpy_model, rand, same_bits_nan_aware  # noqa: E402

ops = torch.ops.aligned
BF = torch.bfloat16
pytestmark = pytest.mark.skipif(aligned_ops.mma_unit() != "amx_bf16",
                                reason=f"the AMX unit; this process's mma unit is {aligned_ops.mma_unit()}")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_amx_level_runs_the_amx_unit():
    assert ops._cpu_isa() == "amx"
    assert aligned_ops.mma_unit() == "amx_bf16"


# Row counts: one row group (1, 15, 16), two blocks (17, 31, 32), a tail block past two (33, 47), several groups
# (100, 259). Columns: N % 16 and N % 32 tails, one block. K: lanes of whole 32-blocks (256: 32 each; 4864: 608 =
# 19 blocks), lanes ending in a partial block (896, 203, 77), K < 8 (empty lanes), K = 1.
AMX_SHAPES = [(1, 896, 40), (15, 203, 17), (16, 256, 32), (17, 77, 33), (31, 4864, 20), (32, 5, 48), (33, 1, 16),
              (47, 130, 31), (100, 320, 70), (259, 64, 9)]


@pytest.mark.parametrize("M,K,N", AMX_SHAPES)
def test_kernel_equals_the_instruction_one_element_at_a_time(M, K, N):
    x, w = rand(M, K, seed=M + K), rand(N, K, seed=N, scale=0.05)
    xa, wa = adversarial(M, K, N, seed=M * 7 + N)
    for xx, ww in ((x, w), (xa, wa)):
        for lanes in (1, 2, 4, 8):
            ref = ops._linear_mma_reference(xx, ww, lanes)
            assert same_bits_nan_aware(ops.linear_mma_partial(xx, ww, lanes), ref), (M, K, N, lanes)
    b = rand(N, seed=9)
    ref = ops._linear_mma_reference(x, w, 8)
    assert_bitwise_equal(ops.linear_mma(x, w, b), (ref + b.float()).to(BF))
    assert_bitwise_equal(ops.linear_mma(x, w), ref.to(BF))


def test_weight_read_in_place_with_odd_stride_and_misaligned_base():
    """The kernel loads weight tiles straight from the weight's rows (row stride K + 3 elements, the first
    element 2 bytes past a 4-byte boundary): the same bits as a contiguous copy and as the reference."""
    M, K, N = 37, 203, 45
    x = rand(M, K, seed=1)
    big = rand(N, K + 3, seed=2, scale=0.05)
    w = big[:, 1:K + 1]
    assert w.stride() == (K + 3, 1) and w.data_ptr() % 4 == 2
    got = ops.linear_mma(x, w)
    assert_bitwise_equal(got, ops.linear_mma(x, w.contiguous()))
    assert_bitwise_equal(got, ops._linear_mma_reference(x, w.contiguous(), 8).to(BF))


@pytest.mark.parametrize("K", [203, 896])
def test_a_partial_block_is_padded_with_zeros_not_the_next_lane(K):
    """Lane l's last block is partial; the next lane starts with an inf weight. The contract pads lane l with
    +0 weights: the row's result is +-inf (the inf times a nonzero x). A kernel that read on into the next lane
    would add inf * 0 = NaN to lane l."""
    x = torch.ones(3, K, dtype=BF)
    w = rand(16, K, seed=3, scale=0.05)
    starts = [l * K // 8 for l in range(8)]
    assert any((starts[l + 1] - starts[l]) % 32 for l in range(7))  # the shape has partial blocks
    for l in range(1, 8):
        w[l, starts[l]] = float("inf")
    out = ops.linear_mma_partial(x, w, 8)
    assert torch.isinf(out[:, 1:8]).all() and not torch.isnan(out).any(), out[:, :8]
    assert same_bits_nan_aware(out, ops._linear_mma_reference(x, w, 8))


def test_the_amx_bits_are_not_the_vdpbf16ps_model():
    """The control that the AMX unit runs (and that the reference comparisons above can fail): on adversarial
    inputs the kernel and its reference differ from mma.h's vdpbf16ps model."""
    x, w = adversarial(32, 64, 24, seed=5)
    kern = ops.linear_mma_partial(x, w, 8)
    assert same_bits_nan_aware(kern, ops._linear_mma_reference(x, w, 8))
    assert not same_bits_nan_aware(numpy_model(x, w, 8), kern)


_AVX512_UNIT = r"""
import sys, torch, aligned_ops
assert aligned_ops.mma_unit() == "avx512_bf16", aligned_ops.mma_unit()
x, w = torch.load(sys.argv[1])
torch.save(torch.ops.aligned.linear_mma_partial(x, w, 8), sys.argv[2])
"""


@pytest.mark.slow
def test_the_avx512_level_on_this_cpu_runs_vdpbf16ps(tmp_path):
    """ALIGNED_CPU_ISA=avx512 on an AMX CPU selects the vdpbf16ps unit (the bits every avx512_bf16 CPU shares):
    test_linear_mma.py's model tests pass there, and that unit's bits differ from this process's."""
    env = dict(os.environ, ALIGNED_CPU_ISA="avx512")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                          os.path.join(ROOT, "tests", "ops", "test_linear_mma.py"), "-k",
                          "numpy_model or other_order_and_no_flush"],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout, res.stdout[-1000:]
    x, w = adversarial(16, 96, 20, seed=6)
    torch.save((x, w), tmp_path / "in.pt")
    res = subprocess.run([sys.executable, "-c", _AVX512_UNIT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    avx512 = torch.load(tmp_path / "out.pt")
    assert same_bits_nan_aware(avx512, numpy_model(x, w, 8))
    assert not same_bits_nan_aware(avx512, ops.linear_mma_partial(x, w, 8))
