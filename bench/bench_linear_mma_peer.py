"""The `mma` linear against vLLM-CPU's own stock linear: `onednn_mm` with the weight pre-packed once
(vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm), on the projections of bench_e2e_exact.py's Qwen2
(hidden 896, intermediate 4864, vocab 32000). Each timed pass runs the op over several copies of the weight
totalling > 96 MB, so the weights come from DRAM as in the engine (an in-cache loop flatters a kernel whose weight
reads prefetch poorly). Min over --rounds passes, thread CPU time at 1 thread (a loaded machine stretches it far
less than wall time), wall time otherwise; ratio = oneDNN time / linear_mma time (> 1: ours is faster). On the
amx_bf16 unit also linear_mma_packed on weights packed once (what aligned_ops.linear_mma runs for the engine's
registered weights, as vLLM's own GEMM runs on its pre-packed ones) and its ratio.

    PYTHONPATH=python python3 bench/bench_linear_mma_peer.py [--threads 1] [--rounds 5] [--ms 16,512] [--shapes qkv,o]
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896), "lm_head": (896, 32000)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ms", default="16,512")
    p.add_argument("--shapes", default=",".join(SHAPES))
    a = p.parse_args()
    import aligned_ops  # noqa: F401  (registers torch.ops.aligned)
    from vllm import _custom_ops as vllm_ops

    if aligned_ops.mma_unit() is None:
        raise SystemExit("bench_linear_mma_peer: this CPU has no avx512_bf16 (the mma profile refuses)")
    torch.set_num_threads(a.threads)
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    torch.manual_seed(0)
    bf = torch.bfloat16
    packs = aligned_ops.mma_unit() == "amx_bf16"
    extra = " linear_mma_packed (ms) | oneDNN / packed |" if packs else ""
    print(f"| shape (K -> N) | M | linear_mma (ms) | onednn_mm (ms) | oneDNN / mma |{extra}  "
          f"({a.threads} threads, {'thread CPU' if a.threads == 1 else 'wall'} time, min of {a.rounds}, "
          f"unit {aligned_ops.mma_unit()})")
    print("|---|---:|---:|---:|---:|" + ("---:|---:|" if packs else ""))
    for name in a.shapes.split(","):
        K, N = SHAPES[name]
        copies = max(2, int(96e6 // (N * K * 2)))
        ws = [(torch.randn(N, K) / K**0.5).to(bf) for _ in range(copies)]
        handles = [vllm_ops.create_onednn_mm(w.t(), 32) for w in ws]
        packed = [torch.ops.aligned.linear_mma_pack_weight(w) for w in ws] if packs else []
        for M in (int(m) for m in a.ms.split(",")):
            if M > 16 and name == "lm_head":
                continue
            x = torch.randn(M, K).to(bf)
            best_a = best_t = best_p = float("inf")
            for _ in range(a.rounds):
                if packs:
                    t0 = clock()
                    for w, pw in zip(ws, packed):
                        torch.ops.aligned.linear_mma_packed(x, w, pw, None)
                    best_p = min(best_p, (clock() - t0) / copies)
                t0 = clock()
                for w in ws:
                    torch.ops.aligned.linear_mma(x, w, None)
                best_a = min(best_a, (clock() - t0) / copies)
                t0 = clock()
                for h in handles:
                    vllm_ops.onednn_mm(h, x, None)
                best_t = min(best_t, (clock() - t0) / copies)
            tail = f" {best_p * 1e3:.3f} | {best_t / best_p:.2f} |" if packs else ""
            print(f"| {name} {K} -> {N} | {M} | {best_a * 1e3:.3f} | {best_t * 1e3:.3f} | {best_t / best_a:.2f} |{tail}",
                  flush=True)


if __name__ == "__main__":
    main()
