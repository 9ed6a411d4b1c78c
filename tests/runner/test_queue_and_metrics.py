"""The learner's side of the bookkeeping, without engines: the rollout queue hands out batches in step order whatever
order they arrive in and refuses a batch outside the staleness bound or one that arrives twice; metrics.jsonl is cut
back to a checkpoint's offset on resume (a step redone after a kill is counted once); the summary's numbers follow
from the records; batches and sampling seeds are pure functions of (seed, batch index)."""

import json
import math
import queue
import re

import pytest


from aligned_ops.runner import RunConfig, scalars, summarize
from aligned_ops.runner.loop import RolloutQueue
from aligned_ops.runner.metrics import MetricsLog, read_records
from aligned_ops.runner.task import AdditionTask
from aligned_ops.runner.worker import request_seed


def batch(step, version):
    return ("batch", step, {"step": step, "version": version})


def make_queue(messages, lag, polls=None):
    q = queue.Queue()
    for m in messages:
        q.put(m)
    polls = [] if polls is None else polls

    def poll():
        polls.append(1)
        if len(polls) > 1:
            raise RuntimeError("worker died")

    rq = RolloutQueue(q, lag, poll)
    rq.inbox.get = lambda timeout=None, _g=q.get: _g(timeout=0.01)  # keep the empty-queue poll fast
    return rq


def test_batches_come_out_in_step_order():
    rq = make_queue([batch(2, 1), batch(0, 0), ("ready", 0, {"startup_s": 1.0}), batch(1, 0)], lag=1)
    assert [rq.get(s)["step"] for s in (0, 1, 2)] == [0, 1, 2]
    assert rq.ready == {0: {"startup_s": 1.0}}


def test_staleness_bound_and_duplicates_are_refused():
    with pytest.raises(RuntimeError, match="batch 3 was generated with version 1, outside the staleness bound 1"):
        make_queue([batch(3, 1)], lag=1).get(3)
    with pytest.raises(RuntimeError, match="batch 2 was generated with version 2"):
        make_queue([batch(2, 2)], lag=1).get(2)  # fresher than the schedule: not what step 2 must consume
    make_queue([batch(3, 2)], lag=1).get(3)  # positive control: exactly the bound
    with pytest.raises(RuntimeError, match="batch 0 arrived twice"):
        make_queue([batch(0, 0), batch(0, 0), batch(1, 0)], lag=1).get(1)


def test_worker_errors_and_deaths_reach_the_learner():
    with pytest.raises(RuntimeError, match="rollout worker 1 failed:\nTraceback: boom"):
        make_queue([("error", 1, "Traceback: boom")], lag=0).get(0)
    with pytest.raises(RuntimeError, match="worker died"):
        make_queue([], lag=0).get(0)  # nothing arrives: poll() is asked, and raises the second time


def rec(step, **kw):
    r = dict(step=step, reward=0.0, d3=1e-5, is_ratio_max=1.01, is_ratio_min=0.99, loss=0.1, grad_norm=1.0,
             kernel_bitwise_frac=1.0, kernel_abs_diff_max=0.0, kernel_d3=0.0, gen_tokens=100, num_rollouts=8,
             step_s=0.5, gen_s=0.2, train_s=0.2, wait_s=0.0, sync_s=0.01, sync_send_s=0.004, sync_load_s=0.006,
             staleness=1)
    r.update(kw)
    return r


def test_metrics_log_is_cut_back_to_the_checkpoint_on_resume(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    log = MetricsLog(path)
    log.open(None)
    log.append(rec(0))
    at_checkpoint = log.append(rec(1))
    log.append(rec(2))  # written, then the process was killed before the next checkpoint
    log.close()
    assert [r["step"] for r in read_records(path)] == [0, 1, 2]
    resumed = MetricsLog(path)
    resumed.open(at_checkpoint)  # resume from the checkpoint taken after step 1
    resumed.append(rec(2, reward=0.5))
    resumed.close()
    records = read_records(path)
    assert [r["step"] for r in records] == [0, 1, 2] and records[2]["reward"] == 0.5
    fresh = MetricsLog(path)  # a new run (no checkpoint) starts the file over
    fresh.open(None)
    fresh.close()
    assert read_records(path) == []


def test_summary_follows_from_the_records():
    cfg = RunConfig(mode="async", kernels="aligned", steps=10, lr_warmup=2)
    records = [rec(s, reward=s / 10, d3=(100.0 if s == 1 else 1.0 + (s == 7)), kernel_bitwise_frac=1.0 - (s == 5) * 0.25,
                   is_ratio_max=1.0 + s / 100) for s in range(10)]
    s = summarize(records, cfg)
    assert s["updates"] == 10 and s["rollouts"] == 80 and s["gen_tokens"] == 1000
    assert s["tokens_per_s"] == pytest.approx(1000 / 5.0)
    # D3 over steps >= --lr-warmup (2): the warm-up spike at step 1 is outside the window, step 7's 2.0 is the peak
    assert (s["d3_from"], s["d3_steps"], s["d3_peak"], s["d3_peak_step"], s["d3_median"]) == (2, 8, 2.0, 7, 1.0)
    assert s["d3_peak_to_median"] == 2.0 and s["d3_peak_to_median_all_steps"] == 100.0
    assert s["kernel_bitwise_min"] == 0.75 and s["is_ratio_max"] == pytest.approx(1.09)
    assert s["reward_first"] == pytest.approx(0.05) and s["reward_last"] == pytest.approx(0.85)  # fifths: 2 steps
    assert s["nan_steps"] == 0 and s["mode"] == "async" and s["max_lag"] == 1
    records[4]["loss"] = float("nan")
    records[4]["d3"] = float("nan")
    bad = summarize(records, cfg)
    assert bad["nan_steps"] == 1 and math.isnan(bad["d3_peak"]) and math.isnan(bad["d3_peak_to_median"])
    json.dumps(bad)  # NaN is still writable


def test_scalars_are_logger_ready():
    out = scalars(rec(3, routing_flips=2))
    assert out["mismatch/d3"] == 1e-5 and out["kernel/bitwise_frac"] == 1.0 and out["kernel/routing_flips"] == 2.0
    assert out["async/staleness"] == 1.0 and all(isinstance(v, float) for v in out.values())
    assert "step" not in out


class Tok:
    eos_token_id, unk_token_id = 0, None

    def convert_tokens_to_ids(self, c):
        return 1 + "0123456789+=".index(c)


def test_batches_and_seeds_are_functions_of_seed_and_index():
    task = AdditionTask(Tok(), a_range=1000)
    a = task.batch(0, 5, 8, 4)
    assert a == task.batch(0, 5, 8, 4)
    assert a != task.batch(0, 6, 8, 4) and a != task.batch(1, 5, 8, 4)
    prompts, answers = a
    assert len(prompts) == 32 and all(prompts[4 * i] == prompts[4 * i + j] for i in range(8) for j in range(4))
    seeds = {request_seed(s, b, i) for s in range(3) for b in range(50) for i in range(64)}
    assert len(seeds) == 3 * 50 * 64 and all(0 <= x < 2**32 for x in seeds)
    assert request_seed(0, 1, 2) == request_seed(0, 1, 2)



def test_resume_refuses_other_settings(tmp_path):
    from aligned_ops.runner import ConfigError

    out = tmp_path / "run"
    (out / "checkpoint").mkdir(parents=True)
    from _tiny_checkpoints import runner_checkpoint_bytes

    (out / "checkpoint" / "state.pt").write_bytes(runner_checkpoint_bytes(step=1))  # validate reads it whole
    saved = RunConfig(out=str(out), lr=1e-4, tiny="dense").validate(check_out=False)
    (out / "checkpoint" / "config.json").write_text(json.dumps(saved.to_dict()))
    (out / "metrics.jsonl").write_text("")
    RunConfig(out=str(out), lr=1e-4, tiny="dense", resume=True, steps=500).validate()  # more steps: fine
    with pytest.raises(ConfigError, match=r"--resume with other settings than the run in --out: --lr 0.001 \(the run has 0.0001\)"):
        RunConfig(out=str(out), lr=1e-3, tiny="dense", resume=True).validate()
    with pytest.raises(ConfigError, match="already holds a run"):  # and no resume: no overwrite
        RunConfig(out=str(out), lr=1e-4, tiny="dense").validate()


def test_resume_without_a_defaulted_flag_continues_with_the_runs_value(tmp_path):
    # a run with --max-lag 3 (or a MoE run with --train-scope all --no-freeze-router) resumed without that flag
    # passed the settings check (None: "not given") and then ran at the default: lag 1, head-only, frozen router
    import json

    from _tiny_checkpoints import runner_checkpoint_bytes

    from aligned_ops.runner import ConfigError

    def run_folder(name, **flags):
        out = tmp_path / name
        (out / "checkpoint").mkdir(parents=True)
        (out / "checkpoint" / "state.pt").write_bytes(runner_checkpoint_bytes(step=3))
        saved = RunConfig(out=str(out), tiny="moe", **flags).validate(check_out=False)
        (out / "checkpoint" / "config.json").write_text(json.dumps(saved.to_dict()))
        (out / "metrics.jsonl").write_text("")
        return str(out)

    out = run_folder("explicit", max_lag=3, train_scope="all", freeze_router=False, d3_from=5)
    cfg = RunConfig(out=out, tiny="moe", resume=True).validate()
    assert (cfg.lag, cfg.train_scope, cfg.freeze_router, cfg.d3_from) == (3, "all", False, 5)
    # controls: a flag given with another value is still refused; a run that took the defaults resumes at them
    with pytest.raises(ConfigError, match=r"--max-lag 2 \(the run has 3\)"):
        RunConfig(out=out, tiny="moe", resume=True, max_lag=2).validate()
    with pytest.raises(ConfigError, match="--d3-from 5 must be < --steps 5"):  # the run's --d3-from, checked
        RunConfig(out=out, tiny="moe", resume=True, steps=5).validate()
    cfg = RunConfig(out=run_folder("defaults"), tiny="moe", resume=True).validate()
    assert (cfg.lag, cfg.train_scope, cfg.freeze_router, cfg.d3_from) == (1, "head", True, None)


def test_both_sides_get_one_linear_profile_by_name():
    from aligned_ops import profiles
    from aligned_ops.runner.loop import check_engine_profiles
    from aligned_ops.runner.worker import worker_env

    cfg = RunConfig(out="unused", linear="exact", kernels="aligned").validate(check_out=False)
    assert cfg.linear == "exact" and cfg.linear_profile() is profiles.EXACT
    env = worker_env(cfg.kernels, cfg.linear)
    assert env[profiles.ENV_VAR] == "exact" and env["ALIGNED_OPS_VLLM"] == "1"
    assert profiles.ENV_VAR not in worker_env("standard")
    check_engine_profiles({0: {"linear_profile": "exact"}, 1: {"linear_profile": "exact"}}, profiles.EXACT)
    # negative controls: an engine on another profile, or one the plugin never configured, stops the run
    with pytest.raises(RuntimeError, match="rollout worker 1's vLLM engine runs linear profile 'fma', the learner "
                                           "'exact'"):
        check_engine_profiles({0: {"linear_profile": "exact"}, 1: {"linear_profile": "fma"}}, profiles.EXACT)
    with pytest.raises(RuntimeError, match="runs linear profile None"):
        check_engine_profiles({0: {"linear_profile": None}}, profiles.FMA)


def test_an_mma_worker_on_another_cpu_unit_stops_the_run():
    """The mma profile's CPU bits are its unit's (amx_bf16 or avx512_bf16, chosen per process by the kernel level):
    a worker whose unit differs from the learner's would disagree on every log-prob."""
    import aligned_ops
    from aligned_ops import profiles
    from aligned_ops.runner.loop import check_engine_profiles

    mine = aligned_ops.mma_unit()
    assert profiles.MMA.cpu_unit() == mine and profiles.FMA.cpu_unit() is None and profiles.EXACT.cpu_unit() is None
    check_engine_profiles({0: {"linear_profile": "mma", "cpu_unit": mine}}, profiles.MMA)
    other = "avx512_bf16" if mine == "amx_bf16" else "amx_bf16"
    # (mine is None on a CPU without a bf16 unit, e.g. AVX2-only: the message says None)
    with pytest.raises(RuntimeError, match=re.escape(f"rollout worker 0 runs the mma profile on CPU unit '{other}', "
                                                     f"the learner on {mine!r}")):
        check_engine_profiles({0: {"linear_profile": "mma", "cpu_unit": other}}, profiles.MMA)
