"""FSDP2 leaves the ROOT module (embedding, final norm, LM head) unsharded after a forward, and a forward under
no_grad has no backward to reshard it (integrations/fsdp.py, reshard_after_no_grad_forward). A toy FSDP2 model
on 2 gloo ranks (CPU, seconds), each case run with and without a no-grad scoring forward, compared bit for bit
(integer views) with the same run without it:

* case A (step, scoring forward, model.zero_grad(), step): the root gradients. Without the hook zero_grad sees
  the unsharded plain parameters and misses the sharded .grad, so step 2 accumulates onto step 1's gradient.
* case B (backward, scoring forward, opt.step(), forward): log-probs and loss. Without the hook the root stays
  unsharded, unshard() returns early, and the forward after the update computes with the old root weights.

With the hook: equal. Without it (the negative control): different, on every rank. The unscored runs agree with
and without the hook (the hook does nothing with grad on).

cache_exact_weights on a model shard_aligned marked: the root's unsharded LM head weight (a plain Parameter
after a grad forward, in storage FSDP2 reuses), a detached view of it, the head module and the model are refused
by message, and after backward the DTensor ("DTensor (FSDP2/TP)"); negative control: an unmarked model's
unsharded head weight is accepted (the hole the mark closes)."""

import json
import os

import pytest
import torch.distributed as dist

from aligned_ops.testing.distributed import launch

WORKER = os.path.join(os.path.dirname(__file__), "_fsdp2_root_reshard_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("fsdp2_root") / "res.json"
    launch(WORKER, 2, ["check", out], timeout=300)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["A", "B"])
def test_root_reshard_after_no_grad_forward(results, case):
    assert len(results) == 2
    for r in results:
        assert r[case]["hook_equal"], r[case]
        assert r[case]["unscored_hook_vs_nohook_equal"], r[case]
        assert not r[case]["nohook_equal"], r[case]  # negative control: FSDP2 without the hook


def test_cache_exact_weights_refuses_unsharded_root_params(results):
    for r in results:
        f = r["refusals"]
        assert f["unsharded_is_plain"] and f["sharded_is_dtensor"], f
        assert "refused a parameter of an FSDP2-sharded model" in f["unsharded_param"], f
        assert "refused a parameter of an FSDP2-sharded model" in f["unsharded_view"], f
        assert "refused a module inside an FSDP2-sharded model" in f["head_module"], f
        assert "refused an FSDP2-managed module" in f["model"], f
        assert "refused a DTensor (FSDP2/TP)" in f["dtensor"], f
        for k in ("unsharded_param", "unsharded_view", "head_module", "model", "dtensor"):
            assert "FSDP2-managed parameters cannot be cached" in f[k], f
        assert f["unmarked_unsharded_param"] == "accepted 1", f  # negative control: without the mark it passes
