"""MLA (latent attention, csrc/common/attention.h "MLA"): mla_attention_varlen (+ backward), mla_reshape_and_cache,
mla_paged_attention (+ planned form).

Accuracy against a float64 reference (several kv_lora_rank + rope_dim sizes, odd ones included, non-contiguous
inputs); bitwise invariance through integer views — a sequence alone ≡ in a batch, chunked prefill ≡ whole
prefill ≡ decode from the latent cache (any block size), planned ≡ per-call, threads and repeated runs, every CPU
ISA level — each with a negative control; gradients against torch autograd of the reference; opcheck and
torch.compile(fullgraph=True); clear errors naming the op and the argument."""

from __future__ import annotations

import pathlib

import pytest
import torch

import aligned_ops
from aligned_ops.testing import bitwise_equal

ops = torch.ops.aligned
TOL = {torch.float32: (3e-5, 3e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3)}
SIZES = [(512, 64), (128, 32), (40, 8), (33, 0)]  # (kv_lora_rank, rope_dim): DeepSeek-V3 / Kimi-K2, smaller, odd


# ---- references and inputs --------------------------------------------------------------------------------------


def ref_mla(q, kv, cu_q, cu_k, R, scale, causal=True):
    """Plain float64 latent attention per sequence (bottom-right causal): scores over the whole row, values its
    first R dims. Rows that see no key: out 0, lse -inf."""
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b] : cu_q[b + 1]].double()
        cs = kv[cu_k[b] : cu_k[b + 1]].double()
        s = torch.einsum("qhd,kd->hqk", qs, cs) * scale
        lq, lk = qs.shape[0], cs.shape[0]
        if causal:
            pos = torch.arange(lq)[:, None] + (lk - lq)
            s = s.masked_fill(torch.arange(lk)[None, :] > pos, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        outs.append(torch.einsum("hqk,kd->qhd", p, cs[:, :R]))
        lses.append(lse.T)
    return torch.cat(outs), torch.cat(lses)


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def make(lens_q, lens_k, h, R, rope, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = R + rope
    q = torch.randn(sum(lens_q), h, D, generator=g).to(dtype)
    kv = torch.randn(sum(lens_k), D, generator=g).to(dtype)
    return q, kv, cu(lens_q), cu(lens_k)


def scale_of(D):
    return D ** -0.5


def varlen(q, kv, cq, ck, R, causal=True):
    return ops.mla_attention_varlen(q, kv, cq, ck, R, scale_of(q.shape[-1]), causal)


def fill_cache(kv, lens, R, block_size, n_blocks=None, seed=0):
    """A latent cache holding each sequence's rows in shuffled blocks (written by mla_reshape_and_cache); returns
    (cache, block_table)."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + block_size - 1) // block_size for n in lens]
    n_blocks = n_blocks or sum(need) + 3
    perm = torch.randperm(n_blocks, generator=g)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    slots, used = [], 0
    for b, n in enumerate(lens):
        blocks = perm[used : used + need[b]]
        used += need[b]
        table[b, : need[b]] = blocks.to(torch.int32)
        slots += [int(blocks[j // block_size]) * block_size + j % block_size for j in range(n)]
    cache = torch.full((n_blocks, block_size, kv.shape[1]), float("nan"), dtype=kv.dtype)
    aligned_ops.mla_reshape_and_cache(kv[:, :R], kv[:, R:], cache, torch.tensor(slots, dtype=torch.int64))
    return cache, table


def paged(q, cache, table, seq_lens, q_lens, R):
    return ops.mla_paged_attention(q, cache, table, torch.tensor(seq_lens, dtype=torch.int32), cu(q_lens), R,
                                   scale_of(q.shape[-1]))


# ---- accuracy ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("R, rope", SIZES)
def test_forward_matches_float64(dtype, R, rope):
    lens_q, lens_k = [3, 530, 1], [3, 530, 6]  # a 2-split sequence; a decode row over 6 keys (bottom-right)
    q, kv, cq, ck = make(lens_q, lens_k, 3, R, rope, dtype, seed=1)
    out, lse = varlen(q, kv, cq, ck, R)
    ref_out, ref_lse = ref_mla(q, kv, cq, ck, R, scale_of(R + rope))
    assert out.shape == (q.shape[0], 3, R) and out.dtype == dtype and lse.dtype == torch.float32
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref_out, rtol=rtol, atol=atol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_forward_non_causal_and_empty_rows():
    q, kv, cq, ck = make([4, 6], [9, 3], 2, 40, 8, torch.float32, seed=2)
    out, lse = varlen(q, kv, cq, ck, 40, causal=False)
    ref_out, ref_lse = ref_mla(q, kv, cq, ck, 40, scale_of(48), causal=False)
    torch.testing.assert_close(out.double(), ref_out, rtol=3e-5, atol=3e-5)
    # q longer than k (causal): the first rows see no key -> out 0, lse -inf
    out, lse = varlen(q[:6], kv[:3], cu([6]), cu([3]), 40)
    assert torch.all(out[:3] == 0) and torch.all(lse[:3] == float("-inf"))


def test_non_contiguous_inputs():
    """q a strided view, kv a slice of a wider projection output (as vLLM's kv_a_proj split gives it)."""
    q, kv, cq, ck = make([7, 20], [7, 20], 4, 64, 16, torch.bfloat16, seed=3)
    q_nc = q.transpose(0, 1).contiguous().transpose(0, 1)
    wide = torch.cat([torch.randn(kv.shape[0], 5).to(kv.dtype), kv, torch.randn(kv.shape[0], 3).to(kv.dtype)], 1)
    kv_nc = wide[:, 5 : 5 + 80]
    assert not q_nc.is_contiguous() and not kv_nc.is_contiguous()
    a = varlen(q, kv, cq, ck, 64)
    b = varlen(q_nc, kv_nc, cq, ck, 64)
    assert bitwise_equal(a[0], b[0]) and bitwise_equal(a[1], b[1])


def test_is_the_attention_contract_with_one_kv_head():
    """MLA is attention_varlen with Hkv = 1, K = V = the row, the first R output dims kept (one contract, one plan)."""
    q, kv, cq, ck = make([5, 40], [5, 40], 3, 48, 16, torch.bfloat16, seed=4)
    out, lse = varlen(q, kv, cq, ck, 48)
    row = kv[:, None, :]
    a_out, a_lse = ops.attention_varlen(q, row, row, cq, ck, scale_of(64), True)
    assert bitwise_equal(out, a_out[..., :48].contiguous()) and bitwise_equal(lse, a_lse)


# ---- invariance ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariance(dtype):
    """A sequence's output alone ≡ in a batch (any position in it)."""
    lens = [17, 530, 2, 64]
    q, kv, cq, ck = make(lens, lens, 4, 128, 32, dtype, seed=5)
    out, lse = varlen(q, kv, cq, ck, 128)
    for b in range(len(lens)):
        s, e = int(cq[b]), int(cq[b + 1])
        o1, l1 = varlen(q[s:e], kv[s:e], cu([e - s]), cu([e - s]), 128)
        assert bitwise_equal(out[s:e], o1) and bitwise_equal(lse[s:e], l1), f"sequence {b}"


def merge_lse(o1, l1, o2, l2):
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    return ((o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]).to(o1.dtype)


def test_negative_control_prefix_merge_differs():
    """vLLM's MLA chunked prefill (prefix attention + causal chunk attention, merged by LSE) gives the right answer
    with different bits: the chunked ≡ whole checks below would catch a kernel that did this."""
    n, c0, R = 300, 100, 64
    q, kv, cq, ck = make([n], [n], 2, R, 16, torch.float32, seed=6)
    whole = varlen(q, kv, cq, ck, R)[0][c0:]
    o_pre, l_pre = varlen(q[c0:], kv[:c0], cu([n - c0]), cu([c0]), R, causal=False)
    o_new, l_new = varlen(q[c0:], kv[c0:], cu([n - c0]), cu([n - c0]), R, causal=True)
    cascaded = merge_lse(o_pre, l_pre, o_new, l_new)
    torch.testing.assert_close(cascaded, whole, atol=1e-5, rtol=1e-5)
    assert not bitwise_equal(cascaded, whole)


@pytest.mark.parametrize("block_size", [16, 1, 64, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_and_chunked_prefill_from_cache_equal_varlen(block_size, dtype):
    """The trainer's varlen pass ≡ vLLM's paths over the latent cache: whole prefill, chunked prefill (chunks of
    any size, a prefix hit), decode one token at a time, and a mixed batch of them."""
    R, rope, lens = 128, 32, [600, 37]
    q, kv, cq, ck = make(lens, lens, 4, R, rope, dtype, seed=7)
    ref = varlen(q, kv, cq, ck, R)[0]
    cache, table = fill_cache(kv, lens, R, block_size, seed=block_size)
    # whole prefill of both sequences from the cache
    assert bitwise_equal(paged(q, cache, table, lens, lens, R), ref)
    # chunked prefill of sequence 0 (chunk boundaries off the 32/512 grid), each chunk alone
    s0 = q[: lens[0]]
    for a, b in [(0, 45), (45, 300), (300, 513), (513, 600)]:
        o = paged(s0[a:b], cache, table[:1], [b], [b - a], R)
        assert bitwise_equal(o, ref[a:b]), f"chunk {a}:{b}"
    # decode: one token of each sequence at several positions, batched together
    for p0, p1 in [(0, 0), (511, 36), (512, 20), (599, 1)]:
        qd = torch.stack([q[p0], q[lens[0] + p1]])
        o = paged(qd, cache, table, [p0 + 1, p1 + 1], [1, 1], R)
        assert bitwise_equal(o[0], ref[p0]) and bitwise_equal(o[1], ref[lens[0] + p1]), (p0, p1)
    # a mixed step: a decode row of sequence 1 and a prefill chunk of sequence 0 (a prefix hit at 200)
    qm = torch.cat([q[lens[0] + 30 : lens[0] + 31], s0[200:260]])
    o = paged(qm, cache, torch.stack([table[1], table[0]]), [31, 260], [1, 60], R)
    assert bitwise_equal(o[:1], ref[lens[0] + 30 : lens[0] + 31]) and bitwise_equal(o[1:], ref[200:260])


def test_negative_control_decode_check_sees_a_wrong_key():
    """The decode ≡ varlen check fails when one cached row differs slightly (relative 2^-12: the check is live)."""
    R, lens = 64, [100]
    q, kv, cq, ck = make(lens, lens, 2, R, 16, torch.float32, seed=8)
    ref = varlen(q, kv, cq, ck, R)[0]
    cache, table = fill_cache(kv, lens, R, 16)
    blk = int(table[0, 50 // 16])
    cache[blk, 50 % 16] *= 1 + 2.0**-12
    assert not bitwise_equal(paged(q[99:], cache, table, [100], [1], R), ref[99:])


def test_planned_equals_per_call():
    R, rope, lens, bs = 96, 32, [40, 1, 530], 16
    q, kv, cq, ck = make(lens, lens, 2, R, rope, torch.bfloat16, seed=9)
    cache, table = fill_cache(kv, lens, R, bs)
    q_lens, seq_lens = [5, 1, 530], lens  # the last 5 of seq 0, seq 1 whole, seq 2 whole
    qq = torch.cat([q[35:40], q[40:41], q[41:]])
    per_call = paged(qq, cache, table, seq_lens, q_lens, R)
    plan = aligned_ops.AttentionPlan().plan_paged(cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32), table, 2, 1,
                                                  R + rope, cache.shape[0], bs)
    planned = aligned_ops.mla_paged_attention(qq, cache, kv_lora_rank=R, scale=scale_of(R + rope), plan=plan)
    assert bitwise_equal(planned, per_call)
    # the plan checks the call: another head count is refused by name
    with pytest.raises(RuntimeError, match="mla_paged_attention_planned"):
        aligned_ops.mla_paged_attention(qq[:, :1].contiguous(), cache, kv_lora_rank=R, scale=0.1, plan=plan)


def test_varlen_planned_equals_per_call_forward_and_backward():
    """The trainer's run form (one plan per step, every layer): same bits as the per-call form, gradients included;
    the backward refuses offsets its forward's plan was not made from (negative control of the plan check)."""
    R, rope, lens = 64, 16, [30, 1, 530]
    q, kv, cq, ck = make(lens, lens, 2, R, rope, torch.bfloat16, seed=22)
    go = torch.randn(q.shape[0], 2, R, generator=torch.Generator().manual_seed(23)).to(torch.bfloat16)
    plan = aligned_ops.AttentionPlan().plan_varlen(cq, ck, 2, 1, R + rope)
    res = []
    for p in (None, plan):
        qa, ka = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out, lse = aligned_ops.mla_attention_varlen(qa, ka, cq, ck, R, scale_of(R + rope), plan=p)
        out.backward(go)
        res.append((out, lse, qa.grad, ka.grad))
    for a, b in zip(*res):
        assert bitwise_equal(a, b)
    other = cu([31, 530])
    with pytest.raises(RuntimeError, match="mla_attention_varlen_planned: cu_seqlens_q / cu_seqlens_k are not the "
                       "offsets the plan"):
        aligned_ops.mla_attention_varlen(q, kv, other, other, R, 0.1, plan=plan)
    out, lse = aligned_ops.mla_attention_varlen(q, kv, cq, ck, R, 0.1, plan=plan)
    with pytest.raises(RuntimeError, match="mla_attention_varlen_backward: cu_seqlens_q / cu_seqlens_k are not"):
        ops.mla_attention_varlen_backward(go, q, kv, out, lse, other, other, R, 0.1, True, plan.info)


def test_threads_and_repeats():
    q, kv, cq, ck = make([70, 33], [70, 33], 4, 64, 16, torch.bfloat16, seed=10)
    go = torch.randn(q.shape[0], 4, 64).to(torch.bfloat16)
    n = torch.get_num_threads()

    def once():
        qa, ka = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out, lse = aligned_ops.mla_attention_varlen(qa, ka, cq, ck, 64, scale_of(80))
        out.backward(go)
        return out, lse, qa.grad, ka.grad

    try:
        torch.set_num_threads(1)
        a = once()
        torch.set_num_threads(max(2, n))
        b, c = once(), once()
    finally:
        torch.set_num_threads(n)
    for x, y, z in zip(a, b, c):
        assert bitwise_equal(x, y) and bitwise_equal(y, z)


# ---- the cache write ------------------------------------------------------------------------------------------


def test_reshape_and_cache_layout():
    T, R, rope, bs = 9, 40, 8, 4
    g = torch.Generator().manual_seed(11)
    wide = torch.randn(T, R + rope + 6, generator=g).to(torch.bfloat16)  # kv_c, k_pe: slices of one projection
    kv_c, k_pe = wide[:, :R], wide[:, R : R + rope]
    cache = torch.zeros(5, bs, R + rope, dtype=torch.bfloat16)
    slots = torch.tensor([3, 0, -1, 19, 7, 8, -1, 12, 1], dtype=torch.int64)
    aligned_ops.mla_reshape_and_cache(kv_c, k_pe, cache, slots)
    flat = cache.view(-1, R + rope)
    want = torch.zeros_like(flat)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[s] = torch.cat([kv_c[t], k_pe[t]])
    assert bitwise_equal(flat, want)  # -1 skipped, nothing else touched


# ---- gradients ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R, rope", [(64, 16), (33, 0)])
def test_backward_matches_float64_autograd(dtype, R, rope):
    lens = [6, 40, 1]
    q, kv, cq, ck = make(lens, [6, 40, 3], 3, R, rope, dtype, seed=12)
    go = torch.randn(q.shape[0], 3, R, generator=torch.Generator().manual_seed(13)).to(dtype)
    qa, ka = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, _ = aligned_ops.mla_attention_varlen(qa, ka, cq, ck, R, scale_of(R + rope))
    out.backward(go)
    qr, kr = q.double().requires_grad_(), kv.double().requires_grad_()
    ref_mla(qr, kr, cq, ck, R, scale_of(R + rope))[0].backward(go.double())
    rtol, atol = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (3e-2, 3e-2)}[dtype]
    torch.testing.assert_close(qa.grad.double(), qr.grad, rtol=rtol, atol=atol)
    torch.testing.assert_close(ka.grad.double(), kr.grad, rtol=rtol, atol=atol)


def test_backward_one_rounding_of_the_shared_row():
    """dkv = round(dk + dv) in fp32 (the row is both key and value): equal to the fp32 attention backward's sum rounded
    once — and NOT to the sum of the separately rounded bf16 key and value gradients (the negative control)."""
    R, rope = 48, 16
    q, kv, cq, ck = make([50], [50], 4, R, rope, torch.bfloat16, seed=14)
    go = torch.randn(50, 4, R, generator=torch.Generator().manual_seed(15)).to(torch.bfloat16)
    out, lse = varlen(q, kv, cq, ck, R)
    dq, dkv = ops.mla_attention_varlen_backward(go, q, kv, out, lse, cq, ck, R, scale_of(R + rope), True)
    pad = lambda t: torch.nn.functional.pad(t.float(), (0, rope))  # noqa: E731
    row = kv.float()[:, None, :]
    dq32, dk32, dv32 = ops.attention_varlen_backward(pad(go), q.float(), row, row, pad(out), lse, cq, ck,
                                                     scale_of(R + rope), True)
    want = dk32[:, 0].clone()
    want[:, :R] += dv32[:, 0, :R]
    assert bitwise_equal(dq, dq32.to(torch.bfloat16)) and bitwise_equal(dkv, want.to(torch.bfloat16))
    rowb = kv[:, None, :]
    _, dkb, dvb = ops.attention_varlen_backward(pad(go).to(torch.bfloat16), q, rowb, rowb, pad(out).to(torch.bfloat16),
                                                lse, cq, ck, scale_of(R + rope), True)
    twice = dkb[:, 0].clone()
    twice[:, :R] += dvb[:, 0, :R]
    assert not bitwise_equal(dkv, twice)


def test_backward_batch_invariance():
    lens = [20, 45, 3]
    q, kv, cq, ck = make(lens, lens, 2, 64, 16, torch.bfloat16, seed=16)
    go = torch.randn(q.shape[0], 2, 64, generator=torch.Generator().manual_seed(17)).to(torch.bfloat16)
    out, lse = varlen(q, kv, cq, ck, 64)
    dq, dkv = ops.mla_attention_varlen_backward(go, q, kv, out, lse, cq, ck, 64, scale_of(80), True)
    for b in range(3):
        s, e = int(cq[b]), int(cq[b + 1])
        dq1, dkv1 = ops.mla_attention_varlen_backward(go[s:e], q[s:e], kv[s:e], out[s:e], lse[s:e], cu([e - s]),
                                                      cu([e - s]), 64, scale_of(80), True)
        assert bitwise_equal(dq[s:e], dq1) and bitwise_equal(dkv[s:e], dkv1), f"sequence {b}"


def test_paged_ops_have_no_backward():
    q, kv, cq, ck = make([4], [4], 2, 32, 8, torch.float32, seed=18)
    cache, table = fill_cache(kv, [4], 32, 4)
    qa = q.clone().requires_grad_()
    out = paged(qa, cache, table, [4], [4], 32)
    with pytest.raises(RuntimeError, match="mla_paged_attention.*(no|not).*backward|inference only"):
        out.sum().backward()


# ---- opcheck / compile ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    R, rope, bs = 32, 8, 4
    q, kv, cq, ck = make([5, 9], [5, 12], 2, R, rope, dtype, seed=19)
    torch.library.opcheck(ops.mla_attention_varlen.default,
                          (q.clone().requires_grad_(), kv.clone().requires_grad_(), cq, ck, R, 0.25, True))
    out, lse = varlen(q, kv, cq, ck, R)
    torch.library.opcheck(ops.mla_attention_varlen_backward.default,
                          (torch.ones_like(out), q, kv, out, lse, cq, ck, R, 0.25, True))
    vplan = aligned_ops.AttentionPlan().plan_varlen(cq, ck, 2, 1, R + rope)
    torch.library.opcheck(ops.mla_attention_varlen_planned.default,
                          (q.clone().requires_grad_(), kv.clone().requires_grad_(), cq, ck, vplan.plan, vplan.info,
                           vplan.workspace_floats, R, 0.25, True))
    cache, table = fill_cache(kv[5:], [12], R, bs)
    slots = torch.arange(kv.shape[0], dtype=torch.int64)
    cache2 = torch.zeros(6, bs, R + rope, dtype=dtype)
    torch.library.opcheck(ops.mla_reshape_and_cache.default, (kv[:, :R], kv[:, R:], cache2, slots))
    args = (q[5:], cache, table, torch.tensor([12], dtype=torch.int32), cu([9]), R, 0.25)
    torch.library.opcheck(ops.mla_paged_attention.default, args)
    plan = aligned_ops.AttentionPlan().plan_paged(cu([9]), torch.tensor([12], dtype=torch.int32), table, 2, 1, R + rope,
                                                  cache.shape[0], bs)
    torch.library.opcheck(ops.mla_paged_attention_planned.default,
                          (q[5:], cache, plan.plan, plan.table, plan.info, plan.workspace_floats, R, 0.25))


def test_torch_compile_fullgraph():
    R, rope, lens = 64, 16, [5, 40]
    q, kv, cq, ck = make(lens, lens, 2, R, rope, torch.float32, seed=20)
    cache, table = fill_cache(kv, lens, R, 16)
    sl, ql = torch.tensor(lens, dtype=torch.int32), cu(lens)

    def f(q, kv):
        out, lse = aligned_ops.mla_attention_varlen(q, kv, cq, ck, R, 0.125)
        return out * 2, lse

    def g(q):
        return aligned_ops.mla_paged_attention(q, cache, table, sl, ql, R, 0.125)

    eager = f(q, kv)
    compiled = torch.compile(f, fullgraph=True)(q, kv)
    assert bitwise_equal(eager[0], compiled[0]) and bitwise_equal(eager[1], compiled[1])
    assert bitwise_equal(torch.compile(g, fullgraph=True)(q), g(q))
    qa, ka = q.clone().requires_grad_(), kv.clone().requires_grad_()
    torch.compile(f, fullgraph=True)(qa, ka)[0].sum().backward()
    qb, kb = q.clone().requires_grad_(), kv.clone().requires_grad_()
    f(qb, kb)[0].sum().backward()
    assert bitwise_equal(qa.grad, qb.grad) and bitwise_equal(ka.grad, kb.grad)


# ---- bad input ------------------------------------------------------------------------------------------------------


def test_bad_inputs():
    R = 32
    q, kv, cq, ck = make([4, 5], [4, 5], 2, R, 8, torch.float32, seed=21)
    op = ops.mla_attention_varlen
    with pytest.raises(RuntimeError, match="mla_attention_varlen: kv must have the dtype of q"):
        op(q, kv.to(torch.bfloat16), cq, ck, R, 0.1, True)
    with pytest.raises(RuntimeError, match=r"mla_attention_varlen: kv must be \[tokens, kv_lora_rank \+ rope_dim\]"):
        op(q, kv[:, None, :], cq, ck, R, 0.1, True)
    with pytest.raises(RuntimeError, match=r"mla_attention_varlen: the row width of kv \(39\) must equal q's last"):
        op(q, kv[:, :39], cq, ck, R, 0.1, True)
    with pytest.raises(RuntimeError, match=r"mla_attention_varlen: kv_lora_rank must be in \[1, 40\]"):
        op(q, kv, cq, ck, 41, 0.1, True)
    with pytest.raises(RuntimeError, match="mla_attention_varlen: kv_lora_rank must be in"):
        op(q, kv, cq, ck, 0, 0.1, True)
    with pytest.raises(RuntimeError, match="mla_attention_varlen: cu_seqlens_q must be int32"):
        op(q, kv, cq.long(), ck, R, 0.1, True)
    with pytest.raises(RuntimeError, match="mla_attention_varlen: scale must be finite"):
        op(q, kv, cq, ck, R, float("inf"), True)
    with pytest.raises(RuntimeError, match="mla_attention_varlen"):  # offsets past the rows: the planner, named
        op(q, kv, cu([4, 9]), ck, R, 0.1, True)
    out, lse = varlen(q, kv, cq, ck, R)
    with pytest.raises(RuntimeError, match=r"mla_attention_varlen_backward: grad_out must be \[9, 2, 32\]"):
        ops.mla_attention_varlen_backward(torch.ones_like(q), q, kv, out, lse, cq, ck, R, 0.1, True)
    cache = torch.zeros(4, 4, 40)
    with pytest.raises(RuntimeError, match=r"mla_reshape_and_cache: the row width of kv_cache \(40\) must equal"):
        ops.mla_reshape_and_cache(kv[:, :R], kv[:, R : R + 4], cache, torch.arange(9))
    with pytest.raises(RuntimeError, match="mla_reshape_and_cache: k_pe must have the dtype of kv_c"):
        ops.mla_reshape_and_cache(kv[:, :R], kv[:, R:].double(), cache, torch.arange(9))
    with pytest.raises(RuntimeError, match="mla_reshape_and_cache: slot_mapping must be int64"):
        ops.mla_reshape_and_cache(kv[:, :R], kv[:, R:], cache, torch.arange(9, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="mla_reshape_and_cache"):  # a slot past the cache (16 slots)
        ops.mla_reshape_and_cache(kv[:, :R], kv[:, R:], cache, torch.arange(9) + 10)
    with pytest.raises(RuntimeError, match=r"mla_reshape_and_cache: kv_cache must be \[num_blocks, block_size"):
        ops.mla_reshape_and_cache(kv[:, :R], kv[:, R:], cache[:, :, None], torch.arange(9))
    table = torch.zeros(1, 4, dtype=torch.int32)
    sl = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"mla_paged_attention: kv_cache must be \[num_blocks, block_size"):
        ops.mla_paged_attention(q[:5], cache[:, :, None], table, sl, cu([5]), R, 0.1)
    with pytest.raises(RuntimeError, match=r"mla_paged_attention: the row width of kv_cache \(40\) must equal"):
        ops.mla_paged_attention(q[:5, :, :32].contiguous(), cache, table, sl, cu([5]), 16, 0.1)
    with pytest.raises(RuntimeError, match="mla_paged_attention: block_table must be int32"):
        ops.mla_paged_attention(q[:5], cache, table.long(), sl, cu([5]), R, 0.1)
    with pytest.raises(RuntimeError, match="mla_paged_attention"):  # a block id past the cache: the planner, named
        ops.mla_paged_attention(q[:5], cache, table + 7, sl, cu([5]), R, 0.1)
    with pytest.raises(ValueError, match="aligned_ops.mla_attention_varlen: scale is required"):
        aligned_ops.mla_attention_varlen(q, kv, cq, ck, R, None)


# ---- ISA levels ---------------------------------------------------------------------------------------------------

_ISA_SCRIPT = r"""
import sys, torch
sys.path.insert(0, HERE)
from test_mla import make, varlen, fill_cache, paged, cu, ops, scale_of
res = []
for dtype in (torch.float32, torch.bfloat16):
    lens = [3, 530, 40]
    q, kv, cq, ck = make(lens, lens, 4, 96, 32, dtype, seed=30)
    out, lse = varlen(q, kv, cq, ck, 96)
    go = torch.randn(q.shape[0], 4, 96, generator=torch.Generator().manual_seed(31)).to(dtype)
    dq, dkv = ops.mla_attention_varlen_backward(go, q, kv, out, lse, cq, ck, 96, scale_of(128), True)
    cache, table = fill_cache(kv, lens, 96, 16)
    res += [out, lse, dq, dkv, paged(q[-1:], cache, table[2:], [40], [1], 96)]
torch.save(res, sys.argv[1])
""".replace("HERE", repr(str(pathlib.Path(__file__).resolve().parent)))
ISA_FAMILIES = {"mla": _ISA_SCRIPT}


@pytest.mark.slow
def test_isa_levels_identical(isa_matrix):
    """generic, AVX2 and AVX-512 builds give the same bits for MLA forward, backward and paged decode."""
    results = [torch.load(isa_matrix.run(isa, "mla").path) for isa in isa_matrix.levels_to_compare()]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert bitwise_equal(a, b)


# ---- the absorbed projections ---------------------------------------------------------------------------------------


def kv_b(H, dn, dv, R, dtype, seed):
    return (torch.randn(H * (dn + dv), R, generator=torch.Generator().manual_seed(seed)) * R ** -0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_projections_match_float64(dtype):
    H, dn, dv, R, T = 3, 24, 20, 40, 11
    w = kv_b(H, dn, dv, R, dtype, 40)
    g = torch.Generator().manual_seed(41)
    q_nope = torch.randn(T, H, dn, generator=g).to(dtype)
    o_lat = torch.randn(T, H, R, generator=g).to(dtype)
    ab = aligned_ops.mla_absorbed_weights(w, H, dn, dv)
    wv = w.double().view(H, dn + dv, R)
    rtol, atol = TOL[dtype]
    q_lat = aligned_ops.mla_absorb_q(q_nope, ab)
    assert q_lat.shape == (T, H, R) and q_lat.dtype == dtype
    torch.testing.assert_close(q_lat.double(), torch.einsum("thd,hdr->thr", q_nope.double(), wv[:, :dn]),
                               rtol=rtol, atol=atol)
    o = aligned_ops.mla_absorb_out(o_lat, ab)
    assert o.shape == (T, H, dv)
    torch.testing.assert_close(o.double(), torch.einsum("thr,hvr->thv", o_lat.double(), wv[:, dn:]), rtol=rtol,
                               atol=atol)
    # head h is the profile's linear of that head's slice (the layout of the derivation)
    assert bitwise_equal(q_lat[:, 1], aligned_ops.linear(q_nope[:, 1], wv[1, :dn].T.to(dtype).contiguous()))
    assert bitwise_equal(o[:, 2], aligned_ops.linear(o_lat[:, 2], wv[2, dn:].to(dtype).contiguous()))


def _split_k_by_batch(x, w):
    """A linear whose K split depends on the batch size (a batch-dependent split-K heuristic)."""
    k = w.shape[1] // (2 if x.shape[0] > 4 else 3)
    return (x[:, :k] @ w[:, :k].T + x[:, k:] @ w[:, k:].T).to(x.dtype)


def test_absorbed_projections_batch_invariant_with_negative_control():
    H, dn, dv, R = 2, 32, 16, 64
    w = kv_b(H, dn, dv, R, torch.float32, 42)
    ab = aligned_ops.mla_absorbed_weights(w, H, dn, dv)
    x = torch.randn(9, H, dn, generator=torch.Generator().manual_seed(43))
    o = torch.randn(9, H, R, generator=torch.Generator().manual_seed(44))
    qb, ob = aligned_ops.mla_absorb_q(x, ab), aligned_ops.mla_absorb_out(o, ab)
    for t in (0, 4, 8):
        assert bitwise_equal(aligned_ops.mla_absorb_q(x[t : t + 1], ab), qb[t : t + 1])
        assert bitwise_equal(aligned_ops.mla_absorb_out(o[t : t + 1], ab), ob[t : t + 1])
    # the same check on a batch-dependent split-K linear fails
    bad_b = aligned_ops.mla_absorb_out(o, ab, linear=_split_k_by_batch)
    assert any(not bitwise_equal(aligned_ops.mla_absorb_out(o[t : t + 1], ab, linear=_split_k_by_batch),
                                 bad_b[t : t + 1]) for t in range(9))


def test_absorbed_weights_cached_per_version_and_refit_invalidates():
    """A registered (engine) weight's W_UK / W_UV are derived once per weight state: an in-place write (version
    counter) is seen; a write through ``.data`` (vLLM's weight loaders, a broadcast) is not until
    ``clear_exact_weight_cache()`` (what load_weights / refit call) — negative control: without the clear the stale
    derivation is returned. Unregistered and inference tensors are derived per call."""
    H, dn, dv, R = 2, 8, 8, 16
    w = kv_b(H, dn, dv, R, torch.float32, 45)
    aligned_ops.cache_exact_weights(w)

    def fresh_uv(w):
        return w.view(H, dn + dv, R)[:, dn:].contiguous()

    with torch.no_grad():
        a = aligned_ops.mla_absorbed_weights(w, H, dn, dv)
        assert aligned_ops.mla_absorbed_weights(w, H, dn, dv) is a  # derived once per weight state
        w.copy_(kv_b(H, dn, dv, R, torch.float32, 46))  # an in-place write: the version counter moves
        b = aligned_ops.mla_absorbed_weights(w, H, dn, dv)
    assert b is not a and bitwise_equal(b.w_uv, fresh_uv(w))
    assert not bitwise_equal(a.w_uv, b.w_uv)
    with torch.no_grad():
        w.data.copy_(kv_b(H, dn, dv, R, torch.float32, 47))  # behind the counter's back
        stale = aligned_ops.mla_absorbed_weights(w, H, dn, dv)
        assert stale is b and not bitwise_equal(stale.w_uv, fresh_uv(w))  # negative control: stale without the clear
        aligned_ops.clear_exact_weight_cache()
        c = aligned_ops.mla_absorbed_weights(w, H, dn, dv)
    assert bitwise_equal(c.w_uv, fresh_uv(w))
    plain = kv_b(H, dn, dv, R, torch.float32, 48)  # not registered: per call
    with torch.no_grad():
        assert aligned_ops.mla_absorbed_weights(plain, H, dn, dv) is not aligned_ops.mla_absorbed_weights(
            plain, H, dn, dv)
    with torch.inference_mode():
        inf = kv_b(H, dn, dv, R, torch.float32, 49)
        assert bitwise_equal(aligned_ops.mla_absorbed_weights(inf, H, dn, dv).w_uv, fresh_uv(inf))
    with pytest.raises(ValueError, match=r"aligned_ops.mla_absorbed_weights: kv_b_proj weight must be"):
        aligned_ops.mla_absorbed_weights(w, 3, dn, dv)


def test_absorbed_attention_gradients_reach_kv_b_proj():
    """The absorbed attention of one layer (q_nope·W_UK ‖ q_rope over the latent rows, then ·W_UV), differentiated
    through the ops, against float64 autograd of the same formula."""
    H, dn, dr, dv, R, lens = 2, 16, 8, 12, 24, [5, 9]
    g = torch.Generator().manual_seed(47)
    T = sum(lens)
    q_nope, q_rope = torch.randn(T, H, dn, generator=g), torch.randn(T, H, dr, generator=g)
    kv = torch.randn(T, R + dr, generator=g)
    w = kv_b(H, dn, dv, R, torch.float32, 48)
    cq = cu(lens)
    scale = (dn + dr) ** -0.5

    def absorbed(q_nope, q_rope, kv, w):
        ab = aligned_ops.mla_absorbed_weights(w, H, dn, dv)
        q = torch.cat([aligned_ops.mla_absorb_q(q_nope, ab), q_rope], -1)
        o, _ = aligned_ops.mla_attention_varlen(q, kv, cq, cq, R, scale)
        return aligned_ops.mla_absorb_out(o, ab)

    def reference(q_nope, q_rope, kv, w):
        wv = w.view(H, dn + dv, R)
        q = torch.cat([torch.einsum("thd,hdr->thr", q_nope, wv[:, :dn]), q_rope], -1)
        o = ref_mla(q, kv, cq, cq, R, scale)[0]
        return torch.einsum("thr,hvr->thv", o, wv[:, dn:])

    ins = [t.clone().requires_grad_() for t in (q_nope, q_rope, kv, w)]
    gw = torch.randn(T, H, dv, generator=g)
    (absorbed(*ins) * gw).sum().backward()
    ins64 = [t.double().requires_grad_() for t in (q_nope, q_rope, kv, w)]
    (reference(*ins64) * gw.double()).sum().backward()
    for a, b in zip(ins, ins64):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-5)
