"""Child of test_lm_head.py's memory test (one fresh process per measurement): the peak resident set of the fused
LM head's FORWARD as the user's process sees it (/proc/self/status VmHWM, reset through /proc/self/clear_refs).

argv: which (op | completion_fused | completion_auto), T, V. After a tiny call (lazy initialisation only) the peak
counter is reset and the full-size call runs three times (a training loop calls it again and again: memory a
first call leaves resident counts); prints {"peak": bytes over the RSS before the first full call}.
"""

import json
import sys

import torch

import aligned_ops


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main():
    which, T, V = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    K = 64
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (T,), generator=g)
    if which == "op":
        h = torch.randn(T, K, generator=g).bfloat16()
        w = (torch.randn(V, K, generator=g) * 0.1).bfloat16()

        def run(n):
            return aligned_ops.fused_token_logprobs(h[:n], w, ids[:n], 0.7)
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from aligned_ops.integrations.hf import completion_logprobs, patch_model

        cfg = Qwen2Config(vocab_size=V, hidden_size=K, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                          tie_word_embeddings=True)
        torch.manual_seed(0)
        model = patch_model(Qwen2ForCausalLM(cfg).to(torch.bfloat16))
        option = True if which == "completion_fused" else "auto"

        def run(n):
            seqs = ids[:n].view(4, n // 4)
            mask = torch.ones_like(seqs)
            mask[:, 0] = 0
            return completion_logprobs(model, seqs, mask, temperature=0.7, fused_lm_head=option)
    with torch.no_grad():
        run(8)  # lazy initialisation (kernel scratch, thread pool), not the LM head's memory
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        r0 = status("VmRSS")
        for _ in range(3):
            lp = run(T)
            del lp
    print(json.dumps({"peak": status("VmHWM") - r0}))


if __name__ == "__main__":
    main()
