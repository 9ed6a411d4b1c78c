"""The GPU `exact` linear (csrc/gpu/exact_linear_kernels.cuh: int8 mma.sync on CUDA, MFMA i8 on HIP) run under
emulation: bit for bit the CPU backend's linear_exact, at both warp widths and every emulated arch.

The emulation runs the integer matrix instructions with the vendors' fragment layouts (csrc/gpu/int_mma.cuh,
csrc/emu/runtime.cpp); the launch records prove the GPU source ran. All comparisons are on integer views.
Shapes stay small: emulated MMAs are slow and CI runs this suite twice (once under ASan).
"""

from __future__ import annotations

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, count_bitwise_equal

ops = torch.ops.aligned
pytestmark = pytest.mark.emulated

ALL_ARCHS = list(aligned_ops.emulation.ARCHS)
WIDTHS = ["sm_90", "gfx942"]
KERNELS = {"exact_row_forms_kernel", "exact_pack_digits_kernel", "exact_gemm_kernel"}


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(4321)


def randn(*shape, dtype=torch.bfloat16, scale=1.0, gen=None):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def digit_rows(K, dtype, gen):
    """Rows whose canonical forms need 1, 2, 3 and 4 digits, plus the extreme rows of exact_linear.h."""
    base = torch.randint(-100, 100, (K,), generator=gen).float()
    rows = [
        torch.ones(K),                                   # range 0: 1 digit
        base,                                            # small integers: 1 digit
        base * torch.where(torch.arange(K) % 2 == 0, 1.0, 2.0 ** -8),   # 2 digits
        base * torch.where(torch.arange(K) % 3 == 0, 1.0, 2.0 ** -14),  # 3 digits
        base * torch.where(torch.arange(K) % 5 == 0, 1.0, 2.0 ** -24),  # 4 digits, exact
        base * torch.where(torch.arange(K) % 7 == 0, 1e30, 1e-30),      # wider than 4 digits: rounded
        torch.zeros(K),                                  # zero row
        randn(K, dtype=torch.float32, scale=3e4, gen=gen),  # large values (fp16 max 65504)
    ]
    if dtype == torch.float32:
        rows.append(torch.full((K,), 1e-42) * (torch.arange(K) % 3))  # subnormals
        rows.append(torch.full((K,), 3e38) * torch.where(torch.arange(K) % 2 == 0, 1.0, -1.0))  # overflow to inf
    nan_row = randn(K, dtype=torch.float32, gen=gen)
    nan_row[K // 2] = float("nan")
    inf_row = randn(K, dtype=torch.float32, gen=gen)
    inf_row[1] = float("inf")
    rows += [nan_row, inf_row]
    return torch.stack(rows).to(dtype)


def cpu_vs_emulated(arch, *args):
    ref = ops.linear_exact(*args)
    with aligned_ops.emulate(arch) as emu:
        got = ops.linear_exact(*args)
    assert_bitwise_equal(got, ref, f"linear_exact on {arch}")
    assert emu.kernels() == KERNELS, emu.kernels()
    return ref, emu


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_exact_linear_gpu_equals_cpu_odd_shapes(arch, gen):
    """M = 1, 17, 300; K = 100 (not a multiple of the 32-wide k step or the 64-wide packing); N = 24 (1.5 panels)."""
    K, N = 100, 24
    w = randn(N, K, scale=0.02, gen=gen)
    b = randn(N, gen=gen)
    for M in (1, 17, 300):
        x = randn(M, K, gen=gen)
        ref, emu = cpu_vs_emulated(arch, x, w, b if M != 17 else None)
        gemm = [l for l in emu.launches if l.kernel_base == "exact_gemm_kernel"]
        warp = 64 if arch.startswith("gfx") else 32
        assert [(l.grid, l.block) for l in gemm] == [((2, (M + 63) // 64, 1), (4 * warp, 1, 1))]
        torch.testing.assert_close(ref.float(), (x.double() @ w.double().t() + b.double()).float()
                                   if M != 17 else (x.double() @ w.double().t()).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("arch", ALL_ARCHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_exact_linear_gpu_digit_rows_and_extremes(arch, dtype, gen):
    """x and weight rows needing 1-4 digits, wider-than-exact rows, zeros, large values, NaN / inf rows."""
    K = 77
    x = digit_rows(K, dtype, gen)
    w = torch.cat([digit_rows(K, dtype, gen), randn(5, K, dtype=dtype, scale=0.1, gen=gen)])
    ref, _ = cpu_vs_emulated(arch, x, w, None)
    definition = ops._linear_exact_reference(x, w, None)  # the scalar int128 definition (torch's NaN payloads)
    assert torch.equal(ref.isnan(), definition.isnan())
    assert_bitwise_equal(ref[~ref.isnan()], definition[~ref.isnan()])
    # the packed weight bytes are the CPU's (same layout, same digits)
    cpu_packed = ops.linear_exact_pack_weight(w)
    with aligned_ops.emulate(arch):
        gpu_packed = ops.linear_exact_pack_weight(w)
    for c, g in zip(cpu_packed, gpu_packed):
        assert torch.equal(c, g)
    assert cpu_packed[0].shape[0] == 4  # the weight needs every digit


@pytest.mark.parametrize("arch", WIDTHS)
def test_exact_linear_gpu_row_invariance(arch, gen):
    """A row's bits do not depend on the batch, its position or its tile-mates' digit counts."""
    K, N = 70, 20
    w = randn(N, K, scale=0.05, gen=gen)
    x = torch.cat([randn(30, K, gen=gen), digit_rows(K, torch.bfloat16, gen)[:6]])
    wd, we, wb = ops.linear_exact_pack_weight(w)
    perm = torch.randperm(x.shape[0], generator=gen)
    with aligned_ops.emulate(arch):
        full = ops.linear_exact_packed(x, wd, we, wb, N, None, 1)
        shuffled = ops.linear_exact_packed(x[perm], wd, we, wb, N, None, 1)
        singles = [ops.linear_exact_packed(x[i:i + 1], wd, we, wb, N, None, 1) for i in (0, 17, 35)]
        split_k = ops.linear_exact_packed(x, wd, we, wb, N, None, 3)  # k per int32 level sum: 32 instead of 128
    assert_bitwise_equal(shuffled, full[perm])
    for i, s in zip((0, 17, 35), singles):
        assert_bitwise_equal(s[0], full[i])
    assert_bitwise_equal(split_k, full)
    assert_bitwise_equal(full, ops.linear_exact_packed(x, wd, we, wb, N, None, 1))  # == CPU


@pytest.mark.parametrize("arch", WIDTHS)
def test_exact_linear_gpu_bad_input_is_the_glue_check(arch, gen):
    w = randn(8, 40, gen=gen)
    packed = ops.linear_exact_pack_weight(w)
    for fn, msg in [
        (lambda: ops.linear_exact_packed(randn(3, 41, gen=gen), *packed, 8, None, 1), r"aligned::linear_exact_packed"),
        (lambda: ops.linear_exact(randn(3, 40, gen=gen), w.float(), None), r"aligned::linear_exact: weight dtype"),
    ]:
        with pytest.raises(RuntimeError, match=msg) as cpu_err:
            fn()
        with aligned_ops.emulate(arch) as emu:
            with pytest.raises(RuntimeError, match=msg) as emu_err:
                fn()
        assert str(emu_err.value).splitlines()[0] == str(cpu_err.value).splitlines()[0]
        assert emu.launches == []


@pytest.mark.parametrize("arch", WIDTHS)
def test_negative_control_wrong_fragment_layout(arch, gen):
    """The comparison sees a matrix-instruction model with a wrong fragment layout (a plausible kernel bug)."""
    x, w = randn(17, 100, gen=gen), randn(24, 100, scale=0.02, gen=gen)
    ref = ops.linear_exact(x, w, None)
    with aligned_ops.emulate(arch, _fault="matrix_layout"):
        bad = ops.linear_exact(x, w, None)
    assert count_bitwise_equal(bad, ref) < ref.numel() // 2
