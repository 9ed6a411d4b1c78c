"""The decode GEMM (csrc/gpu/gemm_fp32.cuh gemm_small_m_kernel: M <= 16 rows, 16-byte loads, the 8-lane tree in the
same kernel) computes the `fma` profile's bits: equal to the CPU backend and to the tiled kernel it replaces at
small M (the same rows computed inside a batch of 17+ rows, which the launcher sends to the tiled kernel), at both
warp widths. Shapes cross every path: aligned vectors, unaligned heads and tails of each lane (K not a multiple of
8 x 8), strided / misaligned x (element loads), K < 8 (empty lanes), N not a multiple of the block's 16 columns,
a chain that ends in -0."""

from __future__ import annotations

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, bits

ops = torch.ops.aligned
pytestmark = pytest.mark.emulated
WIDTHS = ["sm_90", "gfx942"]


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def run(arch, fn):
    with aligned_ops.emulate(arch) as emu:
        out = fn()
    return out, emu.kernels()


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 37, 1024), (2, 16, 4103), (3, 40, 517), (5, 9, 96), (9, 33, 200), (16, 17, 64),
                                   (1, 5, 3), (4, 20, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_small_m_equals_cpu_and_the_tiled_kernel(arch, dtype, M, N, K, bias):
    x = randn(M, K, dtype=dtype, seed=M * 7 + K)
    w = randn(N, K, dtype=dtype, scale=0.1, seed=N)
    b = randn(N, dtype=dtype, seed=3) if bias else None
    ref = ops.linear(x, w, b)  # CPU backend
    small, kernels = run(arch, lambda: ops.linear(x, w, b))
    assert "gemm_small_m_kernel" in kernels and "gemm_fp32_kernel" not in kernels
    assert_bitwise_equal(small, ref)
    # the previous kernel: the same rows at the top of a 17-row batch go through the 128-row tiles + lane fold
    batch = torch.cat([x, randn(17, K, dtype=dtype, seed=99)])
    tiled, kernels = run(arch, lambda: ops.linear(batch, w, b))
    assert "gemm_fp32_kernel" in kernels and "gemm_small_m_kernel" not in kernels
    assert_bitwise_equal(tiled[:M], small)


@pytest.mark.parametrize("arch", WIDTHS)
def test_small_m_strided_and_misaligned_inputs(arch):
    K = 1000
    base = randn(3, K + 9, dtype=torch.bfloat16, seed=1)
    w_base = randn(41, K + 1, dtype=torch.bfloat16, scale=0.1, seed=2)
    for x in (base[:, 9:], base[:, :K], base[:, 1:K + 1]):  # aligned / misaligned column windows (row stride K + 9)
        for w in (w_base[:, :K], w_base[:, 1:]):
            ref = ops.linear(x, w, None)
            got, kernels = run(arch, lambda: ops.linear(x, w, None))
            assert "gemm_small_m_kernel" in kernels
            assert_bitwise_equal(got, ref)
    wt = randn(K, 41, dtype=torch.bfloat16, seed=5).t()  # W with strides (1, 41): element loads
    ref = ops.linear(base[:, :K], wt, None)
    got, _ = run(arch, lambda: ops.linear(base[:, :K], wt, None))
    assert_bitwise_equal(got, ref)


@pytest.mark.parametrize("arch", WIDTHS)
def test_small_m_signed_zero_chain(arch):
    x = torch.full((1, 72), -1e-30)
    w = torch.full((3, 72), 1e-30)
    got, _ = run(arch, lambda: ops.linear(x, w, None))
    assert_bitwise_equal(got, ops.linear(x, w, None))
    assert torch.signbit(got).all() and (got == 0).all()


@pytest.mark.parametrize("arch", WIDTHS)
def test_small_m_negative_control_lane_tree(arch):
    """The comparison can fail: a 1-lane chain (another tree, not the contract's) differs from the small-M result."""
    x = randn(2, 4096, seed=4)
    w = randn(64, 4096, scale=0.1, seed=6)
    got, _ = run(arch, lambda: ops.linear(x, w, None))
    one_chain = ops.linear_partial(x, w, 1)  # a single fma chain over all of K (fp32, unrounded)
    assert not torch.equal(got.view(torch.int32), one_chain.view(torch.int32))
    assert_bitwise_equal(got, ops.linear_partial(x, w, 8))  # ... while the 8-lane tree is the same bits


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token", [0, 1], ids=["nan-of-the-sum", "nan-of-the-input"])
def test_which_nan_a_linear_writes_is_not_contracted_but_log_probs_are_canonical(arch, dtype, token):
    """Where a NaN input meets inf - inf (row 1: x[1, 5] NaN, the other products of column 0 overflow to +-inf), IEEE
    leaves which NaN comes out to the hardware's operand order: in an optimised build the CPU kernel and the emulated
    tiled kernel returned the default NaN (sign set), the emulated small-M kernel the input's — so a linear's NaN
    sign depended on M (and on the build: ASan's small-M kernel returned the default NaN too). The
    contract (README "NaN policy", contract.h) promises that such an output IS NaN, not which; the log-prob ops write
    the canonical NaN 0x7fc00000, so the log-probs (what the contract is about) are bitwise the same for every M —
    also of the token whose logit is that NaN (fp32 logits: its log-prob was the logit's own NaN, M-dependent)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 300, generator=g).to(dtype)
    x[0, :] = torch.finfo(dtype).max
    # a negative NaN with a payload, written as bits (torch's float -> bf16 conversion would write 0x7fc0)
    nan_in = 0xFFC12300 - (1 << 32) if dtype == torch.float32 else 0xFFC1 - (1 << 16)
    x.view(torch.int32 if dtype == torch.float32 else torch.int16)[1, 5] = nan_in
    w = torch.randn(9, 300, generator=g).to(dtype)
    w[0, :] = torch.finfo(dtype).max
    ids = torch.full((20,), token)  # row 1's column 0 is the NaN whose sign varies with M; column 1 the input's
    outs = {}
    for M in (2, 17):
        with aligned_ops.emulate(arch):
            y = ops.linear(x[:M], w)
            outs[M] = (y[:2], aligned_ops.token_logprobs(y, ids[:M])[:2],
                       aligned_ops.fused_token_logprobs(x[:M], w, ids[:M])[:2])
    # the linear outputs of row 1 are NaN; WHICH NaN (the input's, or the default NaN of the host's inf - inf:
    # x86 0xffc00000) depends on the kernel and on the build (an optimised build's small-M kernel returned the
    # input's here, the ASan build's the default): not contracted, so not asserted. What the test needs is that some
    # of them are not the canonical NaN, so the log-probs' canonical NaN is made by the log-prob ops, not inherited
    canonical = torch.full((2,), float("nan"))  # 0x7fc00000
    assert bits(canonical)[0] == 0x7FC00000
    linear_nans = torch.cat([outs[M][0][1].float() for M in (2, 17)])
    assert torch.isnan(linear_nans).all()
    assert (bits(linear_nans) != bits(canonical)[0]).any()
    cpu = ops.linear(x[:2], w)
    for M in (2, 17):
        for lp in outs[M][1:]:
            assert_bitwise_equal(lp, canonical)
    assert_bitwise_equal(aligned_ops.token_logprobs(cpu, ids[:2]), canonical)
    assert_bitwise_equal(aligned_ops.fused_token_logprobs(x[:2], w, ids[:2]), canonical)
