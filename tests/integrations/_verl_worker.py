"""Run in the verl venv (verl 0.9.1 + transformers 5.10.4 over the main torch) by test_verl.py:
``python _verl_worker.py ROLLOUTS.json OUT.json``.

Loads the aligned_ops verl plugin through verl's own entry-point discovery (``import verl``; a dist-info on sys.path
declares the ``verl.plugins`` entry point as the wheel's pyproject does), builds the actor with verl's real
``FSDPEngineWithLMHead._build_module`` (verl's apply_monkey_patch, then our build-time hook), and computes the
rollouts' log-probs with verl's real ``forward_step`` / ``prepare_model_inputs`` / ``prepare_model_outputs``
(remove-padding with cu_seqlens, the static pad segment, the padded path) and ``forward_backward_batch`` (training).
FSDP wrapping and Ray need GPUs: the engine is built without them (a CPU stand-in for verl's platform, a 1-rank gloo
group). Writes, per case, the response log-probs' int32 bits and the count equal to the vLLM plugin's saved bits.
"""

import json
import logging
import os
import subprocess
import sys
import tempfile
import types
from inspect import signature

import torch


def _entry_point_dir():
    d = tempfile.mkdtemp(prefix="verl_ep_")
    info = os.path.join(d, "aligned_ops_verl_entry-0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: aligned-ops-verl-entry\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:  # what pyproject.toml declares
        f.write("[verl.plugins]\naligned_ops = aligned_ops.integrations.verl\n")
    return d


def main(rollouts_path, out_path):
    data = json.load(open(rollouts_path))
    sys.path.insert(0, _entry_point_dir())
    records = []
    logging.getLogger("aligned_ops.integrations.verl").addHandler(_Capture(records))

    import verl  # loads the verl.plugins entry points: our module, which installs its hook (ALIGNED_OPS_VERL=1)

    loaded_by_verl = "aligned_ops.integrations.verl" in sys.modules
    from aligned_ops.integrations import verl as plugin

    out = {"loaded_by_verl": loaded_by_verl, "installed_on_import": plugin.is_installed(),
           "verl": verl.__version__}

    import transformers
    from tensordict import TensorDict  # noqa: F401
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import set_platform
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    out["transformers"] = transformers.__version__

    class CPUPlatform(PlatformBase):  # verl's engine asks its platform for the device; this machine has no GPU
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = types.SimpleNamespace()

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def empty_cache(self):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

    CPUPlatform.__abstractmethods__ = frozenset()  # the rest (CUDA/Ray/profiler hooks) is never reached here
    set_platform(CPUPlatform())
    torch.distributed.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0,
                                         world_size=1)

    model_dir, T = data["model_dir"], data["temperature"]
    prompts, completions = data["prompt_token_ids"], data["token_ids"]
    want = torch.tensor([b for seq in data["logprob_bits"] for b in seq], dtype=torch.int32)

    def engine(fused=True, rmpad=True, pad_to_length=False, **model_overrides):
        eng = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
        cfg = transformers.AutoConfig.from_pretrained(model_dir)
        eng.model_config = types.SimpleNamespace(
            hf_config=cfg, local_path=model_dir, trust_remote_code=False, model_type="language_model",
            use_liger=False, fused_kernel_options={"impl_backend": "torch"}, use_fused_kernels=fused,
            enable_gradient_checkpointing=False, lora_rank=0)
        for k, v in model_overrides.items():
            setattr(eng.model_config, k, v)
        eng.engine_config = types.SimpleNamespace(
            model_dtype=data["dtype"], forward_only=False, ulysses_sequence_parallel_size=1,
            entropy_from_logits_with_chunking=False, entropy_checkpointing=False)
        eng.use_remove_padding, eng.ulysses_sequence_parallel_size, eng.use_ulysses_sp = rmpad, 1, False
        eng.ulysses_device_mesh = eng.device_mesh = None
        eng.pad_to_length, eng.pad_to_length_bucket, eng._is_lora = pad_to_length, 64, False
        from verl.utils import torch_functional as verl_F

        eng.compute_entropy_from_logits = verl_F.entropy_from_logits
        module = eng._build_module()  # verl's: from_pretrained, apply_monkey_patch, ... (and our hook)
        # verl's _build_model_optimizer, verbatim: a forward that takes cu_seqlens gets the packed boundaries
        eng.pass_packed_cu_seqlens = "cu_seqlens" in signature(module.forward).parameters
        eng.module, eng._autocast_dtype = module, torch.bfloat16  # verl's default autocast: our forward ignores it
        return eng

    def batch(rmpad, fused):
        ids = [torch.tensor(p + c, dtype=torch.long) for p, c in zip(prompts, completions)]
        nested = torch.nested.as_nested_tensor(ids, layout=torch.jagged)
        pos = torch.nested.as_nested_tensor([torch.arange(len(i)) for i in ids], layout=torch.jagged)
        mask = torch.nested.as_nested_tensor([torch.tensor([0] * len(p) + [1] * len(c), dtype=torch.float32)
                                              for p, c in zip(prompts, completions)], layout=torch.jagged)
        return tu.get_tensordict({"input_ids": nested, "position_ids": pos, "loss_mask": mask},
                                 {"temperature": T, "use_remove_padding": rmpad, "use_fused_kernels": fused,
                                  "calculate_entropy": True, "pad_mode": DatasetPadMode.NO_PADDING})

    def responses(nested):  # row i scores token i+1: the completion's tokens are rows len(p)-1 .. len(p)+len(c)-2
        rows = nested.unbind()
        return torch.cat([r[len(p) - 1:len(p) + len(c) - 1] for r, p, c in zip(rows, prompts, completions)])

    def case(name, eng, rmpad=True, fused=True):
        with torch.no_grad():
            _, res = eng.forward_step(batch(rmpad, fused), loss_function=None, forward_only=True)
        lp = responses(res["model_output"]["log_probs"]).float().contiguous()
        ent = responses(res["model_output"]["entropy"]).float()
        got = lp.view(torch.int32)
        out[name] = {"equal": int((got == want).sum()), "total": want.numel(), "max_abs_diff":
                     float((lp - want.view(torch.float32)).abs().max()),
                     "entropy_finite_positive": bool(torch.isfinite(ent).all() and (ent > 0).all()),
                     "pass_packed_cu_seqlens": bool(getattr(eng, "pass_packed_cu_seqlens", False))}
        return eng

    # 1. aligned, verl's remove-padding path (cu_seqlens), its static pad segment, its padded path
    eng = case("aligned_rmpad", engine())
    out["active_lines"] = [r for r in records if "verl plugin active" in r]
    case("aligned_rmpad_static_pad", engine(pad_to_length=True))
    case("aligned_padded", engine(rmpad=False), rmpad=False)

    # 2. training: verl's forward_backward_batch with a loss over the log-probs; gradients reach the weights
    def loss_fn(model_output, data, dp_group=None):
        lp = model_output["log_probs"].values()
        return -lp.sum(), {}

    eng.module.zero_grad(set_to_none=True)
    train = batch(True, True)
    tu.assign_non_tensor(train, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)  # one micro-batch per sequence
    eng.forward_backward_batch(train, loss_fn, forward_only=False)
    grads = [p.grad for p in eng.module.parameters() if p.requires_grad]
    out["train_grads"] = {"with_grad": sum(g is not None for g in grads), "params": len(grads),
                          "finite_nonzero": bool(all(g is not None and torch.isfinite(g).all() for g in grads)
                                                 and any(g.abs().sum() > 0 for g in grads if g is not None))}

    # 3. refusals, by name, at build time
    refusals = {}
    for key, overrides, eng_over in (("liger_and_sp", {"use_liger": True}, {"ulysses_sequence_parallel_size": 2}),
                                     ("unfused", {"use_fused_kernels": False}, {})):
        try:
            e = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
            e.model_config = types.SimpleNamespace(model_type="language_model", use_liger=False,
                                                   use_fused_kernels=True, lora_rank=0)
            for k, v in overrides.items():
                setattr(e.model_config, k, v)
            e.engine_config = types.SimpleNamespace(**{"ulysses_sequence_parallel_size": 1, **eng_over})
            plugin.check_engine(e)
            refusals[key] = None
        except ValueError as err:
            refusals[key] = str(err)
    from verl.workers.engine.base import EngineRegistry

    try:  # an engine the plugin does not patch is refused where verl picks it
        EngineRegistry.new("language_model", "megatron", None)
        refusals["megatron"] = None
    except ValueError as err:
        refusals["megatron"] = str(err)
    out["refusals"] = refusals

    # 4. negative controls: verl's own numerics
    plugin.uninstall()
    # 4a. no plugin: verl's fused torch backend (FusedLinearForPPO) on the stock HF model
    case("stock_fused", engine())
    # 4b. aligned logits, verl's own bf16 division + log-softmax (use_fused_kernels=False on a patch_model model)
    from aligned_ops.integrations.hf import patch_model

    e = engine(fused=False)
    patch_model(e.module)
    e.pass_packed_cu_seqlens = False  # (its forward refuses verl's cu_seqlens_cpu; packed rows split at restarts)
    case("aligned_logits_verl_logsoftmax", e, fused=False)

    # 5. the shipped config file composes on verl's ppo_trainer and verl's dataclasses accept it
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    with initialize_config_dir(config_dir=os.path.dirname(plugin.config_path()), version_base=None):
        cfg = compose(config_name=plugin.CONFIG_NAME)
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    omega_conf_to_dataclass(cfg.algorithm)  # verl's AlgoConfig accepts the section
    rc = omega_conf_to_dataclass(cfg.algorithm.rollout_correction, RolloutCorrectionConfig)
    out["config"] = {
        "rollout_correction": {k: getattr(rc, k) for k in ("bypass_mode", "loss_type", "rollout_is",
                                                            "rollout_is_threshold", "rollout_rs",
                                                            "rollout_is_batch_normalize")},
        "use_fused_kernels": cfg.actor_rollout_ref.model.use_fused_kernels,
        "actor_use_fused_kernels": cfg.actor_rollout_ref.actor.use_fused_kernels,
        "calculate_log_probs": cfg.actor_rollout_ref.rollout.calculate_log_probs,
        "logprobs_mode": cfg.actor_rollout_ref.rollout.logprobs_mode,
        "top_k": cfg.actor_rollout_ref.rollout.top_k, "top_p": cfg.actor_rollout_ref.rollout.top_p,
        "ulysses": cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size,
        "ref_ulysses": cfg.actor_rollout_ref.ref.ulysses_sequence_parallel_size,
        "env_vars": OmegaConf.to_container(cfg.ray_kwargs.ray_init.runtime_env.env_vars),
        "ray_runtime_env": plugin.ray_runtime_env(profile="fma"),
    }
    # 6. verl's real actor loss under the shipped config (the loss verl's trainer runs: get_policy_loss_fn of
    # actor.policy_loss.loss_mode on the actor's dataclass): rollout log-probs mu (the vLLM bits) as old log-probs
    # (bypass mode), log pi = mu except one token with log pi - log mu = 3, advantage 1. Gradient weight per token
    # = -dL/dlog pi * N (token-mean): REINFORCE with untruncated token IS gives w = e^3 there and exactly 1 elsewhere;
    # verl's stock ppo_trainer (vanilla PPO-clip +-0.2) gives 0 there (clipped) -- the negative control.
    import verl as verl_pkg
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    def loss_weights(config_dir, config_name):
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            c = compose(config_name=config_name, overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"])
        actor_cfg = omega_conf_to_dataclass(c.actor_rollout_ref.actor)
        mu = want.view(torch.float32)[None, :].clone()
        n = mu.numel()
        actor_cfg.global_batch_info.update(dp_size=1, batch_num_tokens=n, global_batch_size=1)
        log_pi = (mu + torch.nn.functional.pad(torch.tensor([3.0]), (0, n - 1))).requires_grad_()
        loss, _ = get_policy_loss_fn(actor_cfg.policy_loss.loss_mode)(
            old_log_prob=mu, log_prob=log_pi, advantages=torch.ones_like(mu), response_mask=torch.ones_like(mu),
            loss_agg_mode=actor_cfg.loss_agg_mode, config=actor_cfg, rollout_is_weights=None)
        loss.backward()
        w = (-log_pi.grad * n)[0]
        return {"loss_mode": actor_cfg.policy_loss.loss_mode, "agg": actor_cfg.loss_agg_mode, "n": n,
                "w_shifted": float(w[0]), "rest_min": float(w[1:].min()), "rest_max": float(w[1:].max())}

    out["loss_weights"] = {
        "aligned": loss_weights(os.path.dirname(plugin.config_path()), plugin.CONFIG_NAME),
        "stock_ppo_trainer": loss_weights(os.path.join(os.path.dirname(verl_pkg.__file__), "trainer", "config"),
                                          "ppo_trainer")}
    # 6b. the refusals on verl's own engine config (the actor's FSDPEngineConfig from the composed shipped config):
    # accepted as shipped; fp32 compute (mixed_precision.param_dtype) and QAT refused by name
    def engine_refusal(overrides):
        with initialize_config_dir(config_dir=os.path.dirname(plugin.config_path()), version_base=None):
            c = compose(config_name=plugin.CONFIG_NAME,
                        overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", *overrides])
        e = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
        e.model_config = types.SimpleNamespace(model_type="language_model", use_liger=False, use_fused_kernels=True,
                                               lora_rank=0)
        e.engine_config = omega_conf_to_dataclass(c.actor_rollout_ref.actor).fsdp_config
        try:
            plugin.check_engine(e)
            return None
        except ValueError as err:
            return str(err)

    out["engine_refusals"] = {
        "shipped": engine_refusal([]),
        "fp32": engine_refusal(["+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32"]),
        "qat": engine_refusal(["actor_rollout_ref.actor.fsdp_config.qat.enable=true"])}
    # 6c. the rollout's sampling (actor_rollout_ref.rollout): the hook on verl's ActorRolloutRefWorker.init_model
    # (keeping verl's @register dispatch attribute) refuses top_k / top_p / logprobs_mode the actor does not score,
    # before anything is built; the shipped config passes
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers.engine_workers import ActorRolloutRefWorker

    def rollout_refusal(overrides):
        with initialize_config_dir(config_dir=os.path.dirname(plugin.config_path()), version_base=None):
            c = compose(config_name=plugin.CONFIG_NAME, overrides=list(overrides))
        w = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
        w.config, w.role = c.actor_rollout_ref, "actor_rollout"
        try:
            if overrides:
                ActorRolloutRefWorker.init_model(w)  # refused before it reads anything else
            else:
                plugin.check_rollout(w.config.rollout)  # (the real init_model would go on to build the models)
            return None
        except ValueError as err:
            return str(err)

    plugin.install()  # (uninstalled above for the stock negative controls)
    init_model = ActorRolloutRefWorker.init_model
    out["rollout_refusals"] = {
        "hooked": hasattr(init_model, "_aligned_original"),
        "dispatch_kept": getattr(init_model, MAGIC_ATTR, None) is getattr(init_model._aligned_original, MAGIC_ATTR, 0),
        "shipped": rollout_refusal([]),
        "top_p": rollout_refusal(["actor_rollout_ref.rollout.top_p=0.9"]),
        "top_k": rollout_refusal(["actor_rollout_ref.rollout.top_k=50"]),
        "raw_logits": rollout_refusal(["actor_rollout_ref.rollout.logprobs_mode=raw_logits"])}
    plugin.uninstall()
    out["config"]["actor_policy_loss"] = {
        "loss_mode": cfg.actor_rollout_ref.actor.policy_loss.loss_mode,
        "rollout_correction": OmegaConf.to_container(cfg.actor_rollout_ref.actor.policy_loss.rollout_correction,
                                                     resolve=True)}
    # 7. VERL_USE_EXTERNAL_MODULES (what ray_runtime_env / the shipped config set): `import verl` imports the plugin
    # without a try. A fresh process whose install fails (the FSDP engine module made unimportable) must fail on
    # `import verl`; the same process with the module intact installs (control); entry-point discovery off in both.
    probe = ("import sys\nif sys.argv[1] == 'break':\n    sys.modules['verl.workers.engine.fsdp.transformer_impl'] = None\n"
             "import verl\nfrom aligned_ops.integrations import verl as p\nprint('INSTALLED', p.is_installed())\n")
    env = {**os.environ, **plugin.ray_runtime_env(profile="fma", extra_env={"VERL_USE_EXTERNAL_MODULES": ""})["env_vars"],
           "VERL_USE_EXTERNAL_PLUGINS": "none"}
    runs = {mode: subprocess.run([sys.executable, "-c", probe, mode], env=env, capture_output=True, text=True,
                                 timeout=300) for mode in ("intact", "break")}
    out["external_modules"] = {
        "value": env["VERL_USE_EXTERNAL_MODULES"],
        "intact": {"rc": runs["intact"].returncode, "stdout": runs["intact"].stdout[-500:],
                   "stderr": runs["intact"].stderr[-1500:]},
        "break": {"rc": runs["break"].returncode, "stdout": runs["break"].stdout[-500:],
                  "stderr": runs["break"].stderr[-3000:]}}
    json.dump(out, open(out_path, "w"), indent=1)


class _Capture(logging.Handler):
    def __init__(self, records):
        super().__init__()
        self.records = records

    def emit(self, record):
        self.records.append(record.getMessage())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
