"""The GPU `exact` linear (csrc/gpu/exact_linear_kernels.cuh: int8 mma.sync on CUDA sm_80+, MFMA i8 on ROCm
gfx942 / gfx950) on a real GPU: bitwise equal to the CPU backend (the sum is an exact integer, rounded once by
the same exact_linear.h helpers), batch-invariant, the packed weight byte-identical to the CPU's.

Skipped without a GPU (CI has none; the same source runs under emulation in tests/emulated). NaN outputs are
compared as "both NaN" (payloads are the hardware's).
"""

from __future__ import annotations

import pytest
import torch

import aligned_ops  # noqa: F401  (registers torch.ops.aligned)
from aligned_ops.testing import assert_bitwise_equal

ops = torch.ops.aligned
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) GPU")


def _same(gpu, cpu):
    gpu = gpu.cpu()
    assert torch.equal(gpu.isnan(), cpu.isnan())
    assert_bitwise_equal(gpu[~gpu.isnan()], cpu[~cpu.isnan()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M,K,N", [(1, 100, 24), (17, 1536, 40), (300, 77, 130), (64, 4864, 96)])
def test_gpu_equals_cpu(dtype, M, K, N):
    g = torch.Generator().manual_seed(M * K + N)
    x = torch.randn(M, K, generator=g).to(dtype)
    x[0, :4] *= 1e3  # an outlier row: 4 digits
    w = (torch.randn(N, K, generator=g) * 0.02).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    ref = ops.linear_exact(x, w, b)
    _same(ops.linear_exact(x.cuda(), w.cuda(), b.cuda()), ref)
    cpu_packed = ops.linear_exact_pack_weight(w)
    gpu_packed = ops.linear_exact_pack_weight(w.cuda())
    for c, d in zip(cpu_packed, gpu_packed):
        assert torch.equal(c, d.cpu())
    _same(ops.linear_exact_packed(x.cuda(), *gpu_packed, N, b.cuda(), 5), ref)  # k_parts: same bits


def test_gpu_batch_invariance_and_extremes():
    g = torch.Generator().manual_seed(7)
    K, N = 300, 50
    x = torch.randn(257, K, generator=g).bfloat16()
    x[3] = 0
    x[5, 7] = float("nan")
    x[9, ::3] *= 2.0 ** -40
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16().cuda()
    packed = ops.linear_exact_pack_weight(w)
    full = ops.linear_exact_packed(x.cuda(), *packed, N, None, 1).cpu()
    for m in (1, 2, 16, 17, 100):
        part = ops.linear_exact_packed(x[:m].cuda(), *packed, N, None, 1).cpu()
        _same(part, full[:m])
    _same(full, ops.linear_exact(x, w.cpu(), None))
