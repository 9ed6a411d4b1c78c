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


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), float("-inf"), 1e39])
def test_scale_logits_refuses_a_temperature_no_sampler_uses(bad):
    # a negative T reversed the row's order and NaN made every score NaN, silently; the name says which argument.
    # 1e39 is finite in float64 but inf in the fp32 the row is divided by: every score 0 (-inf logits NaN)
    z = _logits(R=3, V=16, seed=5)
    with pytest.raises(ValueError, match=r"sampling: temperature must be (a finite number|non-negative).*got "):
        scale_logits(z, torch.tensor([1.0, bad, 0.7], dtype=torch.float64))
    with pytest.raises(ValueError, match="temperature must be (a finite number|non-negative)"):
        scale_logits(z, bad)
    # control: the same rows at temperatures the sampler uses (0 = greedy, scored at 1) are scaled
    x = scale_logits(z, torch.tensor([1.0, 0.0, 0.7]))
    assert bool(torch.isfinite(x).all())


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


def _vllm_scored_temperature(t):
    """The fp32 temperature vLLM 0.32 (installed) divides a request's logits by: SamplingParams' own rule
    (0 < T < 0.01 raised to 0.01, greedy when T < 1e-5), stored as float32 (the input batch), greedy rows at 1."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.sampling_params import SamplingType

    sp = SamplingParams(temperature=t)
    stored = np.float32(0.0 if sp.sampling_type == SamplingType.GREEDY else sp.temperature)
    return torch.tensor([1.0 if stored < 1e-5 else stored], dtype=torch.float32)


# Issue 21.1: the trainer scored 0 < T < 1e-5 at 1.0 ("greedy") and 1e-5 <= T < 0.01 at T, while vLLM raises
# every 0 < T < 0.01 to 0.01 and samples there (up to 3.5 nats apart at T = 1e-6).
TEMPERATURES = [0.0, 5e-324, 1e-300, 1e-45, 1e-6, 9.99e-6, 1e-5, 1.0000001e-5, 0.005, 0.0099999, 0.00999999999,
                0.01, 0.0100001, 0.3, 0.7, 1.0, 1.7, 2.0]


def test_effective_temperature_is_vllms_rule():
    """effective_temperature(T) (floats, fp32 and fp64 tensors) is, bit for bit, the temperature vLLM 0.32's
    SamplingParams + sampler score a request of T at; the plugin, hf.py and scale_logits call it."""
    pytest.importorskip("vllm")
    import ast
    import inspect

    from aligned_ops.integrations import hf, vllm_plugin
    from aligned_ops.integrations.vllm import config, decoders, layers, moe, sampler, tp
    from aligned_ops.sampling import effective_temperature, scale_logits

    theirs = torch.cat([_vllm_scored_temperature(t) for t in TEMPERATURES])
    floats = torch.tensor([effective_temperature(t) for t in TEMPERATURES], dtype=torch.float32)
    assert_bitwise_equal(floats, theirs)
    assert_bitwise_equal(effective_temperature(torch.tensor(TEMPERATURES, dtype=torch.float64)), theirs)
    # an fp32 tensor holds fp32(T): vLLM's rule on those values
    t32 = torch.tensor(TEMPERATURES, dtype=torch.float32)
    assert_bitwise_equal(effective_temperature(t32),
                         torch.cat([_vllm_scored_temperature(float(t)) for t in t32]))
    # idempotent: the plugin applies it to the engine's stored (already raised) temperatures
    assert_bitwise_equal(effective_temperature(theirs), theirs)
    x = torch.randn(len(TEMPERATURES), 7)
    assert_bitwise_equal(scale_logits(x, torch.tensor(TEMPERATURES, dtype=torch.float64)), x / theirs[:, None])
    # negative control: the old rule (greedy below 1e-5, T itself above) is not vLLM's
    old = torch.tensor([1.0 if t < 1e-5 else t for t in TEMPERATURES], dtype=torch.float32)
    assert not torch.equal(old.view(torch.int32), theirs.view(torch.int32))
    # the thresholds are written once: no numeric copy left in the integrations
    for mod in (hf, vllm_plugin, config, decoders, layers, moe, sampler, tp):
        consts = {n.value for n in ast.walk(ast.parse(inspect.getsource(mod))) if isinstance(n, ast.Constant)}
        assert not consts & {1e-5, 1e-2}


@pytest.mark.parametrize("t", [2.0000001, 2.5, float("inf"), float("-inf"), float("nan"), -1e-9, -1.0])
def test_check_temperature_refuses_what_vllm_refuses(t):
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    from aligned_ops.sampling import check_temperature

    with pytest.raises(Exception, match="temperature"):
        SamplingParams(temperature=t)
    with pytest.raises(ValueError, match="^my_temperature must be"):
        check_temperature(t, "my_temperature", vllm_version="0.32.0")
    with pytest.raises(ValueError, match="temperature must be"):
        check_temperature(torch.tensor([0.5, t], dtype=torch.float64))


def test_check_temperature_accepts_what_vllm_accepts():
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    from aligned_ops.sampling import check_temperature

    for t in TEMPERATURES + [-0.0]:
        SamplingParams(temperature=t)
        check_temperature(t, vllm_version="0.32.0")


def test_temperature_rule_per_release(monkeypatch):
    """Read in each release's sampling_params.py: 0.22/0.23 take any T >= 0 (NaN and inf too, which we refuse
    by name); from 0.24 T must be finite and in [0, 2]. The mapping (0 < T < 0.01 -> 0.01) is the same in all."""
    from aligned_ops.sampling import VLLM_VERSION_ENV, check_temperature, temperature_rule

    check_temperature(2.5, vllm_version="0.22.0")
    check_temperature(7.0, vllm_version="0.23.1")
    for v in ("0.24.0", "0.29.0", "0.31.0", "0.32.0", "0.33.0"):
        with pytest.raises(ValueError, match=r"must be in \[0, 2\]"):
            check_temperature(2.5, vllm_version=v)
    with pytest.raises(ValueError, match="accepts it and samples from NaN"):
        check_temperature(float("nan"), vllm_version="0.23.0")
    # finite in float64, inf in the engine's float32 (rule 4): the same garbage as inf; FLT_MAX itself is a number
    with pytest.raises(ValueError, match="must be a finite number, got 1e"):
        check_temperature(1e39, vllm_version="0.23.0")
    check_temperature(3.4028234663852886e38, vllm_version="0.23.0")
    with pytest.raises(ValueError, match="temperature rule is not known"):
        temperature_rule("0.10.2")
    with pytest.raises(ValueError, match="cannot read the vLLM version"):
        temperature_rule("main")
    monkeypatch.setenv(VLLM_VERSION_ENV, "0.23.0")
    check_temperature(2.5)
    monkeypatch.setenv(VLLM_VERSION_ENV, "0.24.0")
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        check_temperature(2.5)


@pytest.mark.parametrize("kw, message", [
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"), (dict(top_p=1.0000001), r"top_p must be in \(0, 1\]"),
    (dict(top_p=float("nan")), "top_p must be in"), (dict(top_p=torch.tensor([0.5, float("nan"), 0.9])), "top_p"),
    (dict(min_p=-1e-9), r"min_p must be in \[0, 1\]"), (dict(min_p=float("nan")), r"min_p must be in \[0, 1\]"),
    (dict(min_p=torch.tensor([0.1, 1.5, 0.0])), "min_p must be in"),
    (dict(top_k=-2), r"top_k must be 0 or -1 \(disable\), or at least 1, got -2"),
    (dict(top_k=3.0), "top_k must be an integer, got float 3.0"), (dict(top_k=float("nan")), "top_k must be an integer"),
    (dict(top_k=torch.tensor([1.5, 2.0, 3.0])), "top_k must be an integer, got a torch.float32 tensor"),
    (dict(top_k=torch.tensor([5, -3, 1])), "top_k must be 0 or -1"),
])
def test_truncation_options_refused_as_vllm_refuses(kw, message):
    """Issue 21.4: NaN top_p / min_p were silently "off", top_p > 1 or <= 0 gave all -inf rows, a fractional or
    negative top_k was truncated or off. vLLM's own rules (SamplingParams._verify_args), the argument named."""
    x = _logits(R=3, V=50)
    with pytest.raises(ValueError, match="^aligned_ops sampling: " + message):
        truncation_mask(x, **kw)
    with pytest.raises(ValueError, match=message):
        truncate_logits(x, **kw)


def test_truncation_options_vllm_accepts_and_off_values():
    """The boundary values vLLM accepts are accepted (vLLM's SamplingParams agrees), and top_k -1 is off like 0."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    x = _logits(R=3, V=50)
    for kw in (dict(top_p=1.0), dict(top_p=1e-9), dict(min_p=0.0), dict(min_p=1.0), dict(top_k=-1), dict(top_k=0),
               dict(top_k=1), dict(top_k=10**6)):
        SamplingParams(temperature=1.0, **kw)
        truncation_mask(x, **kw)
    for kw in (dict(top_p=0.0), dict(top_p=float("nan")), dict(min_p=float("nan")), dict(min_p=-0.5), dict(top_k=-2),
               dict(top_k=2.5)):
        with pytest.raises(Exception):
            SamplingParams(temperature=1.0, **kw)
    assert torch.equal(truncation_mask(x, top_k=-1), truncation_mask(x, top_k=0))
    assert bool(truncation_mask(x, top_k=-1, top_p=1.0, min_p=0.0).all())
    # min_p = 1 keeps exactly the most probable tokens (their tie group), never an empty row
    kept = truncation_mask(x, min_p=1.0)
    assert bool((kept.sum(1) >= 1).all())


def test_processed_logprobs_refusal_names_each_option_that_changes_the_logits():
    """sampling_rules.processed_logprobs_refusal (the vLLM plugin's admission check in processed_logprobs mode):
    one line naming every option set; None for a request without sampled log-probs or with none of them set."""
    vllm = pytest.importorskip("vllm")
    from aligned_ops.sampling_rules import PROCESSED_LOGPROBS_UNREPRODUCED, processed_logprobs_refusal
    from vllm.sampling_params import StructuredOutputsParams

    SP = vllm.SamplingParams
    assert processed_logprobs_refusal(SP(logprobs=0, top_p=0.9, top_k=5, min_p=0.1, seed=1, n=2,
                                         stop_token_ids=[3], ignore_eos=True, prompt_logprobs=2)) is None
    assert processed_logprobs_refusal(SP(logprobs=0, repetition_penalty=1.0, presence_penalty=0.0)) is None
    one = dict(presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=0.9, logit_bias={7: 1.0},
               bad_words=["the"], allowed_token_ids=[1, 2], min_tokens=2,
               structured_outputs=StructuredOutputsParams(regex="[a-z]+"), thinking_token_budget=0)
    assert set(one) == {name for name, _ in PROCESSED_LOGPROBS_UNREPRODUCED}
    for name, value in one.items():
        assert processed_logprobs_refusal(SP(**{name: value})) is None  # no sampled log-probs: nothing to reproduce
        msg = processed_logprobs_refusal(SP(logprobs=2, **{name: value}))
        assert msg and "\n" not in msg and name in msg and "processed_logprobs" in msg, msg
        assert sum(other in msg for other in one) == 1, msg
        assert ("--generation-config vllm" in msg) == name.endswith("_penalty"), msg  # the hint where it applies
    msg = processed_logprobs_refusal(SP(logprobs=0, **one))
    assert "\n" not in msg and all(name in msg for name in one), msg
    assert "presence_penalty=0.5" in msg and "logit_bias," in msg  # numbers by value, containers by name
