"""aligned_ops.sampling: the one truncation recipe (min-p, top-k, top-p) both sides use in processed-logprob mode."""

import pytest
import torch

import aligned_ops
from aligned_ops.sampling import scale_logits, truncate_logits, truncation_mask
from aligned_ops.testing import assert_bitwise_equal


def _logits(R=6, V=300, seed=0, ties=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, V, generator=g) * 3
    if ties:  # bf16-like coarse values: many exact ties, also at the thresholds
        x = x.to(torch.bfloat16).to(torch.float32)
    return x


def _reference_mask(x, k, p, mp):
    """Row by row, in Python: the recipe of the module docstring with explicit tie groups."""
    R, V = x.shape
    out = torch.zeros(R, V, dtype=torch.bool)
    exp = torch.ops.aligned._exp_f32
    for r in range(R):
        row = x[r : r + 1]
        keep = torch.ones(V, dtype=torch.bool)
        if mp > 0:
            pr = exp(aligned_ops.log_softmax(row, 1.0))[0]
            keep &= pr >= pr.max() * mp
        if 0 < k < V:
            vals = sorted(row[0][keep].tolist(), reverse=True)
            kth = vals[k - 1] if k <= len(vals) else float("-inf")
            keep &= row[0] >= kth
        if p < 1:
            xr = torch.where(keep, row[0], torch.tensor(float("-inf")))[None]
            q = exp(aligned_ops.log_softmax(xr, 1.0))[0]
            groups = sorted(set(q.tolist()), reverse=True)
            mass = 0.0
            kept_vals = set()
            for v in groups:
                if mass < float(torch.tensor(p, dtype=torch.float32)):
                    kept_vals.add(v)
                mass += v * int((q == v).sum())  # float64 sum in descending order
            keep &= torch.tensor([float(v) in kept_vals for v in q.tolist()])
        out[r] = keep
    return out


@pytest.mark.parametrize("k, p, mp", [(0, 0.9, 0.0), (20, 1.0, 0.0), (20, 0.8, 0.0), (0, 1.0, 0.1), (50, 0.95, 0.02),
                                      (1, 0.5, 0.0), (299, 0.999, 0.0)])
def test_matches_reference_with_ties(k, p, mp):
    x = _logits()
    assert_bitwise_equal(truncation_mask(x, k, p, mp).to(torch.int8), _reference_mask(x, k, p, mp).to(torch.int8))


def test_tie_order_does_not_matter():
    """Permuting the vocabulary permutes the mask: tied tokens are kept or dropped together."""
    x = _logits(seed=1)
    perm = torch.randperm(x.shape[1], generator=torch.Generator().manual_seed(5))
    for kw in (dict(top_p=0.9), dict(top_k=17), dict(top_k=40, top_p=0.7, min_p=0.01)):
        m = truncation_mask(x, **kw)
        assert torch.equal(truncation_mask(x[:, perm].contiguous(), **kw), m[:, perm])


def test_row_invariant_and_per_row_parameters():
    x = _logits(R=5, seed=2)
    k = torch.tensor([0, 3, 50, 300, 10])
    p = torch.tensor([0.9, 1.0, 0.5, 0.99, 0.3])
    mp = torch.tensor([0.0, 0.1, 0.0, 0.05, 0.0])
    full = truncate_logits(x, k, p, mp)
    for r in range(5):
        alone = truncate_logits(x[r : r + 1].clone(), int(k[r]), float(p[r]), float(mp[r]))
        assert_bitwise_equal(alone[0], full[r])
    # disabled values keep everything
    assert bool(truncation_mask(x, top_k=0, top_p=1.0, min_p=0.0).all())


def test_same_set_as_vllm_without_ties():
    """On tie-free logits the recipe keeps the set vLLM's own top-k/top-p and min-p keep."""
    pytest.importorskip("vllm")
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    x = _logits(R=8, V=1000, seed=3, ties=False).double().float()
    k = torch.tensor([0, 5, 100, 999, 1000, 37, 1, 200], dtype=torch.int32)
    p = torch.tensor([0.9, 1.0, 0.5, 0.99, 0.3, 0.95, 1.0, 0.8])
    theirs = torch.isfinite(apply_top_k_top_p_pytorch(x.clone(), torch.where(k == 0, 1000, k), p))
    ours = truncation_mask(x, k, p)
    assert torch.equal(ours, theirs)
    probs = torch.softmax(x, -1)
    theirs_mp = probs >= probs.amax(-1, keepdim=True) * 0.05
    assert torch.equal(truncation_mask(x, min_p=0.05), theirs_mp)


def test_processed_logprob_is_log_softmax_of_truncated_and_differentiable():
    z = _logits(R=4, V=64, seed=4).to(torch.bfloat16).requires_grad_(True)
    t = torch.tensor([1.0, 0.7, 0.0, 1.3])
    x = scale_logits(z, t)
    assert_bitwise_equal(x[2], z[2].float())  # greedy row scored at T = 1
    xt = truncate_logits(x, top_p=0.8)
    ids = xt.argmax(-1)
    lp = aligned_ops.token_logprobs(xt, ids, 1.0)
    assert_bitwise_equal(lp, aligned_ops.log_softmax(xt.detach(), 1.0).gather(1, ids[:, None])[:, 0])
    lp.sum().backward()
    g = z.grad.float()
    assert bool(torch.isfinite(g).all())
    assert bool((g[~torch.isfinite(xt.detach())] == 0).all())  # no gradient into dropped tokens
    assert bool((g != 0).any())


def test_bad_input():
    with pytest.raises(ValueError, match="aligned_ops sampling: x must be 2-D float32"):
        truncation_mask(torch.zeros(3, 4, dtype=torch.bfloat16), top_p=0.9)
    with pytest.raises(ValueError, match="expected one value per row \\(3\\), got 2"):
        truncation_mask(torch.zeros(3, 4), top_k=torch.tensor([1, 2]))


def test_effective_temperature_is_the_one_greedy_rule():
    """Greedy (T < 1e-5, vLLM's eps) is scored at 1 — floats and tensors; the plugin, hf.py and scale_logits use it."""
    import inspect

    from aligned_ops.integrations import hf
    from aligned_ops.integrations.vllm import config, decoders, layers, moe, sampler, tp
    from aligned_ops.sampling import GREEDY_TEMPERATURE_EPS, effective_temperature, scale_logits

    assert effective_temperature(0.0) == 1.0 and effective_temperature(9.9e-6) == 1.0
    assert effective_temperature(1e-5) == 1e-5 and effective_temperature(0.7) == 0.7
    t = effective_temperature(torch.tensor([0.0, 1e-6, 0.5, 2.0], dtype=torch.float64))
    assert t.dtype == torch.float32 and t.tolist() == [1.0, 1.0, 0.5, 2.0]
    x = torch.randn(2, 5)
    assert torch.equal(scale_logits(x, torch.tensor([0.0, 0.5])), torch.stack([x[0], x[1] / 0.5]))
    # negative control: a threshold of 0 (greedy divided by itself) is not what scale_logits does
    assert not torch.isfinite(x[0] / torch.tensor(0.0)).all()
    for mod in (hf, config, decoders, layers, moe, sampler, tp):  # the threshold is written once: no copy left
        assert "1e-5" not in inspect.getsource(mod).replace("< 1e-5 is greedy", "")
    assert GREEDY_TEMPERATURE_EPS == 1e-5
