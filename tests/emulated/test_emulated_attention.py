"""GPU attention (csrc/gpu/attention_kernels.cuh) under emulation, at both warp widths: every serving path
equals the training path bit for bit, and every path equals the CPU backend.

Under ``aligned_ops.emulate(arch)`` attention_varlen, reshape_and_cache and paged_attention run the GPU glue
(csrc/torch/glue/attention.h on the emulated GPU backend) and the GPU kernels; the launch records prove it. The
matrix per arch:
training varlen (one packed batch) == one-shot prefill through the paged cache == chunked prefill (chunks
crossing tile and split boundaries) == decode one token at a time in a mixed batch, under a permuted batch
order and permuted block tables — each compared with the CPU backend on integer views. Negative controls:
torch's SDPA on the same inputs, and the emulator's neighbour-first shuffle tree (a tile sum in a different
order) must both give different bits. Shapes are small (emulation runs every GPU thread as a fiber).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, bitwise_equal

ops = torch.ops.aligned
pytestmark = pytest.mark.emulated

WIDTHS = ["sm_90", "gfx942"]  # warp 32 (CUDA spelling) and wave64 (HIP spelling)
KERNELS = {"attention_split_kernel", "attention_merge_kernel", "cache_write_kernel"}


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def make_seqs(lens, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(n, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv)) for n in lens]


def packed(seqs, i):
    return torch.cat([s[i] for s in seqs])


class Cache:
    """Paged KV cache, blocks in a random order; unused memory is NaN (a stray read shows in the result)."""

    def __init__(self, lens, hkv, d, dtype, block_size, seed):
        g = torch.Generator().manual_seed(seed)
        need = [(n + block_size - 1) // block_size for n in lens]
        n_blocks = sum(need) + 2
        perm = torch.randperm(n_blocks, generator=g).to(torch.int32)
        self.table = torch.full((len(lens), max(need) + 1), 10**6, dtype=torch.int32)  # garbage past the end
        pos = 0
        for b, nb in enumerate(need):
            self.table[b, :nb] = perm[pos : pos + nb]
            pos += nb
        self.k = torch.full((n_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
        self.v = torch.full_like(self.k, float("nan"))
        self.bs = block_size

    def write(self, b, start, k, v):
        pos = torch.arange(start, start + k.shape[0])
        slots = self.table[b, pos // self.bs].long() * self.bs + pos % self.bs
        ops.reshape_and_cache(k, v, self.k, self.v, slots)

    def attend(self, q, seq_ids, seq_lens, q_lens, scale):
        return ops.paged_attention(q, self.k, self.v, self.table[list(seq_ids)],
                                   torch.tensor(seq_lens, dtype=torch.int32), cu(q_lens), scale)


def serve(seqs, hkv, d, dtype, block_size, scale, prompt_lens, chunk, order, seed):
    """Chunked prefill of each prompt, then decode of the remaining tokens, in mixed batches in `order`.
    Returns per-sequence outputs in token order."""
    lens = [s[0].shape[0] for s in seqs]
    cache = Cache(lens, hkv, d, dtype, block_size, seed)
    outs = [[] for _ in seqs]
    done = [0] * len(seqs)
    while any(done[b] < lens[b] for b in order):
        batch = [b for b in order if done[b] < lens[b]]
        take = [min(chunk, prompt_lens[b] - done[b]) if done[b] < prompt_lens[b] else 1 for b in batch]
        for b, t in zip(batch, take):
            cache.write(b, done[b], seqs[b][1][done[b] : done[b] + t], seqs[b][2][done[b] : done[b] + t])
        q = torch.cat([seqs[b][0][done[b] : done[b] + t] for b, t in zip(batch, take)])
        o = cache.attend(q, batch, [done[b] + t for b, t in zip(batch, take)], take, scale)
        off = 0
        for b, t in zip(batch, take):
            outs[b].append(o[off : off + t])
            off += t
            done[b] += t
    return [torch.cat(o) for o in outs]


def varlen(seqs, scale):
    lens = [s[0].shape[0] for s in seqs]
    return ops.attention_varlen(packed(seqs, 0), packed(seqs, 1), packed(seqs, 2), cu(lens), cu(lens), scale, True)


# (hq, hkv, head_dim, dtype, block_size): GQA, head_dim 64 and 128, a head_dim that is no multiple of 32
CONFIGS = [(4, 2, 64, torch.bfloat16, 16), (2, 1, 128, torch.float32, 7), (3, 3, 40, torch.float16, 32)]


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"h{c[0]}x{c[1]}_d{c[2]}_{str(c[3])[6:]}_bs{c[4]}")
def test_training_prefill_chunked_decode_bitwise(arch, cfg):
    hq, hkv, d, dtype, bs = cfg
    lens = [45, 70]  # tiles of 32 keys: 2 and 3 tiles, partial last tile
    seqs = make_seqs(lens, hq, hkv, d, dtype, seed=hq * 100 + d)
    scale = d**-0.5
    cpu_out, cpu_lse = varlen(seqs, scale)
    with aligned_ops.emulate(arch) as emu:
        out, lse = varlen(seqs, scale)  # training path
        one_shot = serve(seqs, hkv, d, dtype, bs, scale, lens, chunk=10**6, order=[0, 1], seed=1)
        chunked = serve(seqs, hkv, d, dtype, bs, scale, [33, 40], chunk=13, order=[1, 0], seed=2)
    assert_bitwise_equal(out, cpu_out, f"varlen out on {arch}")
    assert_bitwise_equal(lse, cpu_lse, f"varlen lse on {arch}")
    cpu_rows = torch.split(cpu_out, lens)
    for b in range(len(lens)):
        assert_bitwise_equal(one_shot[b], cpu_rows[b], f"one-shot prefill seq {b} on {arch}")
        assert_bitwise_equal(chunked[b], cpu_rows[b], f"chunked prefill + decode seq {b} on {arch}")
    assert KERNELS <= emu.kernels(), emu.kernels()
    assert all(l.arch == arch for l in emu.launches)
    # negative control: torch's attention on the same inputs is right but not bitwise equal
    q, k, v = (packed(seqs[1:], i).transpose(0, 1).float() for i in range(3))
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    sdpa = sdpa.transpose(0, 1).to(dtype)
    torch.testing.assert_close(sdpa.float(), cpu_rows[1].float(), atol=2e-2, rtol=2e-2)
    assert not bitwise_equal(sdpa, cpu_rows[1])


@pytest.mark.parametrize("arch", WIDTHS)
def test_context_across_the_split_boundary(arch):
    """Rows whose keys cross the 512-key split (two splits merged in split order) and tile boundaries:
    a chunk of prefill rows and decode rows at contexts 511..514 and 530, in any batch order, == CPU."""
    hq, hkv, d, dtype = 2, 1, 64, torch.bfloat16
    n = 530
    (q, k, v), = make_seqs([n], hq, hkv, d, dtype, seed=7)
    scale = d**-0.5
    ref = ops.paged_attention  # CPU reference: the same op outside emulation
    cache = Cache([n], hkv, d, dtype, 16, seed=3)
    cache.write(0, 0, k, v)  # CPU write; the emulated write is tested against it below
    tbl = cache.table
    emu_k, emu_v = torch.full_like(cache.k, float("nan")), torch.full_like(cache.v, float("nan"))
    pos = torch.arange(n)
    slots = tbl[0, pos // 16].long() * 16 + pos % 16
    # a mixed batch: chunk rows [505, 515) (crossing the split), decode rows at contexts 512, 513, 530
    ctx = [515, 512, 513, 530]
    qlens = [10, 1, 1, 1]
    qs = torch.cat([q[505:515], q[511:512], q[512:513], q[529:530]])
    meta = (tbl[[0, 0, 0, 0]], torch.tensor(ctx, dtype=torch.int32), cu(qlens))
    cpu = ref(qs, cache.k, cache.v, *meta, scale)
    full, _ = ops.attention_varlen(q, k, v, cu([n]), cu([n]), scale, True)  # CPU training path
    with aligned_ops.emulate(arch) as emu:
        ops.reshape_and_cache(k, v, emu_k, emu_v, slots)
        got = ops.paged_attention(qs, emu_k, emu_v, *meta, scale)
        perm = [3, 0, 2, 1]  # the same rows in another batch order
        off = cu(qlens).tolist()
        qp = torch.cat([qs[off[i] : off[i + 1]] for i in perm])
        got_p = ops.paged_attention(qp, emu_k, emu_v, tbl[[0] * 4], torch.tensor([ctx[i] for i in perm],
                                    dtype=torch.int32), cu([qlens[i] for i in perm]), scale)
    assert_bitwise_equal(emu_k, cache.k, "cache write k")  # NaN slots compare by bits too
    assert_bitwise_equal(emu_v, cache.v, "cache write v")
    assert_bitwise_equal(got, cpu, f"paged across the split on {arch}")
    assert_bitwise_equal(got, torch.cat([full[505:515], full[511:513], full[529:530]]), "paged == training")
    offp = cu([qlens[i] for i in perm]).tolist()
    for j, i in enumerate(perm):
        assert_bitwise_equal(got_p[offp[j] : offp[j + 1]], got[off[i] : off[i + 1]], f"batch order, seq {i}")
    splits = [l for l in emu.launches if l.kernel_base == "attention_split_kernel"]
    # items = (row block, split): the chunk and 3 decode rows past key 512 have 2 splits each, 512 has 1
    assert [l.grid[0] for l in splits] == [2 + 1 + 2 + 2] * 2
    assert all(l.block == (256, 1, 1) for l in splits)


@pytest.mark.parametrize("arch", WIDTHS)
def test_negative_control_tile_sum_order(arch):
    """The emulator's neighbour-first shuffle tree (a different tile-sum order than fold_lanes) must change the
    bits: the comparisons above can fail."""
    seqs = make_seqs([40], 2, 1, 64, torch.float32, seed=5)
    cpu_out, _ = varlen(seqs, 0.125)
    with aligned_ops.emulate(arch, _fault="neighbour_tree"):
        bad, _ = varlen(seqs, 0.125)
    torch.testing.assert_close(bad, cpu_out, atol=1e-5, rtol=1e-5)
    assert not bitwise_equal(bad, cpu_out)


def test_bad_inputs_under_emulation():
    """The GPU glue runs the same metadata checks and the planner: the same messages as the CPU backend."""
    seqs = make_seqs([5], 2, 1, 16, torch.float32, seed=9)
    q, k, v = (packed(seqs, i) for i in range(3))
    cache = Cache([5], 1, 16, torch.float32, 4, seed=1)
    with aligned_ops.emulate("sm_90") as emu:
        with pytest.raises(RuntimeError, match=r"aligned::attention_varlen: cu_seqlens_q must be non-decreasing"):
            ops.attention_varlen(q, k, v, torch.tensor([0, 3, 2, 5], dtype=torch.int32),
                                 torch.tensor([0, 1, 2, 5], dtype=torch.int32), 0.25, True)
        with pytest.raises(RuntimeError, match=r"aligned::paged_attention: block_table\[0, 1\] = 1000000 is out of"):
            ops.paged_attention(q, cache.k, cache.v, torch.tensor([[0, 10**6]], dtype=torch.int32),
                                torch.tensor([5], dtype=torch.int32), cu([5]), 0.25)
        with pytest.raises(RuntimeError, match=r"aligned::reshape_and_cache: slot_mapping\[1\] = 99 is out of range"):
            ops.reshape_and_cache(k[:2], v[:2], cache.k, cache.v, torch.tensor([0, 99]))
        with pytest.raises(RuntimeError, match=r"aligned::paged_attention: head_dim must be <= 640 on the GPU"):
            ops.paged_attention(torch.zeros(1, 1, 648), torch.zeros(2, 4, 1, 648), torch.zeros(2, 4, 1, 648),
                                torch.tensor([[0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                                cu([1]), 0.25)
    assert not emu.launches  # every bad call was refused before a launch


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("cfg", [(4, 2, 64, torch.bfloat16, True), (2, 2, 40, torch.float32, False)],
                         ids=["gqa_d64_bf16_causal", "d40_f32_noncausal"])
def test_backward_equals_cpu_and_is_batch_invariant(arch, cfg):
    """Deterministic backward on the GPU source: dq, dk, dv == CPU bitwise; a sequence's gradients do not
    depend on the other sequences of the batch (alone vs packed with others, in another order)."""
    hq, hkv, d, dtype, causal = cfg
    lens = [37, 9]
    seqs = make_seqs(lens, hq, hkv, d, dtype, seed=d)
    g = torch.Generator().manual_seed(4)
    q, k, v = (packed(seqs, i) for i in range(3))
    c = cu(lens)
    out, lse = ops.attention_varlen(q, k, v, c, c, 0.15, causal)
    go = torch.randn(out.shape, generator=g).to(dtype)
    ref = ops.attention_varlen_backward(go, q, k, v, out, lse, c, c, 0.15, causal)
    with aligned_ops.emulate(arch) as emu:
        got = ops.attention_varlen_backward(go, q, k, v, out, lse, c, c, 0.15, causal)
        alone = ops.attention_varlen_backward(go[37:], q[37:], k[37:], v[37:], out[37:], lse[37:], cu([9]), cu([9]),
                                              0.15, causal)
    for name, a, b in zip("dq dk dv".split(), got, ref):
        assert_bitwise_equal(a, b, f"{name} on {arch}")
    for name, a, b in zip("dq dk dv".split(), alone, got):
        assert_bitwise_equal(a, b[37:], f"{name} alone vs packed on {arch}")
    assert {"attention_bwd_delta_kernel", "attention_bwd_dq_kernel", "attention_bwd_dkdv_kernel"} <= emu.kernels()
    # negative control: torch autograd through SDPA gives the right gradient with other bits
    qs, ks, vs = (t[37:].transpose(0, 1).float().requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=0.15, enable_gqa=True)
    o.backward(go[37:].transpose(0, 1).float())
    dq_t = qs.grad.transpose(0, 1).to(dtype)
    torch.testing.assert_close(dq_t.float(), got[0][37:].float(), atol=3e-2, rtol=3e-2)
    assert not bitwise_equal(dq_t, got[0][37:])
