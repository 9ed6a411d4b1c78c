"""aligned::attention_varlen (+ backward): accuracy vs a float64 reference, batch/thread/ISA invariance
(integer views) with negative controls, opcheck, torch.compile, bad input.

The invariance contract (csrc/common/attention.h): a query row's output depends only on its own q, the keys
of its sequence up to its position, and the scale — tiles of 32 keys and KV splits of 512 keys are aligned to
absolute position 0 and merged in split order, whatever the batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import aligned_ops
from aligned_ops.testing import bitwise_equal

ops = torch.ops.aligned
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3)}


# ---- float64 reference ----------------------------------------------------------------------------------


def ref_attention(q, k, v, cu_q, cu_k, scale, causal=True):
    """Plain float64 attention per sequence (bottom-right causal). Rows that see no key: out 0, lse -inf."""
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b] : cu_q[b + 1]].double()
        ks = k[cu_k[b] : cu_k[b + 1]].double()
        vs = v[cu_k[b] : cu_k[b + 1]].double()
        g = qs.shape[1] // ks.shape[1]
        ks, vs = ks.repeat_interleave(g, 1), vs.repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        lq, lk = qs.shape[0], ks.shape[0]
        if causal:
            pos = torch.arange(lq)[:, None] + (lk - lq)
            s = s.masked_fill(torch.arange(lk)[None, :] > pos, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        outs.append(torch.einsum("hqk,khd->qhd", p, vs))
        lses.append(lse.T)
    return torch.cat(outs), torch.cat(lses)


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def make(lens_q, lens_k, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(dtype)
    k = torch.randn(sum(lens_k), hkv, d, generator=g).to(dtype)
    v = torch.randn(sum(lens_k), hkv, d, generator=g).to(dtype)
    return q, k, v, cu(lens_q), cu(lens_k)


def run(q, k, v, cq, ck, causal=True, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return ops.attention_varlen(q, k, v, cq, ck, scale, causal)


# ---- accuracy -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "lens_q, lens_k, hq, hkv, d, causal",
    [
        ([5, 600, 33], [5, 600, 33], 4, 2, 64, True),  # GQA, a 2-split sequence
        ([1, 17, 70], [1, 17, 70], 3, 3, 128, True),  # MHA, D=128
        ([7, 3], [40, 3], 4, 1, 40, True),  # MQA, odd head_dim, bottom-right causal (q shorter than k)
        ([9, 2], [20, 50], 2, 2, 64, False),  # non-causal, lengths differ
        ([6], [4], 2, 1, 16, True),  # q longer than k: first rows see no key (out 0, lse -inf)
    ],
)
def test_forward_matches_float64(dtype, lens_q, lens_k, hq, hkv, d, causal):
    q, k, v, cq, ck = make(lens_q, lens_k, hq, hkv, d, dtype)
    out, lse = run(q, k, v, cq, ck, causal)
    ro, rl = ref_attention(q, k, v, cq, ck, d**-0.5, causal)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == (q.shape[0], hq)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), ro, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), rl, atol=2e-5, rtol=2e-5)  # scores are fp32 from exact inputs


def test_empty_rows_and_zero_size():
    q, k, v, cq, ck = make([6], [4], 2, 1, 16, torch.float32)
    out, lse = run(q, k, v, cq, ck)
    assert bitwise_equal(out[:2], torch.zeros_like(out[:2]))
    assert torch.isneginf(lse[:2]).all() and torch.isfinite(lse[2:]).all()
    # zero tokens, zero-length sequences in the batch
    q, k, v, cq, ck = make([0, 3, 0], [0, 3, 0], 2, 2, 8, torch.float32)
    out, lse = run(q, k, v, cq, ck)
    ro, _ = ref_attention(q, k, v, cq, ck, 8**-0.5)
    torch.testing.assert_close(out.double(), ro, atol=1e-5, rtol=1e-5)
    q, k, v, cq, ck = make([], [], 2, 2, 8, torch.float32)
    out, lse = run(q, k, v, cq, ck)
    assert out.shape == (0, 2, 8) and lse.shape == (0, 2)


def test_non_contiguous_inputs():
    q, k, v, cq, ck = make([10, 23], [10, 23], 4, 2, 32, torch.float32)
    qn = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, head-major strides
    assert not qn.is_contiguous()
    kn = torch.cat([k, torch.zeros_like(k)], dim=-1)[..., : k.shape[-1]]
    assert not kn.is_contiguous()
    a = run(q, k, v, cq, ck)
    b = run(qn, kn, v, cq, ck)
    assert bitwise_equal(a[0], b[0]) and bitwise_equal(a[1], b[1])


# ---- backward -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lens_q, lens_k, hq, hkv, d, causal",
    [
        ([5, 40, 33], [5, 40, 33], 4, 2, 64, True),
        ([7, 3], [40, 3], 2, 1, 24, True),
        ([9, 2], [20, 50], 2, 2, 16, False),
        ([6], [4], 2, 1, 16, True),
    ],
)
def test_backward_matches_float64_autograd(dtype, lens_q, lens_k, hq, hkv, d, causal):
    q, k, v, cq, ck = make(lens_q, lens_k, hq, hkv, d, dtype, seed=1)
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    out, _ = aligned_ops.attention_varlen(qa, ka, va, cq, ck, causal=causal)
    out.backward(go)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ro, _ = ref_attention(qr, kr, vr, cq, ck, d**-0.5, causal)
    ro.backward(go.double())
    tol = 2e-4 if dtype == torch.float32 else 5e-2
    for got, want in ((qa.grad, qr.grad), (ka.grad, kr.grad), (va.grad, vr.grad)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_backward_long_sequence_two_splits():
    q, k, v, cq, ck = make([530], [530], 2, 1, 32, torch.float32, seed=3)
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    aligned_ops.attention_varlen(qa, ka, va, cq, ck)[0].backward(go)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref_attention(qr, kr, vr, cq, ck, 32**-0.5)[0].backward(go.double())
    for got, want in ((qa.grad, qr.grad), (ka.grad, kr.grad), (va.grad, vr.grad)):
        torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=2e-4)


def grads(q, k, v, cq, ck, go, causal=True):
    out, lse = run(q, k, v, cq, ck, causal)
    return ops.attention_varlen_backward(go, q, k, v, out, lse, cq, ck, q.shape[-1] ** -0.5, causal)


# ---- invariance -----------------------------------------------------------------------------------------


def per_seq(fn_out, cq, b):
    return fn_out[cq[b] : cq[b + 1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariance_forward(dtype):
    """A sequence's rows are the same bits alone (one-shot prefill), at any position in a packed batch, with any
    neighbours, for batch sizes 1, 2, 3, 7."""
    lens = [37, 1, 600, 19, 129, 2, 64]
    q, k, v, cq, ck = make(lens, lens, 4, 2, 64, dtype, seed=5)
    out, lse = run(q, k, v, cq, ck)
    for b, n in enumerate(lens):
        s = slice(int(cq[b]), int(cq[b + 1]))
        o1, l1 = run(q[s], k[s], v[s], cu([n]), cu([n]))
        assert bitwise_equal(o1, out[s]) and bitwise_equal(l1, lse[s])
    # reversed order, other content around (sizes 2, 3)
    q2, k2, v2, _, _ = make([50, 11], [50, 11], 4, 2, 64, dtype, seed=6)
    s = slice(int(cq[2]), int(cq[3]))
    qb = torch.cat([q2[:50], q[s], q2[50:]])
    kb = torch.cat([k2[:50], k[s], k2[50:]])
    vb = torch.cat([v2[:50], v[s], v2[50:]])
    ob, lb = run(qb, kb, vb, cu([50, 600, 11]), cu([50, 600, 11]))
    assert bitwise_equal(ob[50:650], out[s]) and bitwise_equal(lb[50:650], lse[s])


def test_prefix_row_invariance_bottom_right():
    """Row i of a full causal pass == the same token computed as the last rows of a shorter query block
    (q = suffix of the sequence, k = whole prefix): the chunked-prefill shape in varlen form."""
    n = 700
    q, k, v, cq, ck = make([n], [n], 2, 2, 64, torch.float32, seed=7)
    out, lse = run(q, k, v, cq, ck)
    for start, end in [(0, 1), (5, 12), (511, 513), (650, 700), (699, 700)]:
        o, l = run(q[start:end], k[:end], v[:end], cu([end - start]), cu([end]))
        assert bitwise_equal(o, out[start:end]) and bitwise_equal(l, lse[start:end])


def test_thread_and_repeat_invariance_forward_backward():
    lens = [300, 45, 1030]
    q, k, v, cq, ck = make(lens, lens, 4, 1, 64, torch.float32, seed=8)
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    torch.set_num_threads(1)
    f1 = run(q, k, v, cq, ck)
    g1 = grads(q, k, v, cq, ck, go)
    torch.set_num_threads(2)
    f2 = run(q, k, v, cq, ck)
    g2 = grads(q, k, v, cq, ck, go)
    g3 = grads(q, k, v, cq, ck, go)
    for a, b in zip(f1 + g1, f2 + g2):
        assert bitwise_equal(a, b)
    for a, b in zip(g2, g3):
        assert bitwise_equal(a, b)
    # bf16, 7 query heads per KV head (the AVX-512 forward's 4 + 3 pairs), whole blocks handed out by a work counter
    # in whatever order the threads take them: 1, 2, 3 threads and repeats give the same bits
    q, k, v, cq, ck = make([90, 260, 33], [90, 260, 33], 14, 2, 64, torch.bfloat16, seed=10)
    outs = []
    for threads in (1, 2, 3, 3, 2):
        torch.set_num_threads(threads)
        outs.append(run(q, k, v, cq, ck))
    torch.set_num_threads(2)
    for other in outs[1:]:
        assert bitwise_equal(outs[0][0], other[0]) and bitwise_equal(outs[0][1], other[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariance_backward(dtype):
    """dq of a sequence's rows and dk/dv of its keys do not depend on the other sequences of the batch."""
    lens = [40, 3, 77]
    q, k, v, cq, ck = make(lens, lens, 4, 2, 32, dtype, seed=10)
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(11)).to(dtype)
    dq, dk, dv = grads(q, k, v, cq, ck, go)
    s = slice(43, 120)
    dq1, dk1, dv1 = grads(q[s], k[s], v[s], cu([77]), cu([77]), go[s])
    assert bitwise_equal(dq1, dq[s]) and bitwise_equal(dk1, dk[s]) and bitwise_equal(dv1, dv[s])


_ISA_SCRIPT = (
    "import sys, torch, aligned_ops\n"
    "from aligned_ops import _C\n"
    "g = torch.Generator().manual_seed(0)\n"
    "lens = [3, 530]; cu = torch.tensor([0, 3, 533], dtype=torch.int32)\n"
    "q = torch.randn(533, 2, 32, generator=g).bfloat16(); k = torch.randn(533, 1, 32, generator=g).bfloat16()\n"
    "v = torch.randn(533, 1, 32, generator=g).bfloat16()\n"
    "o, l = torch.ops.aligned.attention_varlen(q, k, v, cu, cu, 0.17, True)\n"
    "gr = torch.ops.aligned.attention_varlen_backward(o, q, k, v, o, l, cu, cu, 0.17, True)\n"
    "res = [o, l, *gr]\n"
    # The forward's other kernels per level: the AVX-512 path (16x16 K/V unpack when D % 16 == 0, TileProbs) against
    # the generic and AVX2 ones. Paged decode (GQA, 2 KV splits on the longest row, shuffled blocks) at D 64 / 128 in
    # fp16 and bf16; D 72 (unpack fallback) and 80; fp32; and rows whose K/V/q hold NaN, +-inf.
    "def paged(dt, D, lens, bs=16, hq=4, hkv=2, seed=1):\n"
    "    g = torch.Generator().manual_seed(seed); B = len(lens); nb = [(n + bs - 1) // bs for n in lens]\n"
    "    perm = torch.randperm(sum(nb), generator=g).int(); bt = torch.zeros(B, max(nb), dtype=torch.int32)\n"
    "    c = 0\n"
    "    for b in range(B): bt[b, :nb[b]] = perm[c:c + nb[b]]; c += nb[b]\n"
    "    kc = torch.randn(sum(nb), bs, hkv, D, generator=g).to(dt)\n"
    "    vc = torch.randn(sum(nb), bs, hkv, D, generator=g).to(dt)\n"
    "    q = torch.randn(B, hq, D, generator=g).to(dt)\n"
    "    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), torch.arange(B + 1, dtype=torch.int32)\n"
    "for dt in (torch.float16, torch.bfloat16):\n"
    "    for D in (64, 128, 80):\n"
    "        res.append(torch.ops.aligned.paged_attention(*paged(dt, D, [1, 37, 530]), 0.125, 'fma'))\n"
    "q, kc, vc, bt, sl, qsl = paged(torch.float32, 64, [20, 45, 33])\n"
    "res.append(torch.ops.aligned.paged_attention(q, kc, vc, bt, sl, qsl, 0.125, 'fma'))\n"
    "q, kc, vc, bt, sl, qsl = paged(torch.bfloat16, 64, [40, 50, 45, 33, 9])\n"
    "nan, inf = float('nan'), float('inf')\n"
    "kc[bt[1, 0], 3, 0, 5] = nan; vc[bt[2, 1], 2, 1, 7] = inf\n"
    "kc[bt[3, 0], 4, 1, :] = inf; vc[bt[3, 1], 0, 0, 9] = -inf\n"
    "q[4, 0, 2] = inf\n"
    "res.append(torch.ops.aligned.paged_attention(q, kc, vc, bt, sl, qsl, 0.125, 'fma'))\n"
    "g = torch.Generator().manual_seed(2); cu = torch.tensor([0, 5, 45], dtype=torch.int32)\n"
    "for dt, D in ((torch.bfloat16, 72), (torch.float16, 80), (torch.float32, 64), (torch.float32, 72)):\n"
    "    q, k, v = (torch.randn(45, h, D, generator=g).to(dt) for h in (4, 2, 2))\n"
    "    k[40, 1, 3] = nan; v[30, 0, 1] = inf\n"
    "    res += list(torch.ops.aligned.attention_varlen(q, k, v, cu, cu, 0.1, True))\n"
    # Causal prefill at D 64 / 128 with 7 query heads per KV head (the AVX-512 forward updates 1-4 (row, head) pairs
    # of a tile together, each pair's PV chain ending at its own diagonal): NaN and inf in later keys (every earlier
    # row's chain must end before them), scores of exactly +-0 (the tile maximum's scalar fallback), fp16 / bf16 /
    # fp32; value rows whose one dim holds +inf, -inf and NaN within a tile, across tiles and across the 512-key
    # splits, so a default NaN (inf - inf) meets an input NaN in one fma: the sign of the NaN that survives depends
    # on the instruction's operand order, which every level must keep.
    "cu = torch.tensor([0, 37, 107, 140], dtype=torch.int32)\n"
    "for dt, D in ((torch.bfloat16, 64), (torch.float16, 128), (torch.float32, 64), (torch.bfloat16, 128)):\n"
    "    q, k, v = (torch.randn(140, h, D, generator=g).to(dt) for h in (14, 2, 2))\n"
    "    k[60, 1, :] = nan; v[80, 0, 3] = inf; v[81, 1, :] = -inf; q[100, 3, :] = 0; k[120:123, 0, :] = 0\n"
    "    q[110, 7, :] = -0.0\n"
    "    res += list(torch.ops.aligned.attention_varlen(q, k, v, cu, cu, 0.125, True))\n"
    "cu = torch.tensor([0, 40, 700], dtype=torch.int32)\n"
    "for dt, D in ((torch.bfloat16, 64), (torch.float32, 128)):\n"
    "    q, k, v = (torch.randn(700, h, D, generator=g).to(dt) for h in (14, 2, 2))\n"
    "    v[2, 0, 5] = inf; v[3, 0, 5] = -inf; v[4, 0, 5] = nan\n"
    "    v[70, 1, 9] = -inf; v[100, 1, 9] = inf; v[101, 1, 9] = nan; v[40, 0, 1] = nan; v[41, 0, 1] = -inf\n"
    "    v[551, 0, 2] = inf; v[600, 0, 2] = -inf; v[690, 1, 3] = nan; v[41 + 511, 1, 3] = inf\n"
    "    res += list(torch.ops.aligned.attention_varlen(q, k, v, cu, cu, 0.125, True))\n"
    "torch.save(res, sys.argv[1])\n"
)
ISA_FAMILIES = {"attention": _ISA_SCRIPT}  # run once per level for the whole run by tests/_isa_matrix.py


@pytest.mark.slow
def test_isa_levels_identical(isa_matrix):
    """generic (scalar, libm fmaf), AVX2 and AVX-512 builds of the kernels produce the same bits."""
    results = []
    for isa in isa_matrix.levels_to_compare():
        results.append(torch.load(isa_matrix.run(isa, "attention").path))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert bitwise_equal(a, b)


# ---- negative controls ----------------------------------------------------------------------------------


def test_negative_control_sdpa_decode_vs_prefill():
    """torch's SDPA is not decode/prefill invariant in fp32: the checker used above detects it."""
    n = 200
    q, k, v, cq, ck = make([n], [n], 2, 2, 64, torch.float32, seed=12)
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
    full = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    mismatches = 0
    for p in (63, 120, 199):
        last = F.scaled_dot_product_attention(qt[:, :, p : p + 1], kt[:, :, : p + 1], vt[:, :, : p + 1])
        mismatches += not bitwise_equal(full[:, :, p : p + 1], last)
        # ours on the same case is exact
        o_full = run(q, k, v, cq, ck)[0][p]
        o_dec = run(q[p : p + 1], k[: p + 1], v[: p + 1], cu([1]), cu([p + 1]))[0][0]
        assert bitwise_equal(o_full, o_dec)
    assert mismatches > 0


def merge_lse(o1, l1, o2, l2):
    """Cascade merge of two partial attentions (what a prefix + new-chunk implementation does)."""
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    return ((o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]).to(o1.dtype)


def test_negative_control_chunk_aligned_splits():
    """A chunked prefill that splits the keys at the chunk boundary (prefix part + causal chunk part, merged by
    LSE) instead of at absolute 512-key boundaries is NOT bitwise equal to the one-shot result: the invariance
    checks above would catch a kernel that did this."""
    n, c0 = 300, 100  # chunk = rows [100, 300) over prefix keys [0, 100)
    q, k, v, cq, ck = make([n], [n], 2, 2, 64, torch.float32, seed=13)
    ref_out = run(q, k, v, cq, ck)[0][c0:]
    o_pre, l_pre = run(q[c0:], k[:c0], v[:c0], cu([n - c0]), cu([c0]), causal=False)
    o_new, l_new = run(q[c0:], k[c0:], v[c0:], cu([n - c0]), cu([n - c0]), causal=True)
    cascaded = merge_lse(o_pre, l_pre, o_new, l_new)
    torch.testing.assert_close(cascaded, ref_out, atol=1e-5, rtol=1e-5)  # right answer...
    assert not bitwise_equal(cascaded, ref_out)  # ...but different bits


# ---- opcheck / compile ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    q, k, v, cq, ck = make([5, 9], [5, 12], 4, 2, 16, dtype, seed=14)
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    torch.library.opcheck(ops.attention_varlen.default, (q, k, v, cq, ck, 0.25, True))
    out, lse = run(q.detach(), k.detach(), v.detach(), cq, ck, scale=0.25)
    torch.library.opcheck(
        ops.attention_varlen_backward.default, (torch.ones_like(out), q.detach(), k.detach(), v.detach(), out, lse, cq, ck, 0.25, True)
    )


def test_torch_compile_matches_eager():
    q, k, v, cq, ck = make([5, 40], [5, 40], 4, 2, 32, torch.float32, seed=15)

    def f(q, k, v):
        out, lse = aligned_ops.attention_varlen(q, k, v, cq, ck)
        return out * 2, lse

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    assert bitwise_equal(eager[0], compiled[0]) and bitwise_equal(eager[1], compiled[1])
    # backward through the compiled graph
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    torch.compile(f, fullgraph=True)(qa, ka, va)[0].sum().backward()
    qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
    f(qb, kb, vb)[0].sum().backward()
    assert bitwise_equal(qa.grad, qb.grad) and bitwise_equal(ka.grad, kb.grad) and bitwise_equal(va.grad, vb.grad)


# ---- bad input ------------------------------------------------------------------------------------------


def test_bad_inputs():
    q, k, v, cq, ck = make([4, 5], [4, 5], 4, 2, 16, torch.float32)
    with pytest.raises(RuntimeError, match="k must have the dtype of q"):
        run(q, k.double(), v, cq, ck)
    with pytest.raises(RuntimeError, match="must be float32, bfloat16 or float16"):
        run(q.double(), k.double(), v.double(), cq, ck)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        run(q[:, :3], k, v, cq, ck)
    with pytest.raises(RuntimeError, match="head_dim of k"):
        run(q, k[..., :8], v[..., :8], cq, ck)
    with pytest.raises(RuntimeError, match="k and v must have the same shape"):
        run(q, k, v[:, :1], cq, ck)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be int32"):
        run(q, k, v, cq.long(), ck)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        run(q, k, v, torch.tensor([0, 6, 5, 9], dtype=torch.int32), torch.tensor([0, 4, 4, 9], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"cu_seqlens_k\[-1\] must equal the number of rows"):
        run(q, k, v, cq, torch.tensor([0, 4, 8], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="same length"):
        run(q, k, v, cq, torch.tensor([0, 9], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="must be on the same device"):
        run(q.to("meta"), k, v, cq, ck)
    meta = run(*(t.to("meta") for t in (q, k, v, cq, ck)))  # all-meta: shapes only
    assert meta[0].shape == q.shape and meta[1].shape == (9, 4) and meta[1].dtype == torch.float32
    with pytest.raises(RuntimeError, match="q must be"):
        run(q[0], k, v, cq, ck)
    out, lse = run(q, k, v, cq, ck)
    with pytest.raises(RuntimeError, match="lse must be float32"):
        ops.attention_varlen_backward(out, q, k, v, out, lse[:3], cq, ck, 0.25, True)
    with pytest.raises(RuntimeError, match="grad_out must match q"):
        ops.attention_varlen_backward(out.half(), q, k, v, out, lse, cq, ck, 0.25, True)
