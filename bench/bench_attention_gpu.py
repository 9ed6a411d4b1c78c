"""GPU attention benchmark (CUDA / ROCm): aligned paged_attention decode (GB/s of K/V read) and attention_varlen
prefill (TFLOP/s) against torch's SDPA on the same data, timed with device events (median of repeats).

    PYTHONPATH=python python bench/bench_attention_gpu.py --device cuda [--quick] [--out results.md]
Planner metadata is host tensors (as the GPU glue requires); the planning and the one upload are in the timing.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import aligned_ops  # noqa: F401

ops = torch.ops.aligned


def time_ms(fn, reps):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    reps = 5 if a.quick else 20
    dt, hq, hkv, d, bs = torch.bfloat16, 32, 8, 128, 16
    rows = ["| attention (GPU) | shape | aligned ms | torch ms | rate |", "|---|---|---|---|---|"]
    # decode: B sequences x C context, one token each
    for B, C in ([(32, 4096)] if a.quick else [(32, 4096), (128, 2048), (8, 32768)]):
        nb = B * C // bs
        kc = torch.randn(nb, bs, hkv, d, device=a.device, dtype=dt)
        vc = torch.randn_like(kc)
        table = torch.randperm(nb, dtype=torch.int32).view(B, C // bs)
        q = torch.randn(B, hq, d, device=a.device, dtype=dt)
        sl = torch.full((B,), C, dtype=torch.int32)
        qsl = torch.arange(B + 1, dtype=torch.int32)
        ms = time_ms(lambda: ops.paged_attention(q, kc, vc, table, sl, qsl, d**-0.5), reps)
        kd = kc.view(B, C, hkv, d).transpose(1, 2)
        vd = vc.view(B, C, hkv, d).transpose(1, 2)
        tms = time_ms(lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, enable_gqa=True), reps)
        gbs = 2 * kc.numel() * kc.element_size() / ms / 1e6
        rows.append(f"| paged decode | B={B} C={C} H={hq}/{hkv} D={d} | {ms:.3f} | {tms:.3f} | {gbs:.0f} GB/s |")
        del kc, vc, kd, vd
    # prefill: one causal sequence
    for n in ([4096] if a.quick else [4096, 16384]):
        q = torch.randn(n, hq, d, device=a.device, dtype=dt)
        k = torch.randn(n, hkv, d, device=a.device, dtype=dt)
        v = torch.randn_like(k)
        cu = torch.tensor([0, n], dtype=torch.int32)
        ms = time_ms(lambda: ops.attention_varlen(q, k, v, cu, cu, d**-0.5, True), reps)
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
        tms = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True), reps)
        tf = 2 * 2 * hq * d * n * n / 2 / ms / 1e9
        rows.append(f"| varlen prefill | N={n} H={hq}/{hkv} D={d} | {ms:.3f} | {tms:.3f} | {tf:.2f} TFLOP/s |")
    text = "\n".join(rows)
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text + "\n\n")


if __name__ == "__main__":
    main()
