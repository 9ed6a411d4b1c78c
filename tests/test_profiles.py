"""The numerics profiles as objects (aligned_ops.profiles): resolution once (pin > explicit > ALIGNED_OPS_LINEAR),
carried by patched layers, singletons through copies and pickles, capability refusals, each profile's linear and
route; `aligned-ops verify` passes the resolved profile to its children without touching this process's
environment."""

from __future__ import annotations

import copy
import os
import pickle
import types

import pytest
import torch

import aligned_ops
from aligned_ops import profiles
from aligned_ops.testing import assert_bitwise_equal, bits


def test_registry_and_names():
    assert profiles.REGISTRY["fma"] is profiles.FMA and profiles.REGISTRY["exact"] is profiles.EXACT
    assert profiles.REGISTRY["mma"] is profiles.MMA and profiles.get("MMA") is profiles.MMA  # issue 27's slot
    assert profiles.DEFAULT is profiles.FMA and set(profiles.names()) >= {"fma", "exact"}
    # the torch-free names the CLI checks flags with are exactly the registered profiles
    from aligned_ops import choices

    assert set(choices.PROFILE_NAMES) == set(profiles.names()) and choices.DEFAULT_PROFILE == profiles.DEFAULT.name
    assert choices.PROFILE_ENV_VAR == profiles.ENV_VAR
    # the torch-free list of profiles that can refuse a model (the CLI imports the profile objects only for those)
    # is exactly the profiles that override model_refusals
    refusing = {n for n in profiles.names() if type(profiles.get(n)).model_refusals is not profiles.Profile.model_refusals}
    assert set(choices.MODEL_REFUSING_PROFILES) == refusing and refusing
    assert profiles.get("EXACT ") is profiles.EXACT and profiles.get(profiles.FMA) is profiles.FMA
    with pytest.raises(ValueError, match=r"linear profile must be one of \('fma', 'exact'.*got 'tensorcore'"):
        profiles.get("tensorcore")
    with pytest.raises(ValueError, match="already registered"):
        profiles.register(type(profiles.FMA)())  # a second object under a taken name


def test_resolution_order_and_the_environment_read_once(monkeypatch):
    monkeypatch.delenv(profiles.ENV_VAR, raising=False)
    assert profiles.resolve() is profiles.FMA
    monkeypatch.setenv(profiles.ENV_VAR, "exact")
    assert profiles.resolve() is profiles.EXACT
    assert profiles.resolve("fma") is profiles.FMA  # explicit beats the variable
    assert profiles.resolve(pinned="exact") is profiles.EXACT  # an architecture's pin beats the variable
    assert profiles.resolve("exact", pinned="exact") is profiles.EXACT
    with pytest.raises(ValueError, match="'fma' was asked for, but this architecture's rules pin the linear "
                                         "profile to 'exact'"):
        profiles.resolve("fma", pinned="exact")  # an explicit request the pin would override silently
    monkeypatch.setenv(profiles.ENV_VAR, "nope")
    with pytest.raises(ValueError, match="ALIGNED_OPS_LINEAR must be one of"):
        profiles.resolve()
    with pytest.raises(ValueError, match="LayerRules.linear_profile must be one of"):
        profiles.resolve(pinned="nope")


def test_a_layer_carries_its_profile(monkeypatch):
    monkeypatch.setenv(profiles.ENV_VAR, "exact")
    bound = types.SimpleNamespace(_aligned_profile=profiles.FMA)
    assert profiles.profile_of(bound) is profiles.FMA  # carried: the variable is not read
    stray = types.SimpleNamespace()
    assert profiles.profile_of(stray) is profiles.EXACT  # unbound: bound now, once
    monkeypatch.setenv(profiles.ENV_VAR, "fma")
    assert profiles.profile_of(stray) is profiles.EXACT  # ... and kept


def test_profiles_are_singletons_through_copies_and_pickles():
    for p in (profiles.FMA, profiles.EXACT, profiles.MMA):
        assert copy.copy(p) is p and copy.deepcopy(p) is p and pickle.loads(pickle.dumps(p)) is p
    layer = types.SimpleNamespace(_aligned_profile=profiles.EXACT)
    assert copy.deepcopy(layer)._aligned_profile is profiles.EXACT


def test_each_profile_runs_its_op_and_route():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g)  # fp32 outputs: the two profiles' roundings show in the bits
    w = torch.randn(24, 96, generator=g) * 0.05
    b = torch.randn(24, generator=g)
    assert_bitwise_equal(profiles.FMA.linear(x, w, b), aligned_ops.linear(x, w, b))
    assert_bitwise_equal(profiles.EXACT.linear(x, w, b), aligned_ops.linear_exact(x, w, b))
    # negative control: the two profiles' bits differ on these inputs
    assert int((bits(profiles.FMA.linear(x, w, b)) != bits(profiles.EXACT.linear(x, w, b))).sum()) > 0
    assert profiles.FMA.op == "linear" and profiles.EXACT.op == "linear_exact"
    hidden, ids = x, torch.randint(0, 24, (5,), generator=g)
    assert_bitwise_equal(profiles.FMA.fused_token_logprobs(hidden, w, ids, 0.7),
                         aligned_ops.fused_token_logprobs(hidden, w, ids, 0.7))
    with pytest.raises(ValueError, match="the 'exact' linear profile has no fused LM-head log-prob"):
        profiles.EXACT.fused_token_logprobs(hidden, w, ids, 0.7)


def test_capabilities_become_refusals():
    assert profiles.FMA.refusals(device="cuda", tp_size=8, compiled=True, cuda_graphs=True) == []
    assert profiles.EXACT.refusals(tp_size=2) == []  # eager CPU TP: the integer route
    r = profiles.EXACT.refusals(tp_size=2, compiled=True)
    assert len(r) == 1 and "runs its row-parallel layers in eager mode only" in r[0]
    r = profiles.EXACT.refusals(device="cuda", tp_size=2)
    assert len(r) == 1 and "tensor-parallel route runs on cpu only, not cuda" in r[0]
    assert "captured CUDA graph" in profiles.EXACT.refusals(device="cuda", compiled=True, cuda_graphs=True)[0]
    assert "does not run on xla" in profiles.FMA.refusals(device="xla")[0]
    assert "invariant to" in profiles.EXACT.describe() and "Backward" in profiles.FMA.describe()


def test_verify_passes_the_profile_to_its_children_not_through_os_environ(monkeypatch, tmp_path):
    from aligned_ops.apps import cli, verify

    seen = {}

    def fake_run_child(kernels, argv, result_path, env=None):
        seen[kernels] = dict(env or {})
        return dict(num_tokens=1, frac_bitwise_equal=1.0, abs_diff_max=0.0, abs_diff_mean=0.0, kl_k3=0.0,
                    ratio_max=1.0, ratio_min=1.0, linear_profile=env[profiles.ENV_VAR], prompt_lengths=[1])

    monkeypatch.setattr(verify, "run_child", fake_run_child)
    monkeypatch.setattr(verify, "temp_dir", lambda prefix: str(tmp_path))
    monkeypatch.setenv(profiles.ENV_VAR, "fma")
    before = dict(os.environ)
    args = cli.build_parser().parse_args(["verify", "--model", str(tmp_path), "--linear", "exact"])
    assert verify.main(args) == 0
    assert dict(os.environ) == before  # this process's environment is untouched
    assert seen == {k: {profiles.ENV_VAR: "exact"} for k in ("standard", "aligned")}
    # negative control: without --linear the children get what the variable selects
    assert verify.main(cli.build_parser().parse_args(["verify", "--model", str(tmp_path)])) == 0
    assert seen["aligned"] == {profiles.ENV_VAR: "fma"}


def test_attention_profile_per_linear_profile_and_device():
    """Profile.attention_profile: fma / exact run fma attention everywhere; mma runs mma attention on a GPU
    (cuda covers ROCm builds) and on CPU tensors inside an emulate scope (the emulated GPU runs them, as it runs
    linear_mma), fma on a plain CPU (no mma attention there) and for MLA architectures (no mma MLA kernel)."""
    for p in (profiles.FMA, profiles.EXACT):
        for dev in ("cpu", "cuda", torch.device("cuda", 1), torch.device("cpu")):
            assert p.attention_profile(dev) == "fma"
        with aligned_ops.emulate("sm_90"):
            assert p.attention_profile("cpu") == "fma"
    m = profiles.MMA
    assert m.attention_profile("cuda") == "mma" and m.attention_profile(torch.device("cuda", 3)) == "mma"
    assert m.attention_profile("cuda:0") == "mma"
    assert m.attention_profile("cpu") == "fma" and m.attention_profile(torch.device("cpu")) == "fma"
    assert m.attention_profile("meta") == "fma"
    assert m.attention_profile("cuda", mla=True) == "fma"
    for arch in ("sm_90", "gfx942"):
        with aligned_ops.emulate(arch):
            assert m.attention_profile("cpu") == "mma" and m.attention_profile(torch.device("cpu")) == "mma"
            assert m.attention_profile("cpu", mla=True) == "fma"
    assert m.attention_profile("cpu") == "fma"  # the scope is left: the plain CPU again
    # the start-up text says which attention runs
    assert "profile='mma' on a GPU" in m.describe() and "profile='fma' on a plain CPU" in m.describe()
    assert "profile='fma'" in profiles.FMA.describe() and "mma" not in profiles.FMA.attention_description()
