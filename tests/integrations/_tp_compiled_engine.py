"""The aligned compiled TP = 2 engine of test_vllm_tp_compiled.py, run in a fresh process (a background job,
tests/_background.py): a compiled (``enforce_eager=False``) tensor_parallel_size=2 engine (mp workers) with the
aligned_ops plugin on MODEL_DIR samples from the given prompts; prints one JSON line: the engine's TP size and
eager flag, and each rollout's prompt, sampled ids and log-probs (float.hex, exact). The linear profile is the
environment's (``ALIGNED_OPS_LINEAR``, inherited by the mp workers).
Usage: python _tp_compiled_engine.py MODEL_DIR PROMPTS_JSON TEMPERATURE MAX_TOKENS
"""

import json
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % (os.cpu_count() or 1)) for r in range(2)))


def main():
    from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, shutdown

    model_dir, prompts, temperature, max_tokens = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3]), int(
        sys.argv[4])
    llm = make_llm(model_dir, dtype="bfloat16", aligned=True, max_num_batched_tokens=128, max_model_len=512,
                   tensor_parallel_size=2, distributed_executor_backend="mp", enforce_eager=False)
    try:
        cfg = llm.llm_engine.vllm_config
        rollouts = generate_with_logprobs(llm, prompts, temperature=temperature, max_tokens=max_tokens)
        out = {"tp_size": cfg.parallel_config.tensor_parallel_size, "enforce_eager": cfg.model_config.enforce_eager,
               "rollouts": [{"prompt": r.prompt_token_ids, "tokens": r.token_ids,
                             "logprobs": [float(x).hex() for x in r.logprobs_tensor().tolist()]} for r in rollouts]}
    finally:
        shutdown(llm)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
