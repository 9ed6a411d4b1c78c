"""The vLLM plugin: inert unless opted in, refuses (clear error at start-up) what it cannot keep aligned."""

import copy
import os

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.integrations import vllm_plugin  # noqa: E402  (the former name: the public API re-exported)
from aligned_ops.integrations.vllm import config as vconfig  # noqa: E402
from aligned_ops.integrations.vllm import plugin as vinstall  # noqa: E402
from aligned_ops.integrations.vllm import patches, tp  # noqa: E402
from aligned_ops.testing.tiny_model import build_tiny_qwen2  # noqa: E402
from _tiny_checkpoints import edited_copy  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("refuse") / "m", torch.float32, num_hidden_layers=1)


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
    engine in the process builds its own (with its own recorded architecture). The engine's linear profile is
    resolved once, at config creation, and written into the config for its workers: the served architecture's
    rules' pin, else ALIGNED_OPS_LINEAR (negative control: another architecture's changed rules leave it); a
    variable changed afterwards does not reach that config."""
    import dataclasses

    from vllm.model_executor.layers import rotary_embedding

    from aligned_ops import model_spec, profiles
    from aligned_ops.integrations.vllm.bind import PROFILE_KEY, engine_profile

    sentinel = object()
    rotary_embedding._ROPE_DICT[("stale",)] = sentinel
    monkeypatch.setattr(vconfig, "installed_linear_profile", None)
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "fma")
    cfg = _engine_config(tiny_dir)
    assert ("stale",) not in rotary_embedding._ROPE_DICT
    assert vllm_plugin.installed_profile() is profiles.FMA and cfg.additional_config[PROFILE_KEY] == "fma"
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "exact")
    assert engine_profile(cfg) is profiles.FMA  # carried by the config, not re-read from the environment
    cfg = _engine_config(tiny_dir)
    assert vllm_plugin.installed_profile() is profiles.EXACT and cfg.additional_config[PROFILE_KEY] == "exact"
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "fma")
    exact = dataclasses.replace(model_spec.RULES["Qwen2ForCausalLM"], linear_profile="exact")
    monkeypatch.setitem(model_spec.RULES, "LlamaForCausalLM", exact)
    _engine_config(tiny_dir)
    assert vllm_plugin.installed_profile() is profiles.FMA  # not the Llama rules: the served model's
    monkeypatch.setitem(model_spec.RULES, "Qwen2ForCausalLM", exact)
    _engine_config(tiny_dir)
    assert vllm_plugin.installed_profile() is profiles.EXACT


def test_engine_profile_refusals_are_start_up_errors(tiny_dir, monkeypatch):
    """The profile's capabilities are checked at start-up: the exact profile's TP route does not run in a traced
    forward, so TP = 2 + compiled mode is refused by name before any model is built (eager is accepted)."""
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "exact")
    base = _engine_config(tiny_dir)
    c = copy.copy(base)
    c.parallel_config = copy.copy(base.parallel_config)
    c.parallel_config.tensor_parallel_size = 2
    vllm_plugin.validate_vllm_config(c)  # eager: the integer route runs
    c.model_config = copy.copy(base.model_config)
    c.model_config.enforce_eager = False
    with pytest.raises(ValueError, match="the 'exact' linear profile at tensor parallelism 2 runs its row-parallel "
                                         "layers in eager mode only"):
        vllm_plugin.validate_vllm_config(c)
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "fma")  # negative control: the fma tree is traceable
    c.additional_config = {}
    vllm_plugin.validate_vllm_config(c)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(logprobs_mode="processed_logits"), "logprobs_mode 'processed_logits' is not supported"),
        (dict(logprobs_mode="raw_logits"), "logprobs_mode 'raw_logits' is not supported"),
        (dict(enable_lora=True), "LoRA adapters are not covered"),
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
    d = edited_copy(tiny_dir, tmp_path / "edited", **changes)
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
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        c = copy.copy(base)
        c.parallel_config = copy.copy(base.parallel_config)
        setattr(c.parallel_config, name, 2)
        cases.append((c, f"{name} 2 is not covered; use {name}=1"))
    c = copy.copy(base)
    c.cache_config = copy.copy(base.cache_config)
    c.cache_config.cache_dtype = "fp8"
    cases.append((c, "kv_cache_dtype fp8 is not supported"))
    for cfg, match in cases:
        with pytest.raises(ValueError, match=match):
            vllm_plugin.validate_vllm_config(cfg)


def test_model_runner_v2_refused(tiny_dir, monkeypatch):
    """Model Runner V2 (vLLM's default where Triton is: CUDA / ROCm) samples with its own Sampler, so the plugin's
    log-prob hooks would not run: refused by name. Control: the V1 runner (this CPU machine's) is accepted."""
    base = _engine_config(tiny_dir)
    assert not base.use_v2_model_runner
    vllm_plugin.validate_vllm_config(base)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert base.use_v2_model_runner  # a property read from the environment on every call
    with pytest.raises(ValueError, match="Model Runner V2 is not covered .*VLLM_USE_V2_MODEL_RUNNER=0"):
        vllm_plugin.validate_vllm_config(base)


def test_unsupported_dtype_refused(tiny_dir):
    base = _engine_config(tiny_dir)
    c = copy.copy(base)
    c.model_config = copy.copy(base.model_config)
    c.model_config.dtype = torch.float64
    with pytest.raises(ValueError, match="dtype float64 is not supported"):
        vllm_plugin.validate_vllm_config(c)


def test_unsupported_vllm_version(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.0")  # the range and its gate: test_plugin_versions.py
    with pytest.raises(RuntimeError, match=r"supports vLLM \S+ \.\.\. \S+ .*found 0.33.0"):
        vllm_plugin.check_vllm_version()


_ENTRY_POINT = "aligned_ops.integrations.vllm:register"
_FORMER_ENTRY_POINT = "aligned_ops.integrations.vllm_plugin:register"
# Run in a fresh interpreter (the plugin's state is process-wide: "inert without opt-in" needs a process that never
# installed it).
_INERT_CODE = (
    "import os, importlib\n"
    "from aligned_ops.integrations.vllm import layers, patches\n"
    f"p = importlib.import_module({_ENTRY_POINT.split(':')[0]!r}); q = importlib.import_module({_FORMER_ENTRY_POINT.split(':')[0]!r})\n"
    "assert p.register is q.register and p.install is q.install  # the former name is the same plugin\n"
    "os.environ.pop('ALIGNED_OPS_VLLM', None); q.register(); a = p.is_installed()\n"
    "os.environ['ALIGNED_OPS_VLLM'] = '1'; q.register(); b = p.is_installed()\n"
    "from vllm.model_executor.layers.layernorm import RMSNorm\n"
    "from vllm.model_executor.custom_op import op_registry_oot as r\n"
    "h = r.get('RMSNorm')  # hooked through CustomOp.register_oot, the in-tree class left alone\n"
    "hooked = h is not None and issubclass(h, RMSNorm) and h.forward is layers._rms_norm_forward\n"
    "hooked = hooked and RMSNorm.forward is not layers._rms_norm_forward and len(patches.patched_classes()) > 3\n"
    "hooked = hooked and set(patches.class_patch_reasons()) == set(patches.patched_classes())\n"
    "p.uninstall()\n"
    "print(a, b, hooked, 'RMSNorm' not in r and 'SiluAndMul' not in r and not patches.patched_classes())\n"
)


def BACKGROUND_JOBS(tiny_checkpoint):
    """The entry-point check needs a process that never installed the plugin and nothing from this one:
    tests/_background.py runs it at the beginning of the run, beside the in-process tests, in the process the stock
    probes share (no plugin, _stock_jobs.py: vLLM imported once for all), after them (shared_order: it installs and
    uninstalls the plugin there; the stock engines before it never install it)."""
    from _stock_jobs import stock_job

    return {"plugin_inert_without_opt_in": stock_job(_INERT_CODE, code=True, timeout=300, shared_order=1,
                                                     for_test="test_entry_point_declared_and_inert_without_opt_in")}


def test_entry_point_declared_and_inert_without_opt_in(background):
    """The entry point is declared (installed metadata if present, else pyproject) and does nothing unless opted in."""
    from importlib.metadata import entry_points

    # pyproject names the plugin's home; a wheel installed before the move names the compatibility module, which
    # must keep resolving (vLLM resolves the entry point through sys.path).
    new, former = _ENTRY_POINT, _FORMER_ENTRY_POINT
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        assert f'aligned_ops = "{new}"' in f.read()
    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "aligned_ops"]
    if eps:
        assert eps[0].value in (new, former)
    res = background.result("plugin_inert_without_opt_in")
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


def test_moe_tensor_parallel_eager_accepted_compiled_and_expert_parallel_refused(tmp_path):
    """A MoE model at TP 2 passes validation in eager mode (its experts' TP route: tests/collective/
    test_moe_row_parallel.py, tests/integrations/test_vllm_moe_tp_e2e.py); compiled mode at TP > 1 and expert
    parallelism and data parallelism are refused by name (negative control: the same config at TP 1 compiled is
    accepted; a dense model at data_parallel_size 2 is accepted: test_dense_data_parallel_accepted)."""
    from aligned_ops.testing.tiny_model import build_tiny_moe

    path = build_tiny_moe(tmp_path / "moe", torch.float32, num_hidden_layers=1)
    base = _engine_config(path)

    def at(tp, eager=True, ep=False, dp=1):
        c = copy.copy(base)
        c.parallel_config = copy.copy(base.parallel_config)
        c.parallel_config.tensor_parallel_size = tp
        c.parallel_config.enable_expert_parallel = ep
        c.parallel_config.data_parallel_size = dp
        c.model_config = copy.copy(base.model_config)
        c.model_config.enforce_eager = eager
        return c

    vllm_plugin.validate_vllm_config(at(2))
    vllm_plugin.validate_vllm_config(at(1, eager=False))
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM at tensor_parallel_size 2 runs its MoE layers in eager "
                                         "mode only .*use enforce_eager=True or tensor_parallel_size=1"):
        vllm_plugin.validate_vllm_config(at(2, eager=False))
    with pytest.raises(ValueError, match="expert parallelism \\(enable_expert_parallel\\) is not covered for "
                                         "Qwen3MoeForCausalLM"):
        vllm_plugin.validate_vllm_config(at(2, ep=True))
    # data parallelism flattens the MoE layers' TP over the DP ranks (vLLM's own expert sum): refused up front
    with pytest.raises(ValueError, match="data_parallel_size 2 is not covered for Qwen3MoeForCausalLM: vLLM spreads "
                                         "each expert over the data-parallel ranks"):
        vllm_plugin.validate_vllm_config(at(1, dp=2))


def test_dense_data_parallel_accepted(tiny_dir):
    """Data-parallel replicas of a dense model are independent engines' worth of tokens: accepted."""
    c = copy.copy(_engine_config(tiny_dir))
    c.parallel_config = copy.copy(c.parallel_config)
    c.parallel_config.data_parallel_size = 2
    vllm_plugin.validate_vllm_config(c)


def test_tp_combine_env_refused(monkeypatch):
    monkeypatch.setenv(vllm_plugin.TP_COMBINE_ENV, "ring")
    monkeypatch.setattr(vinstall, "_installed", False)
    with pytest.raises(ValueError, match="ALIGNED_OPS_TP_COMBINE must be one of \\('tree', 'sequential', 'fma', "
                                         "'moe-late'\\), got 'ring'"):
        vllm_plugin.install()


def test_stock_tp_all_reduce_raises_while_installed():
    """No layer can reach vLLM's own TP all-reduce (shared memory on CPU) silently while the plugin is installed."""
    import types

    vllm_plugin.install()
    from vllm.distributed.parallel_state import GroupCoordinator

    assert GroupCoordinator.all_reduce is tp._stock_all_reduce
    group = types.SimpleNamespace(world_size=2, unique_name="tp:0")
    with pytest.raises(RuntimeError, match="a stock tensor-parallel all-reduce .* was reached"):
        tp._stock_all_reduce(group, torch.zeros(3))
    single = types.SimpleNamespace(world_size=1, unique_name="tp:0")
    x = torch.zeros(3)
    assert GroupCoordinator.all_reduce(single, x) is x  # TP = 1: vLLM's bypass, unchanged


def test_layers_vllm_offers_a_hook_for_are_replaced_through_it():
    """Every layer vLLM 0.32 lets an out-of-tree plugin replace (``register_oot`` of a CustomOp or a
    PluggableLayer) is hooked that way: vLLM's own ``__new__`` builds our subclass, the in-tree class keeps
    its methods. What is still class-patched is listed by the patch registry with its reason and offers no such
    hook (RotaryEmbedding: register_oot matches its exact name only, its RoPE subclasses must follow the patch;
    the supported decoder layers, plain nn.Modules whose forward becomes the architecture's block).
    Negative control: a class nobody registered (QKVParallelLinear) is built as itself."""
    vllm_plugin.install()
    from vllm.model_executor.custom_op import CustomOp, PluggableLayer, op_registry_oot
    from vllm.model_executor.layers.linear import QKVParallelLinear

    hooks = vinstall.oot_hooks()
    assert {b.__name__ for b in hooks} == {"RMSNorm", "SiluAndMul", "RowParallelLinear", "VocabParallelEmbedding",
                                           "GateLinear", "MoERunner", "UnquantizedFusedMoEMethod"}
    for base, methods in hooks.items():
        hooked = op_registry_oot[base.__name__]
        assert issubclass(hooked, base) and hooked is not base and hooked._aligned_base is base
        for name, fn in methods.items():
            assert hooked.__dict__[name] is fn and base.__dict__.get(name) is not fn, (base.__name__, name)
        assert type(base.__new__(base)) is hooked, base.__name__  # vLLM's dispatch picks our subclass
    assert type(QKVParallelLinear.__new__(QKVParallelLinear)) is QKVParallelLinear
    patched = patches.patched_classes()
    assert not set(patched) & {b.__name__ for b in hooks}
    from aligned_ops.integrations.vllm.decoders import decoder_classes

    from aligned_ops.models.registry import ARCHITECTURES

    # one decoder class per supported architecture (none shares a class with another), each patched
    assert {c.__name__ for c in decoder_classes()} <= set(patched) and len(decoder_classes()) == len(ARCHITECTURES)
    assert all(patches.class_patch_reasons()[name] for name in patched)
    assert [n for n, c in patched.items() if issubclass(c, (CustomOp, PluggableLayer))] == [
        "RotaryEmbedding", "DeepseekScalingRotaryEmbedding"]
