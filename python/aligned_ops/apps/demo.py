"""``aligned-ops demo``: a small asynchronous RL run on the CPU, standard vs aligned kernels.

Task: a tiny random-weight Qwen2 learns addition ("37+5=" -> "42<eos>"). It is first taught
briefly by supervised steps (shared by both runs), then trained with REINFORCE Zero (untruncated token-level
importance sampling, ``aligned_ops.rl.reinforce_zero_loss``) from real vLLM rollouts generated with weights
that lag the trainer by ``--lag`` steps (the engine is refit every step, as an async RL system does).

Each step logs, per kernel set:
  reward        mean exact-match reward of the step's rollouts;
  D3            k3 KL estimate between trainer log-probs (current weights π) and rollout log-probs (μ), the
                quantity the IS ratio sees (weight lag + kernel mismatch);
  kernel Δ      max |Δlogp| between the trainer scoring the rollout with the *rollout's own weights* and vLLM:
                pure kernel mismatch (0 with aligned kernels).
With ``--moe`` the routing flips are counted in two kinds: kernel-made (trainer vs vLLM at the rollout's weights)
and lag-made (the trainer at its current vs the rollout's weights); ``--train-scope head`` (the --moe default)
trains only the weights after the last router, so a lag step cannot flip a route (README "The MoE demo").
The run ends with a table (reward start -> end, D3 peak-to-median for each kernel set) and a PNG plot.
Seeded: the same flags, thread count (--threads) and torch/vLLM versions give the same numbers on any
x86-64 CPU with AVX2. What used to vary between machines of one kind is torch's CPU kernels (optimiser,
grad-norm, the stock trainer: AVX2 vs AVX-512 code), pinned by the CLI (common.REPRODUCIBLE_ENV) unless
ATEN_CPU_CAPABILITY is set, and the stock engine's oneDNN path (AMX or not), which is not pinned: the
standard column can still differ between CPUs with and without AMX.
"""

from __future__ import annotations

import os
import time

from .common import KERNEL_SETS, print_table, run_child

DIGITS = "0123456789"


# ---- the task ----------------------------------------------------------------------------------------


class AdditionTask:
    """Prompts "a+b=" (a < a_range, b < b_range), answers the digits of a+b followed by eos, as token ids.

    ``a_range`` sets how many distinct prompts there are (a_range * b_range). The --moe demo uses 1000: a model has
    only a few near-tie routing contexts, and with 1000 prompts (100 x 10) they recur from step to step, so a run's
    kernel-made flips are a handful of repeated draws (README "The MoE demo")."""

    def __init__(self, tokenizer, a_range: int = 100, b_range: int = 10):
        if a_range < 1 or b_range < 1:
            raise ValueError(f"AdditionTask: a_range and b_range must be >= 1, got {a_range}, {b_range}")
        self.a_range, self.b_range = a_range, b_range
        self.max_answer_tokens = len(str(a_range + b_range - 2)) + 1  # the largest sum's digits and eos
        self.eos = tokenizer.eos_token_id
        ids = {c: tokenizer.convert_tokens_to_ids(c) for c in DIGITS + "+="}
        if any(v is None or v == tokenizer.unk_token_id for v in ids.values()):
            raise ValueError("demo: the tokenizer needs single-character tokens for digits, '+' and '='")
        self.ids = ids

    def sample(self, gen, n: int) -> list[tuple[list[int], list[int]]]:
        import torch

        a = torch.randint(0, self.a_range, (n,), generator=gen).tolist()
        b = torch.randint(0, self.b_range, (n,), generator=gen).tolist()
        return [([self.ids[c] for c in f"{x}+{y}="], [self.ids[c] for c in str(x + y)] + [self.eos])
                for x, y in zip(a, b)]

    @staticmethod
    def reward(completion: list[int], answer: list[int]) -> float:
        return 1.0 if list(completion[: len(answer)]) == answer else 0.0


# ---- trainer with fp32 master weights ----------------------------------------------------------------


class Trainer:
    """The model in its checkpoint dtype (what both the trainer forward and vLLM run), fp32 master weights
    and AdamW on the masters: the usual mixed-precision set-up of an RL trainer."""

    def __init__(self, model_dir: str, dtype: str, aligned: bool, lr: float, freeze=lambda name: False):
        import torch

        from .trainer import trainer_model

        self.aligned = aligned
        self.model = trainer_model(model_dir, dtype, aligned)
        self.model.train()
        for name, p in self.model.named_parameters():
            if freeze(name):
                p.requires_grad_(False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)

    def logprobs(self, sequences, starts, pad_id):
        from .trainer import pad_batch, stock_completion_logprobs

        ids, attn, comp = pad_batch(sequences, starts, pad_id)
        if self.aligned:
            from ..integrations import hf

            return hf.completion_logprobs(self.model, ids, comp, attention_mask=attn), comp
        return stock_completion_logprobs(self.model, ids, attn, comp), comp

    def step(self, loss) -> float:
        import torch

        self.opt.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None
        loss.backward()
        for p, m in zip(self.params, self.master):
            m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
        norm = torch.nn.utils.clip_grad_norm_(self.master, 1.0)
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)
        return float(norm)

    def state_dict(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


# ---- supervised warm-up (parent, once) -----------------------------------------------------------------


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


def rl_freeze(args, moe: bool):
    """Which parameters RL keeps fixed (a name -> bool predicate), from ``--train-scope`` and ``--freeze-router``."""
    if moe and args.train_scope == "head":
        layers = num_layers(args.model)
        return lambda name: not downstream_of_last_router(name, layers)
    if moe and args.freeze_router:
        return is_router
    return lambda name: False


def supervised_warmup(model_dir: str, out_dir: str, dtype: str, steps: int, lr: float, seed: int,
                      freeze=lambda name: False, a_range: int = 100) -> str:
    """Teach the task briefly (teacher-forced cross-entropy on the answers), save the checkpoint."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    task = AdditionTask(tok, a_range=a_range)
    trainer = Trainer(model_dir, dtype, aligned=False, lr=lr, freeze=freeze)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        batch = task.sample(gen, 64)
        lp, comp = trainer.logprobs([p + a for p, a in batch], [len(p) for p, _ in batch], tok.eos_token_id)
        trainer.step(-(lp * comp).sum() / comp.sum())
    trainer.model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    for f in ("generation_config.json",):
        src = os.path.join(model_dir, f)
        if os.path.exists(src):
            with open(src) as fi, open(os.path.join(out_dir, f), "w") as fo:
                fo.write(fi.read())
    return out_dir


# ---- one RL run (child process, one kernel set) ---------------------------------------------------------


def child(args) -> dict:
    """One RL run with one kernel set (``args.kernels``); returns the per-step records and the D3 summary.

    The first ``args.rl_warmup`` RL steps train exactly like the others but are not logged: Adam's first
    updates (bias-corrected, ≈ lr·sign(g) per weight) move the policy far more than its steady ones, and
    would otherwise be the D3 peak of either kernel set. Logged steps are numbered from 0 after them.
    """
    import torch
    from tqdm import tqdm

    from ..diagnostics import MismatchTracker, mismatch_metrics
    from ..integrations import rollout
    from ..rl import broadcast_to_tokens, grpo_advantages, reinforce_zero_loss
    from .trainer import is_moe_model, routing_pair, trainer_routing

    torch.manual_seed(args.seed)
    aligned = args.kernels == "aligned"
    moe = is_moe_model(args.model)
    freeze = rl_freeze(args, moe)
    llm = rollout.make_llm(args.model, dtype=args.dtype, aligned=aligned, seed=args.seed)
    tok = llm.get_tokenizer()
    task = AdditionTask(tok, a_range=args.a_range)
    trainer = Trainer(args.model, args.dtype, aligned, args.lr, freeze)
    scorer = Trainer(args.model, args.dtype, aligned, args.lr)  # the trainer's forward at the rollout's weights
    history = [trainer.state_dict()]  # history[i] = weights after i steps
    tracker = MismatchTracker()
    gen = torch.Generator().manual_seed(args.seed + 2)
    steps = []
    warm = args.rl_warmup
    bar = tqdm(range(warm + args.steps), desc=f"{args.kernels:>8}", unit="step", dynamic_ncols=True)
    for it in bar:
        logged = it >= warm
        behaviour = max(0, len(history) - 1 - args.lag)
        rollout.refit(llm, history[behaviour])
        scorer.model.load_state_dict(history[behaviour])
        batch = task.sample(gen, args.prompts)
        prompts = [p for p, _ in batch for _ in range(args.samples)]
        answers = [a for _, a in batch for _ in range(args.samples)]
        completions = rollout.generate_with_logprobs(llm, prompts, temperature=1.0, max_tokens=task.max_answer_tokens, ignore_eos=False)
        rewards = torch.tensor([task.reward(c.token_ids, a) for c, a in zip(completions, answers)])
        sequences = [p + list(c.token_ids) for p, c in zip(prompts, completions)]
        starts = [len(p) for p in prompts]

        lp, comp = trainer.logprobs(sequences, starts, task.eos)
        lp_rollout = torch.zeros_like(lp)
        for b, c in enumerate(completions):
            lp_rollout[b, starts[b] : starts[b] + len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float32)
        adv = broadcast_to_tokens(grpo_advantages(rewards, group_size=args.samples), comp)
        loss, _ = reinforce_zero_loss(lp, lp_rollout, adv, comp)
        if logged:
            d3 = tracker.update(it - warm, lp.detach(), lp_rollout, comp)
        else:
            d3 = mismatch_metrics(lp.detach(), lp_rollout, comp)
        experts = {}
        if logged and moe:  # both sides' expert choices at the rollout's weights (one vLLM prefill per sequence)
            experts = dict(zip(("trainer_experts", "rollout_experts"),
                               routing_pair(llm, scorer.model, aligned, sequences, starts, task.eos)))
        with torch.no_grad():
            lp_behaviour, _ = scorer.logprobs(sequences, starts, task.eos)
        kernel = mismatch_metrics(lp_behaviour, lp_rollout, comp, **experts)
        lag = {}
        if logged and moe:  # lag-made flips: the trainer's routes at its current vs the rollout's weights
            lag = mismatch_metrics(lp.detach(), lp_behaviour, comp, rollout_experts=experts["trainer_experts"],
                                   trainer_experts=trainer_routing(trainer.model, aligned, sequences, starts, task.eos))
        grad_norm = trainer.step(loss)
        history.append(trainer.state_dict())
        history = history[-(args.lag + 2):] if len(history) > args.lag + 2 else history
        if not logged:
            bar.set_postfix(warmup=f"{it + 1}/{warm}", D3=f"{d3['kl_k3']:.2e}")
            continue
        rec = dict(step=it - warm, reward=float(rewards.mean()), d3=d3["kl_k3"], ratio_max=d3["ratio_max"],
                   ratio_min=d3["ratio_min"], num_tokens=d3["num_tokens"],
                   kernel_abs_diff_max=kernel["abs_diff_max"], kernel_frac_bitwise_equal=kernel["frac_bitwise_equal"],
                   kernel_d3=kernel["kl_k3"], kernel_ratio_max=kernel["ratio_max"],
                   grad_norm=grad_norm, loss=loss.item())
        if moe:
            rec.update(lag_routing_flips=lag["routing_flips"], lag_abs_diff_max_routing_flipped=lag["abs_diff_max_routing_flipped"],
                       routing_flips=kernel["routing_flips"], tokens_routing_flipped=kernel["num_tokens_routing_flipped"],
                       kernel_abs_diff_max_routing_flipped=kernel["abs_diff_max_routing_flipped"],
                       kernel_abs_diff_max_routing_agreed=kernel["abs_diff_max_routing_agreed"])
        steps.append(rec)
        bar.set_postfix(reward=f"{rec['reward']:.2f}", D3=f"{rec['d3']:.2e}", kernelΔ=f"{rec['kernel_abs_diff_max']:.1e}",
                        **({"flips": int(rec["routing_flips"]), "lag_flips": int(rec["lag_routing_flips"])} if moe else {}))
    return dict(kernels=args.kernels, moe=moe, steps=steps, summary=tracker.summary())


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_d, ax_k) = plt.subplots(1, 3, figsize=(16, 4.2))
    floor = 1e-12  # log axes: exact zeros are drawn at this floor
    for k in KERNEL_SETS:
        s = results[k]["steps"]
        x = [r["step"] for r in s]
        ptm = results[k]["summary"]["d3_peak_to_median"]
        ax_r.plot(x, [r["reward"] for r in s], label=f"{k} kernels")
        (line,) = ax_d.semilogy(x, [max(r["d3"], floor) for r in s], label=f"{k} kernels (peak/median {ptm:.3g})")
        flipped = [(r["step"], max(r["d3"], floor)) for r in s if r.get("routing_flips", 0) > 0]
        if flipped:
            ax_d.scatter(*zip(*flipped), marker="x", color=line.get_color(), zorder=3,
                         label=f"{k}: step with a kernel-made routing flip")
        lag_flipped = [(r["step"], max(r["d3"], floor)) for r in s if r.get("lag_routing_flips", 0) > 0]
        if lag_flipped:
            ax_d.scatter(*zip(*lag_flipped), marker="o", facecolors="none", edgecolors=line.get_color(), zorder=3,
                         label=f"{k}: step with a lag-made routing flip")
        ax_k.semilogy(x, [max(r["kernel_abs_diff_max"], floor) for r in s], label=f"{k} kernels")
    ax_r.set(title="reward (exact match)", xlabel="RL step")
    ax_d.set(title="D3 = mean k3(π ‖ μ) per step (weight lag + kernels)", xlabel="RL step")
    ax_k.set(title=f"kernel mismatch: max |Δlogp| at μ's weights (0 drawn at {floor:g})", xlabel="RL step")
    lo, hi = ax_d.get_ylim()
    ax_d.set_ylim(lo, hi * 30)  # head room on the log axis: the legend must not hide the peaks
    for ax in (ax_r, ax_d, ax_k):
        ax.legend(fontsize=8, loc="upper right" if ax is ax_d else "best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args) -> int:
    """Parent: build and warm up the model once, run both kernel sets, print the table, plot."""
    import torch

    from ..models.tiny import build_tiny_moe, build_tiny_qwen2

    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    if getattr(args, "moe", False):
        base = build_tiny_moe(os.path.join(args.out, "tiny-qwen3-moe"), dtype=getattr(torch, args.dtype),
                              seed=args.seed, hidden_size=args.hidden, moe_intermediate_size=args.hidden // 2,
                              num_hidden_layers=args.layers, router_scale=args.router_scale)
    else:
        base = build_tiny_qwen2(os.path.join(args.out, "tiny-qwen2"), dtype=getattr(torch, args.dtype),
                                seed=args.seed, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                num_hidden_layers=args.layers)
    print(f"supervised warm-up: {args.sft_steps} steps ...", flush=True)
    moe = getattr(args, "moe", False)
    freeze = is_router if (moe and (args.freeze_router or args.train_scope == "head")) else (lambda name: False)
    warm = supervised_warmup(base, os.path.join(args.out, "warm"), args.dtype, args.sft_steps, args.sft_lr, args.seed,
                             freeze, args.a_range)
    argv = ["demo", "--model", warm, "--dtype", args.dtype, "--steps", str(args.steps), "--lag", str(args.lag),
            "--rl-warmup", str(args.rl_warmup), "--prompts", str(args.prompts), "--samples", str(args.samples),
            "--lr", str(args.lr), "--seed", str(args.seed), "--a-range", str(args.a_range),
            "--freeze-router" if args.freeze_router else "--no-freeze-router", "--train-scope", args.train_scope]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    results = {k: run_child(k, argv, os.path.join(args.out, f"demo_{k}.json")) for k in KERNEL_SETS}

    def first_last(k, key):
        s = results[k]["steps"]
        n = max(1, len(s) // 5)  # mean over the first and last fifth of the run
        return sum(r[key] for r in s[:n]) / n, sum(r[key] for r in s[-n:]) / n

    def over_steps(k, key, reduce=max):
        return reduce(r[key] for r in results[k]["steps"])

    summary = {k: results[k]["summary"] for k in KERNEL_SETS}
    rows = [
        ("reward, first -> last fifth", [f"{first_last(k, 'reward')[0]:.2f} -> {first_last(k, 'reward')[1]:.2f}" for k in KERNEL_SETS]),
        ("D3 median over steps", [summary[k]["d3_median"] for k in KERNEL_SETS]),
        ("D3 peak over steps", [summary[k]["d3_peak"] for k in KERNEL_SETS]),
        ("D3 peak-to-median", [summary[k]["d3_peak_to_median"] for k in KERNEL_SETS]),
        ("max IS ratio π/μ (any token)", [over_steps(k, "ratio_max") for k in KERNEL_SETS]),
        ("kernel-only D3 (max over steps)", [over_steps(k, "kernel_d3") for k in KERNEL_SETS]),
        ("kernel max abs Δlogp (any token)", [over_steps(k, "kernel_abs_diff_max") for k in KERNEL_SETS]),
        ("kernel bitwise equal (min %)", [100 * over_steps(k, "kernel_frac_bitwise_equal", min) for k in KERNEL_SETS]),
    ]
    moe = all(results[k].get("moe") for k in KERNEL_SETS)
    if moe:
        rows += [
            ("kernel-made routing flips (token·layer, all steps)", [int(over_steps(k, "routing_flips", sum)) for k in KERNEL_SETS]),
            ("steps with a kernel-made routing flip", [sum(r["routing_flips"] > 0 for r in results[k]["steps"]) for k in KERNEL_SETS]),
            ("lag-made routing flips (token·layer, all steps)", [int(over_steps(k, "lag_routing_flips", sum)) for k in KERNEL_SETS]),
            ("kernel max abs Δlogp, routing flipped", [over_steps(k, "kernel_abs_diff_max_routing_flipped") for k in KERNEL_SETS]),
            ("kernel max abs Δlogp, routing agreed", [over_steps(k, "kernel_abs_diff_max_routing_agreed") for k in KERNEL_SETS]),
        ]
    model = "tiny Qwen3-MoE" if moe else "tiny Qwen2"
    print_table(f"async RL demo ({model}): {args.steps} logged steps after {args.rl_warmup} unlogged, lag {args.lag}, "
                f"lr {args.lr:g}, {args.prompts}x{args.samples} rollouts/step of a+b (a < {args.a_range}), {args.dtype}, "
                + (f"trains {'the head (after the last router)' if args.train_scope == 'head' else 'all weights'}, " if moe else "")
                + f"REINFORCE Zero "
                f"(untruncated token IS)", list(KERNEL_SETS), rows)
    print("\ncolumns: standard = stock vLLM rollouts + stock Hugging Face trainer; aligned = vLLM with the aligned_ops "
          "plugin + the patched trainer.\nrows: D3 = per step, mean over the completion tokens of k3 = (ρ-1) - log ρ, "
          "ρ = π_trainer/μ_rollout (current vs lagged weights: lag + kernel mismatch); kernel-only rows compare the "
          "trainer at the rollout's own weights with vLLM (kernel mismatch alone)"
          + ("; kernel-made routing flips: (token, layer) pairs whose top-k expert set differs between the trainer "
             "and vLLM at the rollout's weights; lag-made: between the trainer at its current and at the rollout's "
             "weights." if moe else "."))
    ptm = {k: summary[k]["d3_peak_to_median"] for k in KERNEL_SETS}
    print(f"D3 peak-to-median: standard {ptm['standard']:.3g}, aligned {ptm['aligned']:.3g} "
          f"(standard / aligned = {ptm['standard'] / ptm['aligned']:.3g}x)")
    png = os.path.join(args.out, "demo.png")
    plot(results, png)
    print(f"\nplot: {png}\nresults: {args.out}/demo_*.json\nwall time: {time.time() - t0:.0f} s")
    return 0
