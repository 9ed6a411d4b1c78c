"""Realistic shapes on the GPU (tests/cuda/realistic_cases.py): the Qwen vocabulary, decode-size linears,
sliced / non-contiguous logits, activations and q — CPU backend == CUDA/ROCm build, bit for bit. Skipped without a
GPU; the same cases run under the emulator in tests/emulated/test_emulated_realistic.py."""

from __future__ import annotations

import pytest
import torch

from aligned_ops.testing import assert_bitwise_equal
from realistic_cases import CASES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) GPU")


def cpu_vs_cuda(op, *args):
    ref = op(*args)
    got = op(*[a.cuda() if isinstance(a, torch.Tensor) and a.is_floating_point() or
               (isinstance(a, torch.Tensor) and a.dtype == torch.int64) else a for a in args])
    torch.cuda.synchronize()
    for i, (r, g) in enumerate(zip(ref if isinstance(ref, (tuple, list)) else [ref],
                                   got if isinstance(got, (tuple, list)) else [got])):
        assert_bitwise_equal(g.cpu(), r, f"{op} [{i}]")
    return ref


@pytest.mark.parametrize("case", sorted(CASES))
def test_realistic_shapes_gpu_equals_cpu(case):
    CASES[case](cpu_vs_cuda, "full")
