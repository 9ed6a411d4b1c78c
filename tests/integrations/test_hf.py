"""Trainer side: the patched HF model is batch/padding/packing invariant, bitwise; gradients; torch.compile."""

import copy

import pytest
import torch

from aligned_ops.integrations.hf import completion_logprobs, patch_model, unpatch_model
from aligned_ops.testing import assert_bitwise_equal, bitwise_equal
from aligned_ops.testing.rollouts import padded_batch, random_sequences


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    d = tiny_checkpoint("qwen2", request.param, seed=3)
    return patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=request.param))


def _seqs(lens, seed=0):
    return random_sequences(lens, seed)


def _lp_single(model, s, start):
    cm = torch.zeros(1, len(s), dtype=torch.long)
    cm[0, start:] = 1
    with torch.no_grad():
        return completion_logprobs(model, s[None], cm, temperature=0.9)[0, start:]


def reference_logprobs_f64(model, s, start, temperature):
    """Plain float64 forward of the unpatched HF model (accuracy reference)."""
    m64 = unpatch_model(copy.deepcopy(model)).to(torch.float64)
    with torch.no_grad():
        logits = m64(s[None]).logits[0]
    lp = torch.log_softmax(logits / temperature, -1)[start - 1 : len(s) - 1].gather(-1, s[start:, None])[:, 0]
    return lp


LENS = [5, 33, 1 + 64, 7, 90, 2, 47]


def test_padding_packing_batch_invariance(model):
    seqs = _seqs(LENS)
    starts = [max(1, n // 2) for n in LENS]
    single = [_lp_single(model, s, st) for s, st in zip(seqs, starts)]
    # right padding, left padding, packed, reversed order, sub-batch
    S = max(LENS)
    for left in (False, True):
        ids, am, cm, _ = padded_batch(seqs, starts, S + 3, left=left)
        with torch.no_grad():
            lp = completion_logprobs(model, ids, cm, attention_mask=am, temperature=0.9)
        for i, (s, st) in enumerate(zip(seqs, starts)):
            off = ids.shape[1] - len(s) if left else 0
            assert_bitwise_equal(lp[i, off + st : off + len(s)], single[i])
    order = [4, 0, 6, 2]
    packed = torch.cat([seqs[i] for i in order])
    cu = torch.tensor([0] + [len(seqs[i]) for i in order]).cumsum(0).to(torch.int32)
    cm = torch.zeros_like(packed)
    for j, i in enumerate(order):
        cm[int(cu[j]) + starts[i] : int(cu[j + 1])] = 1
    with torch.no_grad():
        lp = completion_logprobs(model, packed, cm, cu_seqlens=cu, temperature=0.9)
    for j, i in enumerate(order):
        assert_bitwise_equal(lp[int(cu[j]) + starts[i] : int(cu[j + 1])], single[i])


def test_negative_control_stock_hf_is_padding_variant(model):
    """The same check on the unpatched HF model (SDPA, native matmuls) finds a difference."""
    m = unpatch_model(model)
    try:
        found = False
        for seed in range(4):
            seqs = _seqs([90, 7, 64, 3, 120, 33, 17, 8], seed)
            S = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), S, dtype=torch.long)
            am = torch.zeros_like(ids)
            for i, s in enumerate(seqs):
                ids[i, : len(s)] = s
                am[i, : len(s)] = 1
            with torch.no_grad():
                batch = m(ids, attention_mask=am).logits
                for i, s in enumerate(seqs):
                    alone = m(s[None]).logits[0]
                    if not bitwise_equal(alone, batch[i, : len(s)]):
                        found = True
            if found:
                break
        assert found, "stock HF forward was batch-invariant on every case tried; the control cannot fail"
    finally:
        patch_model(m)


def test_accuracy_vs_float64(model):
    s = _seqs([40], 5)[0]
    lp = _lp_single(model, s, 10).double()
    ref = reference_logprobs_f64(model, s, 10, 0.9)
    tol = 1e-4 if next(model.parameters()).dtype == torch.float32 else 0.25
    assert (lp - ref).abs().max().item() < tol


def test_gradients_flow_and_are_deterministic(model):
    s = _seqs([30, 12], 7)
    packed = torch.cat(s)
    cu = torch.tensor([0, 30, 42], dtype=torch.int32)
    cm = torch.ones_like(packed)
    cm[0] = 0
    cm[30] = 0
    grads = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        lp = completion_logprobs(model, packed, cm, cu_seqlens=cu)
        (-lp.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    names = {n for n, _ in model.named_parameters()}
    assert set(grads[0]) == names  # every parameter (incl. tied embedding / norms / biases) gets a gradient
    for n in names:
        assert torch.isfinite(grads[0][n].float()).all()
        assert_bitwise_equal(grads[0][n], grads[1][n], n)
    assert any(g.abs().sum() > 0 for g in grads[0].values())
    model.zero_grad(set_to_none=True)


def test_torch_compile_matches_eager(model):
    s = _seqs([21, 9], 11)
    ids = torch.zeros(2, 21, dtype=torch.long)
    am = torch.zeros_like(ids)
    ids[0] = s[0]
    am[0] = 1
    ids[1, :9] = s[1]
    am[1, :9] = 1
    with torch.no_grad():
        eager = model(ids, attention_mask=am).logits
        compiled = torch.compile(model, backend="inductor")(ids, attention_mask=am).logits
    assert_bitwise_equal(eager, compiled)


def test_bad_inputs(model):
    ids = torch.randint(0, 500, (2, 6))
    with pytest.raises(ValueError, match="one contiguous run of tokens per row"):
        model(ids, attention_mask=torch.tensor([[1, 0, 1, 1, 1, 1], [1] * 6]))
    with pytest.raises(ValueError, match="marks the first token of a sequence"):
        completion_logprobs(model, ids, torch.ones_like(ids))
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D, start at 0"):
        completion_logprobs(model, ids.reshape(-1), torch.zeros(12, dtype=torch.long), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="past_key_values is not supported"):
        model(ids, past_key_values=object())


def test_unsupported_models_refused():
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
        m.config.architectures = ["GPT2LMHeadModel"]
        patch_model(m)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64, architectures=["Qwen2ForCausalLM"])
    m = Qwen2ForCausalLM(cfg).to(torch.float64)
    with pytest.raises(ValueError, match="unsupported parameter dtype"):
        patch_model(m)
    with pytest.raises(ValueError, match="call aligned_ops.integrations.hf.patch_model"):
        completion_logprobs(Qwen2ForCausalLM(cfg), torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3))
    m = Qwen2ForCausalLM(cfg)
    m.model.layers[0].self_attn.scaling = 0.25  # not head_dim ** -0.5: a model the rules do not describe
    with pytest.raises(ValueError, match=r"attention scale 0.25 is not head_dim \*\* -0.5"):
        patch_model(m)


def test_fused_lm_head_refusal_names_the_profile_and_its_source(model, monkeypatch):
    """The profile is resolved once, by patch_model, from the architecture's pin, the profile= argument or
    ALIGNED_OPS_LINEAR, and the refusal names where it came from. The variable changed after patching does not
    reach the model (negative control: the fma model still runs its fused head)."""
    from dataclasses import replace

    from aligned_ops import model_spec, profiles
    from aligned_ops.integrations.hf import unpatch_model

    s = _seqs([9], 3)[0]
    cm = torch.ones_like(s)
    cm[0] = 0

    def repatched(**kw):
        return patch_model(unpatch_model(copy.deepcopy(model)), **kw)

    assert profiles.profile_of(model) is profiles.FMA
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "exact")
    completion_logprobs(model, s[None], cm[None], fused_lm_head=True)  # resolved at patch time: still fma
    exact = repatched()
    assert profiles.profile_of(exact) is profiles.EXACT
    with pytest.raises(ValueError, match=r"runs the 'exact' profile \(from ALIGNED_OPS_LINEAR\)"):
        completion_logprobs(exact, s[None], cm[None], fused_lm_head=True)
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "fma")
    with pytest.raises(ValueError, match=r"runs the 'exact' profile \(from patch_model\(profile=\)\)"):
        completion_logprobs(repatched(profile="exact"), s[None], cm[None], fused_lm_head=True)
    arch = model._aligned_arch
    monkeypatch.setitem(model_spec.RULES, arch, replace(model_spec.RULES[arch], linear_profile="exact"))
    with pytest.raises(ValueError, match=r"runs the 'exact' profile \(from the model's model_spec.RULES entry"):
        completion_logprobs(repatched(), s[None], cm[None], fused_lm_head=True)


def test_repatching_with_another_profile_or_a_lora_layer_is_refused():
    """patch_model is idempotent for the same profile and refuses a different one (it would keep the old one
    silently); a PEFT/LoRA layer, whose adapter the aligned forward would skip, is refused by name."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from aligned_ops import profiles

    cfg = Qwen2Config(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64, architectures=["Qwen2ForCausalLM"])
    m = patch_model(Qwen2ForCausalLM(cfg), profile="fma")
    assert patch_model(m) is m and patch_model(m, profile=profiles.FMA) is m  # same profile: nothing changes
    with pytest.raises(ValueError, match=r"profile='exact', but the model is already patched with profile 'fma'; "
                                         r"call unpatch_model\(model\) first"):
        patch_model(m, profile="exact")
    assert profiles.profile_of(m) is profiles.FMA
    assert profiles.profile_of(patch_model(unpatch_model(m), profile="exact")) is profiles.EXACT

    class LoraLinear(torch.nn.Linear):  # what PEFT's wrapper looks like to the patch (peft is not installed)
        def __init__(self, base):
            super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
            self.lora_A = torch.nn.ModuleDict()

    m = Qwen2ForCausalLM(cfg)
    m.model.layers[0].self_attn.q_proj = LoraLinear(m.model.layers[0].self_attn.q_proj)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj is a PEFT/LoRA adapter layer "
                                         r"\(LoraLinear\).*merge_and_unload"):
        patch_model(m)
    assert not getattr(m, "_aligned_patched", False)



def test_a_saved_patched_model_loads_patched_with_the_same_bits(model):
    """torch.save / torch.load of a patched model: its forwards were bound methods, pickled as
    ``getattr(layer, "_layer_forward")``, so the saved file did not load (AttributeError: 'Qwen2DecoderLayer' object
    has no attribute '_layer_forward'). Loaded, every forward is bound to the loaded module (not the saved one, not
    HF's), the log-probs are the same bits, the profile is the registry's object and the signature is HF's view."""
    import inspect
    import io

    from aligned_ops import profiles

    s = _seqs([17], 5)[0]
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.forward.__self__ is loaded and loaded.model.forward.__self__ is loaded.model
    assert all(layer.forward.__self__ is layer for layer in loaded.model.layers)
    assert loaded.forward.__func__ is model.forward.__func__
    assert profiles.profile_of(loaded) is profiles.profile_of(model) and patch_model(loaded) is loaded
    assert_bitwise_equal(_lp_single(loaded, s, 5), _lp_single(model, s, 5))
    params = inspect.signature(loaded.forward).parameters
    assert "self" not in params and {"input_ids", "completion_mask"} <= set(params)
    # a bound method's other attributes are its function's (a reader of forward.__name__ keeps working)
    assert loaded.forward.__name__ == "_model_forward"
    assert loaded.model.layers[0].forward.__name__ == "_layer_forward"
    copied = copy.deepcopy(model)
    assert copied.forward.__self__ is copied and copied.model.layers[0].forward.__self__ is copied.model.layers[0]
    unpatch_model(loaded)  # HF's forwards come back
    assert "forward" not in loaded.__dict__ and "forward" not in loaded.model.layers[0].__dict__

# ---- issue 8: valid batches the helper refused, inputs it ignored silently -------------------------------------


def _padded(seqs, starts, width):
    return padded_batch(seqs, starts, width)[:3]  # a None sequence is an all-padding row


def test_all_padding_rows_and_empty_sequences_score_zero_and_keep_bits(model):
    # Was: "completion_mask marks the first token of a sequence" for an all-padding row after a scored row
    # (and for an empty packed sequence), and a reshape error for an all-padding batch.
    seqs = _seqs([9, 14], 21)
    single = [_lp_single(model, s, 4) for s in seqs]
    ids, am, cm = _padded([seqs[0], None, seqs[1], None], [4, 0, 4, 0], 16)
    with torch.no_grad():
        lp = completion_logprobs(model, ids, cm, attention_mask=am, temperature=0.9)
    assert_bitwise_equal(lp[0, 4:9], single[0])
    assert_bitwise_equal(lp[2, 4:14], single[1])
    assert_bitwise_equal(lp[[1, 3]], torch.zeros(2, 16))
    # packed: empty sequences in the middle and at the end
    packed = torch.cat(seqs)
    cu = torch.tensor([0, 9, 9, 23, 23], dtype=torch.int32)
    pcm = torch.zeros_like(packed)
    pcm[4:9] = 1
    pcm[13:23] = 1
    with torch.no_grad():
        lp = completion_logprobs(model, packed, pcm, cu_seqlens=cu, temperature=0.9)
    assert_bitwise_equal(lp[4:9], single[0])
    assert_bitwise_equal(lp[13:23], single[1])
    # an all-padding batch: zeros of the input's shape, and still a graph to call backward() on
    ids, am, cm = _padded([None, None], [0, 0], 5)
    lp = completion_logprobs(model, ids, cm, attention_mask=am)
    assert_bitwise_equal(lp, torch.zeros(2, 5))
    lp.sum().backward()
    model.zero_grad(set_to_none=True)


def test_completion_mask_on_padding_is_refused(model):
    # Was: silently returned 0 for the padding token the mask asked for.
    seqs = _seqs([6, 4], 22)
    ids, am, cm = _padded(seqs, [2, 2], 6)
    cm[1, 5] = 1  # row 1 has 4 tokens: position 5 is padding
    with pytest.raises(ValueError, match="completion_mask marks padding tokens"):
        completion_logprobs(model, ids, cm, attention_mask=am)


@pytest.mark.parametrize("bad", [-0.5, -1e-7, float("nan"), float("inf"), 2.5, torch.tensor([1.0, -2.0]),
                                 torch.tensor([0.5, 2.01])])
def test_bad_temperature_is_refused(model, bad):
    # Was: a negative temperature was scored at 1 (treated as greedy); > 2 (vLLM >= 0.24 refuses it) was scored.
    ids, am, cm = _padded(_seqs([6, 4], 23), [2, 2], 6)
    with pytest.raises(ValueError, match="^completion_logprobs: temperature must be (a finite number|non-negative|"
                                         "in \\[0, 2\\])"):
        completion_logprobs(model, ids, cm, attention_mask=am, temperature=bad)


def test_small_temperatures_are_scored_where_vllm_samples(model):
    """Issue 21.1: vLLM raises 0 < T < 0.01 to 0.01 (SamplingParams) and samples there; the trainer scored
    1e-6 at 1.0 and 0.005 at 0.005. Now both at 0.01, floats and per-sequence tensors."""
    ids, am, cm = _padded(_seqs([7, 5, 6], 25), [2, 2, 3], 7)
    with torch.no_grad():
        at = {t: completion_logprobs(model, ids, cm, attention_mask=am, temperature=t)
              for t in (1e-6, 1e-300, 0.005, 0.0099999, 0.01, 1.0, 0.5)}
        per_seq = completion_logprobs(model, ids, cm, attention_mask=am,
                                      temperature=torch.tensor([0.0, 1e-6, 0.5], dtype=torch.float64))
    for t in (1e-6, 1e-300, 0.005, 0.0099999):
        assert_bitwise_equal(at[t], at[0.01])
    assert not bitwise_equal(at[0.01], at[1.0])  # negative control: the old rule scored 1e-6 at 1.0
    assert_bitwise_equal(per_seq[0], at[1.0][0])
    assert_bitwise_equal(per_seq[1], at[0.01][1])
    assert_bitwise_equal(per_seq[2], at[0.5][2])


@pytest.mark.parametrize("kw, message", [
    (dict(top_p=0.0), "top_p must be in \\(0, 1\\]"), (dict(top_p=1.5), "top_p must be in"),
    (dict(top_p=float("nan")), "top_p must be in"), (dict(top_p=torch.tensor([0.9, -0.1])), "top_p must be in"),
    (dict(min_p=-0.1), "min_p must be in \\[0, 1\\]"), (dict(min_p=1.5), "min_p must be in"),
    (dict(min_p=float("nan")), "min_p must be in"), (dict(top_k=-2), "top_k must be 0 or -1 \\(disable\\)"),
    (dict(top_k=2.5), "top_k must be an integer"), (dict(top_k=torch.tensor([3.0, 4.0])), "top_k must be an integer"),
    (dict(top_k=torch.tensor([3, -5])), "top_k must be 0 or -1"),
])
def test_bad_sampling_options_are_refused_by_name(model, kw, message):
    """Issue 21.4: NaN / out-of-range options were silently "off" or all -inf, a fractional top_k truncated."""
    ids, am, cm = _padded(_seqs([6, 4], 26), [2, 2], 6)
    with pytest.raises(ValueError, match="^completion_logprobs: " + message):
        completion_logprobs(model, ids, cm, attention_mask=am, **kw)


def test_sampling_options_off_values_and_greedy_rows(model):
    """top_k -1 is off (as vLLM takes it) like 0; a greedy sequence (T = 0) is scored untruncated, as vLLM resets
    its top_k / top_p / min_p; a sampled one in the same batch keeps its truncation."""
    ids, am, cm = _padded(_seqs([7, 6], 27), [2, 2], 7)
    with torch.no_grad():
        full = completion_logprobs(model, ids, cm, attention_mask=am, temperature=torch.tensor([0.0, 0.8]))
        off_k = completion_logprobs(model, ids, cm, attention_mask=am, temperature=torch.tensor([0.0, 0.8]), top_k=-1)
        trunc = completion_logprobs(model, ids, cm, attention_mask=am, temperature=torch.tensor([0.0, 0.8]), top_k=1,
                                    top_p=0.5, min_p=0.2)
    assert_bitwise_equal(off_k, full)
    assert_bitwise_equal(trunc[0], full[0])  # greedy row: untruncated
    assert not bitwise_equal(trunc[1], full[1])  # negative control: the sampled row is truncated


@pytest.mark.parametrize("bad_id", [512, 10**6, -1])
def test_out_of_vocabulary_id_is_refused_by_name(model, bad_id):
    ids, am, cm = _padded(_seqs([6, 4], 28), [2, 2], 6)
    ids[0, 3] = bad_id
    with pytest.raises(ValueError, match="input_ids must lie in \\[0, 512\\) \\(the embedding's rows\\), got ids in"):
        completion_logprobs(model, ids, cm, attention_mask=am)
    with pytest.raises(ValueError, match="input_ids must lie in \\[0, 512\\)"):
        model(ids, attention_mask=am)


@pytest.mark.parametrize("bad", [float("nan"), 0.5, 2.0, -1.0])
def test_completion_and_attention_masks_must_be_zero_one(model, bad):
    """Issue 21.9: a NaN in completion_mask counted as selected (.bool()); 0/1 float masks still work."""
    ids, am, cm = _padded(_seqs([6, 5], 29), [2, 2], 6)
    with torch.no_grad():
        ref = completion_logprobs(model, ids, cm.bool(), attention_mask=am)
        assert_bitwise_equal(completion_logprobs(model, ids, cm.float(), attention_mask=am.float()), ref)
    cmf = cm.float()
    cmf[1, 5] = bad
    with pytest.raises(ValueError, match="completion_mask must hold only 0 and 1 \\(or be bool\\), got"):
        completion_logprobs(model, ids, cmf, attention_mask=am)
    amf = am.float()
    amf[0, 0] = bad
    with pytest.raises(ValueError, match="attention_mask must hold only 0 and 1"):
        completion_logprobs(model, ids, cm, attention_mask=amf)


def test_greedy_temperature_is_scored_at_one(model):
    ids, am, cm = _padded(_seqs([6, 4], 24), [2, 2], 6)
    with torch.no_grad():
        a = completion_logprobs(model, ids, cm, attention_mask=am, temperature=0.0)
        b = completion_logprobs(model, ids, cm, attention_mask=am, temperature=1.0)
    assert_bitwise_equal(a, b)


def test_position_ids_are_used_with_cu_seqlens(model):
    # Was: ignored when cu_seqlens was given (then: shifted positions ran as given, a sequence from position 5 with
    # no keys before it — a continuation the engine never scores; now refused by name).
    seqs = _seqs([8, 6], 25)
    packed = torch.cat(seqs)
    cu = torch.tensor([0, 8, 14], dtype=torch.int32)
    cm = torch.ones_like(packed)
    cm[0] = cm[8] = 0
    default = torch.cat([torch.arange(8), torch.arange(6)])
    with torch.no_grad():
        base = completion_logprobs(model, packed, cm, cu_seqlens=cu)
        same = model(packed, cu_seqlens=cu, position_ids=default, completion_mask=cm).logprobs
        with pytest.raises(ValueError, match="position_ids: sequence 0 starts at position 5, not 0"):
            model(packed, cu_seqlens=cu, position_ids=default + 5, completion_mask=cm)
        with pytest.raises(ValueError, match="position_ids restart at 0 inside a sequence of cu_seqlens"):
            model(packed, cu_seqlens=cu, position_ids=torch.cat([torch.arange(4), torch.arange(10)]),
                  completion_mask=cm)
    assert_bitwise_equal(same, base)
    with pytest.raises(ValueError, match="position_ids must have one entry per token"):
        model(packed, cu_seqlens=cu, position_ids=default[:5], completion_mask=cm)


def test_patch_model_recognises_the_class_when_config_names_none():
    # Was: "unsupported architecture 'Qwen2Config'" for a Qwen2 built in memory (config.architectures None).
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64)
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(cfg)
    assert m.config.architectures is None
    patch_model(m)
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        lp = completion_logprobs(m, ids, torch.tensor([[0, 1, 1, 1, 1, 1, 1]]))
    assert torch.isfinite(lp).all() and (lp[0, 1:] < 0).all()
    g = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert g.config.architectures is None
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        patch_model(g)


def test_fused_lm_head_option_is_bitwise_the_unfused_path(model):
    # completion_logprobs(fused_lm_head=...): log-probs and every parameter gradient (the tied / untied LM head
    # weight included) bit for bit those of the unfused LM head, with chunks that divide neither T nor V.
    s = _seqs([30, 12], 9)
    packed = torch.cat(s)
    cu = torch.tensor([0, 30, 42], dtype=torch.int32)
    cm = torch.ones_like(packed)
    cm[0] = 0
    cm[30] = 0
    temps = torch.tensor([0.7, 1.3])
    runs = []
    for fused in (False, {"token_chunk": 7, "vocab_chunk": 37}, True):
        model.zero_grad(set_to_none=True)
        lp = completion_logprobs(model, packed, cm, cu_seqlens=cu, temperature=temps, fused_lm_head=fused)
        (lp * torch.linspace(-1, 2, lp.numel())).sum().backward()
        runs.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    model.zero_grad(set_to_none=True)
    for lp, grads in runs[1:]:
        assert_bitwise_equal(lp, runs[0][0], "logprobs")
        assert set(grads) == set(runs[0][1])
        for n, g in grads.items():
            assert_bitwise_equal(g, runs[0][1][n], n)
    with pytest.raises(ValueError, match="fused_lm_head does not score truncated"):
        completion_logprobs(model, packed, cm, cu_seqlens=cu, top_p=0.9, fused_lm_head=True)
    with pytest.raises(ValueError, match="fused_lm_head keys"):
        completion_logprobs(model, packed, cm, cu_seqlens=cu, fused_lm_head={"chunk": 3})


def test_fused_lm_head_auto_is_the_default_and_changes_no_bit(model, monkeypatch):
    """Issue 21.7: fused_lm_head="auto" (the default) fuses when the [tokens, vocab] logits would be large
    (lm_head.FUSED_AUTO_MIN_LOGITS_BYTES, lowered here so a tiny model crosses it) and the scoring is eligible;
    truncated scoring and the exact profile stay unfused (no error); every variant gives the same bits."""
    from aligned_ops.ops import lm_head

    ids, am, cm = _padded(_seqs([9, 6], 30), [2, 2], 9)
    calls = []
    real = lm_head.fused_token_logprobs  # what the fma profile's fused head runs (aligned_ops.profiles)
    monkeypatch.setattr(lm_head, "fused_token_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    exact = patch_model(unpatch_model(copy.deepcopy(model)), profile="exact")
    with torch.no_grad():
        unfused = completion_logprobs(model, ids, cm, attention_mask=am, fused_lm_head=False)
        small = completion_logprobs(model, ids, cm, attention_mask=am)  # default: auto, below the threshold
        assert not calls
        monkeypatch.setattr(lm_head, "FUSED_AUTO_MIN_LOGITS_BYTES", 1)
        auto = completion_logprobs(model, ids, cm, attention_mask=am)
        assert calls  # fused
        calls.clear()
        truncated = completion_logprobs(model, ids, cm, attention_mask=am, top_k=5)
        assert not calls  # auto never fuses truncated scoring (and does not refuse it)
        exact_auto = completion_logprobs(exact, ids, cm, attention_mask=am)
        assert not calls  # nor a profile without a fused LM head (exact)
        assert_bitwise_equal(exact_auto, completion_logprobs(exact, ids, cm, attention_mask=am, fused_lm_head=False))
    assert_bitwise_equal(small, unfused)
    assert_bitwise_equal(auto, unfused)
    assert not bitwise_equal(truncated, unfused)  # negative control: truncation really changed the scoring
