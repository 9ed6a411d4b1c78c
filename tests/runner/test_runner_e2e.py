"""`aligned-ops train` end to end on tiny models, real vLLM (one rollout worker process, one learner process).

- aligned kernels, async: every rollout log-prob equals the trainer's at the rollout's weights bit for bit at
  every step (a dense model with tied embeddings, every weight trained: the embedding must reach the engine), with a
  real one-step lag (D3 > 0, staleness 1 — the negative control that the lag is not silently 0); over the run no
  NaN and the IS ratio stays within what the lag explains (the short form of bench/bench_runner_stability.py, whose
  2,000-update run is where learning, reward up, is checked);
- Ray: 2 rollout-worker actors feed one learner actor (below);
- kill and resume: a run killed with SIGKILL mid-run leaves no rollout engine behind, resumes from its checkpoint
  and ends with exactly the records of an uninterrupted run — every step once, the same rollouts (rewards, token
  counts) and the same numbers bit for bit (aligned kernels, per-request sampling seeds).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

SUMMARY_KEYS = ("updates", "tokens_per_s", "mode", "kernels", "kernel_bitwise_min", "d3_median", "d3_peak",
                "d3_peak_to_median", "is_ratio_max", "reward_first", "reward_last")
# per-step fields that are measurements of time, not of the run's numbers
TIMING = {"step_s", "tokens_per_s", "wait_s", "train_s", "sync_send_s", "diag_s", "gen_s", "sync_load_s", "sync_s",
          "rollout_wait_s", "gen_cpu_s", "learner_cpu_s"}


def train(*argv, timeout=600, wait=True):
    cmd = [sys.executable, "-m", "aligned_ops.apps.cli", "train", "--no-progress", *argv]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(out):
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from aligned_ops.runner import RunConfig
    from aligned_ops.runner.models import prepare_tiny_model

    root = tmp_path_factory.mktemp("models")
    dense = prepare_tiny_model(RunConfig(tiny="dense", hidden=64, layers=1, sft_steps=40, sft_lr=1e-2, a_range=10),
                               str(root / "dense"))
    moe = prepare_tiny_model(RunConfig(tiny="moe", hidden=64, layers=1, sft_steps=20, a_range=100), str(root / "moe"))
    return {"dense": dense, "moe": moe}


COMMON = ["--prompts", "8", "--samples", "4", "--a-range", "100", "--lr-warmup", "0", "--seed", "3"]


def _strip(recs):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in recs]


STEPS = 40
ASYNC = ["--mode", "async", "--max-lag", "1", "--steps", str(STEPS), "--lr", "1e-3", "--checkpoint-every", "1", *COMMON,
         "--a-range", "10"]


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ref") / "run")
    train(*ASYNC, "--model", models["dense"], "--out", out)
    return out


def test_async_aligned_is_bitwise_with_a_real_lag_and_stable(reference):
    s, recs = summary(reference), records(reference)
    assert all(k in s for k in SUMMARY_KEYS), s
    assert (s["mode"], s["kernels"], s["max_lag"], s["updates"], s["staleness_max"]) == ("async", "aligned", 1, STEPS, 1)
    assert [r["staleness"] for r in recs] == [0] + [1] * (STEPS - 1)
    assert s["kernel_bitwise_min"] == 1.0 and s["kernel_abs_diff_max"] == 0.0  # tied embedding included
    assert max(r["d3"] for r in recs[1:]) > 0.0 and s["is_ratio_max"] > 1.0  # the lag is real
    assert s["tokens_per_s"] > 0 and s["sync_bytes"] > 0 and s["sync_s_mean"] > 0
    # untruncated token IS on the lag alone (bitwise kernels: every ratio is the trainer's own ratio between two
    # consecutive versions): finite everywhere and bounded. (Whether the policy learns is not asserted here: over 40
    # steps of 32 rollouts the exact-match reward's step-to-step noise, 0.1-0.5, hides it — after the merge onto the
    # restructured main, a run with the same settings went 0.348 -> 0.355 with correct gradients; learning is
    # checked by bench/bench_runner_stability.py, over 2,000 updates.)
    assert s["nan_steps"] == 0 and 0.2 < s["is_ratio_min"] and s["is_ratio_max"] < 5.0


def test_kill_and_resume_is_exactly_once(models, reference, tmp_path):
    out = str(tmp_path / "killed")
    proc = train(*ASYNC, "--model", models["dense"], "--out", out, wait=False)
    path = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(path) and len(records(out)) >= 10:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed:\n" + proc.stdout.read()[-3000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    done_before = len(records(out))
    assert 10 <= done_before < STEPS
    with open(os.path.join(out, "logs", "pids.json")) as f:
        workers = json.load(f)["rollout_workers"]
    deadline = time.time() + 30  # the rollout engine dies with its learner
    while time.time() < deadline and any(_running(p) for p in workers):
        time.sleep(0.1)
    assert not any(_running(p) for p in workers)

    train(*ASYNC, "--model", models["dense"], "--out", out, "--resume")
    got = records(out)
    assert [r["step"] for r in got] == list(range(STEPS))  # every step once
    assert sum(r["num_rollouts"] for r in got) == STEPS * 32 and summary(out)["rollouts"] == STEPS * 32
    assert _strip(got) == _strip(records(reference))  # the same rollouts and numbers as the uninterrupted run
    with pytest.raises(AssertionError, match="already holds a run"):  # negative control: no silent overwrite
        train(*ASYNC, "--model", models["dense"], "--out", out)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read().lower()
    except OSError:
        return False


def test_ray_two_rollout_workers_feed_one_learner(models, tmp_path):
    # A local Ray head on loopback; the learner and 2 rollout workers are actors, the plugin switch reaches the
    # workers through their runtime_env: with it every log-prob is bitwise the trainer's and no route flips (the
    # routes the engines recorded while generating equal the trainer's); without it (the standard test above) not.
    pytest.importorskip("ray")
    out = str(tmp_path / "ray")
    train("--backend", "ray", "--rollout-workers", "2", "--mode", "async", "--max-lag", "2", "--model", models["moe"],
          "--steps", "4", "--lr", "1e-4", "--out", out, *COMMON)
    s, recs = summary(out), records(out)
    assert (s["backend"], s["rollout_workers"], s["updates"]) == ("ray", 2, 4)
    assert sorted({r["worker"] for r in recs}) == [0, 1]  # both workers fed the learner
    assert [r["staleness"] for r in recs] == [0, 1, 2, 2]
    assert s["kernel_bitwise_min"] == 1.0 and s["routing_flips"] == 0 and s["lag_routing_flips"] == 0
