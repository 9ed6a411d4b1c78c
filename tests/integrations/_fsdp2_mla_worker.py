"""Worker for test_fsdp2_deepseek_absorbed.py: one rank of a 2-process gloo world (CPU).

  check OUT.json DIR:DTYPE ...

The DeepSeek-V3 trainer in the ABSORBED MLA form (``shard_aligned(model, mla_form="absorbed")``), each rank its
own micro-batch, two optimiser steps (SGD, lr 2^-4: lr·g is exact, so the update's bits do not depend on whether
the CPU kernel fuses it) with a no-grad scoring forward between them. The reference is the single-process
absorbed trainer on the same two micro-batches: its log-probs, and its gradients of each micro-batch's loss
(``policy_loss`` with the global token count) summed g0 + g1 — what FSDP2's SUM reduce-scatter over 2 ranks
computes (one commutative add). Every parameter starts from, and is updated to, the same bits on both sides.

Per rank and dtype it reports: log-probs of step 1, of the no-grad forward after the update and of step 2 bitwise
equal to the reference; every parameter's gradient (full_tensor) bitwise equal at both steps; the updated
parameters bitwise equal; negative controls: the expanded form's log-probs differ, and a perturbed shard of
kv_b_proj (rank 1's half, W_UK of a head on that rank) moves every rank's log-probs (then restored: equal again);
cache_exact_weights refuses the FSDP2 model, and the root's unsharded LM head weight after a grad forward.
The 2-rank shard boundary of kv_b_proj falls inside a head (the dv != dn variant has 5 heads).
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from _fsdp2_worker import batch, gather_objects, load, per_seq  # noqa: E402

from aligned_ops import rl  # noqa: E402
from aligned_ops.integrations.fsdp import shard_aligned  # noqa: E402
from aligned_ops.integrations.hf import completion_logprobs, patch_model  # noqa: E402
from aligned_ops.testing import bits  # noqa: E402

LR = 2.0 ** -4
TAU = 0.7


def sequences(world):
    g = torch.Generator().manual_seed(7)
    seqs = [(torch.randint(0, 500, (n,), generator=g).tolist(), torch.randint(0, 500, (m,), generator=g).tolist())
            for n, m in [(5, 7), (21, 3), (9, 12), (30, 5), (3, 9)]]
    # rank r's micro-batch: sequences r::world (rank 0: 3 sequences, rank 1: 2 — other sizes, other padding)
    return seqs, [list(range(r, len(seqs), world)) for r in range(world)]


def micro_batch(seqs, idx, step):
    ids, am, cm = batch([seqs[i] for i in idx])
    adv = torch.linspace(-1, 1, len(seqs))[idx][:, None] * (1 if step == 0 else -0.5)
    return ids, am, cm, adv.expand_as(ids).contiguous()


def step_loss(model, seqs, idx, step, n_tokens):
    ids, am, cm, adv = micro_batch(seqs, idx, step)
    lp = completion_logprobs(model, ids, cm, attention_mask=am, temperature=TAU)
    loss, _ = rl.policy_loss(lp, lp.detach(), adv, cm.bool(), global_num_tokens=n_tokens)
    return lp, loss


def scored(model, seqs, idx):
    ids, am, cm = batch([seqs[i] for i in idx])
    with torch.no_grad():
        lp = completion_logprobs(model, ids, cm, attention_mask=am, temperature=TAU)
    return per_seq(lp, [seqs[i] for i in idx])


def same(xs, ys):
    return len(xs) == len(ys) and all(torch.equal(bits(x), bits(y)) for x, y in zip(xs, ys))


def reference(model_dir, dtype, seqs, parts, n_tokens):
    """The single-process absorbed trainer: per step, the log-probs of every micro-batch and the summed gradients;
    the no-grad log-probs after step 1's update; the parameters after step 2's update."""
    model = patch_model(load(model_dir, dtype), mla_form="absorbed")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = {"lp": [], "grads": []}
    for step in range(2):
        lps, total = {}, {}
        for idx in parts:
            model.zero_grad(set_to_none=True)
            lp, loss = step_loss(model, seqs, idx, step, n_tokens)
            loss.backward()
            lps.update(zip(idx, per_seq(lp.detach(), [seqs[i] for i in idx])))
            for n, p in model.named_parameters():
                if p.grad is not None:  # rank order of the sum does not matter: a + b == b + a in fp
                    total[n] = p.grad.clone() if n not in total else total[n] + p.grad
        out["lp"].append(lps)
        out["grads"].append(total)
        for n, p in model.named_parameters():
            p.grad = total.get(n)
        opt.step()
        if step == 0:
            out["lp_nograd"] = {i: x for idx in parts for i, x in zip(idx, scored(model, seqs, idx))}
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def train(model, seqs, mine, n_tokens, ref):
    """Two SGD steps of the FSDP2 model on this rank's micro-batch, a no-grad scoring forward between them;
    each compared with the single-process reference ``ref``."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    res = dict(lp_equal=[], grad_equal=[], grad_differ=[], n_grads=[])
    for step in range(2):
        model.zero_grad(set_to_none=True)
        lp, loss = step_loss(model, seqs, mine, step, n_tokens)
        loss.backward()
        res["lp_equal"].append(same(per_seq(lp.detach(), [seqs[i] for i in mine]), [ref["lp"][step][i] for i in mine]))
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        res["n_grads"].append([len(grads), len(ref["grads"][step])])
        res["grad_differ"].append(sorted(
            (n, float((grads[n].double() - ref["grads"][step][n].double()).abs().max()),
             float(ref["grads"][step][n].double().abs().max())) for n in grads if n in ref["grads"][step]
            and not torch.equal(bits(grads[n]), bits(ref["grads"][step][n]))))
        res["grad_equal"].append(grads.keys() == ref["grads"][step].keys() and not res["grad_differ"][-1])
        opt.step()
        if step == 0:
            # scoring between steps (autograd off): W_UK / W_UV derived from the freshly gathered, updated weight
            res["lp_nograd_equal"] = same(scored(model, seqs, mine), [ref["lp_nograd"][i] for i in mine])
    return res


def check(model_dir, dtype):
    from aligned_ops import cache_exact_weights

    rank, world = dist.get_rank(), dist.get_world_size()
    seqs, parts = sequences(world)
    mine = parts[rank]
    # the global completion-token count (policy_loss's normaliser), all-reduced as a trainer would
    n_tokens = torch.tensor(float(batch([seqs[i] for i in mine])[2].sum()))
    dist.all_reduce(n_tokens)
    ref = reference(model_dir, dtype, seqs, parts, n_tokens)

    model = shard_aligned(load(model_dir, dtype), mla_form="absorbed")
    res = dict(rank=rank, seqs=mine, **train(model, seqs, mine, n_tokens, ref))
    # (the root reshard after a no-grad forward has its own fast test with a negative control:
    # test_fsdp2_root_reshard.py)
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    res["params_equal"] = params.keys() == ref["params"].keys() and all(
        torch.equal(bits(params[n]), bits(ref["params"][n])) for n in params)

    # Negative control 1: the expanded form on the same (updated) weights gives other bits.
    expanded = patch_model(load(model_dir, dtype), mla_form="expanded")
    with torch.no_grad():
        for n, p in expanded.named_parameters():
            p.copy_(ref["params"][n])
    now = scored(model, seqs, mine)
    res["expanded_differ"] = sum(int((bits(x) != bits(y)).sum()) for x, y in zip(scored(expanded, seqs, mine), now))
    # Negative control 2: one element of rank 1's shard of layer 1's kv_b_proj (dim-0 shards: a W_UK row of the
    # last head) perturbed moves every rank's log-probs (each rank gathers it); restored, the same bits again.
    w = model.model.layers[1].self_attn.kv_b_proj.weight
    local = w.to_local()
    row = local.shape[0] - 1 - model.model.layers[1].self_attn.v_head_dim  # last head's last W_UK row
    old = local[row, 3].clone()
    if rank == 1:
        with torch.no_grad():
            local[row, 3] += 0.25
    perturbed = scored(model, seqs, mine)
    res["perturbed_differ"] = sum(int((bits(x) != bits(y)).sum()) for x, y in zip(perturbed, now))
    if rank == 1:
        with torch.no_grad():
            local[row, 3] = old
    res["restored_equal"] = same(scored(model, seqs, mine), now)
    attn = model.model.layers[1].self_attn
    # the 2-rank shard boundary of kv_b_proj's rows ((dn + dv) per head) falls inside a head
    res["boundary_inside_head"] = local.shape[0] % (attn.qk_nope_head_dim + attn.v_head_dim) != 0

    def refused(obj):
        try:
            cache_exact_weights(obj)
            return ""
        except ValueError as e:
            return str(e)

    res["cache_refused"] = refused(model)
    # after a forward with autograd on (no backward yet) the root's LM head weight is a plain, unsharded Parameter
    ids, am, cm = batch([seqs[i] for i in mine])
    lp = completion_logprobs(model, ids, cm, attention_mask=am, temperature=TAU)
    res["lm_head_unsharded_plain"] = type(model.lm_head.weight) is torch.nn.Parameter
    res["lm_head_refused"] = refused(model.lm_head.weight)
    lp.sum().backward()
    model.zero_grad(set_to_none=True)
    return gather_objects(res)


def main():
    from aligned_ops.testing.distributed import init_from_env

    init_from_env(timeout_s=600)
    torch.set_num_threads(1)
    if sys.argv[1] != "check":
        raise SystemExit(f"unknown mode {sys.argv[1]}")
    results = {}
    for spec in sys.argv[3:]:
        d, dtype = spec.rsplit(":", 1)
        results[dtype] = check(d, dtype)
    if dist.get_rank() == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
