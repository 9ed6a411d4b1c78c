"""Dense non-GEMM ops vs torch's native formulas on the same inputs (CPU by default).

Shapes of a 1.5B-class model (hidden 1536, intermediate 8960, 12 heads x 128, 2 kv heads, rotary_dim 128,
vocab 151936) at decode (M = 1..16 tokens) and prefill (M = 512..4096; 256..1024 for the vocab-sized
log-prob ops) sizes. Ratio = torch / aligned, so >= 1 means aligned_ops is at least as fast.

    PYTHONPATH=python python bench/bench_dense.py --threads 2 [--quick] [--out bench/RESULTS.md]
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import Table, emit, parse_args  # noqa: E402

import aligned_ops  # noqa: E402
from aligned_ops.ops import dense  # noqa: E402,F401

ops = torch.ops.aligned

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, ROT, VOCAB = 1536, 8960, 12, 2, 128, 128, 151936
EPS = 1e-6


def torch_rms_norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def torch_rotary(positions, q, cos_full, sin_full):
    # HF apply_rotary_pos_emb (neox halves): cos/sin [max_pos, rot] already duplicated per half
    cos = cos_full.index_select(0, positions).unsqueeze(1)
    sin = sin_full.index_select(0, positions).unsqueeze(1)
    h = q.shape[-1] // 2
    rot_half = torch.cat((-q[..., h:], q[..., :h]), dim=-1)
    return q * cos + rot_half * sin


def main():
    args = parse_args(__doc__.splitlines()[0])
    dev = args.device
    rt = 0.05 if args.quick else 0.2
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float32]
    decode = [1, 16] if args.quick else [1, 4, 16]
    prefill = [512] if args.quick else [512, 4096]
    lp_prefill = [256] if args.quick else [256, 1024]
    table = Table(f"dense ops, {dev}, threads={torch.get_num_threads()}, isa={os.environ.get('ALIGNED_CPU_ISA', 'auto')}")
    g = torch.Generator().manual_seed(0)

    for dt in dtypes:
        w = (torch.rand(HIDDEN, generator=g) + 0.5).to(dt).to(dev)
        for M in decode + prefill:
            x = torch.randn(M, HIDDEN, generator=g).to(dt).to(dev)
            r = torch.randn(M, HIDDEN, generator=g).to(dt).to(dev)
            table.add("rms_norm", f"{M}x{HIDDEN}", dt, lambda: ops.rms_norm(x, w, EPS), lambda: torch_rms_norm(x, w), rt)
            table.add("fused_add_rms_norm", f"{M}x{HIDDEN}", dt, lambda: ops.fused_add_rms_norm(x, r, w, EPS),
                      lambda: torch_rms_norm(x + r, w), rt)
        for M in decode + prefill:
            x = torch.randn(M, 2 * INTER, generator=g).to(dt).to(dev)
            table.add("silu_and_mul", f"{M}x{2 * INTER}", dt, lambda: ops.silu_and_mul(x),
                      lambda: F.silu(x[:, :INTER]) * x[:, INTER:], rt)
        cache = aligned_ops.rotary_cos_sin_cache(ROT, 8192).to(dev)
        cos_full = torch.cat([cache[:, : ROT // 2]] * 2, dim=-1).to(dt)
        sin_full = torch.cat([cache[:, ROT // 2:]] * 2, dim=-1).to(dt)
        for M in decode + prefill:
            pos = torch.randint(0, 8192, (M,), generator=g).to(dev)
            q = torch.randn(M, HEADS, HEAD_DIM, generator=g).to(dt).to(dev)
            table.add("rotary_embedding(q)", f"{M}x{HEADS}x{HEAD_DIM}", dt,
                      lambda: ops.rotary_embedding(pos, q, cache, ROT, True),
                      lambda: torch_rotary(pos, q, cos_full, sin_full), rt)
        for M in decode + lp_prefill:
            z = torch.randn(M, VOCAB, generator=g).to(dt).to(dev)
            ids = torch.randint(0, VOCAB, (M,), generator=g).to(dev)
            tau = 0.7
            table.add("token_logprobs", f"{M}x{VOCAB}", dt, lambda: ops.token_logprobs(z, ids, tau, None),
                      lambda: torch.log_softmax(z.float() / tau, -1).gather(-1, ids[:, None]).squeeze(-1), rt)
            if M in (16, 256) or args.quick:
                table.add("log_softmax", f"{M}x{VOCAB}", dt, lambda: ops.log_softmax(z, tau, None),
                          lambda: torch.log_softmax(z.float() / tau, -1), rt)
    emit(table, args)


if __name__ == "__main__":
    main()
