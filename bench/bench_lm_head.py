"""Peak extra memory and time of the trainer's LM-head log-prob: unfused (aligned linear -> token_logprobs, the
[T, V] logits and their gradient materialised) vs aligned_ops.fused_token_logprobs (issue 14, item 5).

Each variant runs forward + backward (d hidden, d weight) in its OWN subprocess: the inputs are built, a small
warm-up runs, the kernel's peak-RSS counter is reset (/proc/self/clear_refs, 5), then the measured step runs and
VmHWM (peak resident set) minus the RSS before the step is the step's peak memory. "extra" subtracts the
outputs every variant must produce (d hidden, d weight, the log-probs), so it is what the LM head needs on top.
The reference figure is the materialised fp32 logits, T x V x 4 bytes; the issue's bound is 1/8 of it.
Memory does not depend on K except through the outputs (K = 64 by default keeps the run short on 2 cores).

    PYTHONPATH=$PWD/python python3 bench/bench_lm_head.py [--T 4096 --V 151936 --K 64 --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def _status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(args):
    import torch

    import aligned_ops

    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(args.T, args.K, generator=g)).to(dtype)
    w = (torch.randn(args.V, args.K, generator=g) * 0.1).to(dtype)
    ids = torch.randint(0, args.V, (args.T,), generator=g)
    gw = torch.randn(args.T, generator=g)

    def step(h, w, ids, gw):
        hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if args.variant == "fused":
            lp = aligned_ops.fused_token_logprobs(hl, wl, ids, args.temperature, token_chunk=args.token_chunk,
                                                  vocab_chunk=args.vocab_chunk)
        else:
            lp = aligned_ops.token_logprobs(aligned_ops.linear(hl, wl), ids, args.temperature)
        (lp * gw).sum().backward()
        return lp.detach(), hl.grad, wl.grad

    step(h[:8], w[:4096], ids[:8] % 4096, gw[:8])  # warm-up: lazy init, per-thread scratch
    clones = h.numel() * h.element_size() + w.numel() * w.element_size()  # the step's leaf copies
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss0 = _status("VmRSS")
    t0 = time.perf_counter()
    lp, dh, dw = step(h, w, ids, gw)
    dt = time.perf_counter() - t0
    peak = _status("VmHWM") - rss0
    outputs = sum(t.numel() * t.element_size() for t in (lp, dh, dw))
    print(json.dumps({"variant": args.variant, "peak_bytes": peak, "extra_bytes": peak - outputs - clones,
                      "outputs_bytes": outputs, "clones_bytes": clones, "seconds": dt,
                      "lp_bits": int(lp.view(torch.int32).double().sum()),
                      "dh_bits": int(dh.float().view(torch.int32).double().sum()),
                      "dw_bits": int(dw.float().view(torch.int32).double().sum())}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--V", type=int, default=151936)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--token-chunk", type=int, default=0)
    p.add_argument("--vocab-chunk", type=int, default=0)
    p.add_argument("--variants", default="fused,unfused")
    p.add_argument("--variant", default=None)
    args = p.parse_args()
    if args.variant:
        return child(args)
    fp32_logits = args.T * args.V * 4
    print(f"T={args.T} V={args.V} K={args.K} dtype={args.dtype}: materialised fp32 logits = {fp32_logits / 2**20:.1f} "
          f"MiB, 1/8 = {fp32_logits / 8 / 2**20:.1f} MiB")
    res = {}
    for v in args.variants.split(","):
        cmd = [sys.executable, __file__, "--variant", v, "--T", str(args.T), "--V", str(args.V), "--K", str(args.K),
               "--dtype", args.dtype, "--temperature", str(args.temperature), "--token-chunk", str(args.token_chunk),
               "--vocab-chunk", str(args.vocab_chunk)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        r = res[v] = json.loads(out)
        print(f"{v:8s} peak {r['peak_bytes'] / 2**20:8.1f} MiB  extra {r['extra_bytes'] / 2**20:8.1f} MiB "
              f"({r['extra_bytes'] / fp32_logits:.4f} of fp32 logits)  time {r['seconds']:.2f} s")
    if "fused" in res and "unfused" in res:
        same = all(res["fused"][k] == res["unfused"][k] for k in ("lp_bits", "dh_bits", "dw_bits"))
        print(f"bit checksums equal: {same}; time ratio fused/unfused {res['fused']['seconds'] / res['unfused']['seconds']:.2f}")


if __name__ == "__main__":
    main()
