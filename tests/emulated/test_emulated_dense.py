"""The GPU kernel source (csrc/gpu) run under emulation: bitwise equal to the CPU backend, at both warp widths.

``aligned_ops.emulate(arch)`` routes the ops on CPU tensors through the GPU glue and the csrc/gpu kernels
compiled for the host (csrc/emu): sm_90 / sm_100 run the CUDA spelling of compat.cuh with 32-lane warps,
gfx942 / gfx950 the HIP spelling with 64-lane waves (two 32-lane reduction groups per wave). The launch
records prove which kernels ran. Every comparison is on integer views (aligned_ops.testing); the negative
controls prove the comparison fails when the emulated kernels do not compute what the GPU contract says.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, count_bitwise_equal

ops = torch.ops.aligned
pytestmark = pytest.mark.emulated

ROOT = pathlib.Path(__file__).resolve().parents[2]
WIDTHS = ["sm_90", "gfx942"]  # warp 32 (CUDA spelling) and wave64 (HIP spelling)
ALL_ARCHS = list(aligned_ops.emulation.ARCHS)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def randn(*shape, dtype=torch.float32, scale=1.0, gen=None):
    return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(dtype)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def _flat(out):
    return [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]


def cpu_vs_emulated(arch, op, *args, kernels=None):
    """op on the CPU backend and under emulate(arch); asserts equal bits; returns (cpu result, Emulation)."""
    ref = op(*args)
    with aligned_ops.emulate(arch) as emu:
        got = op(*args)
    for i, (r, g) in enumerate(zip(_flat(ref), _flat(got))):
        assert_bitwise_equal(g, r, f"{op} on {arch} [{i}]")
    if kernels is not None:
        assert emu.kernels() == set(kernels), (emu.kernels(), kernels)
    return ref, emu


# ---- every kernel of csrc/gpu runs, at every arch ----------------------------------------------------------


def gpu_kernel_names() -> set[str]:
    """Names of every __global__ function in csrc/gpu (what the coverage test must see launched)."""
    names = set()
    for p in (ROOT / "csrc/gpu").glob("*.cuh"):
        code = re.sub(r"//[^\n]*", "", p.read_text())
        names |= set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(", code))
    return names


def run_every_op(gen):
    x = randn(5, 97, gen=gen)
    w = randn(97, gen=gen)
    ops.rms_norm(x, w, 1e-6)
    ops.fused_add_rms_norm(x, x.flip(0), w, 1e-6)
    ops.rms_norm_backward(x.flip(1), x, w, 1e-6)
    ops.silu_and_mul(x[:, :96])
    ops.silu_and_mul_backward(x[:, :48], x[:, :96])
    cache = aligned_ops.rotary_cos_sin_cache(32, 64)
    pos = torch.tensor([0, 5, 63])
    xr = randn(3, 2, 48, gen=gen)
    ops.rotary_embedding(pos, xr, cache, 32, True)
    ops.rotary_embedding_backward(pos, xr, cache, 32, False)
    ids = torch.tensor([0, 96, 3, 50, 7])
    ops.logsumexp(x, 1.0, None)
    ops.log_softmax(x, 0.7, None)
    ops.token_logprobs(x, ids, 1.0, None)
    ops.token_logprobs_backward(torch.ones(5), x, ids, 1.0, None)
    ops.linear(x, randn(11, 97, gen=gen), randn(11, gen=gen))  # M = 5: gemm_small_m_kernel
    ops.linear(randn(20, 97, gen=gen), randn(11, 97, gen=gen), None)  # M = 20: the tiled kernel + lane_fold_kernel
    ops.linear_backward(randn(5, 11, gen=gen), x, randn(11, 97, gen=gen), True, True, True)
    ops._exp_f32(x)
    ops._log_f32(x.abs())
    # long rows in a small batch: one block per row (dense_kernels.cuh "wide rows")
    xw = randn(2, 2100, gen=gen)
    ops.rms_norm(xw, randn(2100, gen=gen), 1e-6)
    ops.log_softmax(xw, 1.0, None)
    # attention (tests/emulated/test_emulated_attention.py has the invariance matrix)
    qa, ka = randn(5, 2, 8, gen=gen), randn(5, 1, 8, gen=gen)
    cu5 = torch.tensor([0, 5], dtype=torch.int32)
    oa, la = ops.attention_varlen(qa, ka, ka.flip(0), cu5, cu5, 0.3, True)
    ops.attention_varlen_backward(qa.flip(0), qa, ka, ka.flip(0), oa, la, cu5, cu5, 0.3, True)
    kc, vc = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    ops.reshape_and_cache(ka, ka.flip(0), kc, vc, torch.tensor([4, 5, 6, 7, 0]))
    ops.paged_attention(qa[:1], kc, vc, torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
                        torch.tensor([0, 1], dtype=torch.int32), 0.3)
    ops.linear_exact(x.bfloat16(), randn(11, 97, dtype=torch.bfloat16, gen=gen), None)  # int8 MMA / MFMA kernels
    wb = randn(11, 97, dtype=torch.bfloat16, gen=gen)  # the mma linear's bf16 MMA / MFMA kernels:
    ops.linear_mma(x.bfloat16(), wb, None)  # M = 5: mma_linear_lanes_kernel (the 8 lanes over 8 warps)
    ops.linear_mma(randn(20, 97, dtype=torch.bfloat16, gen=gen), wb, None)  # M = 20: mma_linear_rows_kernel
    ops.linear_mma(randn(65, 97, dtype=torch.bfloat16, gen=gen), wb, None)  # M = 65: mma_linear_tiled_kernel
    # attention under the mma profile: forward split kernel, dq and dk/dv kernels (test_emulated_attention_mma.py)
    qb, kb = qa.bfloat16(), ka.bfloat16()
    ob, lb = ops.attention_varlen(qb, kb, kb.flip(0), cu5, cu5, 0.3, True, "mma")
    ops.attention_varlen_backward(qb.flip(0), qb, kb, kb.flip(0), ob, lb, cu5, cu5, 0.3, True, None, "mma")
    # MoE: routing (softmax and grouped sigmoid) with their backwards, and the experts under both profiles
    # (plan, gather, grouped fma / mma GEMM, combine; test_emulated_moe.py has the invariance matrix)
    logits = randn(5, 8, gen=gen)
    tw, ti, sc = ops.moe_routing(logits, 2, "softmax", True)
    ops.moe_routing_backward(torch.ones_like(tw), None, logits, ti, "softmax", True)
    gw, gi, gs = ops.moe_grouped_routing(logits, torch.zeros(8), 2, 1, 1, True, 1.0)
    ops.moe_grouped_routing_backward(torch.ones_like(gw), None, logits, gi, True, 1.0)
    xm = randn(5, 32, dtype=torch.bfloat16, gen=gen)
    w13, w2 = randn(8, 32, 32, dtype=torch.bfloat16, gen=gen), randn(8, 32, 16, dtype=torch.bfloat16, gen=gen)
    ops.moe_experts(xm, tw, ti, w13, w2, None, None, None, "fma")
    ops.moe_experts(xm, tw, ti, w13, w2, None, None, None, "mma")


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_every_gpu_kernel_runs_under_emulation(arch, gen):
    kernels = gpu_kernel_names()
    assert {"rms_norm_kernel", "logits_row_kernel", "gemm_fp32_kernel"} <= kernels  # the scan finds kernels
    with aligned_ops.emulate(arch) as emu:
        run_every_op(gen)
    assert emu.launches and all(launch.arch == arch for launch in emu.launches)
    missing = kernels - emu.kernels()
    assert not missing, f"GPU kernels in csrc/gpu that no op launched under emulation: {sorted(missing)}"
    assert emu.warp_size == (64 if arch.startswith("gfx") else 32)


def test_launch_records_name_grid_block_and_shared(gen):
    x = randn(17, 40, gen=gen)
    with aligned_ops.emulate("gfx942") as emu:
        ops.rms_norm(x, torch.ones(40, dtype=torch.bfloat16).float(), 1e-6)
        ops.linear(randn(130, 9, gen=gen), randn(257, 9, gen=gen), None)
    assert [(l.kernel, l.grid, l.block, l.shared_bytes) for l in emu.launches] == [
        ("rms_norm_kernel<float, float>", (9, 1, 1), (64, 1, 1), 0),  # small batch: 2 rows per block
        # 128 x 128 tiles, one grid z per lane of the fma profile's 8-lane tree (fp32 workspace) ...
        ("gemm_fp32_kernel<float, float, float>", (3, 2, 8), (256, 1, 1), 0),
        ("lane_fold_kernel<float>", (131, 1, 1), (256, 1, 1), 0),  # ... then the tree + bias + rounding
    ]
    # outside the scope nothing is recorded and the CPU backend runs
    with aligned_ops.emulate("sm_90") as idle:
        pass
    ops.rms_norm(x, torch.ones(40), 1e-6)
    assert idle.launches == []


def test_scopes_nest_and_restore(gen):
    x = randn(3, 33, gen=gen)
    with aligned_ops.emulate("sm_90") as outer:
        ops.rms_norm(x, torch.ones(33), 1e-6)
        with aligned_ops.emulate("gfx950") as inner:
            ops.silu_and_mul(x[:, :32])
        ops.logsumexp(x, 1.0, None)
    assert [l.arch for l in inner.launches] == ["gfx950"]
    assert [(l.kernel_base, l.arch) for l in outer.launches] == [
        ("rms_norm_kernel", "sm_90"), ("silu_and_mul_kernel", "gfx950"), ("logits_row_kernel", "sm_90")]


def test_bad_arch_is_refused():
    with pytest.raises(ValueError, match="arch must be one of sm_80, sm_90, sm_100, sm_120, gfx942, gfx950"):
        aligned_ops.emulate("sm_75")
    with pytest.raises(RuntimeError, match="arch must be one of"):
        ops._emulate_enter("gfx90a", 0)


# ---- GPU source == CPU backend, bit for bit ----------------------------------------------------------------

ROW_SHAPES = [(1, 1), (3, 31), (7, 33), (9, 423), (2, 1025), (3, 0), (0, 64), (2, 3, 96)]


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_rms_norm_family(arch, dtype, shape, gen):
    H = shape[-1]
    x = randn(*shape, dtype=dtype, scale=3.0, gen=gen)
    for wdt in {dtype, torch.float32}:
        cpu_vs_emulated(arch, ops.rms_norm, x, randn(H, dtype=wdt, gen=gen), 1e-6)
    r = randn(*shape, dtype=dtype, gen=gen)
    cpu_vs_emulated(arch, ops.fused_add_rms_norm, x, r, randn(H, dtype=dtype, gen=gen), 1e-5)
    g = randn(*shape, dtype=dtype, gen=gen)
    cpu_vs_emulated(arch, ops.rms_norm_backward, g, x, randn(H, dtype=dtype, gen=gen), 1e-6)


@pytest.mark.parametrize("arch", WIDTHS)
def test_rms_norm_special_rows(arch):
    # subnormal squares (no flush-to-zero), a zero row (eps only), squares overflowing to inf
    x = torch.tensor([[1e-30, -2e-25, 3e-20, 0.0], [0.0, 0.0, 0.0, 0.0], [3e19, -3e19, 1.0, 2.0]])
    w = torch.tensor([1.0, -1.0, 0.5, 2.0])
    cpu_vs_emulated(arch, ops.rms_norm, x, w, 0.0)
    cpu_vs_emulated(arch, ops.rms_norm, x, w, 1e-6)


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (3, 46), (7, 2 * 423), (2, 3, 2 * 141), (0, 8)])
def test_silu_and_mul(arch, dtype, shape, gen):
    x = randn(*shape, dtype=dtype, scale=6.0, gen=gen)
    y, _ = cpu_vs_emulated(arch, ops.silu_and_mul, x)
    cpu_vs_emulated(arch, ops.silu_and_mul_backward, randn(*y.shape, dtype=dtype, gen=gen), x)


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("T,heads,head_dim,rot", [(1, 1, 2, 2), (5, 3, 64, 64), (7, 2, 80, 32), (0, 2, 64, 64)])
def test_rotary(arch, dtype, is_neox, T, heads, head_dim, rot, gen):
    cache = aligned_ops.rotary_cos_sin_cache(rot, 4096)
    pos = torch.randint(0, 4096, (T,), generator=gen)
    x = randn(T, heads, head_dim, dtype=dtype, scale=2.0, gen=gen)
    cpu_vs_emulated(arch, ops.rotary_embedding, pos, x, cache, rot, is_neox)
    cpu_vs_emulated(arch, ops.rotary_embedding_backward, pos.to(torch.int32), x, cache, rot, is_neox)


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,V", [(1, 1), (3, 31), (9, 1000), (2, 4099), (0, 7)])
@pytest.mark.parametrize("per_row_temp", [False, True])
def test_logprob_family(arch, dtype, T, V, per_row_temp, gen):
    z = randn(T, V, dtype=dtype, scale=4.0, gen=gen)
    temps = (torch.rand(T, generator=gen) + 0.5) if per_row_temp else None
    ids = torch.randint(0, V, (T,), generator=gen)
    cpu_vs_emulated(arch, ops.logsumexp, z, 0.7, temps)
    cpu_vs_emulated(arch, ops.log_softmax, z, 0.7, temps)
    cpu_vs_emulated(arch, ops.token_logprobs, z, ids, 0.7, temps)
    cpu_vs_emulated(arch, ops.token_logprobs_backward, randn(T, gen=gen), z, ids.to(torch.int32), 0.7, temps)


@pytest.mark.parametrize("arch", WIDTHS)
def test_logprob_nan_inf_rows(arch):
    inf, nan = float("inf"), float("nan")
    z = torch.tensor([[0.0, 1.0, 2.0], [-inf, -inf, -inf], [nan, 0.0, 1.0], [inf, 0.0, 1.0], [-inf, 3.0, -inf],
                      [1e30, -1e30, 0.0]])
    ids = torch.tensor([2, 0, 1, 1, 1, 0])
    cpu_vs_emulated(arch, ops.logsumexp, z, 1.0, None)
    cpu_vs_emulated(arch, ops.log_softmax, z, 1.0, None)
    cpu_vs_emulated(arch, ops.token_logprobs, z, ids, 1.0, None)
    cpu_vs_emulated(arch, ops.token_logprobs_backward, torch.ones(6), z, ids, 1.0, None)


@pytest.mark.parametrize("arch", WIDTHS)
def test_logprob_zero_maximum_sign(arch):
    """A row whose maximum is a zero of both signs: the pair's m is +0 on the GPU too (its warp butterfly folds in
    another order than the CPU's lanes; both take the total order's max). Rows: mixed zeros at both ends, short and
    wide (the wide-row kernel's block fold), and an all -0 maximum (stays -0: the control that the sign is read)."""
    rows = []
    for V in (40, 5000):
        for first in (0.0, -0.0):
            rows.append(torch.cat([torch.full((V // 2,), first), torch.full((V - V // 2,), -first)]))
    rows.append(torch.cat([torch.full((20,), -0.0), torch.full((20,), -3.0)]))
    for z in rows:
        z = z.unsqueeze(0)
        ids = torch.tensor([0])
        (lp, pairs), _ = cpu_vs_emulated(arch, ops.token_logprobs_pairs, z, ids, 1.0, None)
        want = -(2**31) if bool((z[0] > -1).logical_and(z[0].signbit()).sum() == (z[0] > -1).sum()) else 0
        assert int(pairs.view(torch.int32)[0, 0]) == want
        cpu_vs_emulated(arch, ops.logsumexp, z, 1.0, None)
        cpu_vs_emulated(arch, ops.log_softmax, z, 1.0, None)


@pytest.mark.parametrize("arch", WIDTHS)
def test_exp_log(arch, gen):
    x = torch.cat([randn(1000, scale=30.0, gen=gen),
                   torch.tensor([0.0, -0.0, 88.7, 88.8, 89.0, -103.9, -104.0, -110.0, 1e-40, float("inf"),
                                 -float("inf"), float("nan")])])
    cpu_vs_emulated(arch, ops._exp_f32, x)
    cpu_vs_emulated(arch, ops._log_f32, x)


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (3, 5, 7), (37, 45, 67), (130, 129, 9), (4, 3, 0), (2, 0, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(arch, dtype, M, N, K, with_bias, gen):
    x = randn(M, K, dtype=dtype, gen=gen)
    w = randn(N, K, dtype=dtype, gen=gen)
    b = randn(N, dtype=dtype, gen=gen) if with_bias else None
    y, _ = cpu_vs_emulated(arch, ops.linear, x, w, b)
    g = randn(*y.shape, dtype=dtype, gen=gen)
    cpu_vs_emulated(arch, ops.linear_backward, g, x, w, True, True, with_bias)


@pytest.mark.parametrize("arch", WIDTHS)
def test_noncontiguous_inputs(arch, gen):
    x = randn(3, 19, 70, gen=gen)[:, ::2, 3:67]  # strided 3-d input
    w = randn(64, 33, gen=gen).t()  # transposed weight [33, 64]
    cpu_vs_emulated(arch, ops.linear, x, w, None, kernels={"gemm_fp32_kernel", "lane_fold_kernel"})
    z = randn(40, 301, dtype=torch.bfloat16, gen=gen)[::3, 1:]
    cpu_vs_emulated(arch, ops.log_softmax, z, 1.3, None)
    cpu_vs_emulated(arch, ops.rms_norm, z, randn(300, gen=gen), 1e-6)


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_autograd_chain(arch, gen):
    """A tiny decoder step, forward and backward through aligned_ops' autograd, GPU source == CPU."""
    T, H, V = 5, 64, 97
    cache = aligned_ops.rotary_cos_sin_cache(32, 64)
    pos = torch.tensor([0, 1, 2, 9, 63])
    ids = torch.randint(0, V, (T,), generator=gen)
    init = {"x": randn(T, H, gen=gen), "wn": randn(H, gen=gen), "w1": randn(2 * 80, H, gen=gen) * 0.1,
            "w2": randn(V, 80, gen=gen) * 0.1}

    def run():
        p = {k: v.clone().requires_grad_() for k, v in init.items()}
        h = aligned_ops.rms_norm(p["x"], p["wn"], 1e-6)
        h = aligned_ops.rotary_embedding(pos, h.view(T, 2, 32), cache, 32, True).view(T, H)
        h = aligned_ops.silu_and_mul(aligned_ops.linear(h, p["w1"]))
        lp = aligned_ops.token_logprobs(aligned_ops.linear(h, p["w2"]), ids)
        lp.sum().backward()
        return [lp] + [p[k].grad for k in sorted(p)]

    ref = run()
    with aligned_ops.emulate(arch) as emu:
        got = run()
    for r, g in zip(ref, got):
        assert_bitwise_equal(g, r)
    assert {"rms_norm_backward_dx_kernel", "logits_row_kernel", "gemm_fp32_kernel", "column_sum_kernel"} - {
        "column_sum_kernel"} <= emu.kernels()


@pytest.mark.parametrize("arch", WIDTHS)
def test_bad_input_errors_are_the_glue_checks(arch):
    """Under emulation the GPU glue checks arguments with csrc/torch/checks: same rule, same words as the CPU."""
    cases = [
        (lambda: ops.rms_norm(torch.randn(3, 8), torch.randn(7), 1e-6), r"aligned::rms_norm: weight must have shape \[8\]"),
        (lambda: ops.token_logprobs(torch.randn(2, 5), torch.tensor([[0, 4]]), 1.0, None), r"aligned::token_logprobs"),
        (lambda: ops.rotary_embedding(torch.tensor([0, 7]), torch.randn(2, 1, 8), aligned_ops.rotary_cos_sin_cache(6, 64),
                                      8, True), r"aligned::rotary_embedding"),
        # Out-of-range *values* (positions, token ids, temperatures) are checked in the kernel on the GPU, not
        # on the host: tests/emulated/test_emulated_device_errors.py.
        (lambda: ops.linear(torch.randn(2, 3), torch.randn(4, 5), None), r"aligned::linear"),
    ]
    for fn, msg in cases:
        with pytest.raises(RuntimeError, match=msg) as cpu_err:
            fn()
        with aligned_ops.emulate(arch) as emu:
            with pytest.raises(RuntimeError, match=msg) as emu_err:
                fn()
        assert str(emu_err.value).splitlines()[0] == str(cpu_err.value).splitlines()[0]
        assert emu.launches == []  # rejected before any launch


# ---- negative controls: the comparison can fail ---------------------------------------------------------------


@pytest.mark.parametrize("arch", WIDTHS)
def test_negative_control_different_reduction_order(arch, gen):
    """Butterfly masks 1, 2, 4, 8, 16 instead of 16, ..., 1: the neighbour-pairs tree, not the contract's halving tree."""
    x = randn(9, 423, scale=3.0, gen=gen)
    w = randn(423, gen=gen)
    z = randn(64, 4099, gen=gen)  # many terms of similar size: the order shows in a few rows' lse
    for op, args in [(ops.rms_norm, (x, w, 1e-6)), (ops.log_softmax, (z, 1.0, None)), (ops.logsumexp, (z, 1.0, None))]:
        ref = op(*args)
        with aligned_ops.emulate(arch, _fault="neighbour_tree"):
            bad = op(*args)
        with aligned_ops.emulate(arch):
            good = op(*args)
        assert_bitwise_equal(good, ref)
        assert count_bitwise_equal(bad, ref) < ref.numel(), f"{op}: a different reduction order went unnoticed"
        torch.testing.assert_close(bad, ref, rtol=1e-4, atol=1e-4)  # ... although the values are close


@pytest.mark.parametrize("arch", WIDTHS)
def test_negative_control_missing_barrier(arch, gen):
    """The GEMM stages tiles through shared memory: without __syncthreads it reads tiles not yet written."""
    x, wt = randn(37, 67, gen=gen), randn(45, 67, gen=gen)
    ref = ops.linear(x, wt, None)
    with aligned_ops.emulate(arch, _fault="barrier_noop"):
        bad = ops.linear(x, wt, None)
    assert count_bitwise_equal(bad, ref) < ref.numel()


def test_negative_control_vendor_math(gen):
    """torch's silu (its own exp) differs from the contract's in some elements: the comparison can fail."""
    x = randn(64, 2 * 512, scale=6.0, gen=gen)
    with aligned_ops.emulate("sm_90"):
        ours = ops.silu_and_mul(x)
    theirs = torch.nn.functional.silu(x[:, :512]) * x[:, 512:]
    assert count_bitwise_equal(ours, theirs) < ours.numel()


def test_repeated_runs_identical(gen):
    """Deterministic: fibers, worker threads and block order never change a bit."""
    x, w = randn(300, 130, gen=gen), randn(70, 130, gen=gen)
    with aligned_ops.emulate("gfx942"):
        runs = [ops.linear(x, w, None) for _ in range(2)] + [ops.log_softmax(x, 1.0, None) for _ in range(2)]
    assert_bitwise_equal(runs[0], runs[1])
    assert_bitwise_equal(runs[2], runs[3])
