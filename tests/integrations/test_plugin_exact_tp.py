"""The vLLM plugin's row-parallel layers under the ``exact`` linear profile at TP > 1: never the fma route."""

import types

import pytest

pytest.importorskip("vllm")

from aligned_ops.integrations import vllm_plugin  # noqa: E402


def _layer(tp):
    return types.SimpleNamespace(tp_size=tp, reduce_results=True, input_is_parallel=True)


@pytest.mark.skipif(vllm_plugin.EXACT_TP_SUPPORTED, reason="the exact TP route is built")
def test_exact_profile_at_tp2_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "exact")
    with pytest.raises(NotImplementedError) as e:
        vllm_plugin._row_parallel_forward(_layer(2), None)
    msg = str(e.value)
    for part in ("aligned_ops vLLM plugin", "'exact' linear profile", "tensor parallelism 2",
                 "tensor_parallel_size=1", "ALIGNED_OPS_LINEAR=fma"):
        assert part in msg, msg


def test_fma_profile_at_tp2_passes_the_check(monkeypatch):
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "fma")
    assert vllm_plugin.check_row_parallel_profile(_layer(2), 2) == "fma"
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "exact")
    assert vllm_plugin.check_row_parallel_profile(_layer(1), 1) == "exact"
