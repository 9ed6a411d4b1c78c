"""FSDP2 trainer recipe: ``patch_model`` + ``fully_shard`` (each decoder layer, then the root).

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    shard_aligned(model, mesh)                     # patch_model + fully_shard(layer) ... + fully_shard(model)
    lp = completion_logprobs(model, ids, cm, attention_mask=am, temperature=tau)   # rank's own micro-batch

Why the log-probs are bitwise those of one process (and of vLLM at any TP degree): FSDP2 all-gathers each
parameter (a concatenation: exact) in the pre-forward hook of the module that owns it; the patched forwards
are instance attributes of the same modules, reached through ``Module.__call__``, so every aligned op reads
the full, unsharded weight; and every op is row-invariant, so a sequence's result does not depend on
which rank or micro-batch it is in. Data parallelism splits the batch, never a reduction of the forward.

Gradients: each rank's backward is deterministic (fixed-order chains); FSDP2 reduce-scatters them with the
backend's SUM, which over 2 ranks is one commutative fp32 add (bit-reproducible); over more ranks it is
gloo's/NCCL's fixed algorithm — run-to-run deterministic for a fixed world, but not our tree, so gradients
are *not* bitwise equal to a single-process backward (the dw chain over tokens is split by rank).
Loss semantics: pass ``global_num_tokens`` (the all-reduced token count) to ``aligned_ops.rl.policy_loss``
so each rank's loss is its share of the global token mean and the *sum* over ranks is the global loss. FSDP2
*averages* gradients by default (divides by the world size): :func:`shard_aligned` sets the divide factor to 1
and forces a plain SUM reduction (``sum_gradients=True``) so the gradient is that of the global loss; with the default averaging, multiply the
loss by the world size instead.
"""

from __future__ import annotations

import torch

from .hf import patch_model

__all__ = ["shard_aligned"]


def _reshard_after_no_grad_forward(module, args, output):
    if not torch.is_grad_enabled():
        from torch.distributed.fsdp import FSDPModule

        for m in module.modules():  # the root, and any layer sharded with reshard_after_forward=False
            if isinstance(m, FSDPModule):
                m.reshard()


def shard_aligned(model: torch.nn.Module, mesh=None, *, sum_gradients: bool = True, profile=None, mla_form=None,
                  **fsdp_kwargs) -> torch.nn.Module:
    """``patch_model(model, profile, mla_form)``, then FSDP2 ``fully_shard`` on every decoder layer and on the
    root; returns it.

    ``mla_form="absorbed"`` (DeepSeek-V3 / Kimi-K2): W_UK / W_UV are derived from the gathered ``kv_b_proj``
    weight inside each forward (views and a copy of the unsharded parameter, so gradients reach it and FSDP2
    reduce-scatters them); nothing derived from a gathered weight outlives the forward's autograd graph
    (``aligned_ops.ops.mla.mla_absorbed_weights`` caches only for registered weights, and
    :func:`aligned_ops.cache_exact_weights` refuses FSDP2-managed modules and DTensors: FSDP2 all-gathers into
    the same storage every step without moving its version counter).

    ``mesh``: a 1-D ``DeviceMesh`` (default: FSDP2's world mesh on the current device type). ``fsdp_kwargs``
    go to every ``fully_shard`` call (e.g. ``reshard_after_forward``). With ``sum_gradients`` (default) the
    reduce-scatter sums instead of averaging, matching ``policy_loss(..., global_num_tokens=N)``.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    patch_model(model, profile, mla_form)
    if mesh is not None:
        fsdp_kwargs["mesh"] = mesh
    for layer in model.model.layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    # FSDP2 keeps the root's parameters (embedding, final norm, LM head) unsharded after its forward, for the
    # backward that follows; after a forward under no_grad (scoring old log-probs between steps) no backward
    # follows, and the next training step's root gradients came out wrong (measured, torch 2.13, gloo: the
    # embedding / norm / LM-head gradients of the step after a no-grad forward differ from one process's by
    # more than their own size; tests/integrations/test_fsdp2_deepseek_absorbed.py). Reshard after a no-grad
    # forward.
    model._aligned_root_reshard = model.register_forward_hook(_reshard_after_no_grad_forward)
    if sum_gradients:
        for m in model.modules():  # each fully_shard'ed module reduces its own parameter group
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM); factor 1: no scaling
    return model
