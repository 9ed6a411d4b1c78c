"""ALIGNED_OPS_LINEAR=mma in the integrations (no engine runs here; end to end: test_vllm_*_e2e.py, mma params):
the vLLM plugin's row-parallel layers carrying the mma profile take the mma sub-trees and the tree all-reduce;
the profile's start-up refusals (aligned_ops.profiles.MMA.refusals / model_refusals) reach the plugin's config
validation, the trainer patch and `aligned-ops verify --linear mma` in one line each: a CPU without the unit
(ALIGNED_CPU_ISA=avx2 makes the process one), a non-bf16 model, a GPU."""

import copy
import os
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("vllm")

import aligned_ops  # noqa: E402
from aligned_ops import profiles  # noqa: E402
from aligned_ops.integrations import vllm_plugin  # noqa: E402
from aligned_ops.integrations.vllm import tp as vllm_tp  # noqa: E402
from aligned_ops.ops import collective  # noqa: E402
from aligned_ops.testing import assert_bitwise_equal, bits  # noqa: E402
from _row_parallel import row_parallel_layer, world1  # noqa: E402,F401  (world1: a fixture)

needs_unit = pytest.mark.skipif(aligned_ops.mma_unit() is None, reason="this CPU has no avx512_bf16")
REFUSAL = "mma needs avx512_bf16; use ALIGNED_OPS_LINEAR=fma"
# the CLI's form: the advice names the flag the user chose the profile by (runner.config.check_profile_runs_here)
FLAG_REFUSAL = REFUSAL.replace("ALIGNED_OPS_LINEAR=", "--linear ")
BF16_REFUSAL = ("the mma profile takes bfloat16 models (its matrix units multiply bf16), got float32; use "
                "ALIGNED_OPS_LINEAR=fma")
NO_UNIT_ENV = dict(os.environ, ALIGNED_CPU_ISA="avx2")  # a CPU without AVX-512, hence without the unit


@needs_unit
def test_row_parallel_layer_runs_the_mma_sub_tree(monkeypatch, world1):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1536, generator=g).bfloat16()
    w = (torch.randn(24, 1536, generator=g) * 0.05).bfloat16()
    b = torch.randn(24, generator=g).bfloat16()
    monkeypatch.setattr(vllm_tp, "_tp_group", lambda: types.SimpleNamespace(device_group=world1, world_size=1))
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "fma")  # the carried profile wins over the environment

    def fma_sub_tree(*a, **k):
        raise AssertionError("the fma sub-tree ran under the mma profile")

    with monkeypatch.context() as m:
        m.setattr(collective, "linear_partial", fma_sub_tree)
        m.setattr(aligned_ops, "linear_partial", fma_sub_tree)
        out = vllm_tp._row_parallel_forward(row_parallel_layer(2, w, b, profile="mma"), x)
    assert_bitwise_equal(out, aligned_ops.linear_mma(x, w, b))
    # the route is linear_mma_partial + tree_all_reduce + finish: at t = 1 that is the full 8-lane tree
    assert_bitwise_equal(profiles.MMA.row_parallel_linear(x, w, b, world1, in_features=1536),
                         aligned_ops.linear_mma(x, w, b))
    # negative control: a layer carrying the fma profile takes the fma tree, whose bits differ — on products in the
    # subnormal range (the unit flushes them, the fma chain keeps them; elsewhere bf16's rounding mostly hides the
    # two profiles' ulp differences)
    xs, ws = torch.full((2, 64), 1e-20).bfloat16(), torch.full((4, 64), 1e-20).bfloat16()
    tiny_mma = vllm_tp._row_parallel_forward(row_parallel_layer(2, ws, None, profile="mma"), xs)
    tiny_fma = vllm_tp._row_parallel_forward(row_parallel_layer(2, ws, None, profile="fma"), xs)
    assert_bitwise_equal(tiny_mma, aligned_ops.linear_mma(xs, ws))
    assert int((bits(tiny_fma) != bits(tiny_mma)).sum()) == tiny_mma.numel()


@needs_unit
def test_sequential_negative_control_sums_the_mma_lanes(monkeypatch, world1):
    """The sequential TP combine (a negative control of the e2e TP tests) adds the layer's own profile's lane
    sums: under mma the unit's chains, so its bits differ from the tree's only by the combine order."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 256, generator=g).bfloat16()
    w = (torch.randn(8, 256, generator=g) * 0.05).bfloat16()
    group = types.SimpleNamespace(device_group=world1, world_size=1)
    seq = vllm_tp._sequential_lane_combine(x, w, group, profiles.MMA)
    lanes = [aligned_ops.linear_mma_partial(x[:, j * 32:(j + 1) * 32].contiguous(), w[:, j * 32:(j + 1) * 32]
                                            .contiguous(), 1) for j in range(8)]
    acc = lanes[0]
    for s in lanes[1:]:
        acc = acc + s
    assert_bitwise_equal(seq, acc)


@needs_unit
def test_mma_refusals(monkeypatch):
    assert profiles.MMA.refusals(dtype=torch.bfloat16) == []
    assert profiles.MMA.refusals(tp_size=2, compiled=True, dtype=torch.bfloat16) == []  # its TP route traces
    assert profiles.MMA.refusals(dtype=torch.float32) == [BF16_REFUSAL]
    assert profiles.MMA.model_refusals("float32") == [BF16_REFUSAL]
    (gpu,) = profiles.MMA.refusals(device="cuda", dtype=torch.bfloat16)
    assert gpu.startswith("the mma profile has no cuda kernels in this build") and gpu.endswith("use ALIGNED_OPS_LINEAR=fma")
    # negative control: the other profiles take any dtype
    assert profiles.FMA.refusals(dtype=torch.float32) == [] and profiles.EXACT.model_refusals(torch.float16) == []


def _tiny_engine_config(tmp_path, dtype):
    from vllm.engine.arg_utils import EngineArgs

    from aligned_ops.testing.tiny_model import build_tiny_qwen2

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    path = build_tiny_qwen2(tmp_path / "m", torch.float32, num_hidden_layers=1)
    vllm_plugin.install()
    return EngineArgs(model=path, tokenizer=path, dtype=dtype, enforce_eager=True, max_model_len=256,
                      enable_prefix_caching=False, kv_cache_memory_bytes=32 << 20).create_engine_config()


@pytest.mark.slow  # an engine config (vLLM's model inspection): ~25 s on a loaded 2-core machine
@needs_unit
def test_plugin_validation_refuses_a_non_bf16_engine_under_mma(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "fma")
    base = _tiny_engine_config(tmp_path, "float32")
    c = copy.copy(base)
    c.additional_config = {}  # resolved again from the environment
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "mma")
    with pytest.raises(ValueError, match="aligned_ops vLLM plugin refuses this configuration: "
                                         + BF16_REFUSAL.replace("(", "\\(").replace(")", "\\)")):
        vllm_plugin.validate_vllm_config(c)
    c.model_config = copy.copy(base.model_config)
    c.model_config.dtype = torch.bfloat16
    vllm_plugin.validate_vllm_config(c)  # bf16 on a CPU with the unit: accepted
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "fma")  # negative control: fma takes float32
    c.model_config = base.model_config
    vllm_plugin.validate_vllm_config(c)


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


_NO_UNIT_DIR: list = []


def BACKGROUND_JOBS(tiny_checkpoint):
    """The no-unit process needs nothing from this one: tests/_background.py starts it at the beginning of the run
    (its model folder is made here and removed by its test)."""
    import tempfile

    d = tempfile.mkdtemp(prefix="aligned_mma_no_unit_")
    _NO_UNIT_DIR.append(d)
    return {"mma_no_unit_refusals": dict(argv=[sys.executable, "-c", _NO_UNIT_SCRIPT, os.path.join(d, "m")],
                                         env=NO_UNIT_ENV, timeout=900)}  # generous: beside the suite


@pytest.mark.slow
def test_a_cpu_without_the_unit_is_refused_at_start_up_on_both_sides(background):
    import shutil

    res = background.result("mma_no_unit_refusals")
    for d in _NO_UNIT_DIR:
        shutil.rmtree(d, ignore_errors=True)
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
    assert not hasattr(model, "_aligned_profile")  # refused before any layer was patched
    # negative control: the same model under fma (an explicit profile beats the variable) is patched
    assert profiles.profile_of(patch_model(model, profile="fma")) is profiles.FMA


def _cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "aligned_ops.apps.cli", *argv], capture_output=True, text=True,
                          timeout=120, env=env or dict(os.environ))


@pytest.mark.slow  # four CLI processes (each imports torch)
def test_verify_linear_mma_is_validated_up_front():
    res = _cli("verify", "--linear", "mma", "--dtype", "float32")
    assert res.returncode == 2 and res.stdout == ""
    err = res.stderr.strip()
    if aligned_ops.mma_unit() is not None:
        flag_bf16_refusal = BF16_REFUSAL.replace("ALIGNED_OPS_LINEAR=", "--linear ")
        assert err == f"aligned-ops verify: error: --linear mma: {flag_bf16_refusal}"
    res = _cli("verify", "--linear", "mma", env=NO_UNIT_ENV)
    assert res.returncode == 2 and res.stderr.strip() == f"aligned-ops verify: error: --linear mma: {FLAG_REFUSAL}"
    res = _cli("verify", "--model", "/nonexistent", env=dict(os.environ, ALIGNED_OPS_LINEAR="mma"), )
    assert res.returncode == 2 and res.stderr.startswith("aligned-ops verify: error:")
    res = _cli("verify", env=dict(os.environ, ALIGNED_OPS_LINEAR="tensorcore"))
    assert res.returncode == 2 and "ALIGNED_OPS_LINEAR must be one of ('fma', 'exact', 'mma')" in res.stderr
