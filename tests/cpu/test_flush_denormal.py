"""A caller's flush-to-zero / denormals-are-zero (``torch.set_flush_denormal(True)``: MXCSR FTZ | DAZ on x86) does
not change a bit of any CPU op, at 1 or 2 threads.

Why this test exists: the profiles keep subnormals and promise no dependence on the thread count
(csrc/common/contract.h). FTZ / DAZ is per-thread state: the caller's reached the rows computed on the calling
thread but not those of the OpenMP workers (rms_norm, 64 x 4096 fp32 subnormal rows at 2 threads: rows 32-63
differed from the 1-thread result), and at 1 thread every row flushed. Every CPU op now runs under
csrc/cpu/ieee_env.h's IEEE environment on the caller (backends/cpu.h's Call) and in every task
(ieee_parallel_for). Each case compares bits (integer views) with FTZ on against FTZ off.

Negative controls: torch's own multiply flushes a subnormal under FTZ (the switch works on this machine), and
every case's inputs are such that flushing their subnormals by hand changes the op's output (a case whose
output ignored subnormals could not fail)."""

from __future__ import annotations

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, count_bitwise_equal

ops = torch.ops.aligned
TINY = torch.finfo(torch.float32).tiny  # smallest normal fp32 (= bf16's)


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _sub(shape, seed, dtype=torch.float32, normal_share=0.5):
    """Random values, about half of them fp32 subnormals (|v| < 2^-126), the rest normal."""
    g = _g(seed)
    v = torch.randn(shape, generator=g) * 1e-39
    normal = torch.rand(shape, generator=g) < normal_share
    v = torch.where(normal, torch.randn(shape, generator=g), v)
    return v.to(dtype)


def _flushed(t):
    """t with its subnormals replaced by zero (what DAZ reads)."""
    return torch.where(t.float().abs() < TINY, torch.zeros_like(t), t)


def _log_softmax_grad(z, go):
    zz = z.clone().requires_grad_(True)
    aligned_ops.log_softmax(zz, 1.0).backward(go)
    return zz.grad


def _cases():
    """name -> (fn(*inputs) -> tensor, inputs, index of the input whose subnormals matter)"""
    bf = torch.bfloat16
    cases = {}
    # rms_norm: the reviewer's shape; subnormal rows normalise to normal values (DAZ reads them as 0).
    x = torch.randn(64, 4096, generator=_g(1)) * 1e-39
    x[::3] = torch.randn(22, 4096, generator=_g(2))
    cases["rms_norm"] = (lambda x, w: ops.rms_norm(x, w, 1e-6), [x, torch.rand(4096, generator=_g(3)) + 0.5], 0)
    # linear (fma): subnormal activations times large weights give normal products.
    w = torch.randn(96, 512, generator=_g(4)) * 1e30
    x32, x16 = _sub((48, 512), 5, normal_share=0.0), _sub((48, 512), 6, bf, normal_share=0.0)
    cases["linear fma fp32"] = (lambda x, w: ops.linear(x, w, None), [x32, w], 0)
    cases["linear fma bf16"] = (lambda x, w: ops.linear(x, w, None), [x16, w.to(bf)], 0)
    if aligned_ops.mma_unit() is not None:
        # vdpbf16ps reads subnormal inputs as zero whatever MXCSR says; the fp32 fold, bias and rounding of the
        # epilogue do read it: subnormal bias and outputs.
        xm, wm = _sub((48, 512), 7, bf) * 1e-20, (torch.randn(96, 512, generator=_g(8)) * 1e-18).to(bf)
        bias = (torch.randn(96, generator=_g(9)) * 1e-39).to(bf)
        cases["linear_mma bf16"] = (lambda x, w, b: ops.linear_mma(x, w, b), [xm, wm, bias], 2)
    # log_softmax (forward and backward): subnormal upstream gradients give subnormal logit gradients (the forward's
    # outputs, z - m - log L, keep no subnormal of z); at 2 rows the threads share each row (dense_split_kernels.h).
    z = torch.randn(8, 32000, generator=_g(10))
    cases["log_softmax + backward"] = (_log_softmax_grad, [z, _sub((8, 32000), 11, normal_share=0.0)], 1)
    cases["log_softmax + backward, 2 rows"] = (_log_softmax_grad,
                                               [z[:2].clone(), _sub((2, 32000), 12, normal_share=0.0)], 1)
    # attention: subnormal values make subnormal outputs.
    Hq, Hkv, D = 4, 2, 64
    cq = torch.tensor([0, 5, 37, 40], dtype=torch.int32)
    q = torch.randn(40, Hq, D, generator=_g(13)).to(bf)
    k = torch.randn(40, Hkv, D, generator=_g(14)).to(bf)
    v = _sub((40, Hkv, D), 15, bf, normal_share=0.0)
    cases["attention_varlen"] = (lambda q, k, v: ops.attention_varlen(q, k, v, cq, cq, D**-0.5, True)[0],
                                 [q, k, v], 2)
    B, L, bs = 6, 70, 16
    per = (L + bs - 1) // bs
    kc = torch.randn(B * per, bs, Hkv, D, generator=_g(16)).to(bf)
    vc = _sub((B * per, bs, Hkv, D), 17, bf, normal_share=0.0)
    table = torch.arange(B * per, dtype=torch.int32).view(B, per)
    lens = torch.full((B,), L, dtype=torch.int32)
    qsl = torch.arange(B + 1, dtype=torch.int32)
    qd = torch.randn(B, Hq, D, generator=_g(18)).to(bf)
    cases["paged_attention decode"] = (
        lambda q, kc, vc: ops.paged_attention(q, kc, vc, table, lens, qsl, D**-0.5), [qd, kc, vc], 2)
    # moe_experts: subnormal activations times large gate/up weights give normal hidden values.
    T, E, H, I, topk = 24, 4, 64, 32, 2
    w13 = torch.randn(E, 2 * I, H, generator=_g(19)) * 1e37
    w2 = torch.randn(E, H, I, generator=_g(20)) * 1e-3
    tw, ids, _ = aligned_ops.moe_routing(torch.randn(T, E, generator=_g(21)), topk, "softmax", True)
    cases["moe_experts"] = (lambda x: aligned_ops.moe_experts(x, tw, ids, w13, w2),
                            [_sub((T, H), 22, normal_share=0.0)], 0)
    return cases


CASES = _cases()


def _run(fn, inputs, threads, ftz):
    torch.set_num_threads(threads)
    torch.set_flush_denormal(ftz)
    try:
        return fn(*inputs)
    finally:
        torch.set_flush_denormal(False)


@pytest.fixture(autouse=True)
def _restore():
    n = torch.get_num_threads()
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero switch")
    yield
    torch.set_flush_denormal(False)
    torch.set_num_threads(n)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", sorted(CASES))
def test_flush_denormal_of_the_caller_changes_no_bit(name, threads):
    fn, inputs, _ = CASES[name]
    ieee = _run(fn, inputs, threads, False)  # first: the 2-thread pool exists before FTZ is switched on
    ftz = _run(fn, inputs, threads, True)
    assert_bitwise_equal(ftz, ieee, f"{name} at {threads} threads under FTZ/DAZ")
    assert_bitwise_equal(_run(fn, inputs, threads, False), ieee, f"{name}: FTZ leaked into the next call")


@pytest.mark.parametrize("name", sorted(CASES))
def test_negative_control_the_inputs_subnormals_matter(name):
    """Flushing the case's subnormals by hand changes the op's output: a flush inside the op would show."""
    fn, inputs, i = CASES[name]
    assert bool((inputs[i].float().abs() < TINY).logical_and(inputs[i] != 0).any())
    flushed = list(inputs)
    flushed[i] = _flushed(inputs[i])
    a, b = _run(fn, inputs, 1, False), _run(fn, flushed, 1, False)
    assert count_bitwise_equal(a, b) < a.numel(), name


def test_negative_control_ftz_flushes_torch_own_multiply():
    """set_flush_denormal(True) does flush on this machine: torch's multiply of a subnormal (on the calling
    thread) returns zero under it and the subnormal without it; and it is off again after _run."""
    x = torch.full((8,), 1e-39)
    one = torch.ones(8)
    assert_bitwise_equal(_run(torch.mul, [x, one], 1, False), x)
    flushed = _run(torch.mul, [x, one], 1, True)
    assert count_bitwise_equal(flushed, x) == 0
    assert bool((flushed == 0).all())
    assert_bitwise_equal(torch.mul(x, one), x)


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_flush_denormal_of_the_caller_changes_no_emulated_reference_bit(arch):
    """The emulated GPUs' scalar references (what the emulated kernels are held to) run on the calling thread under
    the same IEEE environment (csrc/torch/backends/emulated.h Guard): a caller's FTZ changes none of their bits.
    The inputs' subnormal products matter (control: zeroing them changes the reference)."""
    g = _g(11)
    x = (torch.randn(4, 64, generator=g) * 1e-19).bfloat16()
    w = (torch.randn(32, 64, generator=g) * 1e-19).bfloat16()
    with aligned_ops.emulate(arch):
        clean = torch.ops.aligned._linear_mma_reference(x, w, 8)
        torch.set_flush_denormal(True)
        try:
            flushed = torch.ops.aligned._linear_mma_reference(x, w, 8)
        finally:
            torch.set_flush_denormal(False)
        zeroed = torch.ops.aligned._linear_mma_reference(torch.zeros_like(x), w, 8)
    assert torch.equal(clean.view(torch.int32), flushed.view(torch.int32))
    assert not torch.equal(clean.view(torch.int32), zeroed.view(torch.int32))
