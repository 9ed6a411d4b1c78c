"""A stand-in for vLLM's RowParallelLinear (what the plugin's row-parallel forward reads) and a one-rank gloo group:
the profile-routing tests of the plugin's TP path (test_plugin_exact_tp.py, test_plugin_mma.py) call
``vllm_tp._row_parallel_forward`` on it without an engine."""

import types

import pytest
import torch.distributed as dist

from aligned_ops import profiles


def row_parallel_layer(tp, weight=None, bias=None, profile=None):
    layer = types.SimpleNamespace(tp_size=tp, tp_rank=0, reduce_results=True, input_is_parallel=True,
                                  skip_bias_add=False, return_bias=False, weight=weight, bias=bias, input_size=None)
    if profile is not None:  # what the engine binds when it builds the layer (bind.record_architecture)
        layer._aligned_profile = profiles.get(profile)
    return layer


@pytest.fixture
def world1(tmp_path):
    """A gloo process group of this process alone (file rendezvous in the test's tmp_path)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
