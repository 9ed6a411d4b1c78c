"""MoE negative control, run in a fresh process WITHOUT the aligned_ops plugin (stock vLLM-CPU vs stock HF).

Prints one JSON line: ``mismatch_metrics`` of stock HF (teacher-forced, fp32 log-softmax of its logits) against
stock vLLM's sampled-token log-probs, with both sides' expert choices (routing flips, |Δ log-prob| split by
routing agreed / flipped). Usage: python _stock_vllm_moe_probe.py MODEL_DIR DTYPE
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

    from aligned_ops.diagnostics import mismatch_metrics
    from aligned_ops.integrations import vllm_plugin
    from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm
    from aligned_ops.integrations.routing_capture import (capture_hf_routing, scored_token_experts,
                                                          vllm_teacher_forced_routing)

    model_dir, dtype = sys.argv[1], sys.argv[2]
    n_prompts = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    llm = make_llm(model_dir, dtype=dtype, aligned=False, max_num_batched_tokens=512)
    assert not vllm_plugin.is_installed()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 500, (40 + 13 * i,), generator=g).tolist() for i in range(n_prompts)]
    rollouts = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=16)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    L = sum(1 for layer in model.model.layers if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "top_k"))
    hf_lp, v_lp, hf_ex, v_ex = [], [], [], []
    for r in rollouts:
        seq = r.prompt_token_ids + r.token_ids
        P, C = len(r.prompt_token_ids), len(r.token_ids)
        ids = torch.tensor(seq)[None]
        with torch.no_grad(), capture_hf_routing(model) as rec:
            logits = model(ids).logits[0].float()
        lp = torch.log_softmax(logits, -1)[P - 1 : P - 1 + C].gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
        hf_lp.append(lp)
        v_lp.append(r.logprobs_tensor())
        hf_ex.append(scored_token_experts(torch.stack(rec, dim=1), P, C))
        v_ex.append(scored_token_experts(vllm_teacher_forced_routing(llm, seq, L), P, C))
    m = mismatch_metrics(torch.cat(hf_lp), torch.cat(v_lp), trainer_experts=torch.cat(hf_ex),
                         rollout_experts=torch.cat(v_ex))
    # Stock refit of the same weights must not change anything (rollout.refit re-packs the CPU MoE weights).
    from aligned_ops.integrations.rollout import refit

    before = generate_with_logprobs(llm, prompts[:2], temperature=0.0, max_tokens=4)
    refit(llm, model.state_dict())
    after = generate_with_logprobs(llm, prompts[:2], temperature=0.0, max_tokens=4)
    m["refit_same_weights_unchanged"] = all(
        a.token_ids == b.token_ids and torch.equal(a.logprobs_tensor(), b.logprobs_tensor()) for a, b in zip(before, after))
    from aligned_ops.integrations.rollout import shutdown

    shutdown(llm)  # now: the next job of a shared process (tests/integrations/_stock_jobs.py) starts its own engine
    print(json.dumps(m))


if __name__ == "__main__":
    main()
