"""Worker for test_tree_all_reduce.py: one rank of an 8-process gloo world (launched by aligned_ops.testing).

Every rank joins every subgroup (pairs, quads, the world, a group of 3, a group not holding rank 0), runs the
checks of each group it belongs to and prints one JSON list of records {group, t, rank, check, value}.
"""

import json
import sys

import torch
import torch.distributed as dist

import aligned_ops
from aligned_ops import profiles
from aligned_ops.ops import collective
from aligned_ops import tree_combine as lane_tree
from aligned_ops.ops.collective import tree_all_reduce
from aligned_ops.testing import bits
from aligned_ops.testing.distributed import init_from_env

SHAPES = [(3, 37), (1, 128), (64, 300), (5,), (0, 7)]


def lane_sums(seed, shape):
    """Synthetic lane sums L[8, *shape]: magnitudes spread over 2^±20 so the combine order shows in the bits."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn((8, *shape), generator=g)
    e = torch.randint(-20, 21, (8, *shape), generator=g).to(torch.float32)
    return v * torch.exp2(e)


def rank_partial(L, t, r):
    k = 8 // t
    return lane_tree(list(L[r * k:(r + 1) * k]))


def gather(x, group, t):
    out = [torch.empty_like(x) for _ in range(t)]
    dist.all_gather(out, x.contiguous(), group=group)
    return out


def records_for(name, group, ranks, seed):
    t = len(ranks)
    r = dist.get_rank(group)
    rec = []

    def add(check, value):
        rec.append(dict(group=name, t=t, rank=r, check=check, value=value))

    for si, shape in enumerate(SHAPES):
        L = lane_sums(seed * 100 + si, shape)
        ref = lane_tree(list(L))
        p = rank_partial(L, t, r)
        before = bits(p).clone()
        for algo in collective.ALGORITHMS:
            out = tree_all_reduce(p, group, algorithm=algo)
            add(f"tree_equals_unsplit[{algo},{shape}]", bool(torch.equal(bits(out), bits(ref))))
        add(f"partial_untouched[{shape}]", bool(torch.equal(bits(p), before)))
        # Negative controls: a rank-sequential combine (t >= 4), a lane-sequential combine (any t).
        if shape == (64, 300):
            parts = gather(p, group, t)
            seq = parts[0]
            for q in parts[1:]:
                seq = seq + q
            lane_seq = L[0]
            for q in L[1:]:
                lane_seq = lane_seq + q
            add("rank_sequential_differs", int((bits(seq) != bits(ref)).sum()))
            add("lane_sequential_differs", int((bits(lane_seq) != bits(ref)).sum()))
    rec += embedding_records(name, group, t, r, seed)
    if t == 2:  # K = 13 has no 2-way split into whole lanes (rank 1's 7 features cut 4 ways != global lanes)
        try:
            profiles.row_parallel_linear(torch.zeros(2, 7), torch.zeros(3, 7), None, group, in_features=13, profile="fma")
            add("refuse_lanes", "NO ERROR")
        except ValueError as e:
            add("refuse_lanes", str(e))
    if hasattr(aligned_ops, "linear_partial"):
        rec += linear_records(name, group, t, r, seed)
    return rec


def embedding_records(name, group, t, r, seed):
    """Vocab-sharded lookup: the combine is an exact copy of the owner's row, -0.0 kept (bf16 and fp32)."""
    rec = []
    g = torch.Generator().manual_seed(seed)
    V, H = 40, 16
    for dtype in (torch.float32, torch.bfloat16):
        E = torch.randn(V, H, generator=g).to(dtype)
        E[torch.rand(V, H, generator=g) < 0.3] = -0.0
        ids = torch.randint(0, V, (23,), generator=g)
        lo, hi = r * V // t, (r + 1) * V // t
        not_owned = (ids < lo) | (ids >= hi)
        local = E[torch.where(not_owned, lo, ids)]  # what the shard's gather returns (masked ids -> row 0 of the shard)
        got = collective.sharded_rows_all_reduce(local, not_owned, group)
        rec.append(dict(group=name, t=t, rank=r, check=f"embedding_exact[{dtype}]",
                        value=bool(torch.equal(bits(got), bits(E[ids])))))
        stock = tree_all_reduce(local.masked_fill(not_owned.unsqueeze(-1), 0).float(), group).to(dtype)
        rec.append(dict(group=name, t=t, rank=r, check=f"embedding_plus_zero_fill_loses_sign[{dtype}]",
                        value=int((bits(stock) != bits(E[ids])).sum())))
    return rec


def linear_records(name, group, t, r, seed):
    rec = []
    g = torch.Generator().manual_seed(seed)
    for dtype in (torch.float32, torch.bfloat16):
        for K in (200, 100, 64):
            if K % t:
                continue
            M, N = 5, 37
            x = (torch.randn(M, K, generator=g) * 2).to(dtype)
            W = (torch.randn(N, K, generator=g) * 0.1).to(dtype)
            b = (torch.randn(N, generator=g) * 0.1).to(dtype)
            kr = K // t
            xr, Wr = x[:, r * kr:(r + 1) * kr].contiguous(), W[:, r * kr:(r + 1) * kr].contiguous()
            for bias in (None, b):
                want = aligned_ops.linear(x, W, bias)
                got = profiles.row_parallel_linear(xr, Wr, bias, group, in_features=K, profile="fma")
                rec.append(dict(group=name, t=t, rank=r, check=f"row_parallel_equals_linear[{dtype},K={K},bias={bias is not None}]",
                                value=bool(torch.equal(bits(got), bits(want)))))
            # The lane sums the engine's sequential negative control adds left to right are the linear's own:
            lanes = [aligned_ops.linear_partial(x[:, a:b].contiguous(), W[:, a:b].contiguous(), 1)
                     for a, b in aligned_ops.linear_lane_bounds(K)]
            rec.append(dict(group=name, t=t, rank=r, check=f"lane_sums_tree_equals_partial8[{dtype},K={K}]",
                            value=bool(torch.equal(bits(lane_tree(lanes)), bits(aligned_ops.linear_partial(x, W, 8))))))
            # Negative control: each rank rounds its own linear, the ranks' outputs are summed (what a plain
            # TP split of any fixed-order linear gives).
            naive = sum(x.to(torch.float32) for x in gather(aligned_ops.linear(xr, Wr).to(torch.float32), group, t))
            rec.append(dict(group=name, t=t, rank=r, check=f"per_rank_linear_differs[{dtype},K={K}]",
                            value=int((bits(naive.to(dtype)) != bits(aligned_ops.linear(x, W))).sum()) if t > 1 else -1))
    return rec


def refusal_records(name, group, t):
    r = dist.get_rank(group)
    rec = []

    def expect(check, fn, exc):
        try:
            fn()
        except exc as e:
            rec.append(dict(group=name, t=t, rank=r, check=check, value=str(e)))
        else:
            rec.append(dict(group=name, t=t, rank=r, check=check, value="NO ERROR"))

    p = torch.zeros(4, 8)
    expect("refuse_tp_degree", lambda: tree_all_reduce(p, group), ValueError)
    return rec


def main():
    rank, world = init_from_env()
    assert world == 8
    torch.set_num_threads(1)
    groups = {}
    for i in range(4):
        groups[f"pair{i}"] = [2 * i, 2 * i + 1]
    groups["quad0"] = [0, 1, 2, 3]
    groups["quad1"] = [4, 5, 6, 7]
    groups["triple"] = [0, 1, 2]
    handles = {name: dist.new_group(ranks) for name, ranks in groups.items()}  # every rank creates every group
    rec = []
    for seed, (name, ranks) in enumerate(groups.items()):
        if rank in ranks and name != "triple":
            rec += records_for(name, handles[name], ranks, seed + 1)
    rec += records_for("world", None, list(range(8)), 99)
    if rank in groups["triple"]:
        rec += refusal_records("triple", handles["triple"], 3)
    # Bad dtype and a K that is not t whole-lane slices (any group; world here).
    for check, fn, exc in [
        ("refuse_dtype", lambda: tree_all_reduce(torch.zeros(3, dtype=torch.bfloat16)), TypeError),
        ("refuse_algorithm", lambda: tree_all_reduce(torch.zeros(3), algorithm="ring"), ValueError),
        ("refuse_slice", lambda: profiles.row_parallel_linear(torch.zeros(2, 12), torch.zeros(3, 12), None,
                                                                in_features=200, profile="fma"), ValueError),
    ]:
        try:
            fn()
            rec.append(dict(group="world", t=8, rank=rank, check=check, value="NO ERROR"))
        except exc as e:
            rec.append(dict(group="world", t=8, rank=rank, check=check, value=str(e)))
    dist.barrier()
    print(json.dumps(rec))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.exit(0)
