"""FSDP2 (2 gloo ranks, CPU) runs the DeepSeek-V3 trainer in the ABSORBED MLA form (issue 26 item 4) with the
single-process absorbed trainer's bits: log-probs, every parameter's gradient and the updated parameters over two
optimiser steps, and a no-grad scoring forward between them (the W_UK / W_UV derived from the freshly gathered,
updated kv_b_proj: nothing derived from a gathered weight goes stale). The gradient reference is the single
process's per-micro-batch gradients summed (FSDP2's SUM reduce-scatter over 2 ranks is that one add; over more
ranks it is the backend's order — integrations/fsdp.py). Worker: _fsdp2_mla_worker.py.

Negative controls: the expanded form's log-probs on the same weights differ; one element of rank 1's kv_b_proj
shard perturbed moves both ranks' log-probs (restored: the same bits again); cache_exact_weights refuses the
FSDP2 model and, after a forward with autograd on, the root's unsharded LM head weight (by message). The root
reshard after a no-grad forward (integrations/fsdp.py) and its negative control are tested on a toy model in
test_fsdp2_root_reshard.py (seconds); here the scoring forward between the steps runs through it."""

import json
import os

import pytest
import torch
import torch.distributed as dist

from aligned_ops.testing.distributed import launch
from aligned_ops.testing.tiny_model import build_tiny_deepseek_v3

WORKER = os.path.join(os.path.dirname(__file__), "_fsdp2_mla_worker.py")
DTYPES = ["float32", "bfloat16"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    root = tmp_path_factory.mktemp("fsdp2_mla")
    # v_head_dim != qk_nope_head_dim (the variant): W_UK and W_UV of other shapes, sharded across the ranks
    specs = [f"{build_tiny_deepseek_v3(root / dt, getattr(torch, dt), seed=4, variant='dv-ne-dn')}:{dt}"
             for dt in DTYPES]
    out = root / "res.json"
    launch(WORKER, 2, ["check", out, *specs], timeout=1500)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_fsdp2_absorbed_bitwise_single_process(results, dtype):
    res = results[dtype]
    assert [r["rank"] for r in res] == [0, 1]
    assert sorted(i for r in res for i in r["seqs"]) == [0, 1, 2, 3, 4]
    for r in res:
        assert r["lp_equal"] == [True, True], r
        assert r["lp_nograd_equal"], r
        assert r["grad_equal"] == [True, True], r["grad_differ"]
        assert all(n == m and n > 0 for n, m in r["n_grads"]), r
        assert r["params_equal"], r
        # negative controls
        assert r["expanded_differ"] > 0, r
        assert r["perturbed_differ"] > 0, r
        assert r["restored_equal"], r
        assert r["boundary_inside_head"], r
        assert "refused an FSDP2-managed module" in r["cache_refused"], r
        # the root's LM head weight while unsharded (after a grad forward): a plain Parameter, refused all the same
        assert r["lm_head_unsharded_plain"], r
        assert "refused a parameter of an FSDP2-sharded model" in r["lm_head_refused"], r
