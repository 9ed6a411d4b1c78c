"""Attention under the ``mma`` profile (csrc/common/attention_mma.h; kernel csrc/gpu/attention_mma_kernels.cuh)
under emulation, at both warp widths (sm_90: mma.sync m16n8k16, 32 lanes; gfx942: v_mfma 16x16x16, wave64) and
both models of the bf16 matrix unit (``mmasim``: MMA-Sim's characterisation; ``fma_chain``: order-sensitive).

What is proved, each on integer views (bits, never a tolerance):
- the kernel equals the scalar reference of the contract (aligned::_attention_mma_reference: attention_mma.h's
  attn_mma_row_reference with the same unit model) for several sequences at once: > 1 tile, > 1 KV split (context
  > 512), causal diagonals inside a tile, GQA, head_dim 64 / 80 (an odd multiple of 16) / 72 (a padded block);
- training varlen == one-shot prefill (paged) == chunked prefill == prefix hit (paged, part cached) == paged decode,
  per row; a sequence alone == the same sequence inside a batch of others (another order); the planned run forms
  == the per-call forms;
- a masked key's finite extreme value (|v| = 2^100, in a row's causal future) changes no bit: prefill == decode;
  nor does a non-finite one (k and v holding inf and NaN): prefill == decode == the reference, finite;
- negative controls: the score's d-blocks reversed for prefill only (fault mma_attn_block_order_by_q_len) and
  FlashAttention's shared V operand (fault mma_attn_shared_v) are caught by the same comparisons; the two unit
  models give different bits (the model is applied);
- the backward (attention_mma.h "backward"): dq / dk / dv kernels == the scalar reference at both widths and models;
  autograd == the op; deterministic run to run and across schedules; a sequence's gradients alone == in a batch,
  also behind a sequence whose pairs end mid pair-block; masked operands exercised: a masked key of 2^100 (dq) and
  a masked pair of 2^100 (dk / dv) against tiny values == the reference; a GQA group of 16 over a 3-row decode
  step, and sm_80 / gfx950's unit models == the reference;
- backward negative controls: FlashAttention's shared operand (fault mma_attn_shared_v in dq and dk / dv) and
  pair-blocks counted from the batch's pair index (fault mma_attn_pair_blocks_global) are caught;
- accuracy against float64 within a bf16 tolerance (forward and backward); errors by message (fp16 / fp32 under
  mma, unknown profile, the CPU's refusal, the references outside emulation); opcheck of the changed schemas.
Shapes are small: emulation runs every GPU thread as a fiber.
"""

from __future__ import annotations

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, bitwise_equal

ops = torch.ops.aligned
pytestmark = pytest.mark.emulated

ARCHS = ["sm_90", "gfx942"]
MODELS = ["mmasim", "fma_chain"]
BF16 = torch.bfloat16


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def rand_seqs(n_ctx, hq, hkv, d, seed, scale_qk=1.0):
    """Per sequence (q, k, v) of n_ctx tokens each (bf16)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, hq, d, generator=g).mul(scale_qk).to(BF16),
             torch.randn(n, hkv, d, generator=g).mul(scale_qk).to(BF16),
             torch.randn(n, hkv, d, generator=g).to(BF16)) for n in n_ctx]


def varlen(seqs, q_lens=None, **kw):
    """attention_varlen of the last q_lens[b] rows of each sequence over its whole context (q_lens None: all)."""
    q_lens = q_lens or [s[0].shape[0] for s in seqs]
    q = torch.cat([s[0][s[0].shape[0] - n:] for s, n in zip(seqs, q_lens)])
    k = torch.cat([s[1] for s in seqs])
    v = torch.cat([s[2] for s in seqs])
    ck = cu([s[1].shape[0] for s in seqs])
    return q, k, v, cu(q_lens), ck


class Cache:
    """A paged KV cache (blocks in a shuffled order, unused memory NaN) holding whole sequences."""

    def __init__(self, seqs, block_size, seed):
        g = torch.Generator().manual_seed(seed)
        hkv, d = seqs[0][1].shape[1:]
        need = [(s[1].shape[0] + block_size - 1) // block_size for s in seqs]
        n_blocks = sum(need) + 1
        perm = torch.randperm(n_blocks, generator=g).to(torch.int32)
        self.table = torch.zeros((len(seqs), max(need)), dtype=torch.int32)
        pos = 0
        for b, nb in enumerate(need):
            self.table[b, :nb] = perm[pos:pos + nb]
            pos += nb
        self.k = torch.full((n_blocks, block_size, hkv, d), float("nan"), dtype=seqs[0][1].dtype)
        self.v = torch.full_like(self.k, float("nan"))
        self.bs = block_size
        for b, s in enumerate(seqs):
            p = torch.arange(s[1].shape[0])
            slots = self.table[b, p // block_size].long() * block_size + p % block_size
            ops.reshape_and_cache(s[1], s[2], self.k, self.v, slots)

    def attend(self, q, seq_ids, seq_lens, q_lens, **kw):
        return aligned_ops.paged_attention(q, self.k, self.v, self.table[list(seq_ids)],
                                           torch.tensor(seq_lens, dtype=torch.int32), cu(q_lens), **kw)


def rows_of(seqs, b, lo, hi):
    return seqs[b][0][lo:hi]


# ---- kernel == reference ---------------------------------------------------------------------------------------
SHAPES = [  # (Hq, Hkv, D)
    (4, 2, 64),
    (6, 2, 80),   # 5 d-blocks of 16 (an odd count)
    (2, 1, 72),   # a padded last d-block
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"hq{s[0]}_hkv{s[1]}_d{s[2]}")
def test_kernel_equals_reference(arch, model, shape):
    hq, hkv, d = shape
    seqs = rand_seqs([37, 45, 530], hq, hkv, d, seed=1)
    q, k, v, cq, ck = varlen(seqs, [37, 1, 19])  # causal prefill over 2 tiles; decode; 2 splits (context 530)
    scale = d ** -0.5
    with aligned_ops.emulate(arch, mma_model=model) as em:
        out, lse = aligned_ops.attention_varlen(q, k, v, cq, ck, profile="mma")
        ref_out, ref_lse = ops._attention_mma_reference(q, k, v, cq, ck, scale, True)
    assert {"attention_mma_split_kernel", "attention_merge_kernel"} <= {l.kernel_base for l in em.launches}
    assert_bitwise_equal(out, ref_out, f"{arch}/{model} out")
    assert_bitwise_equal(lse, ref_lse, f"{arch}/{model} lse")


@pytest.mark.parametrize("arch", ARCHS)
def test_wide_head_dim_kernel_equals_reference(arch):
    """head_dim 160: the kernel's widest accumulator bucket (attn_mma_d_instr) against the reference, and the
    paths over it."""
    seqs = rand_seqs([34, 9], 2, 1, 160, seed=16)
    q, k, v, cq, ck = varlen(seqs, [34, 2])
    with aligned_ops.emulate(arch) as em:
        out, lse = aligned_ops.attention_varlen(q, k, v, cq, ck, profile="mma")
        ref_out, ref_lse = ops._attention_mma_reference(q, k, v, cq, ck, 160 ** -0.5, True)
    assert any(l.kernel.startswith("attention_mma_split_kernel") for l in em.launches)
    assert_bitwise_equal(out, ref_out)
    assert_bitwise_equal(lse, ref_lse)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_schedule_gives_the_same_bits(arch):
    """The emulator's thread / warp / block orders (forward, reverse, random) never change a bit."""
    seqs = rand_seqs([37, 30], 4, 2, 64, seed=17)
    q, k, v, cq, ck = varlen(seqs, [37, 5])
    outs = []
    for schedule in ("forward", "reverse", "random:7", "random:8"):
        with aligned_ops.emulate(arch, schedule=schedule):
            outs.append(aligned_ops.attention_varlen(q, k, v, cq, ck, profile="mma"))
    for out, lse in outs[1:]:
        assert_bitwise_equal(out, outs[0][0])
        assert_bitwise_equal(lse, outs[0][1])


@pytest.mark.parametrize("arch", ARCHS)
def test_non_causal_kernel_equals_reference(arch):
    seqs = rand_seqs([21, 50], 4, 2, 64, seed=2)
    q, k, v, cq, ck = varlen(seqs, [21, 9])
    with aligned_ops.emulate(arch):
        out, lse = aligned_ops.attention_varlen(q, k, v, cq, ck, causal=False, profile="mma")
        ref_out, ref_lse = ops._attention_mma_reference(q, k, v, cq, ck, 0.125, False)
    assert_bitwise_equal(out, ref_out)
    assert_bitwise_equal(lse, ref_lse)


def test_the_unit_model_is_applied():
    """mmasim and fma_chain round differently: the same inputs give different bits (the fp32 lse carries the
    score chain's rounding; the bf16 out may round it away), and the mma profile differs from the fma profile."""
    seqs = rand_seqs([40], 4, 2, 64, seed=3)
    q, k, v, cq, ck = varlen(seqs)
    res = {}
    for model in MODELS:
        with aligned_ops.emulate("sm_90", mma_model=model):
            res[model] = aligned_ops.attention_varlen(q, k, v, cq, ck, profile="mma")[1]
    with aligned_ops.emulate("sm_90"):
        fma = aligned_ops.attention_varlen(q, k, v, cq, ck)[1]
    assert not bitwise_equal(res["mmasim"], res["fma_chain"])
    assert not bitwise_equal(res["mmasim"], fma)


# ---- invariance across paths --------------------------------------------------------------------------------------
def paths(arch, model, seqs, block_size=16, chunk=13, fault=None):
    """Per sequence, the output rows of every path (each a [n, Hq, D] tensor over the same absolute rows)."""
    d = seqs[0][0].shape[2]
    kw = dict(profile="mma")
    n = [s[0].shape[0] for s in seqs]
    got = {}
    with aligned_ops.emulate(arch, mma_model=model, _fault=fault):
        # training: one packed varlen batch of every sequence
        q, k, v, cq, ck = varlen(seqs)
        out = aligned_ops.attention_varlen(q, k, v, cq, ck, **kw)[0]
        got["varlen"] = list(out.split(n))
        cache = Cache(seqs, block_size, seed=5)
        # one-shot prefill through the paged cache (all sequences in one batch, reversed order)
        order = list(range(len(seqs)))[::-1]
        out = cache.attend(torch.cat([seqs[b][0] for b in order]), order, [n[b] for b in order],
                           [n[b] for b in order], **kw)
        parts = dict(zip(order, out.split([n[b] for b in order])))
        got["prefill"] = [parts[b] for b in range(len(seqs))]
        # chunked prefill: every sequence in chunks of `chunk` rows, the chunks of all sequences batched together
        chunks = [[] for _ in seqs]
        for start in range(0, max(n), chunk):
            batch = [b for b in range(len(seqs)) if start < n[b]]
            ends = [min(start + chunk, n[b]) for b in batch]
            qb = torch.cat([rows_of(seqs, b, start, e) for b, e in zip(batch, ends)])
            out = cache.attend(qb, batch, ends, [e - start for e in ends], **kw)
            for b, o in zip(batch, out.split([e - start for e in ends])):
                chunks[b].append(o)
        got["chunked"] = [torch.cat(c) for c in chunks]
        # prefix hit: the first 2/3 cached, the rest one chunk
        hit = []
        for b in range(len(seqs)):
            c = (2 * n[b]) // 3
            first = cache.attend(rows_of(seqs, b, 0, c), [b], [c], [c], **kw) if c else seqs[b][0][:0]
            rest = cache.attend(rows_of(seqs, b, c, n[b]), [b], [n[b]], [n[b] - c], **kw)
            hit.append(torch.cat([first, rest]))
        got["prefix_hit"] = hit
        # decode: each sequence's last 3 rows one token at a time, all sequences in one batch per step
        dec = [[] for _ in seqs]
        for t in range(3, 0, -1):
            pos = [n[b] - t for b in range(len(seqs))]
            qb = torch.cat([rows_of(seqs, b, p, p + 1) for b, p in enumerate(pos)])
            out = cache.attend(qb, range(len(seqs)), [p + 1 for p in pos], [1] * len(seqs), **kw)
            for b, o in enumerate(out.split(1)):
                dec[b].append(o)
        got["decode"] = [torch.cat(x) for x in dec]
    return got


def compare(got):
    """The first path each other path differs from, or None."""
    base = got["varlen"]
    for name, outs in got.items():
        for b, o in enumerate(outs):
            ref = base[b][-o.shape[0]:] if name == "decode" else base[b]
            if not bitwise_equal(o, ref):
                return f"{name} (sequence {b})"
    return None


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("model", MODELS)
def test_paths_bitwise(arch, model):
    seqs = rand_seqs([40, 23], 4, 2, 64, seed=6)
    assert compare(paths(arch, model, seqs)) is None


@pytest.mark.parametrize("arch", ARCHS)
def test_paths_bitwise_head_dim_128_gqa_4(arch):
    seqs = rand_seqs([35], 8, 2, 128, seed=7)
    assert compare(paths(arch, "mmasim", seqs, block_size=8, chunk=17)) is None


@pytest.mark.parametrize("arch", ARCHS)
def test_two_splits_chunk_equals_decode(arch):
    """Context 530 (two KV splits): the last 6 rows as one chunk over the packed K/V == as a paged prefix hit ==
    decoded one at a time from the cache."""
    seqs = rand_seqs([530], 4, 2, 64, seed=8)
    n = 530
    with aligned_ops.emulate(arch):
        q, k, v, cq, ck = varlen(seqs, [6])
        chunk = aligned_ops.attention_varlen(q, k, v, cq, ck, profile="mma")[0]
        cache = Cache(seqs, 32, seed=9)
        hit = cache.attend(q, [0], [n], [6], profile="mma")
        dec = torch.cat([cache.attend(seqs[0][0][p:p + 1], [0], [p + 1], [1], profile="mma")
                         for p in range(n - 6, n)])
    assert_bitwise_equal(hit, chunk, "prefix hit vs chunk")
    assert_bitwise_equal(dec, chunk, "decode vs chunk")


@pytest.mark.parametrize("arch", ARCHS)
def test_row_alone_equals_row_in_batch(arch):
    seqs = rand_seqs([29, 33, 7], 4, 2, 64, seed=10)
    with aligned_ops.emulate(arch):
        alone = aligned_ops.attention_varlen(*varlen(seqs[1:2]), profile="mma")
        batch = aligned_ops.attention_varlen(*varlen([seqs[2], seqs[1], seqs[0]]), profile="mma")
    assert_bitwise_equal(batch[0][7:7 + 33], alone[0])
    assert_bitwise_equal(batch[1][7:7 + 33], alone[1])


@pytest.mark.parametrize("arch", ARCHS)
def test_planned_forms_equal_per_call(arch):
    seqs = rand_seqs([40, 23], 4, 2, 64, seed=11)
    q, k, v, cq, ck = varlen(seqs)
    with aligned_ops.emulate(arch):
        per_call = aligned_ops.attention_varlen(q, k, v, cq, ck, profile="mma")
        plan = aligned_ops.AttentionPlan().plan_varlen(cq, ck, 4, 2, 64)
        planned = aligned_ops.attention_varlen(q, k, v, cq, ck, plan=plan, profile="mma")
        cache = Cache(seqs, 16, seed=12)
        pq = torch.cat([seqs[0][0][-1:], seqs[1][0][-1:]])
        qsl, sl = cu([1, 1]), torch.tensor([40, 23], dtype=torch.int32)
        dec = cache.attend(pq, [0, 1], [40, 23], [1, 1], profile="mma")
        pplan = aligned_ops.AttentionPlan().plan_paged(qsl, sl, cache.table, 4, 2, 64, cache.k.shape[0], cache.bs)
        dec_planned = aligned_ops.paged_attention(pq, cache.k, cache.v, plan=pplan, profile="mma")
    assert_bitwise_equal(planned[0], per_call[0])
    assert_bitwise_equal(planned[1], per_call[1])
    assert_bitwise_equal(dec_planned, dec)
    assert_bitwise_equal(dec, torch.cat([per_call[0][39:40], per_call[0][62:63]]))


# ---- masked keys: finite extremes ---------------------------------------------------------------------------------
def extreme_seqs(seed):
    """One sequence of 32 tokens (one tile) whose values are tiny (~1e-30) except at keys 15 and 31 (the ends of the
    tile's two key-blocks): +-2^100. A row before key 15 / 31 masks it; were its value to reach the unit as
    (+0) x 2^100 (exponent -26), the row's own products (exponent <= -100) would be aligned to it and truncated to
    zero — a visible change, while decode (where those keys do not exist yet) gives the row's true value."""
    g = torch.Generator().manual_seed(seed)
    n, hq, hkv, d = 32, 4, 2, 64
    q = torch.randn(n, hq, d, generator=g).to(BF16)
    k = torch.randn(n, hkv, d, generator=g).to(BF16)
    v = torch.randn(n, hkv, d, generator=g) * 1e-30
    for j in (15, 31):
        v[j] = torch.where(torch.rand(hkv, d, generator=g) < 0.5, 2.0 ** 100, -(2.0 ** 100))
    return [(q, k, v.to(BF16))]


@pytest.mark.parametrize("arch", ARCHS)
def test_masked_finite_extremes_change_no_bit(arch):
    seqs = extreme_seqs(13)
    got = paths(arch, "mmasim", seqs, block_size=16, chunk=7)
    assert compare(got) is None
    assert got["varlen"][0][:15].abs().max() < 1e-25  # the rows before key 15 kept their tiny true values
    with aligned_ops.emulate(arch):
        q, k, v, cq, ck = varlen(seqs)
        ref = ops._attention_mma_reference(q, k, v, cq, ck, 0.125, True)[0]
    assert_bitwise_equal(got["varlen"][0], ref)
    assert torch.isfinite(ref.float()).all()


# ---- negative controls -----------------------------------------------------------------------------------------
def cancelling_seqs(seed):
    """Scores whose d-blocks cancel: block 0 adds 2^24, block 1 subtracts it, blocks 2-3 add a random y. In
    ascending order the chain is exactly y; another order rounds y against 2^24 first (a change of the score by up
    to ~2 * scale, visible in bf16 outputs). The fp32 chain's rounding order made visible."""
    seqs = rand_seqs([40, 23], 4, 2, 64, seed=seed)
    for q, k, _ in seqs:
        for t in (q, k):
            t[..., :32] = 0
            t[..., 0] = 2.0 ** 12
        q[..., 16] = 2.0 ** 12
        k[..., 16] = -(2.0 ** 12)
    return seqs


@pytest.mark.parametrize("arch", ARCHS)
def test_control_block_order_by_q_len_is_caught(arch):
    """A kernel whose score order depends on prefill vs decode: the path comparison and the reference both fail
    (on scores whose d-blocks cancel), while the correct kernel passes the same comparison."""
    seqs = cancelling_seqs(6)
    assert compare(paths(arch, "mmasim", seqs)) is None
    assert compare(paths(arch, "mmasim", seqs, fault="mma_attn_block_order_by_q_len")) is not None
    q, k, v, cq, ck = varlen(seqs)
    with aligned_ops.emulate(arch, _fault="mma_attn_block_order_by_q_len"):
        out = aligned_ops.attention_varlen(q, k, v, cq, ck, profile="mma")[0]
        ref = ops._attention_mma_reference(q, k, v, cq, ck, 0.125, True)[0]
    assert not bitwise_equal(out, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_control_shared_v_is_caught_by_finite_extremes(arch):
    """FlashAttention's shared V operand (masked keys' values times P = +0 in the same instruction) gives other
    bits for a row in prefill (its future keys in the tile) than in decode (they do not exist yet) on the unit's
    model: the masked-extremes comparison catches it."""
    got = paths(arch, "mmasim", extreme_seqs(13), block_size=16, chunk=7, fault="mma_attn_shared_v")
    assert compare(got) is not None


# ---- accuracy --------------------------------------------------------------------------------------------------
def attention_f64(q, k, v, cq, ck, scale, causal=True):
    outs = []
    g = q.shape[1] // k.shape[1]
    for b in range(len(cq) - 1):
        qs, ks = q[cq[b]:cq[b + 1]].double(), k[ck[b]:ck[b + 1]].double().repeat_interleave(g, 1)
        vs = v[ck[b]:ck[b + 1]].double().repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        nq, nk = qs.shape[0], ks.shape[0]
        if causal:
            pos = torch.arange(nq)[:, None] + nk - nq
            s = s.masked_fill(torch.arange(nk)[None, :] > pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vs))
    return torch.cat(outs)


@pytest.mark.parametrize("arch", ARCHS)
def test_accuracy_against_float64(arch):
    seqs = rand_seqs([37, 60], 4, 2, 80, seed=14)
    q, k, v, cq, ck = varlen(seqs, [37, 25])
    scale = 80 ** -0.5
    with aligned_ops.emulate(arch):
        out = aligned_ops.attention_varlen(q, k, v, cq, ck, profile="mma")[0]
    exact = attention_f64(q, k, v, cq, ck, scale)
    # bf16 P (relative 2^-9) and the bf16 output rounding (2^-9): a few bf16 ulps of |v| ~ 1
    torch.testing.assert_close(out.double(), exact, atol=2e-2, rtol=1.6e-2)


# ---- errors, backward, opcheck -------------------------------------------------------------------------------------
def small(dtype=BF16):
    seqs = rand_seqs([9], 2, 1, 32, seed=15)
    q, k, v, cq, ck = varlen(seqs)
    return q.to(dtype), k.to(dtype), v.to(dtype), cq, ck


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_mma_refuses_other_dtypes_by_name(dtype):
    q, k, v, cq, ck = small(dtype)
    with aligned_ops.emulate("sm_90"):
        with pytest.raises(RuntimeError, match="attention_varlen: the mma profile's attention takes bfloat16"):
            aligned_ops.attention_varlen(q, k, v, cq, ck, profile="mma")
        cache = Cache([(q, k, v)], 16, seed=0)
        with pytest.raises(RuntimeError, match="paged_attention: the mma profile's attention takes bfloat16"):
            cache.attend(q[-1:], [0], [9], [1], profile="mma")


def test_unknown_profile_is_refused():
    q, k, v, cq, ck = small()
    with pytest.raises(ValueError, match="attention_varlen: profile must be 'fma' or 'mma', got 'exact'"):
        aligned_ops.attention_varlen(q, k, v, cq, ck, profile="exact")
    with pytest.raises(RuntimeError, match="attention_varlen: profile must be 'fma' or 'mma', got 'tf32'"):
        ops.attention_varlen(q, k, v, cq, ck, 0.5, True, "tf32")


def test_cpu_refuses_mma_attention_by_name():
    q, k, v, cq, ck = small()
    msg = "profile='mma' attention runs on a GPU .* the CPU's mma profile covers linear, the LM head and MoE experts"
    with pytest.raises(RuntimeError, match=msg):
        aligned_ops.attention_varlen(q, k, v, cq, ck, profile="mma")
    cache = Cache([(q, k, v)], 16, seed=0)
    with pytest.raises(RuntimeError, match="aligned::paged_attention: " + msg):
        cache.attend(q[-1:], [0], [9], [1], profile="mma")
    plan = aligned_ops.AttentionPlan().plan_varlen(cq, ck, 2, 1, 32)
    with pytest.raises(RuntimeError, match="aligned::attention_varlen_planned: " + msg):
        aligned_ops.attention_varlen(q, k, v, cq, ck, plan=plan, profile="mma")
    with pytest.raises(RuntimeError, match="_attention_mma_reference: needs aligned_ops.emulate"):
        ops._attention_mma_reference(q, k, v, cq, ck, 0.5, True)
    # the fma profile still runs on the CPU, and a profile object is accepted by name
    out = aligned_ops.attention_varlen(q, k, v, cq, ck, profile=aligned_ops.profiles.get("fma"))[0]
    assert_bitwise_equal(out, aligned_ops.attention_varlen(q, k, v, cq, ck)[0])


# ---- backward ------------------------------------------------------------------------------------------------------
def mma_backward_and_reference(arch, q, k, v, cq, ck, dout, scale, model=None):
    """Under emulation: the mma forward, its backward (dq, dk, dv) and attention_mma.h's backward reference; with the
    emulator's launch records."""
    kw = {} if model is None else {"mma_model": model}
    with aligned_ops.emulate(arch, **kw) as em:
        out, lse = aligned_ops.attention_varlen(q, k, v, cq, ck, profile="mma")
        grads = ops.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, scale, True, None, "mma")
        ref = ops._attention_mma_backward_reference(dout, q, k, v, out, lse, cq, ck, scale, True)
    return em.launches, grads, ref


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("model", MODELS)
def test_backward_kernels_equal_reference(arch, model):
    """dq (per row block), dk / dv (per key tile) against attention_mma.h's attn_mma_backward_reference: causal
    diagonals, GQA, a decode-like row, and a context of 530 keys (> one split: the backward has no splits, one
    chain over every key-block)."""
    seqs = rand_seqs([37, 45, 530], 4, 2, 64, seed=18)
    q, k, v, cq, ck = varlen(seqs, [37, 1, 19])
    g = torch.Generator().manual_seed(19)
    dout = torch.randn(q.shape, generator=g).to(BF16)
    launches, grads, ref = mma_backward_and_reference(arch, q, k, v, cq, ck, dout, 0.125, model)
    assert {"attention_mma_bwd_dq_kernel", "attention_mma_bwd_dkdv_kernel"} <= {l.kernel_base for l in launches}
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        assert_bitwise_equal(got, want, f"{arch}/{model} {name}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("D", [64, 80])  # the two narrower column buckets, which read the key-count table
def test_backward_several_pair_groups_per_warp_equal_reference(arch, D):
    """8 query heads per KV head: a row block's (row, head) pairs outnumber one pass of the block's warps (16 pairs
    each), so each warp runs several groups and rewrites its per-warp key-count table (attention_mma_bwd_dq_kernel
    pair_keys) after the previous group read it; causal rows, so the groups' key counts differ. == the reference.
    (Checked to fail with the table written by each warp's first group only.)"""
    seqs = rand_seqs([48, 21], 8, 1, D, seed=28)
    q, k, v, cq, ck = varlen(seqs)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(29)).to(BF16)
    launches, grads, ref = mma_backward_and_reference(arch, q, k, v, cq, ck, dout, D ** -0.5)
    assert "attention_mma_bwd_dq_kernel" in {l.kernel_base for l in launches}
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        assert_bitwise_equal(got, want, f"{arch} D={D} {name}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("D", [129, 200, 256])  # 129 / 200: the second slice ends inside an instruction
def test_backward_wide_head_dim_column_slices_equal_reference(arch, D):
    """head_dim above 128: the dk / dv kernel runs 128 columns per block, the slices over gridDim.y (each recomputes
    S and dP): == the reference, and the launch has the slices. (Checked to fail with the slice offset planted as 0:
    columns 128.. are then never written.)"""
    seqs = rand_seqs([40, 21], 4, 2, D, seed=26)
    q, k, v, cq, ck = varlen(seqs, [40, 3])
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(27)).to(BF16)
    launches, grads, ref = mma_backward_and_reference(arch, q, k, v, cq, ck, dout, D ** -0.5)
    assert {l.grid[1] for l in launches if l.kernel_base == "attention_mma_bwd_dkdv_kernel"} == {2}
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        assert_bitwise_equal(got, want, f"{arch} D={D} {name}")


@pytest.mark.parametrize("arch", ARCHS)
def test_backward_autograd_deterministic_and_row_invariant(arch):
    """Autograd through attention_varlen(profile="mma") == the op; run to run and under other schedules the same
    bits; dq of a sequence alone == inside a batch (dk / dv are the sequence's own: equal too)."""
    seqs = rand_seqs([29, 40], 6, 2, 80, seed=20)
    g = torch.Generator().manual_seed(21)
    douts = [torch.randn(s[0].shape, generator=g).to(BF16) for s in seqs]

    def grads(batch, schedule):
        q, k, v, cq, ck = varlen([seqs[b] for b in batch])
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        with aligned_ops.emulate(arch, schedule=schedule):
            out, _ = aligned_ops.attention_varlen(q, k, v, cq, ck, profile="mma")
            out.backward(torch.cat([douts[b] for b in batch]))
        return q.grad, k.grad, v.grad

    both = grads([0, 1], "forward")
    again = grads([0, 1], "reverse")
    for a, b in zip(both, again):
        assert_bitwise_equal(a, b)
    alone = grads([1], "random:3")
    assert_bitwise_equal(alone[0], both[0][29:])
    assert_bitwise_equal(alone[1], both[1][29:])
    assert_bitwise_equal(alone[2], both[2][29:])
    # the autograd gradient is the op's
    q, k, v, cq, ck = varlen(seqs)
    with aligned_ops.emulate(arch):
        out, lse = aligned_ops.attention_varlen(q, k, v, cq, ck, profile="mma")
        op = ops.attention_varlen_backward(torch.cat(douts), q, k, v, out, lse, cq, ck, 80 ** -0.5, True, None, "mma")
    for a, b in zip(both, op):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("arch", ARCHS)
def test_backward_control_pair_order_is_caught(arch):
    """A dk / dv kernel whose pair-block order depends on prefill vs decode (fault mma_attn_block_order_by_q_len:
    descending pair-blocks for q_len > 1) no longer equals the reference, while the correct kernel does. The data
    make the order visible in bf16: q = 0 (every p equal, non-causal), dO = +2^16 on the first block of 16 pairs,
    -2^16 on the second (they cancel exactly in ascending order), small values after."""
    hq, hkv, d, n = 2, 1, 32, 40  # 80 pairs: 5 pair-blocks
    g = torch.Generator().manual_seed(26)
    q = torch.zeros(n, hq, d, dtype=BF16)
    k = torch.randn(n, hkv, d, generator=g).to(BF16)
    v = torch.randn(n, hkv, d, generator=g).to(BF16)
    dout = torch.randn(n, hq, d, generator=g)
    dout[:8] = 2.0 ** 16   # rows 0..7 x 2 heads = pairs 0..15
    dout[8:16] = -(2.0 ** 16)
    dout = dout.to(BF16)
    cq = ck = cu([n])
    res = {}
    for fault in (None, "mma_attn_block_order_by_q_len"):
        with aligned_ops.emulate(arch, _fault=fault):
            out, lse = aligned_ops.attention_varlen(q, k, v, cq, ck, causal=False, profile="mma")
            got = ops.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, 0.125, False, None, "mma")
            ref = ops._attention_mma_backward_reference(dout, q, k, v, out, lse, cq, ck, 0.125, False)
        res[fault] = (got, ref)
    got, ref = res[None]
    for a, b in zip(got, ref):
        assert_bitwise_equal(a, b)
    got, ref = res["mma_attn_block_order_by_q_len"]
    assert_bitwise_equal(got[0], ref[0])  # dq is not faulted
    assert not bitwise_equal(got[2], ref[2])


def test_planned_backward_equals_per_call():
    """attention_varlen(plan=..., profile="mma"): its autograd runs the mma backward (the profile travels through
    the planned form's autograd), the same bits as the per-call form's."""
    seqs = rand_seqs([21, 12], 4, 2, 64, seed=28)
    q, k, v, cq, ck = varlen(seqs)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(29)).to(BF16)
    grads = []
    for planned in (False, True):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        with aligned_ops.emulate("gfx942"):
            plan = aligned_ops.AttentionPlan().plan_varlen(cq, ck, 4, 2, 64) if planned else None
            out, _ = aligned_ops.attention_varlen(qg, kg, vg, cq, ck, plan=plan, profile="mma")
            out.backward(dout)
        grads.append((qg.grad, kg.grad, vg.grad))
    for a, b in zip(*grads):
        assert_bitwise_equal(a, b)


def test_backward_differs_from_the_fma_backward():
    """A control that the comparison above can fail: the fma profile's backward of the same problem (its own
    chains) gives other bits than the mma reference."""
    seqs = rand_seqs([33], 4, 2, 64, seed=22)
    q, k, v, cq, ck = varlen(seqs)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(23)).to(BF16)
    with aligned_ops.emulate("sm_90"):
        out, lse = aligned_ops.attention_varlen(q, k, v, cq, ck, profile="mma")
        mma = ops.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, 0.125, True, None, "mma")
        fma = ops.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, 0.125, True, None, "fma")
    assert not bitwise_equal(mma[0], fma[0])
    assert not bitwise_equal(mma[1], fma[1])


@pytest.mark.parametrize("arch", ARCHS)
def test_backward_accuracy_against_float64(arch):
    seqs = rand_seqs([37, 50], 4, 2, 64, seed=24)
    q, k, v, cq, ck = varlen(seqs, [37, 20])
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(25)).to(BF16)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    with aligned_ops.emulate(arch):
        out, _ = aligned_ops.attention_varlen(qg, kg, vg, cq, ck, profile="mma")
        out.backward(dout)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    attention_f64(q64, k64, v64, cq, ck, 0.125).backward(dout.double())
    for got, want in ((qg.grad, q64.grad), (kg.grad, k64.grad), (vg.grad, v64.grad)):
        err = (got.double() - want).abs().max().item()
        assert err <= 3e-2 * want.abs().max().item() + 1e-2, err


def test_opcheck():
    q, k, v, cq, ck = small()
    with aligned_ops.emulate("sm_90"):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        torch.library.opcheck(ops.attention_varlen.default, (qg, kg, vg, cq, ck, 0.25, True, "mma"))
        out, lse = ops.attention_varlen(q, k, v, cq, ck, 0.25, True, "mma")
        torch.library.opcheck(ops.attention_varlen_backward.default,
                              (torch.ones_like(out), q, k, v, out, lse, cq, ck, 0.25, True, None, "mma"))
        utils = ("test_schema", "test_faketensor")
        torch.library.opcheck(ops._attention_mma_backward_reference.default,
                              (torch.ones_like(out), q, k, v, out, lse, cq, ck, 0.25, True), test_utils=utils)
        cache = Cache([(q, k, v)], 4, seed=0)
        args = (q[-2:], cache.k, cache.v, cache.table, torch.tensor([9], dtype=torch.int32), cu([2]), 0.25, "mma")
        torch.library.opcheck(ops.paged_attention.default, args, test_utils=utils)
        torch.library.opcheck(ops._attention_mma_reference.default, (q, k, v, cq, ck, 0.25, True), test_utils=utils)
    # the default profile keeps its full opcheck (autograd included) with the new argument given explicitly
    qg, kg, vg = (t.float().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(ops.attention_varlen.default, (qg, kg, vg, cq, ck, 0.25, True, "fma"))


# ---- backward: masked operands, batch-dependent pair-blocks (negative controls 8 and 10) --------------------------
def backward_pair(arch, q, k, v, dout, cq, ck, causal, model="mmasim", fault=None):
    """(the kernels' dq, dk, dv, the reference's dq, dk, dv) of one problem; scale 1/8."""
    with aligned_ops.emulate(arch, mma_model=model, _fault=fault):
        out, lse = aligned_ops.attention_varlen(q, k, v, cq, ck, causal=causal, profile="mma")
        got = ops.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, 0.125, causal, None, "mma")
        ref = ops._attention_mma_backward_reference(dout, q, k, v, out, lse, cq, ck, 0.125, causal)
    return got, ref


def masked_key_extreme_problem(seed):
    """32 rows, causal, Hq 4 / Hkv 2 / D 64: k tiny (~1e-30) except key 15 = +-2^100. A row before 15 masks key
    15; were K[15] to reach dq's instruction as dS = (+0) x 2^100 (exponent -26 on the unit), the row's own products
    (~2^-100) would be aligned to it and truncated — FlashAttention's shared operand (K cut at the 16-pair group's
    longest row) does that to rows 8..14 (the group of rows 8..15)."""
    g = torch.Generator().manual_seed(seed)
    n, hq, hkv, d = 32, 4, 2, 64
    q = torch.randn(n, hq, d, generator=g).to(BF16)
    k = torch.randn(n, hkv, d, generator=g) * 1e-30
    k[15] = torch.where(torch.rand(hkv, d, generator=g) < 0.5, 2.0 ** 100, -(2.0 ** 100))
    v = torch.randn(n, hkv, d, generator=g).to(BF16)
    dout = torch.randn(n, hq, d, generator=g).to(BF16)
    return q, k.to(BF16), v, dout, cu([n]), cu([n])


def masked_pair_extreme_problem(seed):
    """32 rows, causal, Hq 4 / Hkv 2 / D 64: q and dO tiny (~2^-40) except row 2 = +-2^100. Keys 3.. do not see
    row 2; were its q / dO to reach dk / dv's instruction as dS = (+0) / P = (+0) times 2^100, the key's own
    products (~2^-80) would be truncated — FlashAttention's shared operand (q, dO cut at the union of the pairs the
    block's keys see) does that to keys 3..7 (warp 0's keys seen by pair-block 0 = rows 0..7). Row 2, not 3: its
    pairs 4, 5 share a group of 4 products with row 3's pairs 6, 7 (which see key 3), the group gfx942's unit
    aligns together; row 3's pairs would share one only with row 2's, which see none of keys 4..."""
    g = torch.Generator().manual_seed(seed)
    n, hq, hkv, d = 32, 4, 2, 64
    q = torch.randn(n, hq, d, generator=g) * 2.0 ** -40
    dout = torch.randn(n, hq, d, generator=g) * 2.0 ** -40
    for t in (q, dout):
        t[2] = torch.where(torch.rand(hq, d, generator=g) < 0.5, 2.0 ** 100, -(2.0 ** 100))
    k = torch.randn(n, hkv, d, generator=g).to(BF16)
    v = torch.randn(n, hkv, d, generator=g).to(BF16)
    return q.to(BF16), k, v, dout.to(BF16), cu([n]), cu([n])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("model", MODELS)
def test_backward_dq_masked_key_extreme(arch, model):
    """dq of the rows that mask key 15 (rows 0..14) == the reference bitwise, finite and tiny."""
    got, ref = backward_pair(arch, *masked_key_extreme_problem(30), causal=True, model=model)
    assert_bitwise_equal(got[0][:15], ref[0][:15], f"{arch}/{model} dq rows < 15")
    assert torch.isfinite(got[0][:15].float()).all()
    assert got[0][:15].abs().max() < 1e-20


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("model", MODELS)
def test_backward_dkdv_masked_pair_extreme(arch, model):
    """dk / dv of the keys row 2 does not see (keys 3..31) == the reference bitwise, finite and tiny."""
    got, ref = backward_pair(arch, *masked_pair_extreme_problem(31), causal=True, model=model)
    for i, name in ((1, "dk"), (2, "dv")):
        assert_bitwise_equal(got[i][3:], ref[i][3:], f"{arch}/{model} {name} keys >= 3")
        assert torch.isfinite(got[i][3:].float()).all()
        assert got[i][3:].abs().max() < 1e-6


@pytest.mark.parametrize("arch", ARCHS)
def test_backward_control_shared_operand_is_caught(arch):
    """Fault mma_attn_shared_v in the backward (dq's K cut at the group's longest row; dk / dv's q and dO at the
    block's union of pairs): both masked-extreme comparisons above fail on MMA-Sim's model (sm_90: 1792 of 3840 dq
    elements of rows < 15 differ, 637 dk / 194 dv of keys >= 3; gfx942: 1792, 128, 21). On the fma_chain model
    a (+0) x 2^100 product adds exactly +0 to a chain (no shared alignment), so the shared operand is neutral there
    and cannot be caught by any bit: asserted too, so a change of that model is noticed."""
    got, ref = backward_pair(arch, *masked_key_extreme_problem(30), causal=True, fault="mma_attn_shared_v")
    assert not bitwise_equal(got[0][:15], ref[0][:15])
    got, ref = backward_pair(arch, *masked_pair_extreme_problem(31), causal=True, fault="mma_attn_shared_v")
    assert not bitwise_equal(got[1][3:], ref[1][3:])
    assert not bitwise_equal(got[2][3:], ref[2][3:])
    got, ref = backward_pair(arch, *masked_key_extreme_problem(30), causal=True, model="fma_chain",
                             fault="mma_attn_shared_v")
    assert_bitwise_equal(got[0][:15], ref[0][:15])
    got, ref = backward_pair(arch, *masked_pair_extreme_problem(31), causal=True, model="fma_chain",
                             fault="mma_attn_shared_v")
    assert_bitwise_equal(got[1][3:], ref[1][3:])
    assert_bitwise_equal(got[2][3:], ref[2][3:])


def pair_block_problem(seed):
    """Two sequences, Hq 3 / Hkv 1 (G = 3), D 32, non-causal: the first of 29 rows (87 pairs: 87 mod 16 = 7), the
    second of 40 rows with q = 0 (every p equal) and dO = +2^16 on its pairs 0..15, -2^16 on pairs 16..31, small
    after: in its own pair-blocks the big terms cancel exactly inside blocks 0 and 1; in blocks shifted by 7 they
    meet the small values in the same instruction and round them away."""
    hq, hkv, d = 3, 1, 32
    g = torch.Generator().manual_seed(seed)
    first = rand_seqs([29], hq, hkv, d, seed=seed + 1)[0]
    n = 40
    q = torch.zeros(n, hq, d, dtype=BF16)
    k = torch.randn(n, hkv, d, generator=g).to(BF16)
    v = torch.randn(n, hkv, d, generator=g).to(BF16)
    dout = torch.randn(n, hq, d, generator=g)
    pairs = dout.view(n * hq, d)  # Hkv = 1: pair e = (row e // 3, head e % 3) is flat row e
    pairs[:16] = 2.0 ** 16
    pairs[16:32] = -(2.0 ** 16)
    d0 = torch.randn(29, hq, d, generator=g).to(BF16)
    return first, (q, k, v), d0, dout.to(BF16)


@pytest.mark.parametrize("arch", ARCHS)
def test_backward_sequence_alone_equals_in_batch_with_unaligned_pairs(arch):
    """The second sequence's dq / dk / dv alone == behind a first sequence whose 87 pairs end mid pair-block;
    fault mma_attn_pair_blocks_global (pair-blocks counted from the batch's pair index) fails the same check."""
    first, second, d0, d1 = pair_block_problem(40)

    def run(seqs, douts, fault):
        q, k, v, cq, ck = varlen(seqs)
        got, _ = backward_pair(arch, q, k, v, torch.cat(douts), cq, ck, causal=False, fault=fault)
        return got

    alone = run([second], [d1], None)
    batch = run([first, second], [d0, d1], None)
    for i, name in enumerate(("dq", "dk", "dv")):
        assert_bitwise_equal(batch[i][29:], alone[i], f"{arch} {name}")
    faulted = run([first, second], [d0, d1], "mma_attn_pair_blocks_global")
    assert_bitwise_equal(faulted[0][29:], alone[0])  # dq is not faulted
    assert not bitwise_equal(faulted[2][29:], alone[2])  # dv (dk = dS^T q is +0 here: q = 0)
    # alone, the global index is the sequence's own: the fault changes nothing there
    for a, b in zip(run([second], [d1], "mma_attn_pair_blocks_global"), alone):
        assert_bitwise_equal(a, b)


# ---- masked keys: non-finite values ---------------------------------------------------------------------------
def non_finite_key_seq(seed):
    """32 tokens (one tile), Hq 4 / Hkv 2 / D 64; key 20's k holds +inf and NaN, its v -inf and NaN."""
    q, k, v = rand_seqs([32], 4, 2, 64, seed=seed)[0]
    k[20, :, :32] = float("inf")
    k[20, :, 32:] = float("nan")
    v[20, :, ::2] = float("-inf")
    v[20, :, 1::2] = float("nan")
    return q, k, v


@pytest.mark.parametrize("arch", ARCHS)
def test_masked_non_finite_key_poisons_nothing(arch):
    """Rows 0..19 mask key 20 (in their tile): prefill (the key in the tile, masked) == decode of each row alone
    (the key does not exist yet) == the reference, all finite; fault mma_attn_shared_v (P = +0 times v = NaN in
    the same instruction) poisons them."""
    seq = non_finite_key_seq(50)
    q, k, v, cq, ck = varlen([seq])
    res = {}
    for fault in (None, "mma_attn_shared_v"):
        with aligned_ops.emulate(arch, _fault=fault):
            pre, lse = aligned_ops.attention_varlen(q, k, v, cq, ck, profile="mma")
            cache = Cache([seq], 16, seed=51)
            dec = cache.attend(q[:20], [0] * 20, list(range(1, 21)), [1] * 20, profile="mma")
        res[fault] = (pre, lse, dec)
    pre, lse, dec = res[None]
    assert_bitwise_equal(pre[:20], dec, "prefill vs decode, rows < 20")
    assert torch.isfinite(pre[:20].float()).all() and torch.isfinite(lse[:20]).all()
    with aligned_ops.emulate(arch):
        ref = ops._attention_mma_reference(q, k, v, cq, ck, 0.125, True)[0]
    assert_bitwise_equal(pre[:20], ref[:20])
    assert not torch.isfinite(res["mma_attn_shared_v"][0][:20].float()).all()


# ---- wide GQA groups; the other unit models --------------------------------------------------------------------
def _assert_causal_kernel_equals_reference(arch, seqs, q_lens, dout_seed):
    """The causal mma kernels (forward out and lse, backward dq, dk, dv) == the scalar reference, bitwise."""
    q, k, v, cq, ck = varlen(seqs, q_lens)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(dout_seed)).to(BF16)
    with aligned_ops.emulate(arch):
        out, lse = aligned_ops.attention_varlen(q, k, v, cq, ck, profile="mma")
        ref_out, ref_lse = ops._attention_mma_reference(q, k, v, cq, ck, 0.125, True)
    assert_bitwise_equal(out, ref_out)
    assert_bitwise_equal(lse, ref_lse)
    got, ref = backward_pair(arch, q, k, v, dout, cq, ck, causal=True)
    for name, a, b in zip(("dq", "dk", "dv"), got, ref):
        assert_bitwise_equal(a, b, name)


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_group_over_16_pairs_equals_reference(arch):
    """Hq 32 / Hkv 2 (G = 16): a 3-row decode step packs 48 pairs (3 groups of 16) into one item; forward and
    backward == the reference."""
    _assert_causal_kernel_equals_reference(arch, rand_seqs([20, 40], 32, 2, 64, seed=60), [3, 1], 61)


@pytest.mark.parametrize("arch", ["sm_80", "gfx950"])
def test_other_unit_models_kernel_equals_reference(arch):
    """sm_80 and gfx950 (their own bf16 units' models): forward and backward kernels == the reference."""
    _assert_causal_kernel_equals_reference(arch, rand_seqs([37, 45], 4, 2, 64, seed=62), [37, 1], 63)
