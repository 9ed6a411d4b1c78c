"""Worker for test_moe_row_parallel.py: one rank of a 4-process gloo world (launched by aligned_ops.testing).

Every rank joins the pairs (0,1), (2,3) and the world; for each group it shards a MoE block's experts as vLLM does
(every expert's I slice: gate rows, up rows, down columns; the shared expert likewise), runs
``row_parallel_moe_experts`` and compares it with the unsplit ``aligned::moe_experts`` bit for bit. Prints one
JSON list of records {group, t, rank, check, value}.
"""

import json

import torch
import torch.distributed as dist

import aligned_ops
from aligned_ops import profiles
from aligned_ops.testing import bits
from aligned_ops.testing.distributed import init_from_env

T, H, E, K, I, IS = 37, 64, 8, 2, 64, 32


def block(seed, dtype, shared):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    # down weights spread over 2^±8 so the order of the fp32 sums shows in the bits
    w2 = (torch.randn(E, H, I, generator=g) * torch.exp2(torch.randint(-8, 9, (E, H, I), generator=g).float())
          / I ** 0.5).to(dtype)
    tw, ids, _ = aligned_ops.moe_routing(logits, K, "softmax", True)
    sw13 = sw2 = sgate = None
    if shared:
        sw13 = (torch.randn(2 * IS, H, generator=g) / H ** 0.5).to(dtype)
        sw2 = (torch.randn(H, IS, generator=g) * 4).to(dtype)
        sgate = (torch.randn(1, H, generator=g) / H ** 0.5).to(dtype)
    return x, tw, ids, w13, w2, sw13, sw2, sgate


def shard(w13, w2, t, r):
    """vLLM's MergedColumnParallel gate/up and RowParallel down shard of every expert (rank r of t)."""
    i = w2.shape[-1]
    lo, hi = r * i // t, (r + 1) * i // t
    gate, up = w13[..., :i, :], w13[..., i:, :]
    return torch.cat([gate[..., lo:hi, :], up[..., lo:hi, :]], dim=-2).contiguous(), w2[..., lo:hi].contiguous()


def records_for(name, group):
    t, r = dist.get_world_size(group), dist.get_rank(group)
    rec = []

    def add(check, value):
        rec.append(dict(group=name, t=t, rank=r, check=check, value=value))

    cases = [("fma", torch.float32), ("fma", torch.bfloat16)]
    if aligned_ops.mma_unit() is not None:
        cases.append(("mma", torch.bfloat16))
    for pname, dtype in cases:
        profile = profiles.get(pname)
        for shared in (False, True, "ungated"):  # Qwen2-MoE's gated shared expert, DeepSeek-V3's ungated one
            tag = f"{pname},{str(dtype)[6:]},shared={shared}"
            x, tw, ids, w13, w2, sw13, sw2, sgate = block(7 + bool(shared), dtype, bool(shared))
            if shared == "ungated":
                sgate = None
            ref = profile.moe_experts(x, tw, ids, w13, w2, sw13, sw2, sgate)
            l13, l2 = shard(w13, w2, t, r)
            s13 = s2 = None
            if shared:
                s13, s2 = shard(sw13, sw2, t, r)
            out = profile.row_parallel_moe_experts(x, tw, ids, l13, l2, s13, s2, sgate, group)
            add(f"equals_unsplit[{tag}]", bool(torch.equal(bits(out), bits(ref))))
            late = profile.row_parallel_moe_experts(x, tw, ids, l13, l2, s13, s2, sgate, group, combine="late")
            add(f"late_combine_differs[{tag}]", int((bits(late) != bits(ref)).sum()))
            # one token alone equals its row in the batch (the routing slots do not mix tokens)
            one = profile.row_parallel_moe_experts(x[5:6], tw[5:6], ids[5:6], l13, l2, s13, s2, sgate, group)
            add(f"token_alone[{tag}]", bool(torch.equal(bits(one), bits(ref[5:6]))))
            none = profile.row_parallel_moe_experts(x[:0], tw[:0], ids[:0], l13, l2, s13, s2, sgate, group)
            add(f"no_tokens[{tag}]", list(none.shape) == [0, H] and none.dtype == dtype)
    # errors name the op and the argument, on every rank
    x, tw, ids, w13, w2, *_ = block(3, torch.float32, False)
    l13, l2 = shard(w13, w2, t, r)
    for label, kwargs in (("combine", dict(combine="bogus")),
                          ("w2", dict(w2=l2[..., : l2.shape[-1] - 1] if r == 0 else l2))):
        args = dict(x=x, topk_weights=tw, topk_ids=ids, w13=l13, w2=l2)
        args.update(kwargs)
        try:
            profiles.FMA.row_parallel_moe_experts(args["x"], args["topk_weights"], args["topk_ids"], args["w13"],
                                                  args["w2"], group=group, **({"combine": kwargs["combine"]}
                                                                              if "combine" in kwargs else {}))
            add(f"error[{label}]", "NO ERROR")
        except (ValueError, TypeError) as e:
            add(f"error[{label}]", str(e))
    # a true I that does not split into whole lanes (11: 5 + 6 at t = 2, 2 + 3 + 3 + 3 at t = 4), sharded
    # consistently (w13 and w2 agree, so the shape check passes): only the model's intermediate_size can tell
    g = torch.Generator().manual_seed(5)
    w13 = (torch.randn(E, 2 * 11, H, generator=g) / H ** 0.5).float()
    w2 = (torch.randn(E, H, 11, generator=g) * torch.exp2(torch.randint(-8, 9, (E, H, 11), generator=g).float()))
    l13, l2 = shard(w13, w2, t, r)
    try:
        profiles.FMA.row_parallel_moe_experts(x, tw, ids, l13, l2, group=group, intermediate_size=11)
        add("error[intermediate_size]", "NO ERROR")
    except (ValueError, TypeError) as e:
        add("error[intermediate_size]", str(e))
    # negative control: without it the local widths (5 -> 10, 6 -> 12 at t = 2) pass the check, and the lanes are
    # not the unsplit op's: the bits differ
    out = profiles.FMA.row_parallel_moe_experts(x, tw, ids, l13, l2, group=group)
    add("no_size_equal_unsplit", bool(torch.equal(bits(out), bits(profiles.FMA.moe_experts(x, tw, ids, w13, w2)))))
    return rec


def main():
    init_from_env()
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    world = dist.new_group([0, 1, 2, 3])
    rec = records_for(f"pair{rank // 2}", pairs[rank // 2])
    rec += records_for("world", world)
    print(json.dumps(rec))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
