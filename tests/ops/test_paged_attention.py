"""aligned::reshape_and_cache and aligned::paged_attention: the cache write, and bitwise equality of every
serving path (one-shot prefill, chunked prefill with chunk sizes 1/7/64/1000, decode in mixed batches of any
composition, any block-table permutation, block sizes 16/32, 1 vs 2 threads) with the training path
attention_varlen. Negative control: torch's SDPA; bad input: block tables, seq_lens, slots, heads, dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from aligned_ops.testing import bits, bitwise_equal

ops = torch.ops.aligned


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def ref_attention_seq(q, k, v, scale):
    """float64 bottom-right causal attention of the last q.shape[0] tokens of one sequence."""
    qd, kd, vd = q.double(), k.double(), v.double()
    g = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", qd, kd) * scale
    lq, lk = qd.shape[0], kd.shape[0]
    s = s.masked_fill(torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + (lk - lq), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vd)


class PagedCache:
    """A paged KV cache with randomly permuted blocks for a set of sequences (max_len tokens each)."""

    def __init__(self, max_lens, hkv, d, dtype, block_size, seed=0, spare_blocks=3):
        g = torch.Generator().manual_seed(seed)
        need = [(n + block_size - 1) // block_size for n in max_lens]
        self.num_blocks = sum(need) + spare_blocks
        perm = torch.randperm(self.num_blocks, generator=g)
        width = max(need + [1]) + 2  # a few unused table entries, filled with garbage ids
        self.block_table = torch.full((len(max_lens), width), 10**6, dtype=torch.int32)
        pos = 0
        for b, nb in enumerate(need):
            self.block_table[b, :nb] = perm[pos : pos + nb].to(torch.int32)
            pos += nb
        # unused cache memory holds NaN: a read outside the used slots would show up in the result
        self.k_cache = torch.full((self.num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
        self.v_cache = torch.full((self.num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
        self.block_size = block_size

    def slots(self, b, positions):
        bs = self.block_size
        return (self.block_table[b, positions // bs].long() * bs + positions % bs).long()

    def write(self, b, start, k, v):
        pos = torch.arange(start, start + k.shape[0])
        ops.reshape_and_cache(k, v, self.k_cache, self.v_cache, self.slots(b, pos))

    def attend(self, q, seq_ids, seq_lens, q_lens, scale):
        bt = self.block_table[list(seq_ids)]
        return ops.paged_attention(q, self.k_cache, self.v_cache, bt, torch.tensor(seq_lens, dtype=torch.int32),
                                   cu(q_lens), scale)


def make_seqs(lens, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(n, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv)) for n in lens]


def varlen_out(seqs, scale):
    lens = [s[0].shape[0] for s in seqs]
    q, k, v = (torch.cat([s[i] for s in seqs]) for i in range(3))
    out, _ = ops.attention_varlen(q, k, v, cu(lens), cu(lens), scale, True)
    return [out[a:b] for a, b in zip(cu(lens)[:-1].tolist(), cu(lens)[1:].tolist())]


# ---- reshape_and_cache ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reshape_and_cache_writes_slots(dtype):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(6, 2, 8, generator=g).to(dtype)
    v = torch.randn(6, 2, 8, generator=g).to(dtype)
    kc = torch.zeros(4, 16, 2, 8, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([5, -1, 63, 16, 0, -1])
    ops.reshape_and_cache(k, v, kc, vc, slots)
    kf, vf = kc.view(-1, 2, 8), vc.view(-1, 2, 8)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert bitwise_equal(kf[s], k[t]) and bitwise_equal(vf[s], v[t])
    written = torch.zeros(64, dtype=torch.bool)
    written[[5, 63, 16, 0]] = True
    assert (kf[~written] == 0).all() and (vf[~written] == 0).all()  # padding tokens wrote nothing


# ---- paged == varlen, every serving path ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_and_decode_batches_equal_varlen(dtype, block_size):
    """One-shot prefill of a batch, then decode steps in batches of changing composition, equal the training
    pass over the whole sequences (rows of the same tokens) bit for bit."""
    hq, hkv, d = 4, 2, 64
    scale = d**-0.5
    lens = [1, 17, 530, 64, 3, 100, 33]  # final lengths; prompts are all but the last 3 tokens (or 1)
    seqs = make_seqs(lens, hq, hkv, d, dtype, seed=1)
    ref = varlen_out(seqs, scale)
    cache = PagedCache(lens, hkv, d, dtype, block_size, seed=2)
    prompt = [max(1, n - 3) for n in lens]
    # prefill all prompts in one paged call
    for b, (q, k, v) in enumerate(seqs):
        cache.write(b, 0, k[: prompt[b]], v[: prompt[b]])
    q = torch.cat([s[0][: prompt[b]] for b, s in enumerate(seqs)])
    out = cache.attend(q, range(len(lens)), prompt, prompt, scale)
    off = 0
    for b in range(len(lens)):
        assert bitwise_equal(out[off : off + prompt[b]], ref[b][: prompt[b]])
        off += prompt[b]
    # decode: each step a different subset of the sequences, in a shuffled order
    g = torch.Generator().manual_seed(3)
    cur = list(prompt)
    while any(c < n for c, n in zip(cur, lens)):
        live = [b for b in range(len(lens)) if cur[b] < lens[b]]
        live = [live[i] for i in torch.randperm(len(live), generator=g).tolist()]
        step = live[: max(1, len(live) - 1)] if len(live) > 2 else live
        for b in step:
            cache.write(b, cur[b], seqs[b][1][cur[b] : cur[b] + 1], seqs[b][2][cur[b] : cur[b] + 1])
        q = torch.cat([seqs[b][0][cur[b] : cur[b] + 1] for b in step])
        out = cache.attend(q, step, [cur[b] + 1 for b in step], [1] * len(step), scale)
        for i, b in enumerate(step):
            assert bitwise_equal(out[i], ref[b][cur[b]]), (b, cur[b])
            cur[b] += 1


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_prefill_equals_varlen_long_context(chunk):
    """A 2100-token sequence prefilled in chunks (each chunk attends to the paged cache, vLLM-style) gives the
    same bits as the whole-sequence training pass: 5 KV splits, merged the same way in both."""
    n, hq, hkv, d = 2100, 2, 1, 64
    scale = 0.11
    ((q, k, v),) = seqs = make_seqs([n], hq, hkv, d, torch.bfloat16, seed=4)
    ref = varlen_out(seqs, scale)[0]
    cache = PagedCache([n], hkv, d, torch.bfloat16, 16, seed=5)
    cache.write(0, 0, k, v)  # writing ahead is harmless: causal reads stop at each row's position
    outs = []
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        outs.append(cache.attend(q[s:e], [0], [e], [e - s], scale))
    assert bitwise_equal(torch.cat(outs), ref)
    torch.testing.assert_close(ref.double(), ref_attention_seq(q, k, v, scale), atol=2e-2, rtol=2e-2)


def test_mixed_batch_decode_chunk_prefill_any_composition():
    """Decode rows, a chunk and a fresh prompt in one call; same tokens in another grouping (batch of 1, of 64
    decode rows) — identical bits; and 1 vs 2 threads."""
    hq, hkv, d = 4, 1, 128
    scale = d**-0.5
    lens = [700, 40, 12] + [5 + 9 * i for i in range(61)]
    seqs = make_seqs(lens, hq, hkv, d, torch.float32, seed=6)
    ref = varlen_out(seqs, scale)
    cache = PagedCache(lens, hkv, d, torch.float32, 32, seed=7)
    for b, (q, k, v) in enumerate(seqs):
        cache.write(b, 0, k, v)
    # seq 0: decode of its last token; seq 1: chunk rows [20, 40); seq 2: whole prompt; 61 more decodes
    ids = list(range(len(lens)))
    q_lens = [1, 20, 12] + [1] * 61
    q = torch.cat([seqs[b][0][lens[b] - q_lens[b] :] for b in ids])
    outs = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs[threads] = cache.attend(q, ids, lens, q_lens, scale)
    assert bitwise_equal(outs[1], outs[2])
    off = 0
    for b in ids:
        assert bitwise_equal(outs[1][off : off + q_lens[b]], ref[b][lens[b] - q_lens[b] :])
        off += q_lens[b]
    # the same rows in a different batch order
    rev = ids[::-1]
    q_rev = torch.cat([seqs[b][0][lens[b] - q_lens[b] :] for b in rev])
    out_rev = cache.attend(q_rev, rev, [lens[b] for b in rev], [q_lens[b] for b in rev], scale)
    assert bitwise_equal(out_rev[-1], outs[1][0])


def test_block_table_permutation_invariance():
    """The same tokens stored in two caches with different block placements give identical bits."""
    n, hq, hkv, d = 300, 2, 2, 64
    ((q, k, v),) = make_seqs([n], hq, hkv, d, torch.float16, seed=8)
    outs = []
    for seed in (9, 10):
        cache = PagedCache([n], hkv, d, torch.float16, 16, seed=seed, spare_blocks=7)
        cache.write(0, 0, k, v)
        outs.append(cache.attend(q[-5:], [0], [n], [5], 0.125))
    assert bitwise_equal(outs[0], outs[1])


# ---- negative control -----------------------------------------------------------------------------------


def test_negative_control_sdpa_decode_differs_from_prefill():
    """The paged-vs-varlen check above, applied to torch's SDPA (decode = one query over the prefix vs the row
    of a full causal pass), reports mismatches in fp32 — so the check can fail."""
    n, hq, d = 150, 2, 64
    ((q, k, v),) = seqs = make_seqs([n], hq, hq, d, torch.float32, seed=11)
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
    full = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)[0].transpose(0, 1)
    dec = torch.cat([
        F.scaled_dot_product_attention(qt[:, :, p : p + 1], kt[:, :, : p + 1], vt[:, :, : p + 1])[0].transpose(0, 1)
        for p in range(n)
    ])
    assert not bitwise_equal(full, dec)
    # ours: the same check passes
    ref = varlen_out(seqs, d**-0.5)[0]
    cache = PagedCache([n], hq, d, torch.float32, 16, seed=12)
    cache.write(0, 0, k, v)
    ours = torch.cat([cache.attend(q[p : p + 1], [0], [p + 1], [1], d**-0.5) for p in range(n)])
    assert bitwise_equal(ours, ref)


# ---- opcheck / compile ----------------------------------------------------------------------------------


def test_opcheck_and_compile():
    hq, hkv, d = 4, 2, 16
    lens = [20, 5]
    seqs = make_seqs(lens, hq, hkv, d, torch.float32, seed=13)
    cache = PagedCache(lens, hkv, d, torch.float32, 16, seed=14)
    cache.k_cache.zero_()
    cache.v_cache.zero_()
    for b, (q, k, v) in enumerate(seqs):
        cache.write(b, 0, k, v)
    q = torch.cat([seqs[0][0][-3:], seqs[1][0][-1:]])
    bt, sl, qsl = cache.block_table[[0, 1]], torch.tensor(lens, dtype=torch.int32), cu([3, 1])
    args = (q, cache.k_cache, cache.v_cache, bt, sl, qsl, 0.25)
    torch.library.opcheck(ops.paged_attention.default, args)
    kn = torch.randn(2, hkv, d)
    torch.library.opcheck(
        ops.reshape_and_cache.default, (kn, kn.clone(), cache.k_cache.clone(), cache.v_cache.clone(), torch.tensor([40, -1]))
    )
    eager = ops.paged_attention(*args)
    compiled = torch.compile(lambda *a: ops.paged_attention(*a), fullgraph=True)(*args)
    assert bitwise_equal(eager, compiled)

    def write_then_attend(k_new, v_new, kc, vc, slots):
        ops.reshape_and_cache(k_new, v_new, kc, vc, slots)
        return ops.paged_attention(q, kc, vc, bt, sl, qsl, 0.25)

    kc1, vc1, kc2, vc2 = (c.clone() for c in (cache.k_cache, cache.v_cache) * 2)
    slots = cache.slots(0, torch.tensor([18, 19]))
    e = write_then_attend(kn, kn * 2, kc1, vc1, slots)
    c = torch.compile(write_then_attend, fullgraph=True)(kn, kn * 2, kc2, vc2, slots)
    assert bitwise_equal(e, c) and bitwise_equal(kc1, kc2) and bitwise_equal(vc1, vc2)


# ---- bad input ------------------------------------------------------------------------------------------


def test_bad_inputs_paged():
    hq, hkv, d = 4, 2, 16
    cache = PagedCache([40], hkv, d, torch.float32, 16, seed=15, spare_blocks=0)  # 3 blocks, table width 5
    q = torch.randn(2, hq, d)
    sl, qsl = torch.tensor([40], dtype=torch.int32), cu([2])
    bt = cache.block_table[:1].clone()

    def attend(q=q, kc=cache.k_cache, vc=cache.v_cache, bt=bt, sl=sl, qsl=qsl):
        return ops.paged_attention(q, kc, vc, bt, sl, qsl, 0.25)

    bad = bt.clone()
    bad[0, 1] = 3
    with pytest.raises(RuntimeError, match=r"block_table\[0, 1\] = 3 is out of range \[0, 3\)"):
        attend(bt=bad)
    bad[0, 1] = -1
    with pytest.raises(RuntimeError, match="out of range"):
        attend(bt=bad)
    with pytest.raises(RuntimeError, match="out of range"):  # seq_lens reaching into the garbage entries
        attend(sl=torch.tensor([70], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="longer than the block table"):
        attend(sl=torch.tensor([5 * 16 + 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="new tokens but seq_lens"):
        attend(sl=torch.tensor([1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        attend(q=torch.randn(2, 3, d))
    with pytest.raises(RuntimeError, match="head_dim of the cache"):
        attend(q=torch.randn(2, hq, 8))
    with pytest.raises(RuntimeError, match="must have the dtype of q"):
        attend(q=q.bfloat16())
    with pytest.raises(RuntimeError, match="block_table must be int32"):
        attend(bt=bt.long())
    with pytest.raises(RuntimeError, match="seq_lens must be int32"):
        attend(sl=sl.long())
    with pytest.raises(RuntimeError, match=r"query_start_loc\[-1\] must equal"):
        attend(qsl=cu([1]))
    with pytest.raises(RuntimeError, match="batch"):
        attend(sl=torch.tensor([40, 40], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="must be contiguous"):
        attend(kc=cache.k_cache.transpose(1, 2))
    with pytest.raises(RuntimeError, match="same device"):
        attend(q=q.to("meta"))
    # reshape_and_cache
    k = torch.randn(2, hkv, d)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = 48 is out of range \[-1, 48\)"):
        ops.reshape_and_cache(k, k, cache.k_cache, cache.v_cache, torch.tensor([0, 48]))
    with pytest.raises(RuntimeError, match="out of range"):
        ops.reshape_and_cache(k, k, cache.k_cache, cache.v_cache, torch.tensor([-2, 0]))
    with pytest.raises(RuntimeError, match="slot_mapping must be int64"):
        ops.reshape_and_cache(k, k, cache.k_cache, cache.v_cache, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="must have the dtype of k"):
        ops.reshape_and_cache(k.half(), k.half(), cache.k_cache, cache.v_cache, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="cache heads/head_dim"):
        ops.reshape_and_cache(torch.randn(2, 1, d), torch.randn(2, 1, d), cache.k_cache, cache.v_cache,
                              torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match=r"slot_mapping must be \[2\]"):
        ops.reshape_and_cache(k, k, cache.k_cache, cache.v_cache, torch.tensor([0]))


def test_bad_scalars_and_aliased_caches_are_refused():
    """scale must survive the cast to fp32 (1e39 -> inf, 1e-50 -> 0 would silently give NaN / uniform
    attention); head_dim 0 is refused by name; two overlapping views of one buffer as k_cache / v_cache (every
    K write would clobber V) are detected before any write."""
    hq, hkv, d = 4, 2, 16
    cache = PagedCache([40], hkv, d, torch.float32, 16, seed=15, spare_blocks=0)
    q = torch.randn(2, hq, d)
    args = (cache.k_cache, cache.v_cache, cache.block_table[:1].clone(), torch.tensor([40], dtype=torch.int32), cu([2]))
    for scale, msg in ((1e39, "scale must be finite in float32"), (1e-50, "underflows to 0"),
                       (float("inf"), "scale must be finite in float32"), (float("nan"), "scale must be finite")):
        with pytest.raises(RuntimeError, match=f"aligned::paged_attention: scale = .*{msg}|aligned::paged_attention: {msg}"):
            ops.paged_attention(q, *args, scale)
        with pytest.raises(RuntimeError, match=f"aligned::attention_varlen: scale = .*{msg}|aligned::attention_varlen: {msg}"):
            ops.attention_varlen(q, q[:, :hkv], q[:, :hkv], cu([2]), cu([2]), scale, True)
    ops.paged_attention(q, *args, 0.0)  # an exact 0 is a valid (uniform) scale
    with pytest.raises(RuntimeError, match="aligned::attention_varlen: head_dim must be >= 1"):
        e = torch.empty(2, hq, 0)
        ops.attention_varlen(e, e[:, :hkv], e[:, :hkv], cu([2]), cu([2]), 1.0, True)
    buf = torch.zeros(2 * cache.k_cache.numel())
    kc = buf[: cache.k_cache.numel()].view(cache.k_cache.shape)
    vc_overlap = buf[16 : 16 + cache.k_cache.numel()].view(cache.k_cache.shape)
    vc_disjoint = buf[cache.k_cache.numel():].view(cache.k_cache.shape)
    k = torch.randn(2, hkv, d)
    with pytest.raises(RuntimeError, match="aligned::reshape_and_cache: k_cache and v_cache must not overlap"):
        ops.reshape_and_cache(k, k, kc, vc_overlap, torch.tensor([0, 1]))
    ops.reshape_and_cache(k, k, kc, vc_disjoint, torch.tensor([0, 1]))  # adjacent views of one buffer are fine
    assert torch.equal(kc.view(-1, hkv, d)[:2], k) and torch.equal(vc_disjoint.view(-1, hkv, d)[:2], k)


def test_cache_writes_refuse_inputs_that_overlap_the_caches():
    """reshape_and_cache / mla_reshape_and_cache with an input that is a view of the cache it writes: each write could
    change an input row not yet read, in an order that depends on the threads (found: k = a view of k_cache, 200
    tokens into slots 3..202, gave other bits at 1 and 2 threads). Refused by name before any write; controls: the
    same rows copied out of the cache (clone), and an input in the cache buffer's other, disjoint half, are written."""
    hkv, d, bs, nb, T = 2, 16, 16, 16, 200
    kc, vc = torch.randn(nb, bs, hkv, d), torch.randn(nb, bs, hkv, d)
    slots = torch.arange(3, 3 + T)
    k_view = kc.view(-1, hkv, d)[:T]
    v_ok = torch.randn(T, hkv, d)
    for k, v, name in ((k_view, v_ok, "k and k_cache"), (v_ok, vc.view(-1, hkv, d)[:T], "v and v_cache"),
                       (v_ok, kc.view(-1, hkv, d)[5:5 + T], "v and k_cache"),
                       (vc.view(-1, hkv, d)[7:8].expand(T, hkv, d), v_ok, "k and v_cache")):  # stride 0 too
        before = kc.clone(), vc.clone()
        with pytest.raises(RuntimeError, match=f"aligned::reshape_and_cache: {name} must not overlap in memory"):
            ops.reshape_and_cache(k, v, kc, vc, slots)
        assert torch.equal(bits(kc), bits(before[0])) and torch.equal(bits(vc), bits(before[1]))  # nothing written
    ops.reshape_and_cache(k_view.clone(), v_ok, kc, vc, slots)  # control: the same rows, copied out first
    buf = torch.randn(2 * nb * bs * hkv * d)
    own = buf[: nb * bs * hkv * d].view(nb, bs, hkv, d)
    k_beside = buf[nb * bs * hkv * d:].view(-1, hkv, d)[:T]  # the buffer's other half: disjoint
    ops.reshape_and_cache(k_beside, v_ok, own, vc, slots)
    assert torch.equal(bits(own.view(-1, hkv, d)[3:3 + T]), bits(k_beside))
    # MLA: one latent cache [blocks, block_size, R + rope]
    R, P = 16, 8
    cache = torch.randn(nb, bs, R + P)
    rows = cache.view(-1, R + P)[:T]
    for kv_c, k_pe, name in ((rows[:, :R], torch.randn(T, P), "kv_c and kv_cache"),
                             (torch.randn(T, R), rows[:, R:], "k_pe and kv_cache")):
        with pytest.raises(RuntimeError, match=f"aligned::mla_reshape_and_cache: {name} must not overlap in memory"):
            ops.mla_reshape_and_cache(kv_c, k_pe, cache, slots)
    ops.mla_reshape_and_cache(rows[:, :R].clone(), rows[:, R:].clone(), cache, slots)  # control
