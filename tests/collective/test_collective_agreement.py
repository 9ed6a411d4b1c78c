"""Issue 21.5: the collectives agree on what every rank passed before any data moves, and raise on EVERY rank.

Before: ranks passing different sizes to tree_all_reduce crashed a rank (SIGABRT inside gloo) or hung until the
process-group timeout (30 minutes) when the sizes straddled the auto algorithm switch; equal element counts
with different shapes returned garbage; a rank-local refusal (wrong dtype, a slice that is not its lanes) left
the other rank waiting in the collective; exact TP with a rank holding zero input features failed with
"cannot reshape a tensor of 0 elements" on one rank and "Connection closed" on the other.
Now: one small all-gather per call (ops/collective.py, "Agreement first"), then the same error on both ranks
naming what each passed; a rank with K_r = 0 works (bitwise the unsplit linear_exact). One 2-process gloo world
runs every case (_agreement_worker.py), with a 60 s process-group timeout and a launcher timeout, so a
regression fails instead of hanging CI. Positive controls: matching calls after the errors give the right bits.
"""

import json
import os

import pytest
import torch.distributed as dist

from aligned_ops.testing.distributed import launch

WORKER = os.path.join(os.path.dirname(__file__), "_agreement_worker.py")


@pytest.fixture(scope="module")
def records():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    outs = launch(WORKER, 2, timeout=240)
    rec = {}
    for o in outs:
        for r in json.loads(o.strip().splitlines()[-1]):
            rec.setdefault(r["case"], {})[r["rank"]] = r
    return rec


def _both_raise(records, case, types, *fragments):
    got = records[case]
    assert set(got) == {0, 1}, got
    for rank, r in got.items():
        assert r["raised"] in types, (case, rank, r)
        for f in fragments:
            assert f in r["message"], (case, rank, f, r["message"])


DISAGREE = [
    ("tree_size", ("the ranks of the group disagree", "same shape, dtype and device type",
                   "rank 0: (3, 37) float32 on cpu", "rank 1: (3, 38) float32 on cpu")),
    ("tree_straddles_auto_switch", ("the ranks of the group disagree", "rank 0: (262144,)", "rank 1: (262145,)")),
    ("tree_same_numel_other_shape", ("disagree", "rank 0: (4, 6)", "rank 1: (6, 4)")),
    # (rank 1 reads the two codes with its swapped names: each message names one rank on cpu, the other on cuda)
    ("tree_device_type", ("disagree", "same shape, dtype and device type", "(5,) float32 on cpu",
                          "(5,) float32 on cuda")),
    ("tree_algorithm", ("disagree", "algorithm='halving'", "algorithm='allgather'")),
    ("fma_rows_differ", ("aligned_ops.row_parallel_linear: the ranks of the group disagree", "rank 0: (4, 16)",
                         "rank 1: (3, 16)")),
    ("fma_uneven_slices", ("aligned_ops.row_parallel_linear: the ranks of the group disagree",
                           "the ranks' K slices must be the whole-lane split of K = 64 over 2 ranks, [32, 32] features",
                           "rank 0: x float32, bias none, K slice 40", "rank 1: x float32, bias none, K slice 24")),
    ("fma_bias_one_rank", ("aligned_ops.row_parallel_linear: the ranks of the group disagree",
                           "every rank must pass x of the same dtype and a bias alike",
                           "rank 0: x bfloat16, bias bfloat16", "rank 1: x bfloat16, bias none")),
    ("fma_x_dtype_differs", ("aligned_ops.row_parallel_linear: the ranks of the group disagree",
                             "rank 0: x bfloat16, bias none", "rank 1: x float32, bias none")),
    ("fma_bias_dtype", ("aligned_ops.row_parallel_linear: bias must be [16] with x's dtype (torch.bfloat16), got [16] "
                        "torch.float32",)),
    ("embedding_dtype_differs", ("aligned_ops.sharded_rows_all_reduce: the ranks of the group disagree",
                                 "every rank must pass local of the same dtype; rank 0: float32, rank 1: bfloat16")),
    ("exact_rows_differ", ("aligned_ops.exact_row_parallel_linear: the ranks of the group disagree",
                           "rank 0: x bfloat16 (4,)", "rank 1: x bfloat16 (3,)")),
    ("exact_x_dtype_differs", ("disagree", "rank 0: x bfloat16", "rank 1: x float32")),
    ("exact_out_features_differ", ("disagree", "weight bfloat16 [16, 32]", "weight bfloat16 [15, 32]")),
    ("exact_bias_one_rank", ("disagree", "bias bfloat16", "bias none")),
    ("exact_in_features_sum", ("the ranks' slices hold 64 input features in all, in_features is 60",)),
    ("exact_no_rank_has_features", ("no rank holds any input feature (K = 0)",)),
]


@pytest.mark.parametrize("case,fragments", DISAGREE, ids=[c for c, _ in DISAGREE])
def test_disagreeing_ranks_raise_on_both_ranks(records, case, fragments):
    _both_raise(records, case, ("ValueError",), *fragments)


LOCAL = [  # one rank cannot use its input: it raises its own error, the other a ValueError quoting it
    ("tree_dtype", 1, "TypeError", "partial must be float32"),
    ("tree_not_a_tensor", 1, "TypeError", "partial must be a tensor, got list"),
    ("tree_bad_algorithm_one_rank", 1, "ValueError", "algorithm must be one of"),
    ("fma_bias_shape_one_rank", 1, "ValueError",
     "aligned_ops.row_parallel_linear: bias must be [16] with x's dtype (torch.bfloat16), got [15] torch.bfloat16"),
    ("fma_wrong_slice_one_rank", 1, "ValueError", "rank 1 must hold K[32:64] (32 features), it holds 24"),
    ("exact_bad_shape_one_rank", 1, "ValueError", "must hold the same K slice"),
    ("embedding_mask_one_rank", 1, "RuntimeError", "size"),
    # any exception type, and a partial without dense data (before: the other rank hung in the collective)
    ("fma_weight_none_one_rank", 1, "TypeError",
     "aligned_ops.row_parallel_linear: weight must be a tensor, got NoneType"),
    ("fma_x_none_one_rank", 1, "TypeError",
     "aligned_ops.row_parallel_linear: x must be a tensor, got NoneType"),
    ("embedding_mask_none_one_rank", 1, "TypeError",
     "aligned_ops.sharded_rows_all_reduce: not_owned must be a tensor, got NoneType"),
    ("exact_bias_list_one_rank", 1, "TypeError",
     "aligned_ops.exact_row_parallel_linear: bias must be a tensor or None, got list"),
    ("moe_ids_none_one_rank", 1, "TypeError",
     "aligned_ops.row_parallel_moe_experts: topk_ids must be a tensor, got NoneType"),
    ("tree_sparse_one_rank", 1, "TypeError",
     "aligned_ops.tree_all_reduce: partial must be a dense tensor with data (strided layout, not meta), got layout "
     "torch.sparse_coo on cpu"),
    ("tree_meta_one_rank", 1, "TypeError", "partial must be a dense tensor with data (strided layout, not meta), got "
                                           "layout torch.strided on meta"),
]


@pytest.mark.parametrize("case,bad_rank,own_type,fragment", LOCAL, ids=[c for c, *_ in LOCAL])
def test_one_rank_refusal_is_raised_on_every_rank(records, case, bad_rank, own_type, fragment):
    got = records[case]
    assert got[bad_rank]["raised"] == own_type and fragment in got[bad_rank]["message"], got[bad_rank]
    other = got[1 - bad_rank]
    assert other["raised"] == "ValueError", other
    assert f"group rank {bad_rank} could not run its part, so no rank does" in other["message"], other["message"]
    assert fragment in other["message"], other["message"]  # the erring rank's own words travel


@pytest.mark.parametrize("case", ["tree_ok_after_errors", "tree_ok_unchecked", "tree_ok_after_local_errors", "fma_ok",
                                  "fma_even_slices_fp32", "fma_bias_ok", "embedding_fp16_ok", "exact_ok"]
                         + [f"exact_zero_k_rank[{d},{k}]" for d in ("torch.bfloat16", "torch.float32")
                            for k in (None, 64)])
def test_matching_calls_give_the_unsplit_bits(records, case):
    got = records[case]
    assert set(got) == {0, 1}
    for r in got.values():
        assert r["raised"] is None and r["value"] is True, r


def test_embedding_combine_refuses_dtypes_fp32_cannot_hold(records):
    # float64 through the fp32 sum is not a copy: the owner's 1 + 2^-30 came back as 1.0 (every element wrong)
    _both_raise(records, "embedding_fp64", ("TypeError",),
                "aligned_ops.sharded_rows_all_reduce: local must be float32, bfloat16 or float16 (the sum runs in fp32, "
                "which holds these exactly), got torch.float64")
