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

from ..ops.linear_exact import mark_fsdp2_model
from .hf import patch_model

__all__ = ["shard_aligned", "reshard_after_no_grad_forward"]


def reshard_after_no_grad_forward(model: torch.nn.Module):
    """Reshard every FSDP2 module of ``model`` (the root and any layer kept unsharded) after a forward run with
    autograd off; returns the hook's handle (``shard_aligned`` stores it as ``model._aligned_root_reshard``).

    Why: FSDP2 (torch 2.13, ``reshard_after_forward`` left at its default) does not reshard the ROOT module —
    embedding, final norm, LM head — after its forward (``FSDPState._lazy_init`` sets the root group's
    ``post_forward_mesh_info = None``: the backward would gather it again at once); only the post-backward hook
    reshards it. A forward under ``no_grad`` (scoring old log-probs between steps) has no backward, so the root
    stays unsharded until the next backward, and two things go wrong without an error:

    * while unsharded, ``module.parameters()`` yields the plain unsharded tensors, not the sharded DTensors that
      carry ``.grad``: ``model.zero_grad()`` and ``clip_grad_norm_(model.parameters())`` miss the root's
      gradients, so the previous step's root gradient is still there and the next backward accumulates into it;
    * ``FSDPParamGroup.unshard()`` returns at once when the group is already unsharded, so after ``opt.step()``
      (which updates the sharded parameters) the next forward does not gather again and computes with the OLD
      root weights: wrong log-probs and loss.

    Both are tested, with and without this hook, in tests/integrations/test_fsdp2_root_reshard.py. The module
    list is built once here, not walked per forward."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def hook(module, args, output):
        if not torch.is_grad_enabled():
            for m in sharded:
                m.reshard()

    return model.register_forward_hook(hook)


def shard_aligned(model: torch.nn.Module, mesh=None, *, sum_gradients: bool = True, profile=None, mla_form=None,
                  **fsdp_kwargs) -> torch.nn.Module:
    """``patch_model(model, profile, mla_form)``, then FSDP2 ``fully_shard`` on every decoder layer and on the
    root; returns it.

    ``mla_form``: None (default) resolves like the vLLM plugin (``ALIGNED_OPS_MLA_FORM``, default ``absorbed``).
    ``mla_form="absorbed"`` (DeepSeek-V3 / Kimi-K2): W_UK / W_UV are derived from the gathered ``kv_b_proj``
    weight inside each forward (contiguous copies of its slices, made through autograd, so gradients reach the
    unsharded parameter and FSDP2 reduce-scatters them); nothing derived from a gathered weight outlives the
    forward's autograd graph (``aligned_ops.ops.mla.mla_absorbed_weights`` caches only for registered weights,
    and :func:`aligned_ops.cache_exact_weights` refuses DTensors, FSDP2-managed modules, and the model returned
    here, any module inside it and any of its parameters, sharded or not: FSDP2 all-gathers into the same
    storage every step without moving its version counter).

    The root module (embedding, final norm, LM head) stays unsharded after its forward until a backward
    reshards it (FSDP2's default for the root). After a forward under ``no_grad`` the model reshards itself
    (:func:`reshard_after_no_grad_forward`: stale root gradients and stale root weights otherwise). NOT covered:
    a forward with autograd ON and no backward (e.g. scoring without ``torch.no_grad()``) leaves the root
    unsharded: call ``model.reshard()`` after it; prefer ``optimizer.zero_grad(set_to_none=True)`` (it holds the
    sharded parameters, so it clears their gradients whatever the model's state) over ``model.zero_grad()``. If
    you call ``fully_shard`` yourself instead of this function, pass ``reshard_after_forward=True`` to the root's
    call, or reshard the root after every scoring forward.

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
    # the root stays unsharded after a forward: reshard after a no-grad one (reshard_after_no_grad_forward's doc)
    model._aligned_root_reshard = reshard_after_no_grad_forward(model)
    mark_fsdp2_model(model)  # cache_exact_weights refuses it, its modules and its parameters, sharded or not
    if sum_gradients:
        for m in model.modules():  # each fully_shard'ed module reduces its own parameter group
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM); factor 1: no scaling
    return model
