"""The learner: the trainer (patched for aligned kernels, stock Hugging Face for standard ones) with fp32 master
weights and AdamW, one policy-gradient update per rollout batch, and the per-step diagnostics.

Per batch (generated with weights version v = b - staleness) it computes, in this order:
  1. the loss forward and backward at the current weights (version b), the update (version b + 1);
  2. (after the new version is on its way to the workers) the diagnostics: D3 = k3(π_b ‖ μ_v) over the batch's
     completion tokens (what the IS ratio sees: the lag plus any kernel mismatch), the IS ratio range, and the
     *kernel-only* mismatch: the trainer's forward at the rollout's own weights v against the engine's log-probs
     (bitwise-equal fraction, max |Δ|), plus MoE routing flips of both kinds (kernel-made: trainer vs engine at v;
     lag-made: trainer at b vs at v).
"""

from __future__ import annotations

import os

import torch

from ..diagnostics import mismatch_metrics
from ..rl import broadcast_to_tokens, group_mean_advantages, grpo_advantages, policy_loss, rloo_advantages
from .trainer import is_moe_model, pad_batch, stock_completion_logprobs, trainer_model


def is_router(name: str) -> bool:
    """A MoE router weight (Qwen2/Qwen3-MoE ``mlp.gate``; not the shared-expert gate or gate_proj)."""
    return name.endswith("mlp.gate.weight")


def num_layers(model_dir: str) -> int:
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["num_hidden_layers"])


def downstream_of_last_router(name: str, layers: int) -> bool:
    """A parameter that acts after the last MoE router of the forward pass: the last layer's experts (and a
    shared expert, if any), the final norm and an untied LM head. Training only these cannot change any
    token's route — every router input is computed by frozen weights — so a weight-lag step cannot flip an
    expert choice (``--train-scope head``)."""
    last = f"model.layers.{layers - 1}.mlp."
    return (name.startswith(last) and not is_router(name)) or name.startswith(("model.norm.", "lm_head."))


def frozen_predicate(model_dir: str, train_scope: str, freeze_router: bool, moe: bool):
    """Which parameters RL keeps fixed (name -> bool), from ``--train-scope`` and ``--freeze-router``."""
    if moe and train_scope == "head":
        layers = num_layers(model_dir)
        return lambda name: not downstream_of_last_router(name, layers)
    if moe and freeze_router:
        return is_router
    return lambda name: False


class Policy:
    """A model in its checkpoint dtype (what both the trainer forward and vLLM run), fp32 master weights of the
    trainable parameters and AdamW on the masters (linear lr warm-up): the usual mixed-precision RL trainer."""

    def __init__(self, model_dir: str, dtype: str, aligned: bool, lr: float = 1e-5, lr_warmup: int = 0,
                 freeze=lambda name: False, temperature: float = 1.0, profile=None):
        self.aligned, self.temperature = aligned, temperature
        self.moe = is_moe_model(model_dir)
        self.model = trainer_model(model_dir, dtype, aligned, profile)
        self.model.train()
        for name, p in self.model.named_parameters():
            if freeze(name):
                p.requires_grad_(False)
        self.names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        # float(): a numpy lr (a sweep's np.logspace) would reach the optimizer's and scheduler's state, which the
        # checkpoint saves and --resume loads with torch.load(weights_only=True) (no numpy scalars there)
        self.opt = torch.optim.AdamW(self.master, lr=float(lr), betas=(0.9, 0.99), weight_decay=0.0)
        warm = max(0, int(lr_warmup))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda i: min(1.0, (i + 1) / (warm + 1)))

    def logprobs(self, sequences, starts, pad_id, routing: bool = False):
        """Teacher-forced completion log-probs [B, S] (fp32, differentiable), the completion mask, and (MoE,
        ``routing``) the expert choices [B, S, L, k] (entry [b, p]: the experts of position p-1)."""
        ids, attn, comp = pad_batch(sequences, starts, pad_id)
        experts = None
        if self.aligned:
            out = self.model(ids, attention_mask=attn, completion_mask=comp, temperature=self.temperature,
                             return_logits=False, return_routing=routing and self.moe, return_dict=True)
            lp = out.logprobs
            if routing and self.moe:
                experts = _shift_routes(out.routed_experts, sequences)
        else:
            if routing and self.moe:
                from ..integrations.routing_capture import capture_hf_routing

                with capture_hf_routing(self.model) as rec:
                    lp = stock_completion_logprobs(self.model, ids, attn, comp, self.temperature)
                B, S = ids.shape
                per_pos = torch.stack([r.view(B, S, -1) for r in rec], dim=2)
                experts = _shift_routes(per_pos, sequences)
            else:
                lp = stock_completion_logprobs(self.model, ids, attn, comp, self.temperature)
        return lp, comp, experts

    def step(self, loss) -> float:
        for p in self.params:
            p.grad = None
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        for p, m in zip(self.params, self.master):
            m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
        norm = torch.nn.utils.clip_grad_norm_(self.master, 1.0)
        self.opt.step()
        self.sched.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)
        return float(norm)

    def weights(self) -> dict[str, torch.Tensor]:
        """The model's weights (checkpoint dtype), detached copies: one version."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    # ---- checkpoint ----------------------------------------------------------------------------------------

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "master": [m.detach() for m in self.master],
                "opt": self.opt.state_dict(), "sched": self.sched.state_dict()}

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        with torch.no_grad():
            for m, s in zip(self.master, state["master"]):
                m.copy_(s)
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])


def _shift_routes(per_pos: torch.Tensor, sequences) -> torch.Tensor:
    """Per-position expert choices [B, S, L, k] -> per scored token (entry [b, p] = position p-1), -1 elsewhere."""
    B, S = per_pos.shape[:2]
    out = torch.full_like(per_pos, -1, dtype=torch.int64)
    for b, seq in enumerate(sequences):
        out[b, 1: len(seq)] = per_pos[b, : len(seq) - 1]
    return out


def advantages(kind: str, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if kind == "grpo":
        return grpo_advantages(rewards, group_size=group_size)
    if kind == "rloo":
        return rloo_advantages(rewards, group_size=group_size)
    return group_mean_advantages(rewards, group_size=group_size)


def rollout_tensor(values: list, starts: list[int], like: torch.Tensor) -> torch.Tensor:
    """The engine's per-token log-probs placed like the trainer's [B, S] (0 outside the completions)."""
    out = torch.zeros_like(like)
    for b, lp in enumerate(values):
        out[b, starts[b]: starts[b] + len(lp)] = torch.as_tensor(lp, dtype=torch.float32)
    return out


def engine_routes(routes: list, sequences, like: torch.Tensor) -> torch.Tensor:
    """The engine's recorded routes (per rollout: int16 [positions, L, k]) as [B, S, L, k], entry [b, p] = the
    experts of position p-1 (-1 where nothing was recorded)."""
    L, k = routes[0].shape[1:]
    out = torch.full((*like.shape, L, k), -1, dtype=torch.int64)
    for b, (r, seq) in enumerate(zip(routes, sequences)):
        n = min(len(seq) - 1, r.shape[0])
        out[b, 1: 1 + n] = torch.from_numpy(r[:n].astype("int64"))
    return out


class Learner:
    """The policy being trained plus, when the rollouts lag (k > 0), a second copy of the model that the learner
    loads with each batch's own weights version to measure the kernel-only mismatch."""

    def __init__(self, cfg, model_dir: str):
        self.cfg = cfg
        self.aligned = cfg.kernels == "aligned"
        self.profile = cfg.linear_profile() if self.aligned else None  # the linear profile of the aligned trainer
        moe = is_moe_model(model_dir)
        freeze = frozen_predicate(model_dir, cfg.train_scope, cfg.freeze_router, moe)
        self.policy = Policy(model_dir, cfg.dtype, self.aligned, cfg.lr, cfg.lr_warmup, freeze, cfg.temperature,
                             self.profile)
        self.moe = self.policy.moe
        self.scorer = None
        if cfg.lag > 0:
            self.scorer = Policy(model_dir, cfg.dtype, self.aligned, temperature=cfg.temperature, profile=self.profile)
            self.scorer.model.eval()
        self._scorer_version = None

    def update(self, batch: dict, pad_id: int):
        """Step 1: loss, backward, optimiser step. Returns the context the diagnostics need."""
        cfg = self.cfg
        sequences = [p + c for p, c in zip(batch["prompts"], batch["completions"])]
        starts = [len(p) for p in batch["prompts"]]
        lp, comp, experts_now = self.policy.logprobs(sequences, starts, pad_id, routing=self.moe)
        lp_rollout = rollout_tensor(batch["logprobs"], starts, lp)
        rewards = torch.tensor(batch["rewards"], dtype=torch.float32)
        adv = broadcast_to_tokens(advantages(cfg.advantage, rewards, cfg.samples), comp)
        kwargs = {}
        if cfg.loss in ("tis", "seq_tis", "ppo_clip"):
            kwargs["clip_c"] = cfg.clip_c
        if cfg.loss == "ppo_clip":  # one update per batch: the proximal policy is the current one
            kwargs["proximal_logprobs"] = lp.detach()
        loss, loss_metrics = policy_loss(lp, lp_rollout, adv, comp, mode=cfg.loss, **kwargs)
        grad_norm = self.policy.step(loss)
        return dict(sequences=sequences, starts=starts, lp=lp.detach(), comp=comp, lp_rollout=lp_rollout,
                    experts_now=experts_now, rewards=rewards, loss=float(loss.detach()), grad_norm=grad_norm,
                    loss_metrics=loss_metrics)

    def diagnostics(self, batch: dict, ctx: dict, weights_of_version, pad_id: int) -> dict:
        """Step 2: D3 and IS ratio (current vs rollout), the kernel-only mismatch, routing flips."""
        lp, comp, lp_rollout = ctx["lp"], ctx["comp"], ctx["lp_rollout"]
        d3 = mismatch_metrics(lp, lp_rollout, comp)
        engine_experts = None
        if self.moe and batch.get("routes") is not None:
            engine_experts = engine_routes(batch["routes"], ctx["sequences"], lp)
        if self.scorer is None or batch["version"] == batch["step"]:
            lp_behaviour, experts_behaviour = lp, ctx["experts_now"]  # the rollout's weights are the current ones
        else:
            if self._scorer_version != batch["version"]:
                self.scorer.model.load_state_dict(weights_of_version(batch["version"]))
                self._scorer_version = batch["version"]
            with torch.no_grad():
                lp_behaviour, _, experts_behaviour = self.scorer.logprobs(ctx["sequences"], ctx["starts"], pad_id,
                                                                          routing=self.moe)
        flips = {}
        if engine_experts is not None:
            flips = dict(trainer_experts=experts_behaviour, rollout_experts=engine_experts)
        kernel = mismatch_metrics(lp_behaviour, lp_rollout, comp, **flips)
        rec = dict(
            reward=float(ctx["rewards"].mean()),
            d3=d3["kl_k3"], is_ratio_max=d3["ratio_max"], is_ratio_min=d3["ratio_min"],
            abs_diff_max=d3["abs_diff_max"], num_tokens=int(d3["num_tokens"]),
            kernel_bitwise_frac=kernel["frac_bitwise_equal"], kernel_abs_diff_max=kernel["abs_diff_max"],
            kernel_d3=kernel["kl_k3"],
            loss=ctx["loss"], grad_norm=ctx["grad_norm"],
            frac_truncated=ctx["loss_metrics"]["frac_truncated"], frac_masked=ctx["loss_metrics"]["frac_masked"],
            lr=self.policy.opt.param_groups[0]["lr"],
        )
        if self.moe:
            rec.update(routing_flips=int(kernel.get("routing_flips", 0)),
                       kernel_abs_diff_max_routing_flipped=kernel.get("abs_diff_max_routing_flipped", 0.0),
                       kernel_abs_diff_max_routing_agreed=kernel.get("abs_diff_max_routing_agreed", 0.0))
            if experts_behaviour is not None and ctx["experts_now"] is not None:
                lag = mismatch_metrics(lp, lp_behaviour, comp, trainer_experts=ctx["experts_now"],
                                       rollout_experts=experts_behaviour)
                rec["lag_routing_flips"] = int(lag["routing_flips"])
        return rec
