"""ALIGNED_OPS_LINEAR=mma in the integrations (no engine runs here; end to end: test_vllm_*_e2e.py, mma params):
the vLLM plugin's row-parallel layers take the mma sub-trees and the tree all-reduce; the trainer patch, the
plugin's start-up validation and `aligned-ops verify --linear mma` refuse, in one line, a CPU without the unit
(ALIGNED_CPU_ISA=avx2 makes the process one), a non-bf16 model and a GPU."""

import os
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("vllm")

import aligned_ops  # noqa: E402
from aligned_ops.integrations import vllm_plugin  # noqa: E402
from aligned_ops.ops import collective  # noqa: E402
from aligned_ops.testing import assert_bitwise_equal  # noqa: E402

needs_unit = pytest.mark.skipif(aligned_ops.mma_unit() is None, reason="this CPU has no avx512_bf16")
REFUSAL = "mma needs avx512_bf16; use ALIGNED_OPS_LINEAR=fma"
NO_UNIT_ENV = dict(os.environ, ALIGNED_CPU_ISA="avx2")  # a CPU without AVX-512, hence without the unit


def _layer(tp, weight=None, bias=None):
    return types.SimpleNamespace(tp_size=tp, tp_rank=0, reduce_results=True, input_is_parallel=True,
                                 skip_bias_add=False, return_bias=False, weight=weight, bias=bias, input_size=None)


@pytest.fixture
def world1(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@needs_unit
def test_row_parallel_layer_runs_the_mma_sub_tree(monkeypatch, world1):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1536, generator=g).bfloat16()
    w = (torch.randn(24, 1536, generator=g) * 0.05).bfloat16()
    b = torch.randn(24, generator=g).bfloat16()
    monkeypatch.setattr(vllm_plugin, "_tp_group", lambda: types.SimpleNamespace(device_group=world1, world_size=1))
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "mma")

    def fma_sub_tree(*a, **k):
        raise AssertionError("the fma sub-tree ran under the mma profile")

    with monkeypatch.context() as m:
        m.setattr(collective, "linear_partial", fma_sub_tree)
        out = vllm_plugin._row_parallel_forward(_layer(2, w, b), x)
    assert_bitwise_equal(out, aligned_ops.linear_mma(x, w, b))
    # the route is linear_mma_partial + tree_all_reduce + finish: at t = 1 that is the full 8-lane tree
    assert_bitwise_equal(collective.row_parallel_linear(x, w, b, world1, profile="mma", in_features=1536),
                         aligned_ops.linear_mma(x, w, b))
    with pytest.raises(ValueError, match="profile must be 'fma', 'exact' or 'mma', got 'tensorcore'"):
        collective.row_parallel_linear(x, w, b, world1, profile="tensorcore")


def _config(dtype, arch="Qwen2ForCausalLM"):
    hf = types.SimpleNamespace(architectures=[arch])
    return types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=hf, dtype=dtype))


CPU = types.SimpleNamespace(is_cpu=lambda: True, device_type="cpu")
CUDA = types.SimpleNamespace(is_cpu=lambda: False, device_type="cuda")


@needs_unit
def test_plugin_mma_reasons(monkeypatch):
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "mma")
    assert vllm_plugin.mma_reasons(_config(torch.bfloat16), CPU) == []
    assert vllm_plugin.mma_reasons(_config(torch.float32), CPU) == [
        "the mma profile takes bfloat16 models (its matrix units multiply bf16), got float32; use ALIGNED_OPS_LINEAR=fma"]
    (gpu,) = vllm_plugin.mma_reasons(_config(torch.bfloat16), CUDA)
    assert gpu.startswith("the mma profile has no cuda kernels yet") and gpu.endswith("use ALIGNED_OPS_LINEAR=fma")
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "fma")  # negative control: other profiles add nothing
    assert vllm_plugin.mma_reasons(_config(torch.float32), CUDA) == []


_NO_UNIT_SCRIPT = r"""
import os, sys, types, torch
os.environ["ALIGNED_OPS_LINEAR"] = "mma"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from aligned_ops.integrations import vllm_plugin
from aligned_ops.integrations.hf import patch_model
from aligned_ops.testing.tiny_model import build_tiny_qwen2
from transformers import AutoModelForCausalLM
path = build_tiny_qwen2(sys.argv[1], torch.bfloat16, num_hidden_layers=1)
try:
    patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
except ValueError as e:
    print("trainer:", e)
vllm_plugin.install()
from vllm.engine.arg_utils import EngineArgs
try:
    EngineArgs(model=path, tokenizer=path, dtype="bfloat16", enforce_eager=True, max_model_len=256,
               kv_cache_memory_bytes=32 << 20).create_engine_config()
except ValueError as e:
    print("engine:", str(e).splitlines()[0])
"""


@pytest.mark.slow
def test_a_cpu_without_the_unit_is_refused_at_start_up_on_both_sides(tmp_path):
    res = subprocess.run([sys.executable, "-c", _NO_UNIT_SCRIPT, str(tmp_path / "m")], env=NO_UNIT_ENV,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("trainer:", "engine:"))]
    assert lines == [f"trainer: aligned_ops (patch_model): {REFUSAL}",
                     f"engine: aligned_ops vLLM plugin refuses this configuration: {REFUSAL}"], res.stdout[-2000:]


@needs_unit
def test_trainer_refuses_a_non_bf16_model_under_mma(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from aligned_ops.integrations.hf import patch_model
    from aligned_ops.testing.tiny_model import build_tiny_qwen2

    path = build_tiny_qwen2(tmp_path / "m", torch.float32, num_hidden_layers=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "mma")
    with pytest.raises(ValueError, match="aligned_ops \\(patch_model\\): the mma profile takes bfloat16 models"):
        patch_model(model)
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "fma")
    assert patch_model(model)._aligned_linear_profile == "fma"


def _cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "aligned_ops.apps.cli", *argv], capture_output=True, text=True,
                          timeout=120, env=env or dict(os.environ))


def test_verify_linear_mma_is_validated_up_front():
    res = _cli("verify", "--linear", "mma", "--dtype", "float32")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == ("aligned-ops verify: error: --linear mma takes --dtype bfloat16 (its matrix units "
                                  "multiply bf16), got float32")
    res = _cli("verify", "--linear", "mma", env=NO_UNIT_ENV)
    assert res.returncode == 2 and res.stderr.strip() == f"aligned-ops verify: error: --linear mma: {REFUSAL}"
    res = _cli("verify", env=dict(os.environ, ALIGNED_OPS_LINEAR="tensorcore"))
    assert res.returncode == 2
    assert res.stderr.strip() == "aligned-ops verify: error: ALIGNED_OPS_LINEAR must be fma, exact or mma, got 'tensorcore'"
