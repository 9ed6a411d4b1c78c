"""Bits do not depend on the thread count: every CPU op family at 2, 3, 4 and 7 threads against 1 thread.

The ops split rows or output tiles over torch's OpenMP pool (csrc/cpu/cpu_kernels.h); a reduction never crosses a
task. The other files compare 1 vs 2 threads only; the uneven chunks (3, 7), the >= 4-thread lane split of a lone
row's log-softmax (csrc/torch/backends/cpu_dense.cpp lse_pair_split) and attention's mode switch by thread count
(blocks >= 4 * threads) only run above 2 threads — oversubscription is fine for a bit test on a 2-core machine.
Negative control: torch's own fp32 sum, whose parallel reduction is cut by the thread count, shows the harness
catches a thread-count dependence.
"""

from __future__ import annotations

import pytest
import torch

import aligned_ops

ops = torch.ops.aligned
THREADS = (2, 3, 4, 7)
BF = torch.bfloat16


def _bits(t):
    if isinstance(t, (tuple, list)):
        return [_bits(u) for u in t]
    t = t.contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).clone()


def _same(a, b):
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)  # integer views: bit equality


def _rand(g, *shape, dtype=BF, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _cases():
    g = torch.Generator().manual_seed(0)
    cases = {}
    for m, n, k in [(1, 1000, 896), (7, 4864, 896), (33, 200, 300), (513, 100, 128)]:
        x, w, b = _rand(g, m, k), _rand(g, n, k, scale=0.03), _rand(g, n)
        cases[f"linear-{m}x{n}x{k}"] = lambda x=x, w=w, b=b: ops.linear(x, w, b)
        cases[f"linear_mma-{m}x{n}x{k}"] = lambda x=x, w=w, b=b: ops.linear_mma(x, w, b)
    for m, n, k, dt in [(37, 130, 257, torch.float32), (200, 64, 96, BF)]:
        x, w, b, gy = _rand(g, m, k, dtype=dt), _rand(g, n, k, dtype=dt, scale=0.05), _rand(g, n, dtype=dt), \
            _rand(g, m, n, dtype=dt)

        def fwd_bwd(x=x, w=w, b=b, gy=gy):
            xx, ww, bb = (v.clone().requires_grad_() for v in (x, w, b))
            y = aligned_ops.linear(xx, ww, bb)
            y.backward(gy)
            return [y.detach(), xx.grad, ww.grad, bb.grad]

        cases[f"linear-backward-{m}x{n}x{k}-{dt}"] = fwd_bwd
    for t, v in [(1, 151936), (3, 9000), (37, 32000)]:
        z = torch.randn(t, v, generator=g) * 5
        ids = torch.randint(0, v, (t,), generator=g)
        gg = torch.randn(t, generator=g)
        cases[f"log_softmax-{t}x{v}"] = lambda z=z: ops.log_softmax(z, 0.7, None)
        cases[f"token_logprobs-{t}x{v}"] = lambda z=z, ids=ids: ops.token_logprobs(z, ids, 1.0, None)
        cases[f"token_logprobs_backward-{t}x{v}"] = \
            lambda z=z, ids=ids, gg=gg: ops.token_logprobs_backward(gg, z, ids, 0.8, None)
    for rows, h in [(1, 4096), (301, 1000)]:
        x, w, go, gu = _rand(g, rows, h), _rand(g, h) + 1, _rand(g, rows, h), _rand(g, rows, 2 * h)
        cases[f"rms_norm-{rows}x{h}"] = lambda x=x, w=w: ops.rms_norm(x, w, 1e-6)
        cases[f"rms_norm_backward-{rows}x{h}"] = lambda x=x, w=w, go=go: ops.rms_norm_backward(go, x, w, 1e-6)
        cases[f"silu_and_mul-{rows}x{h}"] = lambda gu=gu: ops.silu_and_mul(gu)
    t, h, i, e, k = 37, 256, 128, 16, 4
    x, w13, w2 = _rand(g, t, h), _rand(g, e, 2 * i, h, scale=0.05), _rand(g, e, h, i, scale=0.05)
    tw, ti = torch.topk(torch.randn(t, e, generator=g).softmax(-1), k)
    for profile in ("fma", "mma"):
        cases[f"moe_experts-{profile}"] = \
            lambda profile=profile: aligned_ops.moe_experts(x, tw, ti, w13, w2, linear_profile=profile)
    b, length, hq, hkv, d, bs = 5, 300, 14, 2, 64, 16
    nb = b * ((length + bs - 1) // bs)
    kc, vc = _rand(g, nb, bs, hkv, d), _rand(g, nb, bs, hkv, d)
    table = torch.arange(nb, dtype=torch.int32).view(b, -1)
    q = _rand(g, b, hq, d)
    lens = torch.full((b,), length, dtype=torch.int32)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    cases["paged_attention-decode"] = lambda: ops.paged_attention(q, kc, vc, table, lens, qsl, d ** -0.5)
    qv, kv, vv = _rand(g, 2 * length, hq, d), _rand(g, 2 * length, hkv, d), _rand(g, 2 * length, hkv, d)
    cu = torch.tensor([0, length, 2 * length], dtype=torch.int32)
    cases["attention_varlen-prefill"] = lambda: aligned_ops.attention_varlen(qv, kv, vv, cu, cu, d ** -0.5)
    return cases


CASES = _cases()


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bits_do_not_depend_on_the_thread_count(name, restore_threads):
    fn = CASES[name]
    if "mma" in name and aligned_ops.mma_unit() is None:
        pytest.skip("this CPU has no bf16 dot-product unit (the mma profile refuses)")
    torch.set_num_threads(1)
    ref = _bits(fn())
    for t in THREADS:
        torch.set_num_threads(t)
        assert _same(ref, _bits(fn())), f"{name}: {t} threads differ from 1"


def test_negative_control_torch_sum_depends_on_the_thread_count(restore_threads):
    x = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)) * 1e3
    torch.set_num_threads(1)
    ref = _bits(x.sum())
    differs = []
    for t in THREADS:
        torch.set_num_threads(t)
        differs.append(not _same(ref, _bits(x.sum())))
    assert any(differs), "torch's parallel sum gave the 1-thread bits at every count: the harness proves nothing"


@pytest.mark.parametrize("first", [0.0, -0.0])
def test_a_zero_maximum_has_one_sign_at_every_thread_count_and_batch(first, restore_threads):
    """token_logprobs_pairs returns the rows' (m, L): a row whose maximum is a zero held with both signs got the sign
    of whichever came last in the max fold — the 32 lanes, or a shared row's per-thread parts (V >= 8192 with fewer
    rows than threads: cpu_dense.cpp lse_pair_split) — so m was +0 at 1 thread and -0 at 2, and alone vs inside a
    batch (probe, session 46). The max is now the total order's (numerics.h max_total_f32): +0 where any +0 is.
    Control: a row whose zero maximum is all -0 keeps -0 (the sign is read, not forced), and the log-probs and L
    were never affected."""
    v = 8192
    mixed = torch.cat([torch.full((v // 2,), first), torch.full((v // 2,), -first)])
    negative = torch.full((v,), -0.0)
    ids = torch.tensor([0])
    results = []
    for threads in (1, 2, 3, 4):
        torch.set_num_threads(threads)
        alone = _bits(list(ops.token_logprobs_pairs(mixed.unsqueeze(0), ids, 1.0, None)))
        batch = torch.stack([torch.randn(v) if i != 5 else mixed for i in range(8)])
        inside = _bits(list(ops.token_logprobs_pairs(batch, torch.zeros(8, dtype=torch.long), 1.0, None)))
        assert _same(alone, [inside[0][5:6], inside[1][5:6]]), f"{threads} threads: alone vs inside a batch of 8"
        results.append(alone)
        assert int(alone[1][0, 0]) == 0, f"{threads} threads: a zero maximum with a +0 in it is +0"
        neg = _bits(list(ops.token_logprobs_pairs(negative.unsqueeze(0), ids, 1.0, None)))
        assert int(neg[1][0, 0]) == -(2**31), "an all -0 maximum stays -0"
    assert all(_same(r, results[0]) for r in results)
