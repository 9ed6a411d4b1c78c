"""Negative-control probe, run in a fresh process WITHOUT the aligned_ops plugin: stock vLLM-CPU TP=1 vs TP=2.

Greedy rollouts of the same prompts on a stock TP=1 engine and a stock TP=2 engine (mp workers); prints one
JSON line: tokens compared (up to each prompt's first divergence), how many log-probs differ, how many
prompts diverge in their tokens. Usage: python _stock_tp_probe.py MODEL_DIR DTYPE
"""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.pop("ALIGNED_OPS_VLLM", None)
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per TP rank (auto wants a NUMA node per rank)


def main():
    import torch

    from aligned_ops.integrations import vllm_plugin
    from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, shutdown

    model_dir, dtype = sys.argv[1], sys.argv[2]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (150, 40, 200, 9)]
    outs = {}
    for tp in (1, 2):
        kw = dict(tensor_parallel_size=2, distributed_executor_backend="mp") if tp == 2 else {}
        llm = make_llm(model_dir, dtype=dtype, aligned=False, max_num_batched_tokens=256, max_model_len=512, **kw)
        assert not vllm_plugin.is_installed()
        outs[tp] = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=12)
        shutdown(llm)
        del llm
    compared = differ = diverged = 0
    for a, b in zip(outs[1], outs[2]):
        n = 0
        while n < len(a.token_ids) and a.token_ids[n] == b.token_ids[n]:
            n += 1
        diverged += n < len(a.token_ids)
        la, lb = a.logprobs_tensor()[:n], b.logprobs_tensor()[:n]
        compared += n
        differ += int((la.view(torch.int32) != lb.view(torch.int32)).sum())
    print(json.dumps({"tokens_compared": compared, "logprobs_differing": differ, "prompts_diverged": diverged}))


if __name__ == "__main__":
    main()
