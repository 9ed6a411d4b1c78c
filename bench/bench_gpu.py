"""GPU benchmark of the aligned ops (CUDA / ROCm) against their torch peers, with the machine's own ceilings.

    PYTHONPATH=python python bench/bench_gpu.py [--quick] [--out table.md] [--json rows.json]

First it measures two ceilings in the same run (METHOD.md of the device tool): the bandwidth of a 1 GiB
device-to-device copy (bytes read + bytes written) and the rate of an 8192^3 bf16 torch.matmul on random data.
Then every row times one aligned op and its torch peer (CUDA events, median of repeats after a warm-up; inputs
larger than L2 where the op streams weights, rotated over several copies) and prints:
  * the achieved rate of the resource that bounds the op — GB/s of the bytes it must move (each input read once,
    each output written once) or TFLOP/s of the flops it must do — and that rate as a fraction of its ceiling;
  * "roofline": the op's floor max(bytes / copy GB/s, flops / matmul TFLOP/s) over its measured time. The `fma`
    profile's GEMM runs on CUDA cores, so its honest compute ceiling is the fp32 FMA rate (~1/15 of the bf16
    matmul rate on an H200); the table states the bf16 ceiling, which is what the user compares with;
  * torch's time and aligned / torch.
`--smoke` runs every row on tiny shapes on the CPU (a check of this script without a GPU, no numbers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import aligned_ops  # noqa: F401  (registers torch.ops.aligned)
from common import device_median_ms

ops = torch.ops.aligned


class Timer:
    def __init__(self, device: str, reps: int):
        self.device, self.reps = device, reps

    def __call__(self, fn) -> float:
        """Median milliseconds of fn() over self.reps runs after two warm-up runs (CPU: wall clock, --smoke)."""
        if self.device != "cpu":
            return device_median_ms(fn, self.reps, warmup=2)
        fn()
        fn()
        ts = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)


def ceilings(dev: str, timer: Timer, smoke: bool) -> dict:
    n = 1 << (10 if smoke else 29)  # 2^29 bf16 = 1 GiB
    src = torch.randn(n, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() * src.element_size() / ms / 1e6
    del src, dst
    s = 64 if smoke else 8192
    a = torch.randn(s, s, device=dev, dtype=torch.bfloat16)
    b = torch.randn(s, s, device=dev, dtype=torch.bfloat16)
    ms = timer(lambda: a @ b)
    mm_tflops = 2 * s**3 / ms / 1e9
    return {"copy_GBps": copy_gbs, "bf16_matmul_TFLOPs": mm_tflops}


class Rows:
    def __init__(self, ceil: dict, timer: Timer):
        self.ceil, self.timer, self.rows = ceil, timer, []

    def add(self, op: str, shape: str, fn, peer, *, bytes_: float, flops: float, peer_name: str):
        ms = self.timer(fn)
        pms = self.timer(peer) if peer is not None else float("nan")
        t_mem = bytes_ / (self.ceil["copy_GBps"] * 1e6)  # ms
        t_flop = flops / (self.ceil["bf16_matmul_TFLOPs"] * 1e9)
        mem_bound = t_mem >= t_flop
        rate = (bytes_ / ms / 1e6) if mem_bound else (flops / ms / 1e9)
        frac = rate / (self.ceil["copy_GBps"] if mem_bound else self.ceil["bf16_matmul_TFLOPs"])
        row = {"op": op, "shape": shape, "ms": ms, "rate": rate, "unit": "GB/s" if mem_bound else "TFLOP/s",
               "ceiling_fraction": frac, "roofline_fraction": max(t_mem, t_flop) / ms, "peer": peer_name,
               "peer_ms": pms, "vs_peer": pms / ms}
        self.rows.append(row)
        print(self.fmt(row), flush=True)

    @staticmethod
    def fmt(r: dict) -> str:
        return (f"| {r['op']} | {r['shape']} | {r['ms']:.4f} | {r['rate']:.1f} {r['unit']} | {100 * r['ceiling_fraction']:.1f}% |"
                f" {100 * r['roofline_fraction']:.1f}% | {r['peer']} {r['peer_ms']:.4f} | {r['vs_peer']:.2f}x |")


HEADER = ("| op | shape | aligned ms | achieved | of ceiling | roofline | torch peer ms | torch/aligned |\n"
          "|---|---|---:|---:|---:|---:|---|---:|")


def bench_linear(r: Rows, dev: str, quick: bool, smoke: bool):
    shapes = [(64, 64)] if smoke else ([(4096, 4096), (1536, 4096)] if quick else [(4096, 4096), (1536, 4096), (4096, 14336)])
    ms = [1, 16] if smoke else ([1, 4, 16, 512] if not quick else [1, 16, 512])
    for N, K in shapes:
        copies = 1 if smoke else max(1, (256 << 20) // (N * K * 2))  # > L2: rotate weight copies
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            it = {"i": 0}

            def nxt():
                it["i"] = (it["i"] + 1) % copies
                return ws[it["i"]]

            r.add("linear (fma)", f"M={M} N={N} K={K} bf16", lambda: ops.linear(x, nxt(), None),
                  lambda: F.linear(x, nxt()), bytes_=2 * (N * K + M * K + M * N), flops=2 * M * N * K,
                  peer_name="F.linear")
        del ws


def bench_rows(r: Rows, dev: str, quick: bool, smoke: bool):
    H = 64 if smoke else 4096
    for rows in ([1, 4] if smoke else ([1, 64, 4096] if not quick else [1, 4096])):
        x = torch.randn(rows, H, device=dev, dtype=torch.bfloat16)
        w = torch.randn(H, device=dev, dtype=torch.bfloat16)
        r.add("rms_norm", f"rows={rows} H={H} bf16", lambda: ops.rms_norm(x, w, 1e-6),
              lambda: F.rms_norm(x, (H,), w, 1e-6), bytes_=2 * (2 * rows * H + H), flops=3 * rows * H,
              peer_name="F.rms_norm")
    V = 1000 if smoke else 151936
    for rows in ([1, 3] if smoke else ([1, 8, 64] if not quick else [1, 64])):
        z = torch.randn(rows, V, device=dev, dtype=torch.bfloat16) * 4
        ids = torch.randint(0, V, (rows,), device=dev)
        r.add("log_softmax", f"rows={rows} V={V} bf16->fp32", lambda: ops.log_softmax(z, 1.0, None),
              lambda: torch.log_softmax(z.float(), -1), bytes_=rows * V * (2 + 4), flops=0,
              peer_name="torch.log_softmax")
        r.add("token_logprobs", f"rows={rows} V={V} bf16", lambda: ops.token_logprobs(z, ids, 1.0, None),
              lambda: torch.log_softmax(z.float(), -1).gather(-1, ids[:, None]), bytes_=rows * V * 2, flops=0,
              peer_name="log_softmax+gather")


def bench_attention(r: Rows, dev: str, quick: bool, smoke: bool):
    import torch.nn.functional as F  # noqa: N812

    dt, hq, hkv, d, bs = torch.bfloat16, 32, 8, 128, 16
    cases = [(2, 64)] if smoke else ([(32, 4096)] if quick else [(32, 4096), (128, 2048), (8, 32768)])
    for B, C in cases:
        nb = B * C // bs
        kc = torch.randn(nb, bs, hkv, d, device=dev, dtype=dt)
        vc = torch.randn_like(kc)
        table = torch.randperm(nb, dtype=torch.int32).view(B, C // bs)
        q = torch.randn(B, hq, d, device=dev, dtype=dt)
        sl = torch.full((B,), C, dtype=torch.int32)
        qsl = torch.arange(B + 1, dtype=torch.int32)
        kd = kc.view(B, C, hkv, d).transpose(1, 2)
        vd = vc.view(B, C, hkv, d).transpose(1, 2)
        r.add("paged decode", f"B={B} C={C} H={hq}/{hkv} D={d}", lambda: ops.paged_attention(q, kc, vc, table, sl, qsl, d**-0.5),
              lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, enable_gqa=True),
              bytes_=2 * kc.numel() * kc.element_size(), flops=4 * B * hq * C * d, peer_name="SDPA (contiguous KV)")
        del kc, vc, kd, vd
    for n in ([64] if smoke else ([4096] if quick else [4096, 16384])):
        q = torch.randn(n, hq, d, device=dev, dtype=dt)
        k = torch.randn(n, hkv, d, device=dev, dtype=dt)
        v = torch.randn_like(k)
        cu = torch.tensor([0, n], dtype=torch.int32)
        qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
        r.add("varlen prefill", f"N={n} H={hq}/{hkv} D={d} causal", lambda: ops.attention_varlen(q, k, v, cu, cu, d**-0.5, True),
              lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True),
              bytes_=2 * (2 * q.numel() + 2 * k.numel()), flops=2 * 2 * hq * d * n * n / 2, peer_name="SDPA")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes, fewer repeats")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, no numbers")
    ap.add_argument("--out", default=None, help="append the Markdown table to this file")
    ap.add_argument("--json", default=None, help="write ceilings and rows as JSON")
    a = ap.parse_args()
    if a.smoke:
        dev = "cpu"
    elif not torch.cuda.is_available():
        print("bench_gpu: no GPU (torch.cuda.is_available() is False); use --smoke to check the script", file=sys.stderr)
        return 2
    else:
        dev = "cuda"
    timer = Timer(dev, 3 if a.smoke else (10 if a.quick else 30))
    name = "CPU (smoke)" if a.smoke else torch.cuda.get_device_name(0)
    ceil = ceilings(dev, timer, a.smoke)
    head = (f"{name}, torch {torch.__version__}: ceilings measured in this run — device copy "
            f"{ceil['copy_GBps']:.0f} GB/s (1 GiB, read + write), bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s "
            f"(8192^3, random data)")
    print(head + "\n\n" + HEADER, flush=True)
    r = Rows(ceil, timer)
    failures = []
    for part in (bench_linear, bench_rows, bench_attention):
        try:
            part(r, dev, a.quick, a.smoke)
        except Exception as e:  # one family failing must not lose the others' rows
            failures.append(f"{part.__name__}: {type(e).__name__}: {e}")
            print(f"| {part.__name__} | FAILED: {type(e).__name__}: {str(e)[:200]} | | | | | | |", flush=True)
        if dev == "cuda":
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "a") as f:
            f.write(head + "\n\n" + HEADER + "\n" + "\n".join(Rows.fmt(x) for x in r.rows) + "\n\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": name, "ceilings": ceil, "rows": r.rows, "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
