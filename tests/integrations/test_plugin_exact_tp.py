"""The vLLM plugin's row-parallel layers under the ``exact`` linear profile at TP > 1: the exact route (integer
partials), never the fma tree silently; refused by name where it cannot run (a traced forward). A layer runs the
profile it carries (bound when the engine built it), whatever the environment says later."""

import types

import pytest
import torch

pytest.importorskip("vllm")

import aligned_ops  # noqa: E402
from aligned_ops import profiles  # noqa: E402
from aligned_ops.integrations.vllm import tp as vllm_tp  # noqa: E402
from aligned_ops.ops import collective  # noqa: E402
from aligned_ops.testing import assert_bitwise_equal, bits  # noqa: E402
from _row_parallel import row_parallel_layer, world1  # noqa: E402,F401  (world1: a fixture)


def test_exact_profile_runs_the_integer_route_never_the_fma_tree(monkeypatch, world1):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g)  # fp32 outputs: the two profiles' roundings show in the bits
    w = torch.randn(24, 96, generator=g) * 0.05
    b = torch.randn(24, generator=g)
    layer = row_parallel_layer(2, w, b, profile="exact")
    monkeypatch.setattr(vllm_tp, "_tp_group", lambda: types.SimpleNamespace(device_group=world1, world_size=1))

    def fma_tree(*a, **k):
        raise AssertionError("the fma tree ran under the exact profile")

    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "fma")  # the carried profile wins: the environment is not re-read
    with monkeypatch.context() as m:
        m.setattr(collective, "linear_partial", fma_tree)
        m.setattr(collective, "tree_all_reduce", fma_tree)
        out = vllm_tp._row_parallel_forward(layer, x)
    assert_bitwise_equal(out, aligned_ops.linear_exact(x, w, b))
    # a layer carrying the fma profile takes the tree (and its bits are another profile's)
    fma = vllm_tp._row_parallel_forward(row_parallel_layer(2, w, b, profile="fma"), x)
    assert_bitwise_equal(fma, aligned_ops.linear(x, w, b))
    assert int((bits(fma) != bits(out)).sum()) > 0
    # a stand-in built outside an engine binds the environment's profile once, at its first call
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "exact")
    stray = row_parallel_layer(2, w, b)
    assert_bitwise_equal(vllm_tp._row_parallel_forward(stray, x), out)
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "fma")
    assert stray._aligned_profile is profiles.EXACT


def test_exact_profile_in_a_traced_forward_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(NotImplementedError) as e:
        vllm_tp._row_parallel_forward(row_parallel_layer(2, profile="exact"), None)
    msg = str(e.value)
    for part in ("aligned_ops vLLM plugin", "'exact' linear profile", "tensor parallelism 2", "enforce_eager=True",
                 "tensor_parallel_size=1", "ALIGNED_OPS_LINEAR=fma"):
        assert part in msg, msg
    assert vllm_tp.check_row_parallel_profile(row_parallel_layer(2, profile="fma"), 2) is profiles.FMA


def test_exact_route_refuses_a_device_tensor_and_too_long_k(world1):
    with pytest.raises(ValueError, match="exact_row_parallel_linear: K = 262144 exceeds"):
        profiles.row_parallel_linear(torch.zeros(1, 4), torch.zeros(2, 4), None, world1, in_features=262144,
                                     profile="exact")
    with pytest.raises(NotImplementedError, match="exact_row_parallel_linear: .* CPU only"):
        collective.exact_row_parallel_linear(torch.zeros(1, 4, device="meta"), torch.zeros(2, 4), None, world1)
