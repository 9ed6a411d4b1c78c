"""aligned_ops.fused_token_logprobs (python/aligned_ops/ops/lm_head.py): bit for bit the unfused LM head the trainer
runs (aligned linear -> aligned token_logprobs at a temperature), forward and every gradient, for chunk sizes
that do and do not divide T and V — compared through integer views. Negative controls: a chunked logsumexp
merged across vocabulary chunks (torch.logaddexp: a different order) and a weight gradient summed from two
token halves must both differ."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, bitwise_equal, count_bitwise_equal

ops = torch.ops.aligned


def _inputs(T, K, V, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, K, generator=g) * 2).to(dtype)
    w = (torch.randn(V, K, generator=g) * 0.5).to(dtype)
    b = (torch.randn(V, generator=g)).to(dtype) if bias else None
    ids = torch.randint(0, V, (T,), generator=g)
    gw = torch.randn(T, generator=g)  # fixed weights of the loss: every token's gradient matters
    return h, w, b, ids, gw


def _run(fn, h, w, b, ids, gw):
    leaves = [t.clone().requires_grad_(True) for t in (h, w) + ((b,) if b is not None else ())]
    lp = fn(*leaves)
    (lp * gw).sum().backward()
    return [lp.detach()] + [t.grad for t in leaves]


def _unfused(ids, temp):
    def fn(h, w, b=None):
        return aligned_ops.token_logprobs(aligned_ops.linear(h, w, b), ids, temp)
    return fn


def _fused(ids, temp, tc, vc):
    def fn(h, w, b=None):
        return aligned_ops.fused_token_logprobs(h, w, ids, temp, bias=b, token_chunk=tc, vocab_chunk=vc)
    return fn


def _assert_same(ref, got):
    assert len(ref) == len(got)
    for name, r, x in zip(("logprobs", "d hidden", "d weight", "d bias"), ref, got):
        assert_bitwise_equal(x, r, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tc,vc", [(0, 0), (1, 1), (5, 100), (7, 1003), (37, 33), (64, 4096)])
def test_bitwise_equal_to_unfused(dtype, bias, tc, vc):
    T, K, V = 37, 24, 1003  # V = 1000 + 3: no chunk of 32 or 100 divides it; T = 37 is prime
    h, w, b, ids, gw = _inputs(T, K, V, dtype, bias)
    temp = 0.7
    ref = _run(_unfused(ids, temp), h, w, b, ids, gw)
    got = _run(_fused(ids, temp, tc, vc), h, w, b, ids, gw)
    _assert_same(ref, got)


def test_per_token_temperatures_and_odd_vocab_151936():
    T, K, V = 6, 16, 151936  # Qwen's vocabulary; chunks of 4 tokens and 50000 rows (neither divides)
    h, w, b, ids, gw = _inputs(T, K, V, torch.bfloat16, False, seed=3)
    temps = torch.tensor([0.5, 1.0, 1.3, 0.8, 2.0, 0.25])
    ref = _run(_unfused(ids, temps), h, w, b, ids, gw)
    got = _run(_fused(ids, temps, 4, 50000), h, w, b, ids, gw)
    _assert_same(ref, got)


def test_negative_control_chunked_logsumexp_merge_differs():
    # The naive way to chunk the vocabulary: a logsumexp per vocabulary chunk, merged with logaddexp. It is a
    # different order of the row reduction, so it must miss the unfused bits on many rows (the bitwise
    # comparison above can fail), while the fused op matches every row.
    T, K, V = 64, 32, 1003
    h, w, b, ids, _ = _inputs(T, K, V, torch.bfloat16, False, seed=5)
    z = aligned_ops.linear(h, w)
    ref = aligned_ops.token_logprobs(z, ids, 0.7)
    lse = None
    for a in range(0, V, 100):
        part = aligned_ops.logsumexp(z[:, a:a + 100].contiguous(), 0.7)
        lse = part if lse is None else torch.logaddexp(lse, part)
    naive = z.float().gather(1, ids[:, None])[:, 0] / 0.7 - lse
    assert count_bitwise_equal(naive, ref) < T // 2
    fused = aligned_ops.fused_token_logprobs(h, w, ids, 0.7, token_chunk=7, vocab_chunk=100)
    assert_bitwise_equal(fused, ref)


def test_negative_control_split_weight_gradient_differs():
    # d W is one chain over all tokens; summing the gradients of two token halves (what chunking the tokens of
    # the weight gradient would do) rounds twice and must differ; the fused op never splits that chain.
    T, K, V = 40, 16, 300
    h, w, b, ids, gw = _inputs(T, K, V, torch.float32, False, seed=7)
    ref = _run(_unfused(ids, 1.0), h, w, b, ids, gw)
    halves = [_run(_unfused(ids[s], 1.0), h[s], w, b, ids[s], gw[s]) for s in (slice(0, 17), slice(17, T))]
    split_dw = halves[0][2] + halves[1][2]
    assert not bitwise_equal(split_dw, ref[2])
    got = _run(_fused(ids, 1.0, 17, 64), h, w, b, ids, gw)
    assert_bitwise_equal(got[2], ref[2])


def test_hf_option_small_and_errors():
    # completion_logprobs(fused_lm_head=...) is tested on a real tiny model in tests/integrations/test_hf.py;
    # here the wrapper's own checks.
    h, w, b, ids, _ = _inputs(5, 8, 50, torch.float32, False)
    with pytest.raises(ValueError, match="fused_token_logprobs: weight must be"):
        aligned_ops.fused_token_logprobs(h, w[:, :7].contiguous(), ids)
    with pytest.raises(ValueError, match="fused_token_logprobs: weight dtype"):
        aligned_ops.fused_token_logprobs(h, w.bfloat16(), ids)
    with pytest.raises(ValueError, match="fused_token_logprobs: token_ids must be"):
        aligned_ops.fused_token_logprobs(h, w, ids[:4])
    with pytest.raises(ValueError, match="fused_token_logprobs: token_chunk must be >= 0"):
        aligned_ops.fused_token_logprobs(h, w, ids, token_chunk=-1)
    with pytest.raises(ValueError, match="fused_token_logprobs: bias must be"):
        aligned_ops.fused_token_logprobs(h, w, ids, bias=torch.zeros(49))
    with pytest.raises(ValueError, match="fused_token_logprobs: token_ids must lie in"):
        aligned_ops.fused_token_logprobs(h, w, ids + 50)
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        aligned_ops.fused_token_logprobs(h, w, ids, 0.0)


def test_opcheck_and_compile_fullgraph():
    h, w, b, ids, gw = _inputs(9, 8, 70, torch.float32, True)
    args = (h.requires_grad_(True), w.requires_grad_(True), b.requires_grad_(True), ids, 0.9, None, 4, 32)
    torch.library.opcheck(ops.fused_token_logprobs, args)

    def f(h, w, b):
        return ops.fused_token_logprobs(h, w, b, ids, 0.9, None, 4, 32)[0]

    eager = _run(f, h.detach(), w.detach(), b.detach(), ids, gw)
    compiled = _run(torch.compile(f, fullgraph=True), h.detach(), w.detach(), b.detach(), ids, gw)
    _assert_same(eager, compiled)


def test_empty_and_pairs_not_differentiable():
    h = torch.zeros(0, 8, requires_grad=True)
    w = torch.randn(30, 8, requires_grad=True)
    lp = aligned_ops.fused_token_logprobs(h, w, torch.zeros(0, dtype=torch.int64))
    assert lp.shape == (0,)
    lp.sum().backward()
    assert w.grad is not None and not w.grad.any()
    h2, w2, _, ids, _ = _inputs(3, 8, 30, torch.float32, False)
    _, pairs = ops.fused_token_logprobs(h2.requires_grad_(True), w2, None, ids, 1.0, None, 0, 0)
    assert not pairs.requires_grad


def test_under_gpu_emulation_equal_to_unfused():
    # The fused op is composed of dispatcher ops, so under aligned_ops.emulate the linear pieces run the GPU
    # source (csrc/gpu) and the result is still the unfused path's, bit for bit (the column-tile backward and
    # token_logprobs_pairs have no GPU kernel and run the CPU ones).
    h, w, b, ids, gw = _inputs(6, 8, 70, torch.bfloat16, True, seed=11)
    with aligned_ops.emulate("sm_90") as emu:
        ref = _run(_unfused(ids, 0.8), h, w, b, ids, gw)
        got = _run(_fused(ids, 0.8, 4, 33), h, w, b, ids, gw)
    assert emu.launches  # the GPU source really ran
    _assert_same(ref, got)


# ---- issue 21.7: the fused forward's peak resident set is tiles, not the logits ---------------------------------
CHILD = __file__.replace("test_lm_head.py", "_lm_head_memory_child.py")
MEMORY_CASES = ["op", "completion_fused", "completion_auto"]
MEMORY_T, MEMORY_V = 2048, 151936


def BACKGROUND_JOBS(tiny_checkpoint):
    """The memory children need nothing from this process (each is its own fresh process, whose own peak resident
    set it reports): tests/_background.py starts them at the beginning of the run, beside the in-process tests."""
    test = "test_fused_forward_peak_resident_memory_is_tiles_not_logits"
    return {f"lm_head_memory_{which}": dict(argv=[sys.executable, CHILD, which, str(MEMORY_T), str(MEMORY_V)],
                                            timeout=600, for_test=f"{test}[{which}]")  # only that case's child
            for which in MEMORY_CASES}


@pytest.mark.slow
@pytest.mark.parametrize("which", MEMORY_CASES)
def test_fused_forward_peak_resident_memory_is_tiles_not_logits(which, background):
    """T = 2048 tokens x V = 151,936 (bf16 logits: 594 MiB). The forward peaked at the logits' size in most fresh
    processes (48 of every 55-row 16 MiB tile left resident by glibc heap fragmentation; issue 21.7, measured at
    T = 4096: 1.1-1.2 GB). Tiles above glibc's mmap-threshold ceiling leave nothing behind: the bound is the
    default tile twice over plus 64 MiB for the model and outputs — a page-count measurement, not a timing, in a
    fresh process per case (a background job: tests/_background.py)."""
    from aligned_ops.ops import lm_head

    T, V = MEMORY_T, MEMORY_V
    proc = background.result(f"lm_head_memory_{which}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = json.loads(proc.stdout.strip().splitlines()[-1])["peak"]
    logits = T * V * 2
    bound = 2 * lm_head.DEFAULT_TILE_BYTES + (64 << 20)
    assert peak <= bound, f"{which}: peak {peak / 2**20:.0f} MiB > bound {bound / 2**20:.0f} MiB (logits " \
                          f"{logits / 2**20:.0f} MiB)"
    assert bound < logits / 3  # the bound separates tiles from the logits
    assert lm_head.DEFAULT_TILE_BYTES > lm_head.GLIBC_MMAP_THRESHOLD_MAX


def test_fused_by_default_threshold_and_auto_picks_the_same_bits(monkeypatch):
    """completion_logprobs(fused_lm_head="auto") (the default) fuses when the [T, V] logits reach
    FUSED_AUTO_MIN_LOGITS_BYTES and the scoring is eligible, unfused otherwise; the bits are the same."""
    from aligned_ops.ops import lm_head

    assert lm_head.fused_by_default(4096, 151936, torch.bfloat16)  # 1.16 GiB of bf16 logits
    assert not lm_head.fused_by_default(64, 151936, torch.bfloat16)  # 18.5 MiB
    assert lm_head.fused_by_default(1024, 151936, torch.float32) and not lm_head.fused_by_default(8, 512, torch.float32)
