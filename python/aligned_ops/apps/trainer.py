"""The trainer side of ``aligned-ops verify`` and ``demo``: load the HF model (patched or stock), build the
padded batch, score completion tokens teacher-forced — the stock way (fp32 log_softmax of the logits) or
through ``hf.completion_logprobs`` (aligned)."""

from __future__ import annotations


def stock_completion_logprobs(model, input_ids, attention_mask, completion_mask, temperature: float = 1.0):
    """What a trainer without aligned_ops computes: fp32 log_softmax of the model's logits, gathered (greedy
    temperatures scored at 1, as both aligned sides do: ``sampling.effective_temperature``)."""
    import torch

    from ..sampling import effective_temperature

    temperature = effective_temperature(temperature)

    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
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


def trainer_model(model_dir: str, dtype: str, aligned: bool):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    if aligned:
        from ..integrations import hf

        hf.patch_model(model)
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
