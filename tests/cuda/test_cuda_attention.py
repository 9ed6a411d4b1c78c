"""CUDA (and ROCm) attention: attention_varlen, reshape_and_cache, paged_attention on the GPU equal the CPU
backend bit for bit, and every serving path equals the training path on the GPU (any batch order).

Skipped without a GPU (CI has none; the same kernels run under emulation in tests/emulated); run on a lent GPU
by .ci/gpu_check.sh. Planner metadata (offsets, seq_lens, block tables) is passed as host tensors — the GPU
glue refuses device metadata rather than reading it back (csrc/torch/glue/attention.h).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import aligned_ops  # noqa: F401  (registers torch.ops.aligned)
from aligned_ops.testing import assert_bitwise_equal, bitwise_equal

ops = torch.ops.aligned
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) GPU")


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def rand(shape, dtype, g):
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 128), (4, 4, 64), (3, 1, 80)])
def test_varlen_gpu_equals_cpu(dtype, hq, hkv, d):
    g = torch.Generator().manual_seed(hq * d)
    lens = [1, 31, 600, 1100]  # crosses tiles and 512-key splits
    q, k, v = (rand((sum(lens), h, d), dtype, g) for h in (hq, hkv, hkv))
    c = cu(lens)
    ref = ops.attention_varlen(q, k, v, c, c, d**-0.5, True)
    got = ops.attention_varlen(q.cuda(), k.cuda(), v.cuda(), c, c, d**-0.5, True)
    assert_bitwise_equal(got[0].cpu(), ref[0], "out")
    assert_bitwise_equal(got[1].cpu(), ref[1], "lse")
    sdpa = F.scaled_dot_product_attention(*(t[-1100:].cuda().transpose(0, 1).float() for t in (q, k, v)),
                                          is_causal=True, scale=d**-0.5, enable_gqa=True).transpose(0, 1).to(dtype)
    assert not bitwise_equal(sdpa.cpu(), ref[0][-1100:])  # negative control


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_paged_decode_and_prefill_equal_training_on_gpu(dtype):
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, bs = 8, 2, 128, 16
    lens = [4100, 700, 33]
    q, k, v = ([rand((n, h, d), dtype, g) for n in lens] for h in (hq, hkv, hkv))
    c = cu(lens)
    train, _ = ops.attention_varlen(torch.cat(q).cuda(), torch.cat(k).cuda(), torch.cat(v).cuda(), c, c, d**-0.5, True)
    rows = torch.split(train.cpu(), lens)
    need = [(n + bs - 1) // bs for n in lens]
    perm = torch.randperm(sum(need), generator=g).to(torch.int32)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    o = 0
    for b, nb in enumerate(need):
        table[b, :nb] = perm[o : o + nb]
        o += nb
    kc = torch.zeros(sum(need), bs, hkv, d, dtype=dtype, device="cuda")
    vc = torch.zeros_like(kc)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = table[b, pos // bs].long() * bs + pos % bs
        ops.reshape_and_cache(k[b].cuda(), v[b].cuda(), kc, vc, slots)  # host slot mapping
    # decode: the last token of each sequence, in two batch orders
    for order in ([0, 1, 2], [2, 0, 1]):
        qd = torch.cat([q[b][-1:] for b in order]).cuda()
        out = ops.paged_attention(qd, kc, vc, table[order], torch.tensor([lens[b] for b in order], dtype=torch.int32),
                                  cu([1] * 3), d**-0.5)
        for i, b in enumerate(order):
            assert_bitwise_equal(out[i : i + 1].cpu(), rows[b][-1:], f"decode seq {b}")
    # chunked prefill: the last 77 rows of sequence 1
    out = ops.paged_attention(q[1][-77:].cuda(), kc, vc, table[[1]], torch.tensor([700], dtype=torch.int32),
                              cu([77]), d**-0.5)
    assert_bitwise_equal(out.cpu(), rows[1][-77:], "chunked prefill")


def test_device_metadata_is_refused():
    q = torch.zeros(4, 2, 16, device="cuda")
    c = torch.tensor([0, 4], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be a CPU \\(host\\) tensor"):
        ops.attention_varlen(q, q[:, :1], q[:, :1], c, c.cpu(), 0.25, True)
