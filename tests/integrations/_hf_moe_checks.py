"""The checks the HF MoE trainer tests share — tests/integrations/test_hf_moe.py (Qwen3-MoE, Qwen2-MoE) and
test_hf_deepseek_v3.py (DeepSeek-V3) — on a patched model: one sequence scored alone, the same bits for its tokens
in a padded batch (left and right), packed (cu_seqlens) and chunked (a prefix scored alone), and closeness to
float64 stock HF on the tokens whose routing agrees. Each test file keeps only what its architecture adds."""

from __future__ import annotations

import copy

import torch

from aligned_ops.integrations.hf import completion_logprobs, unpatch_model
from aligned_ops.integrations.routing_capture import capture_hf_routing
from aligned_ops.testing import assert_bitwise_equal
from aligned_ops.testing.rollouts import padded_batch, random_sequences


def single(model, s, start):
    """``s`` scored alone, completion from ``start``: (its completion log-probs, its routed experts [T, L, k])."""
    cm = torch.zeros(1, len(s), dtype=torch.long)
    cm[0, start:] = 1
    with torch.no_grad():
        out = model(s[None], completion_mask=cm, return_logits=False, return_routing=True)
    return out.logprobs[0, start:], out.routed_experts[0]


def check_batch_padding_packing_chunking(model, lens, pad):
    """Each of ``len(lens)`` random sequences gives the bits and expert choices it gives alone: in a padded batch
    (``pad`` extra columns, right and left padding; padding tokens route nowhere), packed with cu_seqlens, and —
    for the longest — as prefixes scored alone (causal and row-invariant: what a chunked prefill / decode sees)."""
    seqs = random_sequences(lens, 0)
    starts = [max(1, n // 2) for n in lens]
    alone = [single(model, s, st) for s, st in zip(seqs, starts)]
    for left in (False, True):
        ids, am, cm, _ = padded_batch(seqs, starts, max(lens) + pad, left=left)
        with torch.no_grad():
            out = model(ids, attention_mask=am, completion_mask=cm, return_logits=False, return_routing=True)
        for i, (s, st) in enumerate(zip(seqs, starts)):
            off = ids.shape[1] - len(s) if left else 0
            assert_bitwise_equal(out.logprobs[i, off + st : off + len(s)], alone[i][0])
            assert torch.equal(out.routed_experts[i, off : off + len(s)], alone[i][1])
            assert bool((out.routed_experts[i, :off] == -1).all())  # left padding: no routing
    flat = torch.cat(seqs)[None]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    cm = torch.zeros_like(flat)
    for (a, b), st in zip(bounds, starts):
        cm[0, a + st : b] = 1
    with torch.no_grad():
        lp = completion_logprobs(model, flat, cm, cu_seqlens=cu)
    for (a, b), st, (ref, _) in zip(bounds, starts, alone):
        assert_bitwise_equal(lp[0, a + st : b], ref)
    i = max(range(len(lens)), key=lambda j: lens[j])
    s, st = seqs[i], starts[i]
    for cut in (st + 1, st + 7, len(s) - 1):
        lp_prefix, ex_prefix = single(model, s[:cut], st)
        assert_bitwise_equal(lp_prefix, alone[i][0][: cut - st])
        assert torch.equal(ex_prefix, alone[i][1][:cut])


def check_close_to_float64_stock_hf(model, need: int = 10, max_sequences: int = 8):
    """The patched model's log-probs of 30-token sequences' last 20 tokens are within the dtype's tolerance of the
    unpatched model's in float64, compared at the positions where both chose the same experts in every layer at that
    position and at every earlier one (a flip is a legitimate, discrete difference, and later tokens see it through
    attention) — sequences are drawn until at least ``need`` tokens compare."""
    m64 = unpatch_model(copy.deepcopy(model)).to(torch.float64)
    m64.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    tol = 2e-4 if next(model.parameters()).dtype == torch.float32 else 0.15
    errs = []
    for seed in range(3, 3 + max_sequences):
        s = random_sequences([30], seed)[0]
        with torch.no_grad(), capture_hf_routing(m64) as rec:
            ref = torch.log_softmax(m64(s[None]).logits[0], -1)[9:29].gather(-1, s[10:, None])[:, 0]
        lp, ex = single(model, s, 10)
        assert len(rec) == ex.shape[1]  # one record per sparse layer
        same = torch.ones(30, dtype=torch.bool)
        for layer, ids in enumerate(rec):
            same &= (ids.sort(-1).values == ex[:, layer].sort(-1).values).all(-1)
        keep = same.cumprod(0).bool()[9:29]  # position 9 + i scores token 10 + i
        errs.append((lp[keep].double() - ref[keep]).abs())
        if sum(e.numel() for e in errs) >= need:
            break
    err = torch.cat(errs)
    assert err.numel() >= need, f"only {err.numel()} tokens free of route flips in {max_sequences} sequences"
    assert err.max() < tol, err.max()
