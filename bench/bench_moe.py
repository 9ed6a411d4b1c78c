"""Microbenchmark: one MoE layer — aligned (router aligned::linear -> aligned::moe_routing -> aligned::moe_experts)
vs vLLM-CPU's stock path on the same shapes and inputs (router F.linear -> softmax/top-k/renormalise in torch, as
vLLM's CPU router -> vLLM's fused CPU MoE kernel ``cpu_fused_moe`` on pre-packed weights), in the same run.

    PYTHONPATH=python python bench/bench_moe.py --threads 2 [--quick] [--out bench/RESULTS.md]

Shapes: a scaled-down Qwen3-MoE layer (hidden 1024, expert intermediate 512, 64 experts, top-8; ~200 MB of bf16
expert weights) — Qwen3-30B-A3B's own layer (2048 / 768 / 128 / 8) with --full. Ratio = stock time / aligned
time (> 1: aligned is faster). Also times the experts op alone against ``cpu_fused_moe`` alone.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import Table, emit  # noqa: E402

import aligned_ops  # noqa: E402


def stock_ops():
    from vllm import _custom_ops as vops  # noqa: F401  (loads vLLM's CPU kernels)

    return vops


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--full", action="store_true", help="Qwen3-30B-A3B layer shape (2048/768/128/8)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    vops = stock_ops()
    H, I, E, k = (2048, 768, 128, 8) if args.full else (1024, 512, 64, 8)
    ms = [1, 16, 128] if args.quick else [1, 16, 128, 512]
    run_time = 0.2 if args.quick else 0.5
    isa = "vec"
    table = Table(f"MoE layer (CPU, {args.threads} threads; H={H}, I={I}, E={E}, top-{k}; stock = vLLM-CPU "
                  f"cpu_fused_moe isa={isa})")
    g = torch.Generator().manual_seed(0)
    for dt_name in args.dtypes.split(","):
        dt = getattr(torch, dt_name)
        router = (torch.randn(E, H, generator=g) / H**0.5).to(dt)
        w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dt)
        w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dt)
        w13p = vops.cpu_prepack_moe_weight(w13, isa)
        w2p = vops.cpu_prepack_moe_weight(w2, isa)
        for M in ms:
            x = torch.randn(M, H, generator=g).to(dt)

            def aligned_layer():
                return aligned_ops.moe_layer(x, router, w13, w2, k)

            def stock_layer():
                logits = F.linear(x, router)
                probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
                w, ids = torch.topk(probs, k, dim=-1)
                w = w / w.sum(-1, keepdim=True)
                out = torch.empty_like(x)
                vops.cpu_fused_moe(out, x, w13p, w2p, None, None, w, ids.to(torch.int32), "silu", isa)
                return out

            table.add("moe layer", f"M={M}", dt, aligned_layer, stock_layer, run_time)
            tw, tid, _ = aligned_ops.moe_routing(aligned_ops.linear(x, router), k)
            tid32 = tid.to(torch.int32)

            def stock_experts():
                out = torch.empty_like(x)
                vops.cpu_fused_moe(out, x, w13p, w2p, None, None, tw, tid32, "silu", isa)
                return out

            table.add("experts only", f"M={M}", dt, lambda: aligned_ops.moe_experts(x, tw, tid, w13, w2),
                      stock_experts, run_time)
    emit(table, args)


if __name__ == "__main__":
    main()
