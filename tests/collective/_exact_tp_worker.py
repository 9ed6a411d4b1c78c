"""Worker for test_exact_row_parallel.py: one rank of a 2-process gloo world (launched by aligned_ops.testing).

Runs aligned_ops.profiles.row_parallel_linear under the exact profile on this rank's K slice and prints one JSON
list of records {check, value}. The launcher sets ALIGNED_OPS_LINEAR=exact: the profile the variable selects is
what picks the route.
"""

import json
import sys

import torch
import torch.distributed as dist

import aligned_ops
from aligned_ops import profiles
from aligned_ops.ops import collective
from aligned_ops.testing import bits
from aligned_ops.testing.distributed import init_from_env


def inputs(dtype, M, N, K, g):
    x = torch.randn(M, K, generator=g)
    W = torch.randn(N, K, generator=g) * 0.05
    big = 3.0e4 if dtype == torch.float16 else 2.0 ** 20
    x[1] *= 2.0 ** -6
    x[1, K - 3] = big      # an outlier row whose span > 29 bits (its form rounds) with the outlier on rank 1
    W[:3, K - 3] = 0       # ... meeting zero weights in columns 0..2
    W[4] *= 2.0 ** -6
    W[4, 2] = big * 1e-3   # an outlier weight row with its outlier on rank 0
    x[2] = 0.0
    x[3, 7] = float("nan")
    W[5, K - 1] = float("inf")
    b = torch.randn(N, generator=g)
    return x.to(dtype), W.to(dtype), b.to(dtype)


def main():
    rank, world = init_from_env()
    assert world == 2
    torch.set_num_threads(1)
    rec = []

    def add(check, value):
        rec.append(dict(rank=rank, check=check, value=value))

    g = torch.Generator().manual_seed(7)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for K, k0 in ((200, 100), (203, 120)):  # vLLM's even split, and an uneven one
            x, W, b = inputs(dtype, 6, 37, K, g)
            sl = slice(0, k0) if rank == 0 else slice(k0, K)
            xr, Wr = x[:, sl].contiguous(), W[:, sl].contiguous()
            for bias in (None, b):
                got = profiles.row_parallel_linear(xr, Wr, bias, None, in_features=K)  # profile: the env's
                add(f"exact_equals_linear_exact[{dtype},K={K},bias={bias is not None}]",
                    bool(torch.equal(bits(got), bits(aligned_ops.linear_exact(x, W, bias)))))
            # negative controls: the fma route on the same slices; each rank's own exact linear, summed
            if K == 200:
                fma = profiles.row_parallel_linear(xr, Wr, None, None, in_features=K, profile="fma")
                add(f"fma_route_differs[{dtype}]", int((bits(fma) != bits(aligned_ops.linear_exact(x, W))).sum()))
                mine = aligned_ops.linear_exact(xr, Wr).float()
                dist.all_reduce(mine, group=None)  # fp32 SUM of the ranks' rounded outputs
                add(f"per_rank_exact_summed_differs[{dtype}]",
                    int((bits(mine.to(dtype)) != bits(aligned_ops.linear_exact(x, W))).sum()))
    # the weight's packing is cached per weight version, and redone after an in-place update
    x, W, b = inputs(torch.bfloat16, 4, 20, 128, g)
    sl = slice(0, 64) if rank == 0 else slice(64, 128)
    xr, Wr = x[:, sl].contiguous(), W[:, sl].contiguous()
    # an unregistered slice is packed on every call: a write behind the version counter is seen (issue 21.3)
    before = profiles.row_parallel_linear(xr, Wr, b, None)
    Wr.data.mul_(2.0)
    W2 = torch.cat([W[:, :64] * 2.0, W[:, 64:] * 2.0], dim=1).to(torch.bfloat16)
    add("unregistered_data_write_seen", bool(torch.equal(bits(profiles.row_parallel_linear(xr, Wr, b, None)),
                                                          bits(aligned_ops.linear_exact(x, W2, b)))))
    Wr.data.mul_(0.5)
    add("unregistered_back", bool(torch.equal(bits(profiles.row_parallel_linear(xr, Wr, b, None)), bits(before))))
    aligned_ops.cache_exact_weights(Wr)  # the rollout engine's weights are registered (the vLLM plugin does it)
    first = profiles.row_parallel_linear(xr, Wr, b, None)
    again = profiles.row_parallel_linear(xr, Wr, b, None)
    add("cached_same_bits", bool(torch.equal(bits(first), bits(again))))
    with torch.no_grad():
        Wr.mul_(3.0)  # bumps the version counter on both ranks
    W3 = torch.cat([W[:, :64] * 3.0, W[:, 64:] * 3.0], dim=1).to(torch.bfloat16)
    after = profiles.row_parallel_linear(xr, Wr, b, None)
    add("repacked_after_update", bool(torch.equal(bits(after), bits(aligned_ops.linear_exact(x, W3, b)))))
    # ranks whose caches disagree (only rank 0 cleared its own) still run the same collectives: no hang, same bits
    if rank == 0:
        aligned_ops.clear_exact_weight_cache()
    one_cleared = profiles.row_parallel_linear(xr, Wr, b, None)
    add("one_rank_cleared_same_bits", bool(torch.equal(bits(one_cleared), bits(after))))
    dist.barrier()
    print(json.dumps(rec))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.exit(0)
