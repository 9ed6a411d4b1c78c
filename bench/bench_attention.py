"""Attention microbenchmarks: aligned attention_varlen (prefill) and paged_attention (decode) vs
torch.nn.functional.scaled_dot_product_attention on the same data.

Prefill: one causal sequence of 2k tokens (varlen, packed) vs SDPA(is_causal=True) on [1, H, N, D].
Decode: B sequences with context C each, one new token per sequence, read through a paged cache (block size
16, shuffled blocks) vs SDPA on dense [B, H, 1, C] K/V (the dense layout favours torch).
GQA: SDPA gets enable_gqa=True. Ratio = torch time / aligned time (> 1: aligned faster).

    PYTHONPATH=python python bench/bench_attention.py [--quick] [--threads N] [--out results.md]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import aligned_ops  # noqa: F401
from common import Table, emit, parse_args

ops = torch.ops.aligned


def bench_prefill(table, n, hq, hkv, d, dtype, t):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, hq, d, generator=g).to(dtype)
    k = torch.randn(n, hkv, d, generator=g).to(dtype)
    v = torch.randn(n, hkv, d, generator=g).to(dtype)
    cu = torch.tensor([0, n], dtype=torch.int32)
    scale = d**-0.5
    qt, kt, vt = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))
    table.add(
        "prefill (causal)", f"N={n} H={hq}/{hkv} D={d}", dtype,
        lambda: ops.attention_varlen(q, k, v, cu, cu, scale, True),
        lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=hq != hkv),
        t,
    )


def bench_decode(table, batch, ctx, hq, hkv, d, dtype, t, block_size=16):
    g = torch.Generator().manual_seed(1)
    nblk = (ctx + block_size - 1) // block_size
    num_blocks = batch * nblk
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    block_table = torch.randperm(num_blocks, generator=g).to(torch.int32).view(batch, nblk)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    q = torch.randn(batch, hq, d, generator=g).to(dtype)
    scale = d**-0.5
    # the same K/V, gathered densely for SDPA: [B, Hkv, ctx, D]
    kd = k_cache[block_table.long()].reshape(batch, nblk * block_size, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    vd = v_cache[block_table.long()].reshape(batch, nblk * block_size, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    qd = q[:, :, None, :]
    table.add(
        "decode (paged)", f"B={batch} ctx={ctx} H={hq}/{hkv} D={d}", dtype,
        lambda: ops.paged_attention(q, k_cache, v_cache, block_table, seq_lens, qsl, scale),
        lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=hq != hkv),
        t,
    )


def main():
    args = parse_args(__doc__)
    t = 0.1 if args.quick else 0.3
    table = Table(f"attention (threads={torch.get_num_threads()})")
    hq, hkv, d = 8, 2, 128
    dtypes = [torch.bfloat16] if args.quick else [torch.float32, torch.bfloat16]
    for dtype in dtypes:
        bench_prefill(table, 2048, hq, hkv, d, dtype, t)
    shapes = [(1, 512), (8, 2048), (64, 512)] if args.quick else [
        (1, 512), (1, 8192), (8, 2048), (16, 4096), (64, 512), (64, 2048), (64, 8192)]
    for dtype in dtypes:
        for batch, ctx in shapes:
            bench_decode(table, batch, ctx, hq, hkv, d, dtype, t)
    emit(table, args)


if __name__ == "__main__":
    main()
