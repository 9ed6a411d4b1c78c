"""MLA decode microbenchmark: aligned mla_paged_attention vs vLLM-CPU's stock MLA decode kernel
(torch.ops._C.mla_decode_kvcache, what the CPU_MLA backend runs) on the same latent cache [blocks, 16, 576] bf16,
plus the plain paged_attention with K = V = the 576-wide row (the work mla_paged_attention runs before it keeps
the first kv_lora_rank output dims). Ratio = ours / stock (< 1: aligned faster). Also prints how many output
elements agree bitwise (stock is not the contract: close, not equal).

    PYTHONPATH=python python bench/bench_mla.py
"""

import time

import torch
import vllm._custom_ops as vops

import aligned_ops  # noqa: F401

torch.manual_seed(0)
ops = torch.ops.aligned
B, H, R, rope, ctx, bs = 4, 16, 512, 64, 1024, 16
D = R + rope
dt = torch.bfloat16
nb = B * ctx // bs
cache = torch.randn(nb, bs, D).to(dt)
table = torch.arange(nb, dtype=torch.int32).view(B, -1)
sl = torch.full((B,), ctx, dtype=torch.int32)
q = torch.randn(B, H, D).to(dt)
scale = D ** -0.5
def ours():
    return ops.mla_paged_attention(q, cache, table, sl, torch.arange(B + 1, dtype=torch.int32), R, scale)
out = torch.empty(B, H, R, dtype=dt)
def stock():
    vops.mla_decode_kvcache_cpu(out, q, cache, scale, table, sl)
    return out
row = cache.unsqueeze(2)
def plain():  # the same attention with K = V = the whole row (what ours runs, before the narrow)
    return ops.paged_attention(q, row, row, table, sl, torch.arange(B + 1, dtype=torch.int32), scale)
def t(f, n=20):
    f(); f()
    best = []
    for _ in range(3):
        s = time.perf_counter()
        for _ in range(n): f()
        best.append((time.perf_counter() - s) / n)
    return min(best)
a, b, c = t(ours), t(stock), t(plain)
print(f"decode B={B} H={H} ctx={ctx} {R}+{rope} bf16, threads={torch.get_num_threads()}: ours {a*1e3:.2f} ms, "
      f"vLLM stock mla_decode_kvcache {b*1e3:.2f} ms (ours/stock {a/b:.2f}), plain paged_attention D=576 {c*1e3:.2f} ms")
o1 = ours(); o2 = stock().clone()
print("max |ours - stock|", (o1.float() - o2.float()).abs().max().item(), "bitwise equal frac",
      (o1.view(torch.int16) == o2.view(torch.int16)).float().mean().item())
