"""``aligned-ops verify``: does the trainer reproduce the rollout engine's log-probs?

For each kernel set (standard = stock vLLM + stock Hugging Face; aligned = vLLM with the aligned_ops plugin +
the patched HF model) a child process:
  1. generates completions with real vLLM for a batch of prompts of very different lengths, with chunked
     prefill on (prompts longer than one scheduler step), and keeps vLLM's log-prob of every sampled token;
  2. scores the same prompt+completion tokens with the trainer (teacher forcing, one padded batch);
  3. reports the mismatch (aligned_ops.diagnostics.mismatch_metrics).
The parent prints both side by side. With aligned kernels every token is bitwise equal.
"""

from __future__ import annotations

import os
import time

from .common import KERNEL_SETS, print_table, run_child, temp_dir
from .trainer import is_moe_model, pad_batch, routing_pair, trainer_logprobs, trainer_model

# Prompt lengths: short and long mixed in one batch, the longest well past one chunked-prefill step.
PROMPT_LENGTHS = (300, 7, 120, 33, 260, 1, 64, 190, 15, 280, 90, 45)
MAX_NUM_BATCHED_TOKENS = 64


def make_prompts(vocab_size: int, n: int, seed: int, eos_id: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        length = PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]
        ids = torch.randint(0, vocab_size, (length,), generator=g)
        ids[ids == eos_id] = (eos_id + 1) % vocab_size
        prompts.append(ids.tolist())
    return prompts


def check_profiles(model):
    """The linear profile (an :mod:`aligned_ops.profiles` object) both sides ran: the one the trainer patch
    resolved for ``model`` and the one the vLLM plugin resolved for the engine it configured in this process
    (none configured here: the trainer's); refuses a mismatch between them."""
    from ..integrations.vllm import installed_profile
    from ..profiles import profile_of

    trainer = profile_of(model)
    engine = installed_profile() or trainer  # None: the plugin ran in another process
    if engine is not trainer:
        raise RuntimeError(f"aligned-ops verify: linear profile mismatch: vLLM plugin {engine.name!r}, trainer "
                           f"{trainer.name!r}; both sides must run one profile")
    return trainer


def child(args) -> dict:
    """One kernel set (``args.kernels``): generate with vLLM, score with the trainer, return the mismatch."""
    import torch

    from .. import profiles
    from ..diagnostics import mismatch_metrics
    from ..integrations import rollout

    aligned = args.kernels == "aligned"
    t0 = time.time()
    llm = rollout.make_llm(args.model, dtype=args.dtype, aligned=aligned, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                           seed=args.seed)
    t_engine = time.time() - t0
    tok = llm.get_tokenizer()
    prompts = make_prompts(len(tok) if len(tok) else 512, args.num_prompts, args.seed, tok.eos_token_id)
    t0 = time.time()
    completions = rollout.generate_with_logprobs(llm, prompts, temperature=args.temperature, max_tokens=args.max_tokens)
    t_gen = time.time() - t0
    sequences = [p + c.token_ids for p, c in zip(prompts, completions)]
    starts = [len(p) for p in prompts]
    model = trainer_model(args.model, args.dtype, aligned)  # the profile: ALIGNED_OPS_LINEAR, set by the parent
    t0 = time.time()
    lp_trainer, comp = trainer_logprobs(model, aligned, sequences, starts, tok.eos_token_id, args.temperature)
    t_train = time.time() - t0
    lp_rollout = torch.zeros_like(lp_trainer)
    for b, (s, c) in enumerate(zip(starts, completions)):
        lp_rollout[b, s : s + len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float32)
    experts = {}
    if is_moe_model(args.model):
        experts = dict(zip(("trainer_experts", "rollout_experts"),
                           routing_pair(llm, model, aligned, sequences, starts, tok.eos_token_id)))
    m = mismatch_metrics(lp_trainer, lp_rollout, comp, **experts)
    profile = check_profiles(model) if aligned else None
    m["linear_profile"] = profile.name if aligned else "stock"
    mc = llm.llm_engine.vllm_config.model_config
    if getattr(mc.hf_text_config, "kv_lora_rank", None):  # an MLA model: the attention form this engine built
        m["mla_form"] = "absorbed" if mc.use_mla else "expanded"
    if aligned and profile is not profiles.DEFAULT:
        # How far this profile's log-probs are from the default (fma) profile's (same tokens, trainer side).
        from ..integrations import hf

        hf.unpatch_model(model)
        hf.patch_model(model, profile=profiles.DEFAULT)  # the same weights, patched to the default profile
        lp_ref, _ = trainer_logprobs(model, aligned, sequences, starts, tok.eos_token_id, args.temperature)
        d = (lp_trainer - lp_ref).abs()[comp.bool()]
        m["vs_default_abs_max"] = float(d.max()) if d.numel() else 0.0
        m["vs_default_abs_mean"] = float(d.mean()) if d.numel() else 0.0
    m.update(engine_start_s=t_engine, generate_s=t_gen, trainer_s=t_train, prompts=len(prompts),
             prompt_lengths=[len(p) for p in prompts])
    return m


def _architecture_env(model_dir: str) -> dict:
    """What the checkpoint's architecture needs in BOTH children (``Architecture.vllm_env``; an MLA architecture,
    DeepSeek-V3: the expanded form, ``ALIGNED_OPS_MLA_FORM=expanded`` and ``VLLM_MLA_DISABLE=1``), so the standard
    column runs stock vLLM on the same attention form as the aligned one (the plugin would set it for the aligned
    child only; vLLM-CPU's stock MLA backend takes only a 576-wide latent row; the trainer patch in the child reads
    the same variable, so it runs the expanded form too)."""
    import json

    from ..models import ARCHITECTURES

    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            names = json.load(f).get("architectures") or []
    except (OSError, ValueError):
        return {}
    env = {}
    for name in names:
        arch = ARCHITECTURES.get(name)
        env.update(arch.vllm_env if arch is not None else {})
        if arch is not None and arch.mla_forms:
            env.update(ALIGNED_OPS_MLA_FORM="expanded", VLLM_MLA_DISABLE="1")
    return env


def main(args) -> int:
    """Parent: build the model if none is given, run both kernel sets, print the table."""
    work = temp_dir("aligned_verify_")
    model = args.model
    if model is None and getattr(args, "moe", False):
        import torch

        from ..models.tiny import build_tiny_moe

        model = build_tiny_moe(os.path.join(work, "tiny-qwen3-moe"), dtype=getattr(torch, args.dtype), seed=args.seed)
        print(f"built a tiny random-weight Qwen3-MoE (8 experts, top-2; {args.dtype}) in {model}", flush=True)
    if model is None:
        import torch

        from ..models.tiny import build_tiny_qwen2

        model = build_tiny_qwen2(os.path.join(work, "tiny-qwen2"), dtype=getattr(torch, args.dtype), seed=args.seed)
        print(f"built a tiny random-weight Qwen2 ({args.dtype}) in {model}", flush=True)
    from .. import profiles

    # Resolved once, here (--linear, else ALIGNED_OPS_LINEAR); both children get it in their environment (the
    # engine and the trainer each resolve it once), never through this process's environment.
    profile = profiles.resolve(getattr(args, "linear", None))
    child_env = {profiles.ENV_VAR: profile.name, **_architecture_env(model)}
    argv = ["verify", "--model", model, "--dtype", args.dtype, "--num-prompts", str(args.num_prompts),
            "--max-tokens", str(args.max_tokens), "--temperature", str(args.temperature), "--seed", str(args.seed)]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    results = {k: run_child(k, argv, os.path.join(work, f"verify_{k}.json"), env=child_env) for k in KERNEL_SETS}
    rows = [
        ("tokens compared", [results[k]["num_tokens"] for k in KERNEL_SETS]),
        ("bitwise equal (%)", [100.0 * results[k]["frac_bitwise_equal"] for k in KERNEL_SETS]),
        ("max abs Δlogp", [results[k]["abs_diff_max"] for k in KERNEL_SETS]),
        ("mean abs Δlogp", [results[k]["abs_diff_mean"] for k in KERNEL_SETS]),
        ("k3 (KL est.)", [results[k]["kl_k3"] for k in KERNEL_SETS]),
        ("peak ratio π/μ", [results[k]["ratio_max"] for k in KERNEL_SETS]),
        ("min ratio π/μ", [results[k]["ratio_min"] for k in KERNEL_SETS]),
        ("linear profile", [results[k].get("linear_profile", "-") for k in KERNEL_SETS]),
    ]
    if "mla_form" in results["aligned"]:  # both columns must run the same attention form (see _architecture_env)
        rows.append(("MLA form", [results[k].get("mla_form", "-") for k in KERNEL_SETS]))
    if "routing_flips" in results["aligned"]:  # MoE: the mechanism, split by routing agreement
        rows += [
            ("routing flips (token·layer)", [results[k]["routing_flips"] for k in KERNEL_SETS]),
            ("tokens with a flip", [results[k]["num_tokens_routing_flipped"] for k in KERNEL_SETS]),
            ("mean abs Δlogp, routing agreed", [results[k]["abs_diff_mean_routing_agreed"] for k in KERNEL_SETS]),
            ("max abs Δlogp, routing agreed", [results[k]["abs_diff_max_routing_agreed"] for k in KERNEL_SETS]),
            ("mean abs Δlogp, routing flipped", [results[k]["abs_diff_mean_routing_flipped"] for k in KERNEL_SETS]),
            ("max abs Δlogp, routing flipped", [results[k]["abs_diff_max_routing_flipped"] for k in KERNEL_SETS]),
        ]
    if "vs_default_abs_max" in results["aligned"]:
        vs = f"{profile.name} vs {profiles.DEFAULT.name}"
        rows += [
            (f"max abs Δlogp {vs}", ["-", results["aligned"]["vs_default_abs_max"]]),
            (f"mean abs Δlogp {vs}", ["-", results["aligned"]["vs_default_abs_mean"]]),
        ]
    print_table(
        f"vLLM rollout vs trainer, {args.dtype}, {args.num_prompts} prompts of lengths "
        f"{results['aligned']['prompt_lengths']}, chunked prefill ({MAX_NUM_BATCHED_TOKENS} tokens/step), "
        f"aligned linear profile {profile.name}",
        list(KERNEL_SETS), rows)
    ok = results["aligned"]["frac_bitwise_equal"] == 1.0
    print("\naligned kernels: every sampled token's log-prob is bitwise equal" if ok else
          "\nALIGNED KERNELS MISMATCH: this is a bug, please report it")
    return 0 if ok else 1
