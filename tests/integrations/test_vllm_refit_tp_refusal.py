"""refit on a TP = 2 engine: a state dict one rank refuses is refused by every rank, before any rank reloads.

The dry run (``rollout._check_refit_items``) runs per rank on that rank's shard, and can pass on one rank and fail
on another: ``o_proj.weight`` short along its row-parallel input dim ([128, 120] for [128, 128]) fits rank 0's
slice (columns 0..63) but not rank 1's (64..127). Measured before the ranks agreed: refit raised "no engine weight
was changed", yet rank 0 had reloaded everything else it was sent (its ``lm_head`` shard changed, rank 1's did
not: an engine whose ranks hold different models). Negative control: the same ``lm_head`` alone is applied on both
ranks. Bits of every engine parameter are compared per rank (sha1 of the bytes), not log-probs."""

import os

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.integrations.rollout import make_llm, refit, shutdown  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_refusal_of_one_rank_is_every_ranks(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("qwen2", torch.bfloat16, seed=4, tie_word_embeddings=False)
    sd = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()

    def digest(worker):  # (nested: shipped to the workers by value)
        import hashlib

        model = worker.model_runner.get_model()
        return {n: hashlib.sha1(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                for n, p in model.named_parameters()}

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # refit ships tensors (and digest) to the mp workers
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % (os.cpu_count() or 1)) for r in range(2)))
        llm = make_llm(path, dtype="bfloat16", aligned=True, max_num_batched_tokens=128, max_model_len=256,
                       tensor_parallel_size=2, distributed_executor_backend="mp")
        try:
            before = llm.collective_rpc(digest)
            o = "model.layers.0.self_attn.o_proj.weight"
            assert tuple(sd[o].shape) == (128, 128)
            head = sd["lm_head.weight"] * 2
            with pytest.raises(ValueError, match=r"refit: state_dict 'model[.]layers[.]0[.]self_attn[.]o_proj[.]weight"
                                                 r"' \(shape \[128, 120\]\) could not be loaded.*no engine weight was "
                                                 r"changed$"):
                refit(llm, {o: sd[o][:, :-8].contiguous(), "lm_head.weight": head})
            after = llm.collective_rpc(digest)
            assert len(before) == 2
            for rank in range(2):
                assert [n for n in before[rank] if before[rank][n] != after[rank][n]] == [], rank
            refit(llm, {"lm_head.weight": head})  # control: applied on both ranks
            again = llm.collective_rpc(digest)
            for rank in range(2):
                assert [n for n in before[rank] if before[rank][n] != again[rank][n]] == ["lm_head.weight"], rank
        finally:
            shutdown(llm)
            del llm
