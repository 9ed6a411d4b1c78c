"""DeepSeek-V3 negative control, run in a fresh process WITHOUT the aligned_ops plugin: stock vLLM-CPU (its non-MLA
path, VLLM_MLA_DISABLE=1: the same expanded attention form the aligned side runs; the CPU MLA backend needs a
576-wide latent) generates from the given prompts and prints one JSON line with each rollout's prompt, sampled ids
and log-probs (float.hex, exact) and the expert ids stock vLLM chose for each scored token.
Usage: python _stock_vllm_deepseek_probe.py MODEL_DIR DTYPE PROMPTS_JSON
"""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"
# ALIGNED_PROBE_STOCK_MLA=1: vLLM's own MLA path instead (CPU_MLA: expanded prefill, absorbed decode; 576-wide rows)
os.environ["VLLM_MLA_DISABLE"] = "0" if os.environ.get("ALIGNED_PROBE_STOCK_MLA") == "1" else "1"
os.environ.pop("ALIGNED_OPS_VLLM", None)


def main():
    from aligned_ops.integrations import vllm_plugin
    from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm

    model_dir, dtype, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = make_llm(model_dir, dtype=dtype, aligned=False, max_num_batched_tokens=64, max_model_len=512)
    assert not vllm_plugin.is_installed()
    assert llm.llm_engine.vllm_config.model_config.use_mla == (os.environ["VLLM_MLA_DISABLE"] == "0")
    rollouts = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=8)
    print(json.dumps([{"prompt": r.prompt_token_ids, "tokens": r.token_ids,
                       "logprobs": [float(x).hex() for x in r.logprobs_tensor().tolist()]} for r in rollouts]))


if __name__ == "__main__":
    main()
