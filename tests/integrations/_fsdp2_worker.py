"""Worker for the FSDP2 tests: one rank of a 2-process gloo world (CPU), launched by aligned_ops.testing.

  check OUT.json DIR:DTYPE ...     log-probs of FSDP2 (each rank its own micro-batch) vs one process, bitwise;
                                   backward twice (bitwise run to run); gradients vs one process (close)
  score MODEL_DIR DTYPE IN.pt OUT.pt
                                   teacher-force rollouts: IN.pt = list of jobs {"state_dict": path|None,
                                   "rollouts": [(prompt_ids, token_ids)], "temperature": float, and optionally
                                   "model_dir", "dtype" (else MODEL_DIR, DTYPE)}; rank r scores rollouts r::2;
                                   OUT.pt (rank 0) = per job, per rollout, fp32 log-probs
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from aligned_ops import rl
from aligned_ops.integrations.fsdp import shard_aligned
from aligned_ops.integrations.hf import completion_logprobs, patch_model
from aligned_ops.testing import bits
from aligned_ops.testing.distributed import init_from_env


def load(model_dir, dtype, state_dict=None):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    if state_dict is not None:
        m.load_state_dict(state_dict)
    return m


def batch(seqs):
    """Right-padded [B, S] ids / attention mask / completion mask from (prompt, completion) pairs."""
    S = max(len(p) + len(c) for p, c in seqs)
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    am = torch.zeros_like(ids)
    cm = torch.zeros_like(ids)
    for i, (p, c) in enumerate(seqs):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(list(p) + list(c))
        am[i, :n] = 1
        cm[i, len(p):n] = 1
    return ids, am, cm


def per_seq(lp, seqs):
    return [lp[i, len(p):len(p) + len(c)].detach().clone() for i, (p, c) in enumerate(seqs)]


def stock_logprobs(model, seqs, tau):
    """Unpatched HF forward of a padded batch, then fp32 log-softmax at tau: what a plain trainer computes."""
    ids, am, cm = batch(seqs)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am).logits.float() / tau
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros(len(seqs), 1), lp], 1)
    return per_seq(lp, seqs)


def gather_objects(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def check(model_dir, dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    seqs = [(torch.randint(0, 500, (n,), generator=g).tolist(), torch.randint(0, 500, (m,), generator=g).tolist())
            for n, m in [(5, 7), (40, 3), (17, 12), (90, 5), (3, 9)]]
    mine = list(range(rank, len(seqs), world))  # rank 0: 3 sequences, rank 1: 2 (different micro-batch sizes)
    my_seqs = [seqs[i] for i in mine]
    tau = 0.7

    ref_model = patch_model(load(model_dir, dtype))
    ids, am, cm = batch(seqs)
    ref_lp = completion_logprobs(ref_model, ids, cm, attention_mask=am, temperature=tau)
    ref = per_seq(ref_lp.detach(), seqs)
    # Single-process gradient of the global token-mean loss (reference for closeness only).
    adv = torch.linspace(-1, 1, len(seqs))[:, None].expand_as(ids).contiguous()
    loss_ref, _ = rl.policy_loss(ref_lp, ref_lp.detach(), adv, cm.bool())
    loss_ref.backward()
    ref_grads = {n: p.grad.float().clone() for n, p in ref_model.named_parameters() if p.grad is not None}

    model = shard_aligned(load(model_dir, dtype))
    ids, am, cm = batch(my_seqs)
    global_tokens = torch.tensor(float(cm.sum()))
    dist.all_reduce(global_tokens)
    runs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        lp = completion_logprobs(model, ids, cm, attention_mask=am, temperature=tau)
        a = adv[mine][:, : ids.shape[1]]
        loss, _ = rl.policy_loss(lp, lp.detach(), a.contiguous(), cm.bool(), global_num_tokens=global_tokens)
        loss.backward()
        grads = {n: p.grad.full_tensor().float().clone() for n, p in model.named_parameters() if p.grad is not None}
        runs.append((per_seq(lp.detach(), my_seqs), grads))
    lp_equal = all(torch.equal(bits(x), bits(ref[i])) for x, i in zip(runs[0][0], mine))
    lp_repeat = all(torch.equal(bits(x), bits(y)) for x, y in zip(runs[0][0], runs[1][0]))
    grad_repeat = runs[0][1].keys() == runs[1][1].keys() and all(
        torch.equal(bits(runs[0][1][n]), bits(runs[1][1][n])) for n in runs[0][1])
    # Negative control: the stock HF forward (not patched), FSDP2-sharded, on the same micro-batches.
    stock = load(model_dir, dtype)
    stock_ref = stock_logprobs(stock, seqs, tau)
    from torch.distributed.fsdp import fully_shard

    for layer in stock.model.layers:
        fully_shard(layer)
    fully_shard(stock)
    stock_mine = stock_logprobs(stock, my_seqs, tau)
    stock_differ = sum(int((bits(x) != bits(stock_ref[i])).sum()) for x, i in zip(stock_mine, mine))
    names = sorted(set(ref_grads) & set(runs[0][1]))
    rel = max(((runs[0][1][n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp(min=1e-30)).item() for n in names)
    res = gather_objects(dict(rank=rank, seqs=mine, lp_equal=lp_equal, stock_differ=stock_differ, lp_repeat=lp_repeat, grad_repeat=grad_repeat,
                              grad_rel_err=rel, n_grads=len(names), n_params=len(list(ref_model.parameters()))))
    return res


def score(model_dir, dtype, in_path, out_path):
    rank, world = dist.get_rank(), dist.get_world_size()
    jobs = torch.load(in_path)
    results = []
    env_profile = os.environ.get("ALIGNED_OPS_LINEAR")
    for job in jobs:
        sd = torch.load(job["state_dict"]) if job.get("state_dict") else None
        # job["profile"]: the linear profile this job's trainer runs (patch_model reads ALIGNED_OPS_LINEAR once)
        profile = job.get("profile") or env_profile
        if profile is None:
            os.environ.pop("ALIGNED_OPS_LINEAR", None)
        else:
            os.environ["ALIGNED_OPS_LINEAR"] = profile
        model = shard_aligned(load(job.get("model_dir", model_dir), job.get("dtype", dtype), sd))
        seqs = job["rollouts"]
        mine = list(range(rank, len(seqs), world))
        ids, am, cm = batch([seqs[i] for i in mine])
        with torch.no_grad():
            lp = completion_logprobs(model, ids, cm, attention_mask=am, temperature=job["temperature"])
        parts = gather_objects(list(zip(mine, per_seq(lp, [seqs[i] for i in mine]))))
        got = dict(x for part in parts for x in part)
        results.append([got[i] for i in range(len(seqs))])
        del model
    if rank == 0:
        torch.save(results, out_path)


def mixed(model_dir, out_path):
    """fp32 master weights sharded with FSDP2 mixed precision (param_dtype bf16, what verl's FSDP engine runs; FSDP2
    casts the float tensors of every sharded module's arguments to bf16): each rank's log-probs vs one process on the
    bf16 model, bitwise, and (control) vs one process on the fp32 model. Also with gradients, a backward runs."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    seqs = [(torch.randint(0, 500, (p,), generator=g).tolist(), torch.randint(0, 500, (c,), generator=g).tolist())
            for p, c in ((3, 6), (7, 2), (1, 9))]
    ids, am, cm = batch(seqs)
    res = {"rank": rank}
    try:
        model = shard_aligned(load(model_dir, "float32"), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                                         reduce_dtype=torch.float32))
        lp = completion_logprobs(model, ids, cm, attention_mask=am, temperature=0.8)
        lp.sum().backward()
        got = per_seq(lp, seqs)
        for dtype in ("bfloat16", "float32"):
            with torch.no_grad():
                want = per_seq(completion_logprobs(patch_model(load(model_dir, dtype)), ids, cm, attention_mask=am,
                                                   temperature=0.8), seqs)
            res[dtype] = all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want))
    except Exception as e:  # noqa: BLE001 - reported to the test (was: the bf16-cast RoPE table refused)
        res["error"] = f"{type(e).__name__}: {e}"
    results = gather_objects(res)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def main():
    init_from_env()
    torch.set_num_threads(1)
    mode = sys.argv[1]
    if mode == "check":
        out = sys.argv[2]
        results = {}
        for spec in sys.argv[3:]:
            d, dtype = spec.rsplit(":", 1)
            results[dtype] = check(d, dtype)
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    elif mode == "mixed":
        mixed(sys.argv[2], sys.argv[3])
    elif mode == "score":
        score(*sys.argv[2:6])
    else:
        raise SystemExit(f"unknown mode {mode}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
