"""Peak resident memory (and time) of the trainer's LM-head log-prob as the user's process sees it: unfused (aligned
linear -> token_logprobs, the [T, V] logits and their gradient materialised) vs aligned_ops.fused_token_logprobs,
and the same through hf.completion_logprobs on a one-layer Qwen2 with that vocabulary (issue 14 item 5, issue 21
item 7).

How it measures (each variant x phase in its OWN fresh process, ``--processes`` of them):
  * the inputs are built, then one tiny call runs (lazy initialisation: kernel scratch, thread pool);
  * the kernel's peak-RSS counter is reset (/proc/self/clear_refs, "5") and the RSS read: the baseline;
  * the full-size call runs ``--calls`` times (a training loop calls it again and again: whatever a first call
    leaves resident — an allocator's heap that freed tiles could not be returned from — counts);
  * peak = VmHWM - baseline (what the process needed for the op), retained = VmRSS after the last call (its
    results freed) - baseline. "extra" subtracts what every variant must hold: the outputs (log-probs; in the
    step also d hidden, d weight) and the step's leaf copies.
The report gives the max and min over processes: glibc's heap behaviour depends on thread timing (before issue 21
item 7 the same fused forward peaked at 1.1 GB in some processes and 0.1 GB in others). Phases: ``forward`` (no
grad, the scoring pass: old / reference log-probs) and ``step`` (forward + backward d hidden, d weight).
Reference: the materialised bf16 logits, T x V x 2 bytes.

    PYTHONPATH=$PWD/python python3 bench/bench_lm_head.py [--T 4096 --V 151936 --K 64 --dtype bfloat16]
        [--phases forward,step] [--variants fused,unfused,completion_fused,completion_unfused]
        [--processes 3] [--calls 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


from common import proc_status_bytes as _status  # noqa: E402  (bench/ is the script's directory)


def child(args):
    import torch

    import aligned_ops

    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    T, V, K = args.T, args.V, args.K
    ids = torch.randint(0, V, (T,), generator=g)
    gw = torch.randn(T, generator=g)
    step = args.phase == "step"
    if args.variant in ("fused", "unfused"):
        h = torch.randn(T, K, generator=g).to(dtype)
        w = (torch.randn(V, K, generator=g) * 0.1).to(dtype)
        leaves_bytes = h.numel() * h.element_size() + w.numel() * w.element_size()

        def run(n):
            hl, wl = (h[:n].clone().requires_grad_(True), w.clone().requires_grad_(True)) if step else (h[:n], w)
            with torch.set_grad_enabled(step):
                if args.variant == "fused":
                    lp = aligned_ops.fused_token_logprobs(hl, wl, ids[:n], args.temperature,
                                                          token_chunk=args.token_chunk, vocab_chunk=args.vocab_chunk)
                else:
                    lp = aligned_ops.token_logprobs(aligned_ops.linear(hl, wl), ids[:n], args.temperature)
            if not step:
                return (lp,)
            (lp * gw[:n]).sum().backward()
            return lp.detach(), hl.grad, wl.grad
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from aligned_ops.integrations.hf import completion_logprobs, patch_model

        cfg = Qwen2Config(vocab_size=V, hidden_size=K, intermediate_size=2 * K, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(T, 64),
                          tie_word_embeddings=True)
        torch.manual_seed(0)
        model = patch_model(Qwen2ForCausalLM(cfg).to(dtype))
        model.requires_grad_(step)
        leaves_bytes = 0
        option = {"completion_fused": True, "completion_unfused": False, "completion_auto": "auto"}[args.variant]

        def run(n):
            rows = 4 if n % 4 == 0 else 1
            seqs = ids[:n].view(rows, n // rows)
            mask = torch.ones_like(seqs)
            mask[:, 0] = 0
            with torch.set_grad_enabled(step):
                lp = completion_logprobs(model, seqs, mask, temperature=args.temperature, fused_lm_head=option)
            if not step:
                return (lp,)
            (lp * gw[:n].view_as(lp)).sum().backward()
            grads = tuple(p.grad for p in model.parameters())
            model.zero_grad(set_to_none=True)
            return (lp.detach(),) + grads

    run(8)  # lazy initialisation only
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss0 = _status("VmRSS")
    times, outputs = [], 0
    for _ in range(args.calls):
        t0 = time.perf_counter()
        out = run(T)
        times.append(time.perf_counter() - t0)
        outputs = sum(t.numel() * t.element_size() for t in out if t is not None)
        lp_bits = int(out[0].float().view(torch.int32).double().sum())
        del out
    peak = _status("VmHWM") - rss0
    retained = _status("VmRSS") - rss0
    print(json.dumps({"variant": args.variant, "phase": args.phase, "peak": peak, "retained": retained,
                      "extra": peak - outputs - (leaves_bytes if step else 0), "seconds": min(times),
                      "lp_bits": lp_bits}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--V", type=int, default=151936)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--token-chunk", type=int, default=0)
    p.add_argument("--vocab-chunk", type=int, default=0)
    p.add_argument("--variants", default="fused,unfused,completion_fused,completion_unfused")
    p.add_argument("--phases", default="forward,step")
    p.add_argument("--processes", type=int, default=3)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--variant", default=None)
    p.add_argument("--phase", default=None)
    args = p.parse_args()
    if args.variant:
        return child(args)
    logits = args.T * args.V * 2
    load = os.getloadavg()
    print(f"T={args.T} V={args.V} K={args.K} {args.dtype}: bf16 logits {logits / 2**20:.1f} MiB; {args.processes} "
          f"fresh processes x {args.calls} full calls per row; load average {load[0]:.1f} {load[1]:.1f}")
    print("| phase | variant | peak MiB (max / min over processes) | extra MiB (max) | retained MiB (max) | "
          "fraction of bf16 logits (max extra) | best time s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    bits = {}
    for phase in args.phases.split(","):
        for v in args.variants.split(","):
            runs = []
            for _ in range(args.processes):
                cmd = [sys.executable, __file__, "--variant", v, "--phase", phase, "--T", str(args.T), "--V",
                       str(args.V), "--K", str(args.K), "--dtype", args.dtype, "--temperature", str(args.temperature),
                       "--token-chunk", str(args.token_chunk), "--vocab-chunk", str(args.vocab_chunk), "--calls",
                       str(args.calls)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
                runs.append(json.loads(out))
            bits.setdefault(phase, {})[v] = {r["lp_bits"] for r in runs}
            mib = lambda key, f=max: f(r[key] for r in runs) / 2**20  # noqa: E731
            print(f"| {phase} | {v} | {mib('peak'):.1f} / {mib('peak', min):.1f} | {mib('extra'):.1f} | "
                  f"{mib('retained'):.1f} | {mib('extra') * 2**20 / logits:.3f} | "
                  f"{min(r['seconds'] for r in runs):.2f} |", flush=True)
    for phase, per in bits.items():
        pairs = [(a, b) for a, b in (("fused", "unfused"), ("completion_fused", "completion_unfused")) if a in per
                 and b in per]
        for a, b in pairs:
            print(f"{phase}: log-prob bit checksums {a} == {b}: {per[a] == per[b] and len(per[a]) == 1}")


if __name__ == "__main__":
    main()
