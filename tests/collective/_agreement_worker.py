"""Worker for test_collective_agreement.py: one rank of a 2-process gloo world (launched by aligned_ops.testing).

Each case calls a collective entry point with inputs that disagree between the ranks (or that one rank cannot
use) and records what this rank got: the exception type and message, or the result's bits against the
expected ones. Prints one JSON list of records {case, rank, raised, message, value}. The process group's
timeout is short (a regression must fail, not wait 30 minutes); the launcher's timeout kills a hung world.
"""

import json
import sys

import torch
import torch.distributed as dist

import aligned_ops
from aligned_ops.ops import collective
from aligned_ops.testing import bits
from aligned_ops.testing.distributed import init_from_env

BIG = collective.AUTO_ALLGATHER_MAX_NUMEL  # auto: all-gather up to this many elements, recursive halving above


def main():
    rank, world = init_from_env(timeout_s=60)
    assert world == 2
    torch.set_num_threads(1)
    rec = []
    g = torch.Generator().manual_seed(rank)

    def case(name, fn):
        try:
            value = fn()
            if isinstance(value, torch.Tensor):  # a case that should have raised returned (recorded, not raised)
                value = f"returned {value.dtype} {list(value.shape)}"
            rec.append(dict(case=name, rank=rank, raised=None, message="", value=value))
        except Exception as e:  # noqa: BLE001 - the test checks type and message
            rec.append(dict(case=name, rank=rank, raised=type(e).__name__, message=str(e), value=None))
        dist.barrier()  # the next case starts together (a rank that raised early must not run ahead)

    tree = collective.tree_all_reduce
    f32 = torch.float32
    case("tree_size", lambda: tree(torch.ones(3, 37 + rank)))
    case("tree_straddles_auto_switch", lambda: tree(torch.ones(BIG + rank)))  # allgather vs halving
    case("tree_same_numel_other_shape", lambda: tree(torch.ones((4, 6) if rank == 0 else (6, 4))))
    case("tree_dtype", lambda: tree(torch.ones(5, dtype=f32 if rank == 0 else torch.bfloat16)))
    case("tree_not_a_tensor", lambda: tree(torch.ones(5) if rank == 0 else [1.0] * 5))
    case("tree_algorithm", lambda: tree(torch.ones(64), algorithm="halving" if rank == 0 else "allgather"))
    def device_type_differs():
        # a CPU-only stand-in for a CPU partial beside a CUDA one in a cpu:gloo,cuda:nccl group (each would send its
        # data over its own backend and wait for ever): rank 1's CPU partial is recorded as device type 1
        saved = getattr(collective, "_DEVICE_TYPES", None)
        if rank == 1:
            collective._DEVICE_TYPES = ("cuda", "cpu")
        try:
            return tree(torch.ones(5))
        finally:
            collective._DEVICE_TYPES = saved

    case("tree_device_type", device_type_differs)
    case("tree_bad_algorithm_one_rank", lambda: tree(torch.ones(8), algorithm="auto" if rank == 0 else "ring"))
    # after all of that the group still works: the same bits as the two-rank tree
    p = torch.randn(3, 37, generator=torch.Generator().manual_seed(9 + rank))
    theirs = torch.randn(3, 37, generator=torch.Generator().manual_seed(9 + 1 - rank))
    expect = (p + theirs) if rank == 0 else (theirs + p)
    case("tree_ok_after_errors", lambda: bool(torch.equal(bits(tree(p)), bits(expect))))
    case("tree_ok_unchecked", lambda: bool(torch.equal(bits(tree(p, check=False)), bits(expect))))

    # fma row-parallel linear: one rank's slice is not its lanes of in_features
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    W = (0.1 * torch.randn(16, 64, generator=torch.Generator().manual_seed(4))).bfloat16()
    sl = slice(0, 32) if rank == 0 else slice(32, 64)
    xr, Wr = x[:, sl].contiguous(), W[:, sl].contiguous()
    case("fma_wrong_slice_one_rank",
         lambda: collective.row_parallel_linear(xr, Wr if rank == 0 else Wr[:, :24].contiguous(), None, None,
                                                in_features=64))
    case("fma_rows_differ", lambda: collective.row_parallel_linear(xr[: 4 - rank], Wr, None, None))
    # what the partials' shape cannot show: each rank's K slice (an uneven split of K = 64, 40 + 24, without
    # in_features; fp32 with spread exponents so other lanes show in the bits), x's dtype, the bias
    xw = (torch.randn(16, 64, generator=torch.Generator().manual_seed(6))
          * torch.exp2(torch.randint(-10, 10, (16, 64), generator=torch.Generator().manual_seed(7)).float()))
    Ww = W.float()
    usl = slice(0, 40) if rank == 0 else slice(40, 64)
    case("fma_uneven_slices", lambda: bool(torch.equal(
        bits(collective.row_parallel_linear(xw[:, usl].contiguous(), Ww[:, usl].contiguous(), None, None)),
        bits(aligned_ops.linear(xw, Ww)))))
    esl = slice(0, 32) if rank == 0 else slice(32, 64)
    case("fma_even_slices_fp32", lambda: bool(torch.equal(
        bits(collective.row_parallel_linear(xw[:, esl].contiguous(), Ww[:, esl].contiguous(), None, None)),
        bits(aligned_ops.linear(xw, Ww)))))
    b16 = torch.randn(16, generator=torch.Generator().manual_seed(8)).bfloat16()
    case("fma_bias_one_rank", lambda: collective.row_parallel_linear(xr, Wr, b16 if rank == 0 else None, None))
    case("fma_x_dtype_differs", lambda: collective.row_parallel_linear(xr.float() if rank else xr,
                                                                       Wr.float() if rank else Wr, None, None))
    case("fma_bias_shape_one_rank", lambda: collective.row_parallel_linear(xr, Wr, b16 if rank == 0 else b16[:15],
                                                                           None))
    case("fma_bias_dtype", lambda: collective.row_parallel_linear(xr, Wr, b16.float(), None))
    case("fma_bias_ok", lambda: bool(torch.equal(bits(collective.row_parallel_linear(xr, Wr, b16, None)),
                                                 bits(aligned_ops.linear(x, W, b16)))))
    case("fma_ok", lambda: bool(torch.equal(bits(collective.row_parallel_linear(xr, Wr, None, None)),
                                            bits(aligned_ops.linear(x, W)))))

    # exact row-parallel linear
    ex = collective.exact_row_parallel_linear
    case("exact_rows_differ", lambda: ex(xr[: 4 - rank], Wr, None, None))
    case("exact_x_dtype_differs", lambda: ex(xr if rank == 0 else xr.float(), Wr, None, None))
    case("exact_out_features_differ", lambda: ex(xr, Wr[: 16 - rank], None, None))
    case("exact_bias_one_rank", lambda: ex(xr, Wr, torch.zeros(16).bfloat16() if rank == 0 else None, None))
    case("exact_in_features_sum", lambda: ex(xr, Wr, None, None, in_features=60))
    case("exact_bad_shape_one_rank", lambda: ex(xr if rank == 0 else xr[:, :5].contiguous(), Wr, None, None))
    for dtype in (torch.bfloat16, torch.float32):
        for in_features in (None, 64):
            xd, Wd = x.to(dtype), W.to(dtype)
            zsl = slice(0, 64) if rank == 0 else slice(64, 64)  # rank 1 holds no input feature
            b = torch.randn(16, generator=torch.Generator().manual_seed(5)).to(dtype)
            case(f"exact_zero_k_rank[{dtype},{in_features}]",
                 lambda: bool(torch.equal(bits(ex(xd[:, zsl].contiguous(), Wd[:, zsl].contiguous(), b, None,
                                                  in_features=in_features)),
                                          bits(aligned_ops.linear_exact(xd, Wd, b)))))
    case("exact_no_rank_has_features", lambda: ex(x[:, :0].contiguous(), W[:, :0].contiguous(), None, None))
    case("exact_ok", lambda: bool(torch.equal(bits(ex(xr, Wr, None, None, in_features=64)),
                                              bits(aligned_ops.linear_exact(x, W)))))

    # the vocab-sharded embedding combine: one rank's mask has the wrong shape
    local = torch.randn(5, 8)
    mask = torch.zeros(5, dtype=torch.bool) if rank == 0 else torch.zeros(4, dtype=torch.bool)
    case("embedding_mask_one_rank", lambda: collective.sharded_rows_all_reduce(local, mask, None))
    # the embedding combine's dtype: float64 does not survive the fp32 sum (1 + 2^-30 came back as 1.0), and the
    # ranks must agree on it (a bf16 rank returned bf16, the fp32 one fp32)
    not_owned = torch.tensor([rank == 1, rank == 0])  # rank 0 owns row 0, rank 1 row 1
    case("embedding_fp64", lambda: collective.sharded_rows_all_reduce(
        torch.full((2, 3), 1 + 2.0 ** -30, dtype=torch.float64), not_owned))
    case("embedding_dtype_differs", lambda: collective.sharded_rows_all_reduce(
        torch.ones(2, 3, dtype=torch.float32 if rank == 0 else torch.bfloat16), not_owned))
    case("embedding_fp16_ok", lambda: bool(torch.equal(bits(collective.sharded_rows_all_reduce(
        torch.full((2, 3), -0.0 if rank == 0 else 65504.0, dtype=torch.float16), not_owned)),
        bits(torch.tensor([[-0.0] * 3, [65504.0] * 3], dtype=torch.float16)))))
    # a rank-local failure of any exception type (not only TypeError/ValueError/RuntimeError) and a partial that is
    # not dense data: before, the failing rank raised alone and the other waited in the collective (a hang until
    # the process-group timeout)
    case("fma_weight_none_one_rank", lambda: collective.row_parallel_linear(xr, Wr if rank == 0 else None, None, None,
                                                                            in_features=64))
    case("fma_x_none_one_rank", lambda: collective.row_parallel_linear(xr if rank == 0 else None, Wr, None, None))
    case("embedding_mask_none_one_rank",
         lambda: collective.sharded_rows_all_reduce(local, torch.zeros(5, dtype=torch.bool) if rank == 0 else None))
    case("exact_bias_list_one_rank", lambda: ex(xr, Wr, None if rank == 0 else [0.0] * 16, None))
    tw, ids, _ = aligned_ops.moe_routing(torch.randn(5, 4, generator=g), 2, "softmax", True)
    case("moe_ids_none_one_rank", lambda: collective.row_parallel_moe_experts(
        torch.randn(5, 16), tw, ids if rank == 0 else None, torch.randn(4, 16, 16), torch.randn(4, 16, 8)))
    case("tree_sparse_one_rank", lambda: tree(torch.ones(5) if rank == 0 else torch.ones(5).to_sparse()))
    case("tree_meta_one_rank", lambda: tree(torch.ones(5) if rank == 0 else torch.ones(5, device="meta")))
    case("tree_ok_after_local_errors", lambda: bool(torch.equal(bits(tree(p)), bits(expect))))
    print(json.dumps(rec))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.exit(0)
