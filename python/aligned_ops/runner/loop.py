"""The RL loop: the learner consumes rollout batches in order, updates, and syncs weights after every step.

Schedule (k = the maximum staleness, ``--max-lag``; k = 0 is synchronous RL): batch b is generated with weights
version max(0, b - k) and consumed by learner step b, which produces version b + 1 and broadcasts it at once. With
k >= 1 a worker generates batch b + 1 (version b + 1 - k) while the learner trains on batch b: rollout and training
overlap; with k = 0 each side waits for the other.

Exactly-once accounting: step s consumes batch s and nothing else; ``metrics.jsonl`` gets step s's record before
the checkpoint that moves the queue position past s is written (atomically), and a resumed run cuts the file back
to the checkpoint's offset before it starts. Batches are pure functions of (seed, b) and the weights version, so a
step redone after a kill consumes the same rollouts it would have consumed.
"""

from __future__ import annotations

import json
import os
import queue as queue_mod
import time

from .config import RunConfig
from .metrics import MetricsLog, read_records, scalars, summarize
from .trainer import sparse_moe_layers


class RolloutQueue:
    """Finished batches keyed by batch index; the learner takes them in order. Checks the staleness bound."""

    def __init__(self, inbox, lag: int, poll):
        self.inbox, self.lag, self.poll = inbox, lag, poll
        self.pending: dict[int, dict] = {}
        self.ready: dict[int, dict] = {}

    def get(self, step: int) -> dict:
        while step not in self.pending:
            try:
                msg = self.inbox.get(timeout=5.0)
            except queue_mod.Empty:
                self.poll()  # raises if a worker died
                continue
            except Exception as e:  # ray.util.queue.Empty is not queue.Empty
                if type(e).__name__ == "Empty":
                    self.poll()
                    continue
                raise
            self._handle(msg)
        batch = self.pending.pop(step)
        staleness = step - batch["version"]
        if not (0 <= staleness <= self.lag) or batch["version"] != max(0, step - self.lag):
            raise RuntimeError(f"rollout queue: batch {step} was generated with version {batch['version']}, "
                               f"outside the staleness bound {self.lag}")
        return batch

    def wait_ready(self, workers: int) -> dict:
        while len(self.ready) < workers:
            try:
                msg = self.inbox.get(timeout=5.0)
            except queue_mod.Empty:
                self.poll()
                continue
            except Exception as e:
                if type(e).__name__ == "Empty":
                    self.poll()
                    continue
                raise
            self._handle(msg)
        return self.ready

    def _handle(self, msg) -> None:
        kind = msg[0]
        if kind == "batch":
            if msg[1] in self.pending:
                raise RuntimeError(f"rollout queue: batch {msg[1]} arrived twice")
            self.pending[msg[1]] = msg[2]
        elif kind == "ready":
            self.ready[msg[1]] = msg[2]
        elif kind == "error":
            raise RuntimeError(f"rollout worker {msg[1]} failed:\n{msg[2]}")
        else:
            raise RuntimeError(f"rollout queue: unknown message {kind!r}")


def _save_checkpoint(path: str, state: dict) -> None:
    import torch

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def check_engine_profiles(ready: dict, profile) -> None:
    """Every rollout engine runs the learner's linear profile (aligned kernels): a worker whose engine was
    configured with another one (or none: the plugin did not run) would make every log-prob differ."""
    for w, info in sorted(ready.items()):
        got = info.get("linear_profile")
        if got != profile.name:
            raise RuntimeError(f"aligned-ops train: rollout worker {w}'s vLLM engine runs linear profile {got!r}, "
                               f"the learner {profile.name!r}; both sides must run one profile (is the aligned_ops "
                               "vLLM plugin installed in the worker's environment?)")
        # a profile whose CPU bits are a per-process unit's (mma: amx_bf16 or avx512_bf16, by kernel level)
        mine, theirs = profile.cpu_unit(), info.get("cpu_unit")
        if theirs != mine:
            raise RuntimeError(f"aligned-ops train: rollout worker {w} runs the {profile.name} profile on CPU unit "
                               f"{theirs!r}, the learner on {mine!r}; the two units give different bits (set one "
                               "ALIGNED_CPU_ISA for both, e.g. avx512)")


def default_cores(workers: int) -> list | None:
    """One core per process (learner first, then each rollout worker) when there are enough; else None."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return None
    if len(cores) < workers + 1:
        return None
    return cores[: workers + 1]


def learner_main(cfg: RunConfig, model_dir: str, launcher, callbacks=(), host: str = "127.0.0.1") -> dict:
    """Run (or resume) the RL loop in this process; ``launcher`` starts the rollout workers (plain processes or
    Ray actors) and gives their inbox. Returns the summary (also written to ``cfg.out``/summary.json)."""
    import torch

    from .learner import Learner
    from .sync import SyncGroup, WeightLayout
    from .worker import pin_process

    out = cfg.out
    os.makedirs(out, exist_ok=True)
    ckpt_path = os.path.join(out, "checkpoint", "state.pt")
    cores = launcher.cores
    pin_process([cores[0]] if cores else None, cfg.threads)
    torch.manual_seed(cfg.seed)

    learner = Learner(cfg, model_dir)
    history: dict[int, dict] = {0: learner.policy.weights()}
    start, offset = 0, None
    if cfg.resume:
        # checked up front (config.check_checkpoint_file); weights_only: a crafted file that passes that check still
        # runs no code here (the checkpoint holds tensors, dicts, lists, numbers and strings only)
        state = torch.load(ckpt_path, weights_only=True)
        if state["step"] >= cfg.steps:  # (the CLI refuses this up front; a caller of learner_main may not)
            raise ValueError(f"--resume: the checkpoint is at step {state['step']}, the run has --steps {cfg.steps}: "
                             "nothing to do")
        learner.policy.load_state(state["policy"])
        history = state["history"]
        start, offset = state["step"], state["metrics_offset"]
        torch.set_rng_state(state["rng"])
    if not cfg.resume:  # the run's settings, which a --resume must repeat (RunConfig._check_resume_matches)
        os.makedirs(os.path.dirname(ckpt_path), exist_ok=True)
        with open(os.path.join(os.path.dirname(ckpt_path), "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=1, sort_keys=True)
    log = MetricsLog(os.path.join(out, "metrics.jsonl"))
    log.open(offset)

    layout = WeightLayout.of(history[max(history)])
    store, port = SyncGroup.host_store(host, cfg.rollout_workers + 1)
    sync_info = dict(host=host, port=port, world_size=cfg.rollout_workers + 1, layout=layout.to_list())
    tok = _tokenizer(model_dir)
    pad_id = tok.eos_token_id
    ok = False
    try:
        launcher.start(cfg, model_dir, start, sync_info, len(sparse_moe_layers(model_dir)))
        group = SyncGroup(host, port, 0, cfg.rollout_workers + 1, store=store)
        q = RolloutQueue(launcher.inbox, cfg.lag, launcher.poll)
        for v in range(max(0, start - cfg.lag), start + 1):  # every version a remaining batch needs
            group.send(v, layout.pack(history[v]))
        ready = q.wait_ready(cfg.rollout_workers)
        startup_s = max(r["startup_s"] for r in ready.values())
        if learner.aligned:
            check_engine_profiles(ready, learner.profile)

        bar = None
        if cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=start, desc=f"{cfg.kernels} {cfg.mode}", unit="step",
                       dynamic_ncols=True)
        t_prev, c_prev = time.time(), time.process_time()
        for s in range(start, cfg.steps):
            t0 = time.time()
            batch = q.get(s)
            batch["step"] = s
            t1 = time.time()
            ctx = learner.update(batch, pad_id)
            t2 = time.time()
            history[s + 1] = learner.policy.weights()
            if s + 1 < cfg.steps:
                group.send(s + 1, layout.pack(history[s + 1]))
            t3 = time.time()
            rec = learner.diagnostics(batch, ctx, history.__getitem__, pad_id)
            for v in [v for v in history if v < max(0, s + 1 - cfg.lag)]:
                del history[v]
            t4 = time.time()
            rec.update(step=s, version=batch["version"], staleness=s - batch["version"], worker=batch["worker"],
                       num_rollouts=len(batch["completions"]), gen_tokens=batch["gen_tokens"],
                       wait_s=t1 - t0, train_s=t2 - t1, sync_send_s=t3 - t2, diag_s=t4 - t3,
                       gen_s=batch["gen_s"], sync_load_s=batch["load_s"], sync_s=(t3 - t2) + batch["load_s"],
                       sync_bytes=layout.nbytes, rollout_wait_s=batch["wait_s"])
            ckpt = (s + 1) % cfg.checkpoint_every == 0 or s + 1 == cfg.steps
            rec["step_s"] = time.time() - t_prev  # this step's share of the loop's wall time
            rec["learner_cpu_s"] = time.process_time() - c_prev  # CPU the learner used for it (waiting uses none)
            rec["gen_cpu_s"] = batch.get("gen_cpu_s", float("nan"))
            rec["tokens_per_s"] = rec["gen_tokens"] / rec["step_s"] if rec["step_s"] > 0 else float("nan")
            end = log.append(rec)
            if ckpt:
                _save_checkpoint(ckpt_path, dict(step=s + 1, metrics_offset=end, policy=learner.policy.state(),
                                                 history=history, rng=torch.get_rng_state(),
                                                 cfg=json.loads(json.dumps(cfg.to_dict(), default=str))))
            t_prev, c_prev = time.time(), time.process_time()
            for cb in callbacks:
                cb(s, scalars(rec))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{rec['reward']:.2f}", D3=f"{rec['d3']:.2e}",
                                kΔ=f"{rec['kernel_abs_diff_max']:.1e}", lag=rec["staleness"],
                                tok_s=f"{rec['tokens_per_s']:.0f}")
        if bar is not None:
            bar.close()
        group.send_stop()
        ok = True
    finally:
        log.close()
        launcher.close(abort=not ok)
    records = read_records(os.path.join(out, "metrics.jsonl"))
    summary = summarize(records, cfg, dict(startup_s=startup_s, **cfg.extra))
    summary["steps_in_file"] = [r["step"] for r in records] == list(range(len(records)))
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
    return summary


def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class ProcessLauncher:
    """Rollout workers as plain processes (spawn), one core each when there are enough cores."""

    def __init__(self, cfg: RunConfig):
        import multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        self.inbox = self.ctx.Queue()
        self.procs, self.logs = [], []
        pin = cfg.pin_cores if cfg.pin_cores is not None else True
        self.cores = default_cores(cfg.rollout_workers) if pin else None

    def start(self, cfg: RunConfig, model_dir: str, start: int, sync_info: dict, moe_layers: int) -> None:
        from .worker import rollout_worker_main, worker_env

        self.log_dir = os.path.join(cfg.out, "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        env_backup = dict(os.environ)
        os.environ.update(worker_env(cfg.kernels, cfg.linear))  # spawn copies the environment at start
        try:
            for w in range(cfg.rollout_workers):
                spec = dict(cfg=cfg.to_dict(), model_dir=model_dir, worker=w, workers=cfg.rollout_workers,
                            start=start, steps=cfg.steps, sync=sync_info, moe_layers=moe_layers,
                            cores=[self.cores[1 + w]] if self.cores else None,
                            log=os.path.join(self.log_dir, f"rollout_worker_{w}.log"))
                p = self.ctx.Process(target=rollout_worker_main, args=(spec, self.inbox), daemon=True,
                                     name=f"rollout-worker-{w}")
                p.start()
                self.procs.append(p)
                self.logs.append(spec["log"])
            with open(os.path.join(self.log_dir, "pids.json"), "w") as f:  # who to look for after a kill
                json.dump({"learner": os.getpid(), "rollout_workers": [p.pid for p in self.procs]}, f)
        finally:
            os.environ.clear()
            os.environ.update(env_backup)

    def poll(self) -> None:
        """Raise if a worker is gone before the learner stopped it (a clean exit too: it owed batches)."""
        for p, log in zip(self.procs, self.logs):
            if not p.is_alive():
                raise RuntimeError(f"{p.name} exited with status {p.exitcode} before the run ended; the end of "
                                   f"its log ({log}):\n{_tail(log)}")

    def close(self, abort: bool = False) -> None:
        """After the stop message the workers exit by themselves; on an error they are killed at once."""
        for p in self.procs:
            p.join(timeout=0 if abort else 60)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
