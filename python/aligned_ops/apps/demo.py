"""``aligned-ops demo``: four runs of the RL runner side by side — standard vs aligned kernels, async vs sync.

The model is the built-in tiny Qwen3-MoE (2 layers, 8 experts, top-2, bf16, routers near ties), taught "a+b=" by a
short supervised warm-up, then trained by REINFORCE Zero (untruncated token-level IS) from real vLLM rollouts. Each
run is ``aligned-ops train`` in its own process (a rollout worker process + a learner process, one core each):

    standard async   stock vLLM + stock trainer, rollouts one version behind the learner (k = 1)
    aligned  async   vLLM with the aligned_ops plugin + the patched trainer, k = 1
    standard sync    k = 0: rollout and training take turns
    aligned  sync

What the table and the PNG show: D3 (k3 of the IS ratio per step) — with aligned kernels it carries only the lag,
a smooth curve; with stock kernels it also carries the kernel mismatch, whose stock-bf16 route flips make rare large
spikes; the kernel-only mismatch (the trainer at the rollout's own weights vs the engine: 0 and bitwise with aligned
kernels at every step); and the throughput of async vs sync. README "The demo" says why these settings.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from ..runner.config import ConfigError, RunConfig, check_writable_folder

RUNS = (("standard", "async"), ("aligned", "async"), ("standard", "sync"), ("aligned", "sync"))

# The demo's own defaults (the rest are aligned-ops train's). Why each: README "The demo".
DEMO_DEFAULTS = dict(steps=70, prompts=64, samples=4, lr=3e-5, lr_warmup=10, tiny="moe", a_range=1000)

# train flags the demo does not take: it sets them per run, or they make no sense for four runs side by side
NOT_DEMO_FLAGS = {"--mode", "--kernels", "--resume", "--backend", "--rollout-workers", "--ray-address",
                  "--checkpoint-every"}


def add_parser(sub):
    import argparse

    from .common import one_line_errors
    from .train import FLAGS

    d = sub.add_parser("demo", allow_abbrev=False, help="standard vs aligned kernels, async vs sync: four RL runs, one table, one PNG",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    base = RunConfig(**{k: v for k, v in DEMO_DEFAULTS.items()})
    for flag, kw in FLAGS:
        if flag in NOT_DEMO_FLAGS:
            continue
        name = flag[2:].replace("-", "_")
        default = "demo_out" if name == "out" else getattr(base, name)
        kw = dict(kw, default=default)
        if kw.get("action") != "store_true" and default is not None and "help" in kw:
            kw["help"] += f" (default {default})"
        names = [flag, "--lag"] if flag == "--max-lag" else [flag]  # --lag: the old demo's name
        d.add_argument(*names, **kw)
    d.add_argument("--moe", dest="tiny", action="store_const", const="moe", help=argparse.SUPPRESS)  # old spelling
    d.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    one_line_errors(d, "aligned-ops demo")
    return d


def configs_from_args(args) -> dict[tuple[str, str], RunConfig]:
    """One validated RunConfig per run (raises ConfigError naming the flag); the model is built once by the demo."""
    from .train import FLAGS

    names = {f[2:].replace("-", "_") for f, _ in FLAGS if f not in NOT_DEMO_FLAGS} | {"progress"}
    shared = {k: getattr(args, k) for k in names}
    out = shared.pop("out")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out}: exists and is not a folder")
    if shared["max_lag"] == 0:
        raise ConfigError("--max-lag 0: the demo's async runs need a lag >= 1 (its sync runs are the lag-0 ones)")
    configs = {}
    for kernels, mode in RUNS:
        kw = dict(shared, kernels=kernels, mode=mode, out=os.path.join(out, "runs", f"{kernels}_{mode}"))
        if mode == "sync":
            kw["max_lag"] = None
        # the run folders are the demo's own: a second demo in the same --out replaces them
        configs[(kernels, mode)] = RunConfig(**kw).validate(check_out=False)
    check_writable_folder(out)  # last: a demo refused for another flag makes no folder
    return configs


def _train_argv(cfg: RunConfig, model_dir: str) -> list[str]:
    from .train import FLAGS

    argv = ["train", "--model", model_dir]
    for flag, kw in FLAGS:
        name = flag[2:].replace("-", "_")
        value = getattr(cfg, name)
        if flag in ("--model", "--resume") or value is None:
            continue
        if kw.get("action") is not None:  # booleans
            if name in ("freeze_router", "pin_cores"):
                argv.append(flag if value else "--no-" + flag[2:])
            continue
        argv += [flag, str(value)]
    if not cfg.progress:
        argv.append("--no-progress")
    return argv


def main(args, configs: dict) -> int:
    import shutil

    from ..runner.models import prepare_tiny_model
    from .common import print_table

    out = args.out
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    any_cfg = configs[RUNS[0]]
    model_dir = any_cfg.model
    if model_dir is None:
        print(f"building the tiny {any_cfg.tiny} model and teaching it the task ({any_cfg.sft_steps} supervised "
              "steps) ...", flush=True)
        model_dir = prepare_tiny_model(any_cfg, os.path.join(out, "model"))
    results = {}
    for key in RUNS:
        cfg = configs[key]
        shutil.rmtree(cfg.out, ignore_errors=True)
        print(f"\n== {cfg.kernels} kernels, {cfg.mode} (lag {cfg.lag}) -> {cfg.out}", flush=True)
        cmd = [sys.executable, "-m", "aligned_ops.apps.cli", *_train_argv(cfg, model_dir)]
        proc = subprocess.run(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise SystemExit(f"aligned-ops demo: the {cfg.kernels} {cfg.mode} run failed (exit {proc.returncode}); "
                             f"see its output above and {cfg.out}/logs")
        with open(os.path.join(cfg.out, "summary.json")) as f:
            summary = json.load(f)
        with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
        results[key] = dict(summary=summary, records=records)
    table, headline = demo_table(results, any_cfg)
    print_table(table[0], table[1], table[2])
    print(LEGEND)
    for line in headline:
        print(line)
    png = os.path.join(out, "demo.png")
    plot(results, png, any_cfg)
    with open(os.path.join(out, "demo_summary.json"), "w") as f:
        json.dump({f"{k}_{m}": results[(k, m)]["summary"] for k, m in RUNS}, f, indent=1, sort_keys=True)
    print(f"\nplot: {png}\nruns: {out}/runs/<kernels>_<mode>/ (metrics.jsonl, summary.json)\n"
          f"wall time: {time.time() - t0:.0f} s")
    return 0


LEGEND = (
    "\ncolumns: standard = stock vLLM rollouts + stock Hugging Face trainer; aligned = vLLM with the aligned_ops plugin "
    "+ the patched trainer; async = rollouts generated while the learner trains, one weights version behind (k = 1); "
    "sync = they take turns (k = 0).\n"
    "rows: D3 = per step, the mean over the completion tokens of k3 = (ρ-1) - log ρ, ρ = π_trainer/μ_rollout (the "
    "weight lag + any kernel mismatch), summarised over the steps after the learning-rate warm-up; kernel-only rows "
    "compare the trainer at the rollout's own weights with vLLM (kernel mismatch alone); kernel-made routing flips: "
    "(token, layer) pairs whose top-k experts differ between the trainer and vLLM at the rollout's weights; tokens/s: "
    "generated tokens per second of the training loop (engine start-up excluded).")


def _fmt_reward(s):
    return f"{s['reward_first']:.3f} -> {s['reward_last']:.3f}"


def demo_table(results: dict, cfg: RunConfig):
    cols = [f"{k} {m}" for k, m in RUNS]
    S = [results[key]["summary"] for key in RUNS]
    R = [results[key]["records"] for key in RUNS]

    def flips(s):
        return f"{s.get('routing_flips', 0)} ({s.get('steps_with_routing_flip', 0)})" if "routing_flips" in s else "-"

    rows = [
        ("D3 median", [s["d3_median"] for s in S]),
        ("D3 peak", [s["d3_peak"] for s in S]),
        ("D3 peak-to-median", [s["d3_peak_to_median"] for s in S]),
        ("max IS ratio π/μ (any token)", [s["is_ratio_max"] for s in S]),
        ("min IS ratio π/μ (any token)", [s["is_ratio_min"] for s in S]),
        ("kernel-only bitwise equal (min % over steps)", [100 * s["kernel_bitwise_min"] for s in S]),
        ("kernel-only max abs Δlogp (any token)", [s["kernel_abs_diff_max"] for s in S]),
        ("kernel-made events (steps: kernel-only D3 >= 10x its median)", [len(kernel_events(r)) for r in R]),
        ("kernel-made routing flips (steps with one)", [flips(s) for s in S]),
        ("reward, first -> last fifth", [_fmt_reward(s) for s in S]),
        ("tokens/s", [f"{s['tokens_per_s']:.0f}" for s in S]),
        ("step time, median (s)", [s["step_s_median"] for s in S]),
        ("  generation / learner update, median (s)", [f"{s['gen_s_median']:.3g} / {s['train_s_median']:.3g}"
                                                       for s in S]),
        ("  CPU time per step: generation / learner (s)", [_cpu_pair(s) for s in S]),
        ("weight sync per step (ms: send + load)", [f"{1e3 * s['sync_s_mean']:.1f}" for s in S]),
    ]
    title = (f"RL runner demo (tiny Qwen3-MoE, {cfg.dtype}): {cfg.steps} updates, {cfg.prompts}x{cfg.samples} rollouts "
             f"per step of a+b (a < {cfg.a_range}), lr {cfg.lr:g} after a {cfg.lr_warmup}-step warm-up, trains "
             f"{'the head (after the last router)' if cfg.train_scope == 'head' else 'all weights'}, {cfg.loss} "
             f"(untruncated token IS); D3 over steps >= {cfg.summary_from}"
             if cfg.tiny == "moe" and cfg.model is None else
             f"RL runner demo ({cfg.model or 'tiny Qwen2'}, {cfg.dtype}): {cfg.steps} updates, {cfg.prompts}x"
             f"{cfg.samples} rollouts per step, lr {cfg.lr:g}, {cfg.loss}; D3 over steps >= {cfg.summary_from}")
    sa, aa = results[("standard", "async")]["summary"], results[("aligned", "async")]["summary"]
    ss, as_ = results[("standard", "sync")]["summary"], results[("aligned", "sync")]["summary"]
    ratio = sa["d3_peak_to_median"] / aa["d3_peak_to_median"] if aa["d3_peak_to_median"] else float("inf")
    headline = [
        f"D3 peak-to-median (async, lag {aa['max_lag']}): standard {sa['d3_peak_to_median']:.3g}, aligned "
        f"{aa['d3_peak_to_median']:.3g} (standard / aligned = {ratio:.3g}x)",
        f"aligned kernels: kernel-only mismatch 0 and bitwise at every step: "
        f"{'yes' if aa['kernel_bitwise_min'] == 1.0 and as_['kernel_bitwise_min'] == 1.0 else 'NO'}",
        f"throughput async / sync: aligned {aa['tokens_per_s'] / as_['tokens_per_s']:.2f}x, standard "
        f"{sa['tokens_per_s'] / ss['tokens_per_s']:.2f}x in wall time (load average {_loadavg()} at the end; timings "
        "vary with the CPU, its load and --threads); from CPU time per step (what two free cores allow): aligned "
        f"{cpu_speedup(as_, aa):.2f}x, standard {cpu_speedup(ss, sa):.2f}x",
    ]
    return (title, cols, rows), headline


def _cpu_pair(s: dict) -> str:
    if "gen_cpu_s_median" not in s:
        return "-"
    return f"{s['gen_cpu_s_median']:.3g} / {s['learner_cpu_s_median']:.3g}"


def cpu_speedup(sync: dict, asyn: dict) -> float:
    """Async over sync throughput that the two sides' CPU time per step allows with one free core each: a sync step
    costs generation + learner, an async one the larger of the two (its learner also scores at the rollout's
    weights). Load-independent, unlike the wall-time ratio."""
    try:
        return ((sync["gen_cpu_s_median"] + sync["learner_cpu_s_median"])
                / max(asyn["gen_cpu_s_median"], asyn["learner_cpu_s_median"]))
    except KeyError:
        return float("nan")


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def kernel_events(records: list[dict], factor: float = 10.0) -> list[dict]:
    """Steps whose kernel-only D3 (the trainer at the rollout's own weights vs the engine: no lag in it) is at least
    ``factor`` times its median over the run: the kernel-made events marked on the D3 plot."""
    kd = [r["kernel_d3"] for r in records]
    med = statistics.median(kd) if kd else 0.0
    return [r for r in records if med > 0 and r["kernel_d3"] >= factor * med]


def plot(results: dict, path: str, cfg: RunConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"standard": "tab:red", "aligned": "tab:blue"}
    fig, axes = plt.subplots(2, 2, figsize=(15, 9.5))
    (ax_d, ax_k), (ax_t, ax_r) = axes
    positive = [r["d3"] for k in ("standard", "aligned") for r in results[(k, "async")]["records"] if r["d3"] > 0]
    floor = min(positive) / 3 if positive else 1e-9  # a step with D3 exactly 0 (step 0: no lag yet) sits here
    k_floor = 1e-4  # the kernel panel's zero line
    for kernels in ("standard", "aligned"):
        recs = results[(kernels, "async")]["records"]
        s = results[(kernels, "async")]["summary"]
        x = [r["step"] for r in recs]
        ax_d.semilogy(x, [max(r["d3"], floor) for r in recs], color=colors[kernels], lw=1.2,
                      label=f"{kernels}: peak / median = {s['d3_peak_to_median']:.3g}")
        if kernels == "standard":
            ev = kernel_events(recs)
            if ev:
                ax_d.scatter([r["step"] for r in ev], [max(r["d3"], floor) for r in ev], marker="x", s=40,
                             color="black", zorder=3,
                             label=f"kernel-made event: kernel-only D3 >= 10x its median ({len(ev)} steps)")
        ax_k.semilogy(x, [max(r["kernel_abs_diff_max"], k_floor) for r in recs], color=colors[kernels], lw=1.2,
                      label=f"{kernels}" + (" (0 and bitwise at every step; drawn at the bottom)"
                                            if s["kernel_abs_diff_max"] == 0 else ""))
    if cfg.summary_from > 0:
        ax_d.axvspan(-0.5, cfg.summary_from - 0.5, color="0.92", zorder=0,
                     label=f"lr warm-up (steps < {cfg.summary_from}, not in the peak/median)")
    ax_d.set(title="D3 per step, async (lag 1): k3 of the IS ratio π/μ", xlabel="learner step", ylabel="D3")
    ax_k.set(title="kernel-only mismatch: max |Δ log-prob|, trainer vs vLLM at the same weights",
             xlabel="learner step", ylabel="max |Δ log-prob| (nats)")
    lo, hi = ax_d.get_ylim()
    ax_d.set_ylim(floor / 2, hi * 3)
    ax_k.set_ylim(k_floor / 2, max(ax_k.get_ylim()[1], 1.0) * 5)
    # throughput: tokens/s of each run
    names, values, cols = [], [], []
    for kernels in ("standard", "aligned"):
        for mode in ("sync", "async"):
            names.append(f"{kernels}\n{mode}")
            values.append(results[(kernels, mode)]["summary"]["tokens_per_s"])
            cols.append(colors[kernels] if mode == "async" else "lightgray")
    bars = ax_t.bar(names, values, color=cols, edgecolor=[colors[k] for k in ("standard",) * 2 + ("aligned",) * 2])
    for kernels, i in (("standard", 1), ("aligned", 3)):
        ratio = values[i] / values[i - 1] if values[i - 1] else float("nan")
        ax_t.annotate(f"{ratio:.2f}x", (bars[i].get_x() + bars[i].get_width() / 2, values[i]), ha="center",
                      va="bottom", fontsize=11, fontweight="bold")
    ax_t.set(title="throughput: generated tokens/s, sync vs async", ylabel="tokens/s")
    ax_t.set_ylim(0, max(values) * 1.2)
    # reward: moving average over 10 steps, all four runs
    for kernels in ("standard", "aligned"):
        for mode, ls in (("async", "-"), ("sync", "--")):
            recs = results[(kernels, mode)]["records"]
            rw = [r["reward"] for r in recs]
            ma = [statistics.fmean(rw[max(0, i - 9): i + 1]) for i in range(len(rw))]
            ax_r.plot([r["step"] for r in recs], ma, color=colors[kernels], ls=ls, label=f"{kernels} {mode}")
    ax_r.set(title="reward (exact match), mean of the last 10 steps", xlabel="learner step", ylabel="reward")
    ax_d.legend(fontsize=8, loc="lower right")  # below the lag curve: nothing to hide there but the warm-up
    ax_k.legend(fontsize=8, loc="center right")
    ax_r.legend(fontsize=8, loc="lower right")
    fig.suptitle("aligned_ops RL runner: stock vs aligned kernels (tiny Qwen3-MoE, CPU)", fontsize=13)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
