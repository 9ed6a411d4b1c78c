"""Rollout helpers on top of vLLM's offline ``LLM``: build an engine, generate with per-token log-probs, refit.

Used by the CLI (``aligned-ops verify`` / ``demo``) and the end-to-end tests::

    llm = make_llm(model_dir, dtype="bfloat16", aligned=True)
    out = generate_with_logprobs(llm, prompts, temperature=1.0, max_tokens=32)
    refit(llm, trainer_model.state_dict())

Engines are single-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ~5 s start-up instead of ~35 s on a CPU,
and the model object is reachable for refit. Guard scripts with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

import aligned_ops

from .._dtensor import is_dtensor
from . import vllm as plugin

__all__ = ["make_llm", "generate_with_logprobs", "refit", "shutdown", "Rollout"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).replace("torch.", "")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} (explicit; 'auto' loads fp32 as bf16), got {dtype!r}")
    return dtype


def make_llm(
    model_dir: str,
    dtype="bfloat16",
    aligned: bool = True,
    *,
    max_model_len: int = 1024,
    max_num_batched_tokens: int = 128,
    max_num_seqs: int = 16,
    kv_cache_memory_bytes: int = 256 << 20,
    enable_chunked_prefill: bool = True,
    **llm_kwargs,
):
    """A single-process vLLM ``LLM`` on ``model_dir``, with (``aligned=True``) or without the plugin.

    Defaults: eager mode, prefix caching off, chunked prefill on with a small token budget (prompts longer
    than ``max_num_batched_tokens`` are prefilled in chunks), a fixed KV-cache size. ``dtype`` must be
    explicit. Extra keyword arguments go to ``vllm.LLM``.

    ``aligned=True`` sets ``ALIGNED_OPS_VLLM=1`` and installs the plugin in this process (also when the
    package is not pip-installed, so the entry point is absent). ``aligned=False`` requires that the plugin
    is not installed in this process (its hooks are process-wide): run the stock engine in another process.
    """
    dtype = _dtype_name(dtype)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if aligned:
        os.environ[plugin.ENV_VAR] = "1"
        plugin.install()
    elif plugin.is_installed():
        raise RuntimeError(
            "make_llm(aligned=False): the aligned_ops plugin is installed in this process; start the stock "
            "engine in a separate process (unset ALIGNED_OPS_VLLM)"
        )
    from vllm import LLM

    kwargs = dict(
        model=model_dir,
        tokenizer=model_dir,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        enable_prefix_caching=False,
        enable_chunked_prefill=enable_chunked_prefill,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        seed=0,
    )
    kwargs.update(llm_kwargs)
    return LLM(**kwargs)


@dataclass
class Rollout:
    """One completion: prompt and completion token ids, and vLLM's fp32 log-prob of each sampled token."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    num_cached_tokens: int | None = None  # prompt tokens served from vLLM's prefix cache (None: not reported)

    def logprobs_tensor(self) -> torch.Tensor:
        return torch.tensor(self.logprobs, dtype=torch.float32)


def generate_with_logprobs(
    llm,
    prompts,
    temperature: float = 1.0,
    max_tokens: int = 32,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    ignore_eos: bool = True,
    n: int = 1,
    min_p: float = 0.0,
) -> list[Rollout]:
    """Generate one completion per prompt; returns the sampled ids and the log-prob vLLM reports for each.

    ``prompts``: strings or lists of token ids. With the plugin, each log-prob is the full-vocabulary
    fp32 log-softmax at ``temperature`` (1.0 for greedy), i.e. what ``hf.completion_logprobs`` computes.
    A per-request ``seed`` crashes vLLM-CPU together with chunked prefill; leave it ``None`` there.
    ``n > 1``: ``n`` completions per prompt (vLLM shares the prompt's KV blocks when prefix caching is on),
    returned prompt-major (``n`` consecutive rollouts per prompt). With an engine built with
    ``logprobs_mode="processed_logprobs"`` the log-probs are those of the top-k/top-p/min-p-truncated
    distribution (``hf.completion_logprobs(..., top_k=, top_p=, min_p=)`` computes the same).
    """
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k if top_k > 0 else -1 if _top_k_minus_one() else 0,
        max_tokens=max_tokens,
        n=n,
        min_p=min_p,
        logprobs=0,
        seed=seed,
        ignore_eos=ignore_eos,
    )
    inputs = [{"prompt_token_ids": list(p)} if not isinstance(p, str) else p for p in prompts]
    outs = llm.generate(inputs, params, use_tqdm=False)
    result = []
    for o in outs:
        for c in sorted(o.outputs, key=lambda c: c.index):
            lps = [step[tok].logprob for tok, step in zip(c.token_ids, c.logprobs)]
            result.append(Rollout(list(o.prompt_token_ids), list(c.token_ids), lps,
                                  num_cached_tokens=getattr(o, "num_cached_tokens", None)))
    return result


def _top_k_minus_one() -> bool:
    # vLLM 0.32 treats top_k 0 and -1 as "disabled"; keep 0.
    return False


def refit(llm, state_dict) -> None:
    """Load new weights (a HF-named state dict, e.g. the trainer's ``model.state_dict()``) into ``llm``.

    Goes through vLLM's own in-place reload (``Worker.reload_weights`` via ``collective_rpc``): the model's
    ``load_weights`` fuses q/k/v and gate/up, then vLLM re-runs each layer's post-load processing. That
    matters for the *stock* CPU engine, whose linear layers re-pack the weight for oneDNN/sgl and drop
    ``layer.weight`` (a plain ``load_weights`` fails there); with the plugin ``layer.weight`` stays a plain
    tensor and the re-processing is a no-op. With prefix caching on, the cache is reset afterwards
    (``llm.reset_prefix_cache()``), so no KV block computed with the old weights is reused.
    Tensors are cast to the engine's dtype and placed on the engine's device by each worker
    (:func:`_reload_on_engine_device`: the device of the model's own parameters). An engine in this process gets
    them without any host round trip (a trainer's CUDA weights stay on the GPU); only an engine in other
    processes receives them through host memory (collective_rpc serialises its arguments), and its workers move
    them back to their device.
    """
    from ..models import ARCHITECTURES
    from ..models.registry import architecture_of

    dtype = llm.llm_engine.model_config.dtype
    in_process = _engine_in_process(llm)
    # The architecture's names (DeepSeek: the HF in-memory fused experts split per expert) and its fp32 weights
    # (DeepSeek's e_score_correction_bias: a rounded bias changes the routing), which are not cast.
    hf_config = getattr(llm.llm_engine.model_config, "hf_config", None)  # (stand-in engines of tests carry none)
    arch = ARCHITECTURES.get(architecture_of(hf_config)) if hf_config is not None else None
    named = arch.refit_weights(state_dict) if arch is not None and arch.refit_weights else state_dict.items()
    keep = tuple(arch.fp32_weights) if arch is not None else ()
    named = list(named)
    for k, v in named:
        if is_dtensor(v):
            raise ValueError(f"refit: state_dict[{k!r}] is a DTensor (FSDP2/TP-sharded); refit takes whole tensors: "
                             "gather them with .full_tensor() on every rank first (nothing was sent to the engine)")
        if not isinstance(v, torch.Tensor) or not (v.is_floating_point()):
            what = f"a {v.dtype} tensor" if isinstance(v, torch.Tensor) else f"a {type(v).__name__}"
            raise ValueError(f"refit: state_dict[{k!r}] is {what}; weights must be floating-point tensors "
                             "(nothing was sent to the engine)")
    items = [(k, _weight_for_transport(v, torch.float32 if keep and k.endswith(keep) else dtype, in_process))
             for k, v in named]
    # A worker returns its refusal instead of raising: an exception in one tensor-parallel worker leaves the other
    # workers' replies queued in vLLM's multiprocess executor, and the next collective_rpc (the next refit) would
    # read them as its own.
    refused = [r for r in (llm.collective_rpc(_reload_on_engine_device, args=(items, keep)) or ()) if r]
    if refused:  # the reason of a rank that found one, before "another rank refused"
        raise ValueError(sorted(refused, key=lambda r: r.startswith(PEER_REFUSED))[0])
    if not plugin.is_installed():
        llm.collective_rpc(_repack_stock_cpu_moe)
    if llm.llm_engine.vllm_config.cache_config.enable_prefix_caching:
        if not llm.reset_prefix_cache():
            raise RuntimeError("refit: vLLM could not reset the prefix cache (requests still running?)")


def _engine_in_process(llm) -> bool:
    """True when the engine core (and its one worker) runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    return type(core).__name__ == "InprocClient"


def _weight_for_transport(v: torch.Tensor, dtype: torch.dtype, in_process: bool) -> torch.Tensor:
    """The engine-dtype copy of one weight, on its own device; through host memory only across processes."""
    v = v.detach().to(dtype=dtype)
    if not in_process and v.device.type != "cpu":
        v = v.cpu()  # collective_rpc to another process serialises tensors as host bytes
    return v


def _reload_on_engine_device(worker, items, keep=()) -> str | None:
    """Runs in each worker: move the weights to the device (and dtype) of the worker's model, then vLLM's
    in-place ``reload_weights`` (which copies them into the existing parameters). Names ending in one of
    ``keep`` stay float32. Returns None, or why the weights were refused (:func:`_check_refit_items`: nothing
    was loaded)."""
    model = worker.model_runner.get_model() if hasattr(worker.model_runner, "get_model") else worker.model_runner.model
    param = next(iter(model.parameters()))
    device, dtype = param.device, worker.model_runner.model_config.dtype
    keep = tuple(keep)
    moved = [(k, v.to(device=device, dtype=torch.float32 if keep and k.endswith(keep) else dtype,
                      non_blocking=True)) for k, v in items]
    if hasattr(model, "load_weights"):  # (the stand-in engines of tests have a plain torch module)
        problem = None
        try:
            _check_refit_items(model, moved, getattr(worker.model_runner.model_config, "hf_config", None))
        except ValueError as e:
            problem = str(e)
        problem = _refusal_of_any_rank(problem)
        if problem is not None:
            return problem
    worker.reload_weights(weights_iterator=moved)
    # vLLM's reload copies processed values back into the parameters through .data: whatever else tracked the
    # writes, no exact-profile packing of the old weights may survive a refit.
    aligned_ops.clear_exact_weight_cache()
    return None


def _engine_tp_group():
    """vLLM's tensor-parallel group coordinator of this worker, or None where there is no vLLM distributed state
    (a stand-in engine of the tests)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group()
    except (ImportError, AssertionError):
        return None


def _tp_world_size() -> int:
    group = _engine_tp_group()
    return 1 if group is None else group.world_size


PEER_REFUSED = "refit: another tensor-parallel rank of the engine refused the state dict"


def _refusal_of_any_rank(problem: str | None) -> str | None:
    """Every tensor-parallel rank refuses when one does (one flag all-reduced over vLLM's TP group, before any rank
    reloads). The dry run can pass on one rank and fail on another: a tensor short along a row-parallel input dim
    fits rank 0's slice, not rank 1's (measured at TP = 2: o_proj [128, 120] for [128, 128]; rank 0 reloaded the
    rest, its lm_head shard changed, rank 1's did not, and refit said no engine weight was changed)."""
    group = _engine_tp_group()
    if group is None or group.world_size <= 1:
        return problem
    flag = torch.tensor([0 if problem is None else 1], dtype=torch.int64)
    torch.distributed.all_reduce(flag, group=group.cpu_group)
    if problem is None and int(flag.item()) > 0:
        problem = f"{PEER_REFUSED} (its reason is reported instead); no engine weight was changed"
    return problem


def _check_refit_items(model, items, hf_config=None) -> None:
    """Refuse, before any engine weight changes, a refit vLLM's in-place reload would apply wrongly or halfway.

    vLLM 0.32's ``reload_weights`` moves every layer to the meta device, rebuilds a layer from ``torch.empty`` once
    any of its weights arrive and copies it back when all its elements are loaded (or at the end): so a layer that
    gets only some of what it fuses (``q_proj`` without ``k_proj`` / ``v_proj`` in ``qkv_proj``, ``gate_proj``
    without ``up_proj``, one expert of a fused-experts layer) gets uninitialised memory in the rest (measured: NaN
    log-probs); an unknown name or a wrong shape raises half-way and leaves the engine's layers on the meta device
    (every later generate fails: "Cannot copy out of meta tensor"); a name vLLM's loader skips (``lm_head.weight`` of
    a tied model) is silently not applied. This runs the model's own ``load_weights`` with vLLM's layerwise loaders
    on the meta tensors only (no data is written: the layer processing is held back), counts what reaches each
    layer, then puts every layer's own tensors back, and raises one ``ValueError`` naming the weight."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload import layerwise as lw
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, to_meta_tensor
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    # tensors vLLM's reload writes in place without a layerwise loader: a dry run would write them; whole tensors,
    # so there is nothing to fuse
    direct = tuple(SKIP_LOAD_TENSORS)
    lw.initialize_layerwise_reload(model)
    owner = {id(t): name for name, layer in model.named_modules() for t in get_layer_tensors(layer).values()}
    current = [None]
    reached: dict[str, set] = {}  # layer name -> the state-dict keys that reached it
    live_got: dict[str, int] = {}  # layer name -> elements loaded into its live tensors (a bias)
    delivered: dict[str, int] = {}  # state-dict key -> elements its loaders copied into engine tensors
    counted = lw.get_numel_loaded

    def get_numel_loaded(loader, args):
        param = args.arguments.get("param")
        layer = owner.get(id(param), "?")
        reached.setdefault(layer, set()).add(current[0])
        live = isinstance(param, torch.Tensor) and not param.is_meta
        if live:  # a bias stays live during vLLM's reload
            args.arguments["param"] = to_meta_tensor(param)
        numel, ret = counted(loader, args)
        if live:
            live_got[layer] = live_got.get(layer, 0) + numel
        delivered[current[0]] = delivered.get(current[0], 0) + numel
        return numel, ret

    def weights():
        for k, v in items:
            if not k.endswith(direct):
                current[0] = k
                yield k, v

    saved = lw.get_numel_loaded, lw._layerwise_process
    lw.get_numel_loaded, lw._layerwise_process = get_numel_loaded, (lambda layer, info: None)
    problem = None
    try:
        model.load_weights(weights())
    except Exception as e:  # noqa: BLE001 - re-raised below, after the engine's tensors are back in place
        shape = next((list(v.shape) for k, v in items if k == current[0]), None)
        why = str(e).splitlines()[0] if str(e) else "shape mismatch"
        problem = f"{current[0]!r} (shape {shape}) could not be loaded ({type(e).__name__}: {why})"
    finally:
        lw.get_numel_loaded, lw._layerwise_process = saved
        incomplete = []
        for name, layer in model.named_modules():
            info = lw.get_layerwise_info(layer)
            if not info.can_load():
                continue
            total, got = info.load_numel_total, info.load_numel
            indices = getattr(layer, "shard_indices", None)  # a vocab-padded embedding / LM head: rows past vocab
            if indices is not None and getattr(layer, "embedding_dim", None):
                total = (indices.num_org_elements + indices.num_added_elements) * layer.embedding_dim
            # vLLM rebuilds from torch.empty only the tensors it moved to the meta device; a live one (a bias,
            # vLLM's SKIP_TENSORS) is written in place and keeps its value when it is not sent: q/k/v weights without
            # their biases are a whole update, a bias alone is not (the weights would come from torch.empty)
            live_total = sum(getattr(t, "weight_loader_numel", t.numel())
                             for n, t in get_layer_tensors(layer).items() if n not in direct and not t.is_meta)
            rebuilt_total, rebuilt_got = total - live_total, got - live_got.get(name, 0)
            if got > 0 and rebuilt_got < rebuilt_total and not is_deferred_attention_layer(layer):
                incomplete.append((name, type(layer).__name__, rebuilt_got, rebuilt_total))
            lw._place_kernel_tensors(layer, info)
            info.reset()
            for t in get_layer_tensors(layer).values():  # live tensors (a bias) keep their own loader
                if getattr(t, "weight_loader", None) is not None:
                    t.weight_loader = lw._get_original_loader(t)
        if hasattr(model, "_original_do_torchao_reload"):
            model._do_torchao_reload = model._original_do_torchao_reload
    if problem is None and incomplete:
        name, cls, got, total = incomplete[0]
        problem = (f"engine layer {name!r} ({cls}) would get only {got} of its {total} elements from "
                   f"{sorted(reached.get(name, ()))} (vLLM rebuilds a layer from the weights it is sent and fuses "
                   f"q/k/v, gate/up and the experts: send every weight of that layer, or none)")
    if problem is None:
        loaded = set().union(*reached.values()) if reached else set()
        names = {k for k, _ in items}
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        for k in names:
            if k in loaded or k.endswith(direct):
                continue
            embedding = k.replace("lm_head.weight", "model.embed_tokens.weight")
            if tied and k.endswith("lm_head.weight") and embedding in names:
                continue  # the trainer's tied copy of the embedding, which is sent too
            problem = (f"{k!r} reaches no engine weight (vLLM's loader skips it"
                       + (": the model ties its LM head to model.embed_tokens.weight, send that" if tied and
                          k.endswith("lm_head.weight") else "") + ")")
            break
    if problem is None and _tp_world_size() == 1:
        # vLLM's loaders slice a tensor to the engine's size along the dims they shard (q/k/v and gate/up rows,
        # o_proj / down_proj columns) and check only the slice: a larger tensor (another model's shape) was cut to
        # the engine's, silently. At TP = 1 every element of a whole tensor must reach the engine.
        for k, v in items:
            got = delivered.get(k, 0)
            if 0 < got != v.numel():
                problem = (f"{k!r} (shape {list(v.shape)}) would reach the engine as {got} of its {v.numel()} "
                           "elements (vLLM's loader cuts a larger tensor to the engine weight's shape: is it the "
                           "engine's model?)")
                break
    if problem is not None:
        raise ValueError(f"refit: state_dict {problem}; no engine weight was changed")


def _repack_stock_cpu_moe(worker) -> int:
    """Stock vLLM-CPU 0.32 MoE refit fix-up (runs in each worker): ``reload_weights`` copies the new plain
    ``[E, 2I, H]`` expert weights into the parameters, and the unquantized MoE method re-runs its set-up as a
    "weight update" — which skips the CPU experts' pre-packing, so the fused CPU kernel would read unpacked
    weights (measured: refitting the *same* weights moved greedy log-probs by 0.8). Re-pack them here. With the
    aligned plugin the weights are never packed, so this is not called."""
    model = worker.model_runner.model
    n = 0
    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        kernel = getattr(qm, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(module, "w13_weight") and hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(module)
            n += 1
    return n


def shutdown(llm) -> None:
    """Stop ``llm``'s engine core and, with ``distributed_executor_backend="mp"`` (tensor parallelism), its
    worker processes, now rather than at garbage collection."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
