"""Engine start-up: the configuration is validated, and the engine's linear profile resolved, once.

At ``EngineArgs.create_engine_config`` the plugin refuses, with one ``ValueError`` listing every reason,
configurations it cannot keep aligned: an MLA form vLLM does not build as asked (``ALIGNED_OPS_MLA_FORM``, default
``absorbed``: the latent backend, ``mla.py``, CPU, eager; ``expanded``: vLLM's non-MLA path), other
architectures (the supported ones: :mod:`aligned_ops.models`) or
RoPE variants (and partial rotary), quantization, a non-``auto`` KV-cache dtype, speculative decoding, a
tensor-parallel size other than 1, 2, 4 or 8, pipeline parallelism, ``logprobs_mode`` ``raw_logits`` /
``processed_logits``, a linear profile that cannot serve the setting (its capabilities: e.g. ``exact`` at TP > 1
in compiled mode), a MoE model at TP > 1 in compiled mode or with expert parallelism and, on CUDA/ROCm, missing
GPU kernels or a stock attention backend asked for.

The engine's linear profile (:mod:`aligned_ops.profiles`: the architecture's pin, else
``additional_config["aligned_ops_linear"]``, else ``ALIGNED_OPS_LINEAR``) is resolved here and written into
``vllm_config.additional_config`` so that every worker process binds the same one (``bind.py``).
"""

from __future__ import annotations

import aligned_ops.ops.collective

from .. import SUPPORTED_DTYPES, check_hf_config
from . import patches
from .bind import PROFILE_KEY, engine_profile
from .gpu_platform import gpu_platform_reasons

SUPPORTED_LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")

# ---- the MLA form of an engine (DeepSeek-V3 / Kimi-K2; the backend: mla.py) ------------------------------------
# One resolver for the engine and the trainer (patch_model's default): models/mla_form.py.
from ...models.mla_form import (DEFAULT_MLA_FORM, MLA_FORM_ENV, MLA_FORM_ENV_ALIASES, MLA_FORM_KEY,  # noqa: F401
                                MLA_FORMS, mla_form_from_env, resolve_mla_form)

# what vLLM needs in the environment for each form (read when it builds the model config and the layers)
VLLM_ENV_OF_FORM = {"absorbed": {"VLLM_MLA_DISABLE": "0"}, "expanded": {"VLLM_MLA_DISABLE": "1"}}


def engine_mla_form(llm_or_config) -> str | None:
    """The MLA form an engine (a ``vllm.LLM`` or its ``VllmConfig``) runs, as ``patch_model(mla_form=...)``
    takes it; None for a model without MLA or an engine the plugin did not configure."""
    cfg = (getattr(llm_or_config, "vllm_config", None)  # AsyncLLM / LLMEngine
           or getattr(getattr(llm_or_config, "llm_engine", None), "vllm_config", None) or llm_or_config)
    extra = getattr(cfg, "additional_config", None)
    return extra.get(MLA_FORM_KEY) if isinstance(extra, dict) else None



# The linear profile (an aligned_ops.profiles object) of the model the last engine config was created for in this
# process (`aligned-ops verify` compares it with the trainer's). None: no engine created in this process.
installed_linear_profile = None


def _platform_device(platform=None) -> str:
    if platform is None:
        from vllm.platforms import current_platform as platform
    return "cpu" if platform.is_cpu() else "cuda"  # ROCm builds of torch use the cuda device type too


def _built_with_torch() -> str:
    try:
        from ..._build_info import TORCH_VERSION
    except ImportError:  # pragma: no cover - a source tree without a build cannot reach an engine
        return "unknown"
    return TORCH_VERSION


def rope_length_reasons(model_config) -> list:
    """``max_model_len`` beyond the positions of the model's RoPE table (``aligned_ops.rope.table_positions``: the
    rows the plugin and the trainer build). vLLM derives ``max_model_len = max_position_embeddings * factor`` for a
    dynamic-NTK RoPE but tables ``max_position_embeddings`` positions: a longer sequence was accepted and then failed
    mid-generation (aligned::rotary_embedding: positions must lie in [0, 1024), got [1024, 1029]), and the trainer
    cannot score it either."""
    from ...rope import rope_spec_from_hf_config, table_positions

    spec = rope_spec_from_hf_config(model_config.hf_config)
    rows, length = table_positions(spec), int(model_config.max_model_len)
    if length <= rows:
        return []
    return [f"max_model_len {length} exceeds the {rows} positions of the model's RoPE table ({spec.rope_type}, "
            f"max_position_embeddings {spec.max_position}); pass max_model_len <= {rows}"]


def validate_vllm_config(vllm_config) -> None:
    """Raise ``ValueError`` listing every reason the configuration cannot be kept aligned."""
    reasons = []
    mc = vllm_config.model_config
    try:
        check_hf_config(mc.hf_config, "vLLM plugin")
    except ValueError as e:
        reasons.append(str(e).split(": ", 1)[-1])
    else:
        reasons.extend(rope_length_reasons(mc))
    dtype = str(mc.dtype).replace("torch.", "")
    from ...models import ARCHITECTURES
    from ...models.registry import architecture_of

    arch = ARCHITECTURES.get(architecture_of(mc.hf_config))
    if arch is not None and arch.refuse_fp16 and dtype == "float16":
        reasons.append(f"{arch.name} in float16 is not covered (vLLM's decoder layer rescales hidden states in fp16); "
                       "use bfloat16 or float32")
    reasons.extend(mla_form_reasons(vllm_config, arch))
    if dtype not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {dtype} is not supported ({', '.join(SUPPORTED_DTYPES)})")
    if getattr(mc, "quantization", None) or getattr(vllm_config, "quant_config", None) is not None:
        reasons.append(f"quantization ({mc.quantization}) is not supported")
    cc = vllm_config.cache_config
    # Prefix caching is allowed: a cache hit is one more chunk boundary for aligned::paged_attention, whose key
    # tiles are aligned to absolute positions (tests/integrations/test_vllm_rl_features.py).
    if str(getattr(cc, "cache_dtype", "auto")) != "auto":
        reasons.append(f"kv_cache_dtype {cc.cache_dtype} is not supported (use 'auto')")
    if getattr(vllm_config, "lora_config", None) is not None:
        reasons.append("LoRA adapters are not covered (vLLM's punica LoRA kernels add the adapter outside the "
                       "aligned linear); merge the adapter into the weights")
    if getattr(vllm_config, "speculative_config", None) is not None:
        reasons.append("speculative decoding is not covered")
    # Model Runner V2 (vLLM's default where Triton is, i.e. CUDA / ROCm; VLLM_USE_V2_MODEL_RUNNER=1 elsewhere)
    # samples with its own Sampler (vllm/v1/worker/gpu/sample): the plugin's log-prob hooks (sampler.py) never run,
    # so the engine would return stock log-probs (at T = 1, not aligned::log_softmax) without a word
    if bool(getattr(vllm_config, "use_v2_model_runner", False)):
        reasons.append("vLLM's Model Runner V2 is not covered (its sampler bypasses the plugin's log-probs); set "
                       "VLLM_USE_V2_MODEL_RUNNER=0")
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size not in aligned_ops.ops.collective.TP_DEGREES:
        reasons.append(
            f"tensor_parallel_size {pc.tensor_parallel_size} is not supported (1, 2, 4 or 8: each rank of a "
            "row-parallel layer must hold whole lanes of the 8-lane linear tree)"
        )
    if arch is not None and arch.moe and pc.tensor_parallel_size > 1:
        # MoE at TP > 1: the experts' route (moe.py -> collective.row_parallel_moe_experts) groups tokens by expert
        # on the host (data-dependent shapes) around its tree all-reduce: eager only, and tensor parallelism only
        if not bool(getattr(mc, "enforce_eager", True)):
            reasons.append(f"{arch.name} at tensor_parallel_size {pc.tensor_parallel_size} runs its MoE layers in "
                           "eager mode only (their experts' tensor-parallel route is not traced): use "
                           "enforce_eager=True or tensor_parallel_size=1")
        if getattr(pc, "enable_expert_parallel", False):
            reasons.append(f"expert parallelism (enable_expert_parallel) is not covered for {arch.name}: its MoE "
                           "layers run tensor parallel (every expert's intermediate slice per rank)")
    if arch is not None and arch.moe and int(getattr(pc, "data_parallel_size", 1) or 1) > 1:
        # vLLM's MoE layers under data parallelism (without expert parallelism) flatten TP across the DP ranks: each
        # expert's intermediate slice is spread over dp x tp ranks and summed by vLLM's own all-reduce, so a DP
        # replica's tokens would not get the single-device bits (the fused-MoE hook would refuse it at model build)
        reasons.append(f"data_parallel_size {pc.data_parallel_size} is not covered for {arch.name}: vLLM spreads each "
                       "expert over the data-parallel ranks and sums them in its own order; run one engine per "
                       "replica (data_parallel_size=1) instead")
    if pc.pipeline_parallel_size != 1:
        reasons.append("pipeline parallelism is not covered; use pipeline_parallel_size=1 (TP 1/2/4/8 and "
                       "data-parallel replicas of dense models are fine)")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(pc, name, 1) or 1) > 1:  # a sequence's keys split over ranks: another reduction order
            reasons.append(f"{name} {getattr(pc, name)} is not covered; use {name}=1")
    # Compiled mode (enforce_eager=False) is allowed, dense, MoE and TP 2: every arithmetic op of the model is
    # an opaque aligned custom op with a fake impl, so inductor only moves data around them (tested bitwise
    # against eager and the trainer: test_vllm_rl_features.py dense, test_vllm_moe_compiled.py MoE,
    # test_vllm_tp_compiled.py TP = 2 with the tree all-reduce).
    mode = str(getattr(mc, "logprobs_mode", "raw_logprobs"))
    if mode not in SUPPORTED_LOGPROBS_MODES:
        reasons.append(f"logprobs_mode {mode!r} is not supported (use 'raw_logprobs', the default, or "
                       "'processed_logprobs')")
    try:
        profile = engine_profile(vllm_config)
    except ValueError as e:
        reasons.append(str(e))
    else:
        device = _platform_device()
        compiled = not bool(getattr(mc, "enforce_eager", True))
        cg = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
        cuda_graphs = compiled and device != "cpu" and cg is not None and getattr(cg, "name", str(cg)) != "NONE"
        reasons.extend(profile.refusals(device=device, tp_size=pc.tensor_parallel_size, compiled=compiled,
                                        cuda_graphs=cuda_graphs, dtype=getattr(mc, "dtype", None)))
    reasons.extend(gpu_platform_reasons(vllm_config))
    if reasons:
        raise ValueError("aligned_ops vLLM plugin refuses this configuration: " + "; ".join(reasons))


def mla_form_reasons(vllm_config, arch) -> list:
    """Why the engine's MLA form cannot run: the form asked for (:func:`resolve_mla_form`) must be the one vLLM
    builds (``use_mla``: absorbed; ``VLLM_MLA_DISABLE=1``: expanded); the absorbed form has its backend on the CPU
    platform only (``mla.py``) and runs in eager mode (tested at TP 1 and 2: each rank's heads are its own, the
    latent row is replicated, o_proj takes the row-parallel route)."""
    mc = vllm_config.model_config
    use_mla = bool(getattr(mc, "use_mla", False))
    if arch is None or not arch.mla_forms:
        return ["MLA (the latent attention form) is not covered for this architecture"] if use_mla and arch else []
    try:
        requested = resolve_mla_form(getattr(vllm_config, "additional_config", None))
    except ValueError as e:
        return [str(e)]
    running = "absorbed" if use_mla else "expanded"
    if running != requested:
        return [f"{arch.name}: the MLA form asked for is {requested!r} ({MLA_FORM_ENV}, default "
                f"{DEFAULT_MLA_FORM!r}), but vLLM builds the {running} form (VLLM_MLA_DISABLE="
                f"{VLLM_ENV_OF_FORM[running]['VLLM_MLA_DISABLE']}; the plugin sets it for a local checkpoint folder, "
                "set it yourself otherwise)"]
    try:
        arch.mla_forms[running].check_config(mc.hf_config, "vLLM plugin")
    except ValueError as e:
        return [str(e).split(": ", 1)[-1]]
    if running != "absorbed":
        return []
    reasons = []
    if _platform_device() != "cpu":
        reasons.append(f"{arch.name} in the absorbed MLA form runs on the CPU platform only (no GPU build of the "
                       f"latent backend yet): set {MLA_FORM_ENV}=expanded")
    if not bool(getattr(mc, "enforce_eager", True)):
        reasons.append(f"{arch.name} in the absorbed MLA form runs in eager mode only so far: use "
                       f"enforce_eager=True or {MLA_FORM_ENV}=expanded")
    return reasons


def _clear_rope_cache() -> None:
    """Empty vLLM's get_rope cache (``_ROPE_DICT``): it is keyed by the rotary module's shape parameters, not by
    model, so without this a second engine in one process would reuse the first model's rotary module and the
    architecture recorded on it (whose rules the rotary hook reads)."""
    from vllm.model_executor.layers import rotary_embedding

    rotary_embedding._ROPE_DICT.clear()


# the values the plugin itself last wrote into the environment (a later engine in the process may change them)
_env_written: dict = {}


def _architecture_env(engine_args) -> str | None:
    """Set what the checkpoint's architecture needs before vLLM builds the config (``Architecture.vllm_env``; for
    an MLA architecture its form's ``VLLM_MLA_DISABLE``, :data:`VLLM_ENV_OF_FORM`), read from a local folder's
    config.json; a conflicting value the user put in the environment is refused. Returns the MLA form (None: not
    an MLA architecture, or a hub id, which is not read here: validation then refuses what vLLM built)."""
    import json
    import logging
    import os

    from ...models import ARCHITECTURES

    try:
        with open(os.path.join(str(engine_args.model), "config.json")) as f:
            names = json.load(f).get("architectures") or []
    except (OSError, ValueError, TypeError):
        return None
    form = None
    for name in names:
        arch = ARCHITECTURES.get(name)
        if arch is None:
            continue
        env = dict(arch.vllm_env)
        if arch.mla_forms:
            form = resolve_mla_form(getattr(engine_args, "additional_config", None))
            env.update(VLLM_ENV_OF_FORM[form])
        for key, value in env.items():
            have = os.environ.get(key)
            if have is not None and have != value and _env_written.get(key) != have:
                hint = f" (the {form} MLA form; {MLA_FORM_ENV} selects the form)" if form else ""
                raise ValueError(f"aligned_ops vLLM plugin refuses this configuration: {name} needs {key}={value}"
                                 f"{hint}, the environment has {have!r}")
            os.environ[key] = _env_written[key] = value
            logging.getLogger("aligned_ops").info("aligned_ops vLLM plugin: %s runs with %s=%s", name, key, value)
    if names:
        # vLLM caches its environment variables once an engine has started (envs.enable_envs_cache): a second
        # engine in this process must see the value just written
        import vllm.envs as envs

        if envs._is_envs_cache_enabled():
            envs.disable_envs_cache()
    return form


def _create_engine_config(self, *args, **kwargs):
    global installed_linear_profile
    from vllm.engine.arg_utils import EngineArgs

    from ...models import ARCHITECTURES
    from ...models.registry import architecture_of

    _architecture_env(self)
    config = patches.original(EngineArgs, "create_engine_config")(self, *args, **kwargs)
    validate_vllm_config(config)
    _clear_rope_cache()
    # Resolved once for this engine; every worker binds the same profile from the config it receives.
    profile = engine_profile(config)
    if not isinstance(config.additional_config, dict):  # pragma: no cover - a user's SupportsHash object
        raise ValueError("aligned_ops vLLM plugin: additional_config must be a dict (it carries the linear profile)")
    config.additional_config[PROFILE_KEY] = profile.name
    arch = ARCHITECTURES.get(architecture_of(config.model_config.hf_config))
    if arch is not None and arch.mla_forms:  # the form the engine runs (validated): the trainer pairs with it
        config.additional_config[MLA_FORM_KEY] = "absorbed" if config.model_config.use_mla else "expanded"
    installed_linear_profile = profile
    active_logger().info("%s", active_line(profile))
    return config


def active_logger():
    """A child of vLLM's ``vllm`` logger, so the line shows where vLLM's own start-up lines do (vLLM configures
    a handler on ``vllm`` only)."""
    import logging

    return logging.getLogger("vllm.aligned_ops")


def active_line(profile) -> str:
    """The one line an engine logs when the plugin is active: versions, profile, what it replaced."""
    import vllm

    oot = sorted(patches.oot_registered())
    classes = sorted(patches.patched_classes())
    return (f"aligned_ops vLLM plugin active: aligned_ops {aligned_ops.__version__} (built for torch "
            f"{_built_with_torch()}), vLLM {getattr(vllm, '__version__', 'unknown')}, linear profile "
            f"{profile.name!r} ({profile.op}); replaced: {len(oot)} layer ops out of tree ({', '.join(oot)}), "
            f"{len(classes)} classes patched ({', '.join(classes)}); {profile.attention_description()}")


def installed_profile():
    """The linear profile of the last engine configured in this process (None: none was)."""
    return installed_linear_profile


def install() -> None:
    from vllm.engine.arg_utils import EngineArgs

    patches.patch(EngineArgs, "create_engine_config", _create_engine_config,
                  "a config object, no hook: the start-up refusals and the engine's profile")
