"""Worker for test_fsdp2_root_reshard.py: one rank of a 2-process gloo world (CPU), a toy FSDP2 model
(embedding, two sharded residual layers, final LayerNorm, LM head; the root sharded last, as shard_aligned
does), fp32, each rank its own token batch.

  check OUT.json

Case A: step (fwd, bwd, opt.step), [no-grad forward], model.zero_grad(), step 2's fwd+bwd -> root gradients.
Case B: fwd+bwd, [no-grad forward], opt.step(), forward -> log-probs and loss.
Each run with and without the bracketed scoring forward, with and without
``integrations.fsdp.reshard_after_no_grad_forward``; rank 0 writes, per case and hook setting, whether the
scored run's bits equal the unscored run's (integer views) on every rank.
Then cache_exact_weights on a model marked by ``mark_fsdp2_model`` (what shard_aligned does) while the root is
unsharded after a grad forward: the LM head's plain Parameter, a detached view of it, the head module, the
model; after backward the DTensor; and an unmarked model's unsharded head weight (accepted: the hole the mark
closes).
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from aligned_ops.integrations.fsdp import reshard_after_no_grad_forward
from aligned_ops.ops.linear_exact import cache_exact_weights, mark_fsdp2_model
from aligned_ops.testing import bits
from aligned_ops.testing.distributed import init_from_env

V, D, LR = 32, 16, 2.0 ** -4
ROOT_PARAMS = ("emb.weight", "norm.weight", "norm.bias", "head.weight")


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h):
        return h + torch.tanh(self.lin(h))


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return torch.log_softmax(self.head(self.norm(h)), dim=-1)


def build(hook):
    torch.manual_seed(0)  # the same initial weights on every rank and in every run
    model = Toy()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    if hook:
        reshard_after_no_grad_forward(model)
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def tokens(step):
    g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    return torch.randint(0, V, (3, 7), generator=g)


def loss_of(lp, ids):
    return -lp[:, :-1].gather(-1, ids[:, 1:, None]).mean()


def case_a(hook, score):
    model, opt = build(hook)
    ids = tokens(0)
    loss_of(model(ids), ids).backward()
    opt.step()
    if score:
        with torch.no_grad():
            model(tokens(9))
    model.zero_grad()
    ids = tokens(1)
    loss_of(model(ids), ids).backward()
    grads = dict(model.named_parameters())
    return [grads[n].grad.full_tensor() for n in ROOT_PARAMS]


def case_b(hook, score):
    model, opt = build(hook)
    ids = tokens(0)
    loss_of(model(ids), ids).backward()
    if score:
        with torch.no_grad():
            model(tokens(9))
    opt.step()
    ids = tokens(1)
    lp = model(ids)
    loss = loss_of(lp, ids)
    loss.backward()  # no forward with autograd on is left without its backward (the root would stay unsharded)
    return [lp.detach(), loss.detach()]


def same(xs, ys):
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(xs, ys, strict=True))


def refusals():
    from torch.distributed.tensor import DTensor

    def attempt(obj):
        try:
            return f"accepted {cache_exact_weights(obj)}"
        except ValueError as e:
            return str(e)

    out = {}
    model, _ = build(hook=True)
    mark_fsdp2_model(model)
    ids = tokens(0)
    lp = model(ids)  # grad on: the root stays unsharded until backward
    out["unsharded_is_plain"] = not isinstance(model.head.weight, DTensor)
    out["unsharded_param"] = attempt(model.head.weight)
    out["unsharded_view"] = attempt(model.head.weight.detach())
    out["head_module"] = attempt(model.head)
    out["model"] = attempt(model)
    loss_of(lp, ids).backward()
    out["sharded_is_dtensor"] = isinstance(model.head.weight, DTensor)
    out["dtensor"] = attempt(model.head.weight)
    # negative control: the same model, not marked — its unsharded LM head weight is a plain Parameter and passes
    unmarked, _ = build(hook=True)
    lp = unmarked(ids)
    out["unmarked_unsharded_param"] = attempt(unmarked.head.weight)
    loss_of(lp, ids).backward()
    return out


def main():
    init_from_env(timeout_s=120)
    torch.set_num_threads(1)
    res = {}
    for name, case in (("A", case_a), ("B", case_b)):
        ref = case(hook=True, score=False)
        ref_nohook = case(hook=False, score=False)
        res[name] = dict(hook_equal=same(case(hook=True, score=True), ref),
                         nohook_equal=same(case(hook=False, score=True), ref_nohook),
                         unscored_hook_vs_nohook_equal=same(ref, ref_nohook))
    res["refusals"] = refusals()
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, res)
    if dist.get_rank() == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] != "check":
        raise SystemExit(f"unknown mode {sys.argv[1]}")
    main()
