"""The trainer side of the RL runner and of ``aligned-ops verify``: load the HF model (patched or stock), build the
padded batch, score completion tokens teacher-forced — the stock way (fp32 log_softmax of the logits) or through
``hf.completion_logprobs`` (aligned) — and read each side's expert choices (MoE)."""

from __future__ import annotations

import os


def stock_completion_logprobs(model, input_ids, attention_mask, completion_mask, temperature: float = 1.0):
    """What a trainer without aligned_ops computes: fp32 log_softmax of the model's logits, gathered (greedy
    temperatures scored at 1, as both aligned sides do: ``sampling.effective_temperature``)."""
    import torch

    from ..sampling import effective_temperature

    temperature = effective_temperature(temperature)

    logits = model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).logits.float()
    lp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]
    out = torch.zeros(input_ids.shape, dtype=torch.float32)
    out[:, 1:] = lp
    return out * completion_mask


def pad_batch(sequences: list[list[int]], completion_starts: list[int], pad_id: int):
    """Right-padded ``input_ids``, ``attention_mask`` and ``completion_mask`` tensors."""
    import torch

    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(sequences), width), dtype=torch.long)
    comp = torch.zeros((len(sequences), width), dtype=torch.float32)
    for b, (s, c) in enumerate(zip(sequences, completion_starts)):
        ids[b, : len(s)] = torch.tensor(s)
        attn[b, : len(s)] = 1
        comp[b, c : len(s)] = 1
    return ids, attn, comp


def trainer_model(model_dir: str, dtype: str, aligned: bool, profile=None):
    """The HF model from ``model_dir``; ``aligned``: patched, running ``profile`` (an :mod:`aligned_ops.profiles`
    name or object; None: ``ALIGNED_OPS_LINEAR``)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    # a checkpoint's "return_dict": false made HF's own backbone call return a tuple, which its causal LM then read
    # as an output (AttributeError, transformers 5.19, even with return_dict=True): the runner reads fields
    model.config.return_dict = True
    model.eval()
    if aligned:
        from ..integrations import hf

        hf.patch_model(model, profile=profile)
    return model


def trainer_logprobs(model, aligned: bool, sequences, completion_starts, pad_id, temperature=1.0):
    import torch

    ids, attn, comp = pad_batch(sequences, completion_starts, pad_id)
    with torch.no_grad():
        if aligned:
            from ..integrations import hf

            lp = hf.completion_logprobs(model, ids, comp, attention_mask=attn, temperature=temperature)
        else:
            lp = stock_completion_logprobs(model, ids, attn, comp, temperature)
    return lp, comp


def sparse_moe_layers(model_dir: str) -> tuple[int, ...]:
    """The indices of the layers whose MLP is a sparse MoE block, as the model's :class:`Architecture` defines
    them (``()`` for a dense model); from ``config.json`` alone."""
    import json
    from types import SimpleNamespace

    from ..models import registry

    with open(os.path.join(model_dir, "config.json")) as f:
        config = SimpleNamespace(**json.load(f))
    arch = registry.get(registry.architecture_of(config), f"model {model_dir}")
    return tuple(arch.sparse_layers(config)) if arch.moe and arch.sparse_layers is not None else ()


def is_moe_model(model_dir: str) -> bool:
    return bool(sparse_moe_layers(model_dir))


def trainer_routing(model, aligned: bool, sequences, completion_starts, pad_id):
    """The trainer's expert choices ``[B, S, L, k]`` (-1 where nothing is scored), entry ``[b, p]`` being the
    experts of position p-1 — the hidden state that scores token p, like the log-prob tensors."""
    import torch

    from ..integrations.routing_capture import capture_hf_routing

    ids, attn, comp = pad_batch(sequences, completion_starts, pad_id)
    B, S = ids.shape
    with torch.no_grad():
        if aligned:
            per_pos = model(ids, attention_mask=attn, return_logits=False, return_routing=True).routed_experts
        else:
            with capture_hf_routing(model) as rec:
                model(input_ids=ids, attention_mask=attn)
            per_pos = torch.stack([r.view(B, S, -1) for r in rec], dim=2)
    L, k = per_pos.shape[-2:]
    trainer = torch.full((B, S, L, k), -1, dtype=torch.int64)
    for b, seq in enumerate(sequences):
        trainer[b, 1 : len(seq)] = per_pos[b, : len(seq) - 1]
    return trainer


def routing_pair(llm, model, aligned: bool, sequences, completion_starts, pad_id):
    """Both sides' expert choices ``[B, S, L, k]`` (-1 where nothing is scored), entry ``[b, p]`` being the
    experts of position p-1 — the hidden state that scores token p, like the log-prob tensors."""
    import torch

    from ..integrations.routing_capture import vllm_teacher_forced_routing

    trainer = trainer_routing(model, aligned, sequences, completion_starts, pad_id)
    L = trainer.shape[2]
    rollout = torch.full_like(trainer, -1)
    for b, seq in enumerate(sequences):
        n = len(seq)
        rollout[b, 1:n] = vllm_teacher_forced_routing(llm, seq, L)[: n - 1]
    return trainer, rollout
