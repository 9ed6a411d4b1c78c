"""The vLLM plugin: inert unless opted in, refuses (clear error at start-up) what it cannot keep aligned."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.integrations import vllm_plugin  # noqa: E402
from aligned_ops.testing.tiny_model import build_tiny_qwen2  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("refuse") / "m", torch.float32, num_hidden_layers=1)


def _edited_copy(src, dst, **config_changes):
    import shutil

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(config_changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


def _engine_config(model_dir, **kw):
    from vllm.engine.arg_utils import EngineArgs

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm_plugin.install()
    args = dict(model=model_dir, tokenizer=model_dir, dtype="float32", enforce_eager=True, max_model_len=256,
                enable_prefix_caching=False, kv_cache_memory_bytes=32 << 20)
    args.update(kw)
    return EngineArgs(**args).create_engine_config()


def test_supported_config_is_accepted(tiny_dir):
    cfg = _engine_config(tiny_dir)
    vllm_plugin.validate_vllm_config(cfg)  # no exception


def test_engine_config_clears_rope_cache_and_records_the_served_profile(tiny_dir, monkeypatch):
    """get_rope caches rotary modules by shape, not model: an engine config empties that cache, so a second
    engine in the process builds its own (with its own recorded architecture). The recorded linear profile is
    the served architecture's rules' (negative control: another architecture's changed rules leave it)."""
    import dataclasses

    from vllm.model_executor.layers import rotary_embedding

    from aligned_ops import model_spec

    sentinel = object()
    rotary_embedding._ROPE_DICT[("stale",)] = sentinel
    monkeypatch.setattr(vllm_plugin, "installed_linear_profile", None)
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "fma")
    _engine_config(tiny_dir)
    assert ("stale",) not in rotary_embedding._ROPE_DICT
    assert vllm_plugin.installed_linear_profile == "fma"
    exact = dataclasses.replace(model_spec.RULES["Qwen2ForCausalLM"], linear_profile="exact")
    monkeypatch.setitem(model_spec.RULES, "LlamaForCausalLM", exact)
    _engine_config(tiny_dir)
    assert vllm_plugin.installed_linear_profile == "fma"  # not the Llama rules: the served model's
    monkeypatch.setitem(model_spec.RULES, "Qwen2ForCausalLM", exact)
    _engine_config(tiny_dir)
    assert vllm_plugin.installed_linear_profile == "exact"


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(logprobs_mode="processed_logits"), "logprobs_mode 'processed_logits' is not supported"),
        (dict(logprobs_mode="raw_logits"), "logprobs_mode 'raw_logits' is not supported"),
    ],
)
def test_engine_start_refuses(tiny_dir, kw, match):
    with pytest.raises(ValueError, match=match):
        _engine_config(tiny_dir, **kw)


@pytest.mark.parametrize(
    "kw",
    [dict(enable_prefix_caching=True), dict(enforce_eager=False), dict(logprobs_mode="processed_logprobs"),
     dict(enable_prefix_caching=True, enforce_eager=False, logprobs_mode="processed_logprobs")],
)
def test_rl_settings_are_accepted(tiny_dir, kw):
    """Prefix caching, compiled mode and processed log-probs are covered (test_vllm_rl_features.py)."""
    cfg = _engine_config(tiny_dir, **kw)
    vllm_plugin.validate_vllm_config(cfg)


def test_llm_constructor_refuses_before_building(tiny_dir):
    """Through the public ``vllm.LLM`` entry point, before any model is built."""
    from vllm import LLM

    vllm_plugin.install()
    with pytest.raises(ValueError, match="aligned_ops vLLM plugin refuses this configuration: logprobs_mode"):
        LLM(model=tiny_dir, dtype="float32", enforce_eager=True, logprobs_mode="processed_logits", max_model_len=128,
            kv_cache_memory_bytes=32 << 20)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(architectures=["MistralForCausalLM"], model_type="mistral"), "unsupported architecture 'MistralForCausalLM'"),
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e6, "short_factor": [1.0] * 16,
                               "long_factor": [1.0] * 16, "original_max_position_embeddings": 1024}),
         "rope_type 'longrope' is not supported"),
        (dict(partial_rotary_factor=0.5), "partial rotary embeddings are not supported"),
        (dict(use_sliding_window=True, sliding_window=64, max_window_layers=1), "sliding-window attention"),
    ],
)
def test_unsupported_model_refused(tiny_dir, tmp_path, changes, match):
    d = _edited_copy(tiny_dir, tmp_path / "edited", **changes)
    with pytest.raises(ValueError, match=match):
        _engine_config(d)


def test_quantization_and_spec_decode_and_tp_refused(tiny_dir):
    base = _engine_config(tiny_dir)
    cases = []
    c = copy.copy(base)
    c.model_config = copy.copy(base.model_config)
    c.model_config.quantization = "fp8"
    cases.append((c, "quantization \\(fp8\\) is not supported"))
    c = copy.copy(base)
    c.speculative_config = object()
    cases.append((c, "speculative decoding is not covered"))
    for tp in (3, 6, 16):
        c = copy.copy(base)
        c.parallel_config = copy.copy(base.parallel_config)
        c.parallel_config.tensor_parallel_size = tp
        cases.append((c, f"tensor_parallel_size {tp} is not supported \\(1, 2, 4 or 8: each rank of a row-parallel "
                         "layer must hold whole lanes of the 8-lane linear tree\\)"))
    c = copy.copy(base)
    c.parallel_config = copy.copy(base.parallel_config)
    c.parallel_config.pipeline_parallel_size = 2
    cases.append((c, "pipeline parallelism is not covered; use pipeline_parallel_size=1"))
    c = copy.copy(base)
    c.cache_config = copy.copy(base.cache_config)
    c.cache_config.cache_dtype = "fp8"
    cases.append((c, "kv_cache_dtype fp8 is not supported"))
    for cfg, match in cases:
        with pytest.raises(ValueError, match=match):
            vllm_plugin.validate_vllm_config(cfg)


def test_unsupported_dtype_refused(tiny_dir):
    base = _engine_config(tiny_dir)
    c = copy.copy(base)
    c.model_config = copy.copy(base.model_config)
    c.model_config.dtype = torch.float64
    with pytest.raises(ValueError, match="dtype float64 is not supported"):
        vllm_plugin.validate_vllm_config(c)


def test_unsupported_vllm_version(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.9")
    with pytest.raises(RuntimeError, match="supports vLLM 0.32.0; found 0.31.9"):
        vllm_plugin.check_vllm_version()


def test_entry_point_declared_and_inert_without_opt_in():
    """The entry point is declared (installed metadata if present, else pyproject) and does nothing unless opted in."""
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "aligned_ops"]
    if eps:
        assert eps[0].value == "aligned_ops.integrations.vllm_plugin:register"
    else:
        with open(os.path.join(REPO, "pyproject.toml")) as f:
            text = f.read()
        assert 'aligned_ops = "aligned_ops.integrations.vllm_plugin:register"' in text
    code = (
        "import os; from aligned_ops.integrations import vllm_plugin as p\n"
        "os.environ.pop('ALIGNED_OPS_VLLM', None); p.register(); a = p.is_installed()\n"
        "os.environ['ALIGNED_OPS_VLLM'] = '1'; p.register(); b = p.is_installed()\n"
        "from vllm.model_executor.layers.layernorm import RMSNorm\n"
        "from vllm.model_executor.custom_op import op_registry_oot as r\n"
        "h = r.get('RMSNorm')  # hooked through CustomOp.register_oot, the in-tree class left alone\n"
        "hooked = h is not None and issubclass(h, RMSNorm) and h.forward is p._rms_norm_forward\n"
        "hooked = hooked and RMSNorm.forward is not p._rms_norm_forward and set(p._patched_classes()) >= {\n"
        "    k.split('.')[0] for k in p._originals if not k.startswith('backend.')}\n"
        "p.uninstall()\n"
        "print(a, b, hooked, 'RMSNorm' not in r and 'SiluAndMul' not in r)\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(vllm_plugin.__file__)).rsplit(os.sep, 1)[0] + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "False True True True"


def test_rollout_dtype_must_be_explicit():
    from aligned_ops.integrations.rollout import make_llm

    with pytest.raises(ValueError, match="dtype must be one of"):
        make_llm("/nonexistent", dtype="auto")


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_degrees_accepted(tiny_dir, tp):
    """TP 2/4/8 pass validation (the row-parallel layers finish the 8-lane tree with tree_all_reduce)."""
    base = _engine_config(tiny_dir)
    c = copy.copy(base)
    c.parallel_config = copy.copy(base.parallel_config)
    c.parallel_config.tensor_parallel_size = tp
    vllm_plugin.validate_vllm_config(c)


def test_tp_combine_env_refused(monkeypatch):
    monkeypatch.setenv(vllm_plugin.TP_COMBINE_ENV, "ring")
    monkeypatch.setattr(vllm_plugin, "_installed", False)
    with pytest.raises(ValueError, match="ALIGNED_OPS_TP_COMBINE must be one of \\('tree', 'sequential', 'fma'\\), got 'ring'"):
        vllm_plugin.install()


def test_stock_tp_all_reduce_raises_while_installed():
    """No layer can reach vLLM's own TP all-reduce (shared memory on CPU) silently while the plugin is installed."""
    import types

    vllm_plugin.install()
    from vllm.distributed.parallel_state import GroupCoordinator

    assert GroupCoordinator.all_reduce is vllm_plugin._stock_all_reduce
    tp = types.SimpleNamespace(world_size=2, unique_name="tp:0")
    with pytest.raises(RuntimeError, match="a stock tensor-parallel all-reduce .* was reached"):
        vllm_plugin._stock_all_reduce(tp, torch.zeros(3))
    single = types.SimpleNamespace(world_size=1, unique_name="tp:0")
    x = torch.zeros(3)
    assert GroupCoordinator.all_reduce(single, x) is x  # TP = 1: vLLM's bypass, unchanged


def test_layers_vllm_offers_a_hook_for_are_replaced_through_it():
    """Every layer vLLM 0.32 lets an out-of-tree plugin replace (``register_oot`` of a CustomOp or a
    PluggableLayer) is hooked that way: vLLM's own ``__new__`` builds our subclass, the in-tree class keeps
    its methods. What is still class-patched is listed in ``_patched_classes()`` and offers no such hook
    (RotaryEmbedding: register_oot matches its exact name only, its RoPE subclasses must follow the patch).
    Negative control: a class nobody registered (QKVParallelLinear) is built as itself."""
    vllm_plugin.install()
    from vllm.model_executor.custom_op import CustomOp, PluggableLayer, op_registry_oot
    from vllm.model_executor.layers.linear import QKVParallelLinear

    hooks = vllm_plugin._oot_hooks()
    assert {b.__name__ for b in hooks} == {"RMSNorm", "SiluAndMul", "RowParallelLinear", "VocabParallelEmbedding",
                                           "GateLinear", "MoERunner", "UnquantizedFusedMoEMethod"}
    for base, methods in hooks.items():
        hooked = op_registry_oot[base.__name__]
        assert issubclass(hooked, base) and hooked is not base and hooked._aligned_base is base
        for name, fn in methods.items():
            assert hooked.__dict__[name] is fn and base.__dict__.get(name) is not fn, (base.__name__, name)
        assert type(base.__new__(base)) is hooked, base.__name__  # vLLM's dispatch picks our subclass
    assert type(QKVParallelLinear.__new__(QKVParallelLinear)) is QKVParallelLinear
    patched = vllm_plugin._patched_classes()
    assert not set(patched) & {b.__name__ for b in hooks}
    assert [n for n, c in patched.items() if issubclass(c, (CustomOp, PluggableLayer))] == ["RotaryEmbedding"]
