"""The patched model as an HF drop-in where frameworks touch it: the backbone call ``model.model(...)``, outputs
that index like dicts, ``labels=`` (HF's causal-LM loss on the aligned logits), per-token entropy, and packed
rows marked only by ``position_ids`` restarts (split into sequences, never one). Bits through integer views
against each sequence run alone; each check with a control that shows it can fail."""

import copy

import pytest
import torch

import aligned_ops
from aligned_ops.integrations.hf import _entropy, completion_logprobs, patch_model
from aligned_ops.models import rules_of
from aligned_ops.profiles import profile_of
from aligned_ops.testing import assert_bitwise_equal, bits, bitwise_equal
from aligned_ops.testing.rollouts import padded_batch, random_sequences


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    d = tiny_checkpoint("qwen2", request.param, seed=3)
    return patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=request.param))


LENS = [9, 33, 5, 20]
STARTS = [4, 10, 2, 7]


def _alone(model, s, **kw):
    with torch.no_grad():
        return model(s[None], **kw)


# ---- model.model(...) -------------------------------------------------------------------------------------


def test_backbone_call_takes_hf_keywords_and_gives_each_sequence_its_own_bits(model):
    # Was: TypeError: _layer_forward() got an unexpected keyword argument 'attention_mask' (TRL's fused LM head
    # calls the backbone with HF's keywords).
    seqs = random_sequences(LENS, 1)
    ids, am, _, off = padded_batch(seqs, STARTS, max(LENS) + 2, left=True)
    with torch.no_grad():
        h = model.model(input_ids=ids, attention_mask=am, use_cache=False, return_dict=True).last_hidden_state
        full_logits = model(ids, attention_mask=am).logits
    assert h.shape == (*ids.shape, model.config.hidden_size) and h.dtype == model.dtype
    assert bitwise_equal(h[am == 0], torch.zeros_like(h[am == 0]))
    head = model.lm_head
    for i, s in enumerate(seqs):
        with torch.no_grad():
            alone = model.model(s[None]).last_hidden_state[0]
        assert_bitwise_equal(h[i, off[i]:off[i] + len(s)], alone)
        # the LM head on the backbone's output is the causal LM's logits, bit for bit
        with torch.no_grad():
            logits = rules_of(model).head_logits(profile_of(model), alone, head.weight, head.bias)
        assert_bitwise_equal(full_logits[i, off[i]:off[i] + len(s)], logits)
    # control: a one-token change in a sequence changes its hidden states
    other = seqs[0].clone()
    other[1] = (other[1] + 1) % 500
    with torch.no_grad():
        changed = model.model(other[None]).last_hidden_state[0]
    assert not bitwise_equal(changed, h[0, off[0]:off[0] + len(seqs[0])])


def test_backbone_refusals(model):
    ids = torch.randint(0, 500, (1, 6))
    with pytest.raises(ValueError, match=r"patched backbone \(model.model\): past_key_values is not supported"):
        model.model(ids, past_key_values=object())
    with pytest.raises(ValueError, match=r"patched backbone \(model.model\): input_ids is required"):
        model.model(inputs_embeds=None)


# ---- outputs index like dicts ------------------------------------------------------------------------------


def test_output_is_a_model_output(model):
    from transformers.utils import ModelOutput

    ids = torch.randint(0, 500, (2, 7))
    out = model(ids)
    assert isinstance(out, ModelOutput)
    assert list(out.keys()) == ["logits"]  # None fields are absent, as in HF
    assert out["logits"] is out.logits and out[0] is out.logits and out.to_tuple() == (out.logits,)
    cm = torch.ones_like(ids)
    cm[:, 0] = 0
    out = model(ids, completion_mask=cm, labels=ids)
    assert list(out.keys()) == ["loss", "logprobs"] and out[0] is out.loss and out["logprobs"] is out.logprobs
    with pytest.raises(KeyError):
        out["logits"]


def test_return_dict_false_returns_hf_s_tuple(model):
    # Was: the ModelOutput whatever return_dict said; `loss, logits = model(..., return_dict=False)` unpacked its
    # keys, the strings "loss" and "logits" (HF's can_return_tuple gives output.to_tuple()).
    ids = torch.randint(0, 500, (2, 7))
    with torch.no_grad():
        ref = model(ids, labels=ids)
        out = model(ids, labels=ids, return_dict=False, use_cache=False)
        loss, logits = out
        (hidden,) = model.model(ids, return_dict=False)
        assert_bitwise_equal(hidden, model.model(ids).last_hidden_state)
    assert type(out) is tuple and len(out) == 2
    assert_bitwise_equal(loss, ref.loss)
    assert_bitwise_equal(logits, ref.logits)
    # control: return_dict=True (and the default) keep the ModelOutput
    assert not isinstance(model(ids, return_dict=True), tuple) and not isinstance(ref, tuple)
    # a config saying return_dict=False, as HF's decorator reads it; completion_logprobs still reads its field
    model.config.return_dict = False
    try:
        with torch.no_grad():
            assert type(model(ids)) is tuple
            cm = torch.ones_like(ids)
            cm[:, 0] = 0
            assert completion_logprobs(model, ids, cm).shape == ids.shape
    finally:
        model.config.return_dict = True


def test_positional_arguments_are_hf_s(model):
    # HF's order (input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels, use_cache); was
    # this library's (cu_seqlens, completion_mask, temperature, ...): model(ids, am, pos, None, None, labels) sent the
    # labels to temperature and returned no loss.
    import inspect

    ids = torch.randint(0, 500, (2, 7))
    am = torch.ones_like(ids)
    with torch.no_grad():
        ref = model(ids, attention_mask=am, labels=ids)
        out = model(ids, am, None, None, None, ids, False)
        (hidden,) = model.model(ids, am, None, None, None, False, return_dict=False)
        assert_bitwise_equal(hidden, model.model(ids, attention_mask=am).last_hidden_state)
    assert_bitwise_equal(out.loss, ref.loss)
    assert_bitwise_equal(out.logits, ref.logits)
    hf = ["input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "labels", "use_cache"]
    params = inspect.signature(model.forward).parameters
    assert [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD] == hf
    # the HF-only positions are refused where set (control: None / False above ran)
    with pytest.raises(ValueError, match="patched model: past_key_values is not supported"):
        model(ids, am, None, object())
    with pytest.raises(ValueError, match=r"patched backbone \(model.model\): use_cache=True is not supported"):
        model.model(ids, am, None, None, None, True)
    # this library's own arguments are keyword-only: a positional one is an error, not another parameter
    with pytest.raises(TypeError):
        model(ids, am, None, None, None, None, False, torch.tensor([0, 7, 14]))


def test_logits_to_keep_is_hf_s(model, tiny_checkpoint):
    # Was: logits_to_keep went into **unused and the full [B, S, V] logits came back where HF returns [B, k, V].
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen2", model.dtype, seed=3), dtype=model.dtype)
    seqs = random_sequences(LENS, 7)
    ids, am, _, _ = padded_batch(seqs, STARTS, max(LENS), left=True)
    with torch.no_grad():
        full = model(ids, attention_mask=am).logits
        for keep, where in ((5, slice(-5, None)), (0, slice(None)), (torch.tensor(3), 3),
                            (torch.tensor([0, 7, 32]), [0, 7, 32])):
            got = model(ids, attention_mask=am, logits_to_keep=keep).logits
            assert got.shape == stock(ids, attention_mask=am, logits_to_keep=keep).logits.shape  # HF's shape
            assert_bitwise_equal(got, full[:, where])
    with pytest.raises(ValueError, match=r"^aligned_ops patched model: logits_to_keep must be an int >= 0 or a "
                                         r"tensor of positions, got -1$"):
        model(ids, logits_to_keep=-1)


@pytest.mark.parametrize("key", ["output_hidden_states", "output_attentions"])
def test_per_layer_outputs_are_refused(model, key):
    # Was: accepted and dropped; HF's out.hidden_states / out.attentions then failed as an unknown attribute.
    ids = torch.randint(0, 500, (1, 6))
    for call, where in ((model, "patched model"), (model.model, r"patched backbone \(model.model\)")):
        with pytest.raises(ValueError, match=rf"^aligned_ops {where}: {key}=True is not supported"):
            call(ids, **{key: True})
        call(ids, **{key: False})  # control: off (what HF's callers pass by default) runs


# ---- labels= --------------------------------------------------------------------------------------------


def test_bidirectional_attention_is_refused(model):
    # HF's is_causal=False (TransformersKwargs) makes its attention bidirectional (tiny Qwen2 fp32: logits move by up
    # to 3.79). Was: swallowed, the causal logits came back without a word.
    ids = torch.randint(0, 500, (2, 7))
    for call in (model, model.model):
        with pytest.raises(ValueError, match="is_causal=False is not supported"):
            call(ids, is_causal=False)
    with torch.no_grad():  # control: is_causal=True (or None) is what the aligned forward runs
        assert_bitwise_equal(model(ids, is_causal=True).logits, model(ids, is_causal=None).logits)
        assert_bitwise_equal(model(ids, is_causal=True).logits, model(ids).logits)
    # the config's is_causal, which HF reads on every call when the keyword is absent (was: causal logits, silently)
    with torch.no_grad():
        causal = model(ids).logits
    model.config.is_causal = False
    try:
        for call in (model, model.model):
            with pytest.raises(ValueError, match="is_causal=False is not supported"):
                call(ids)
        with torch.no_grad():  # the keyword wins over the config, as in HF
            assert_bitwise_equal(model(ids, is_causal=True).logits, causal)
    finally:
        del model.config.is_causal
    from aligned_ops.integrations import check_hf_config

    cfg = copy.deepcopy(model.config)
    cfg.is_causal = False
    with pytest.raises(ValueError, match=r"\(patch_model\): config field is_causal=False"):
        check_hf_config(cfg, "patch_model")
    cfg.is_causal = True
    check_hf_config(cfg, "patch_model")  # control


def test_a_sequence_must_start_at_position_0(model):
    # A context-parallel / Ulysses shard (HF Trainer's shift_labels source) or a continuation chunk: positions from p > 0
    # and no keys of the positions before. Was: scored from its own tokens only (tiny Qwen2 fp32: shard loss 6.7369,
    # the same tokens in the whole sequence 6.4838), no error.
    ids = torch.randint(0, 500, (1, 16))
    pos = torch.arange(16)[None]
    with torch.no_grad():
        model(ids, position_ids=pos)  # control: the whole sequence
        with pytest.raises(ValueError, match="position_ids: row 0: a sequence starts at position 8, not 0"):
            model(ids[:, 8:], position_ids=pos[:, 8:], labels=ids[:, 8:])
        with pytest.raises(ValueError, match="row 0: a sequence starts at position 3"):
            model.model(ids[:, 3:], position_ids=pos[:, 3:])
        # packed rows: every packed sequence restarts at 0 (control), a row starting elsewhere is refused
        packed = torch.cat([torch.arange(5), torch.arange(11)])[None]
        model(ids, position_ids=packed)
        with pytest.raises(ValueError, match="row 0: a sequence starts at position 2"):
            model(ids, position_ids=torch.cat([torch.arange(2, 7), torch.arange(11)])[None])
        # left padding with positions counted from the row's first column (not the first attended token): the
        # message says which row and what HF generate passes; control: HF generate's positions run
        am = torch.ones(2, 16, dtype=torch.long)
        am[1, :3] = 0
        two = ids.expand(2, 16)
        with pytest.raises(ValueError, match=r"row 1: a sequence starts at position 3, not 0 .*With left padding, position_ids "
                                             r"must be 0 at each row's first attended token"):
            model(two, attention_mask=am, position_ids=torch.arange(16).expand(2, 16))
        model(two, attention_mask=am, position_ids=(am.cumsum(-1) - 1).masked_fill(am == 0, 1))
        # the batch row is named, also after a packed row split into sequences before it (review 128: "sequence 3")
        three = torch.randint(0, 500, (3, 8))
        am3 = torch.ones(3, 8, dtype=torch.long)
        am3[2, :2] = 0
        pos3 = torch.stack([torch.arange(4).repeat(2), torch.arange(8), torch.arange(8)])
        with pytest.raises(ValueError, match=r"row 2: a sequence starts at position 2, not 0"):
            model(three, attention_mask=am3, position_ids=pos3)


def test_labels_give_hf_causal_lm_loss_on_the_aligned_logits(model):
    # Was: "labels= is not supported".
    seqs = random_sequences(LENS, 2)
    ids, am, cm, _ = padded_batch(seqs, STARTS, max(LENS) + 3)
    labels = ids.masked_fill(cm == 0, -100)  # SFT-style: prompt and padding ignored
    with torch.no_grad():
        out = model(ids, attention_mask=am, labels=labels)
        lp = completion_logprobs(model, ids, cm, attention_mask=am)
    # bitwise: minus the mean of the aligned token log-probs, in the same token order
    n = int(cm.sum())
    assert_bitwise_equal(out.loss, -(lp[cm.bool()]).sum() / n)
    # HF's own loss function, in float64, on the aligned logits (shift, ignore -100, mean)
    ref = model.loss_function(logits=out.logits.double(), labels=labels, vocab_size=model.config.vocab_size)
    assert abs(float(out.loss) - float(ref)) <= 1e-5 * abs(float(ref))
    # num_items_in_batch: sum / that count (gradient accumulation), as HF
    with torch.no_grad():
        out2 = model(ids, attention_mask=am, labels=labels, num_items_in_batch=torch.tensor(3 * n))
    assert_bitwise_equal(out2.loss, -(lp[cm.bool()]).sum() / (3 * n))
    # labels differing from input_ids are the targets (not input_ids)
    other = labels.clone()
    other[cm.bool()] = (other[cm.bool()] + 1) % 500
    with torch.no_grad():
        moved = model(ids, attention_mask=am, labels=other).loss
    assert not bitwise_equal(moved, out.loss)
    # differentiable
    loss = model(ids, attention_mask=am, labels=labels).loss
    loss.backward()
    g = model.model.layers[0].mlp.down_proj.weight.grad
    assert g is not None and bool(g.abs().sum() > 0)
    model.zero_grad(set_to_none=True)


def test_shift_labels_and_ignore_index_are_hf_s_loss_keywords(model):
    # HF's ForCausalLMLoss takes pre-shifted shift_labels (instead of shifting labels; HF's Trainer and padding-free /
    # context-parallel collators pass them) and ignore_index. Was: both swallowed — the loss of the shifted labels
    # (fp32 tiny Qwen2: 6.9509 where HF's is 6.7307, no error), and ignore_index=-1 labels reached
    # aligned::token_logprobs as token -1.
    seqs = random_sequences(LENS, 5)
    ids, am, cm, _ = padded_batch(seqs, STARTS, max(LENS) + 3)
    labels = ids.masked_fill(cm == 0, -100)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].clone()
    keep = torch.rand(shift.shape, generator=torch.Generator().manual_seed(0)) < 0.5
    shift = shift.masked_fill(~keep, -100)  # score only some of the completion tokens
    with torch.no_grad():
        out = model(ids, attention_mask=am, labels=labels, shift_labels=shift)
        plain = model(ids, attention_mask=am, labels=labels).loss
        lp = completion_logprobs(model, ids, cm, attention_mask=am)
    scored = torch.nn.functional.pad(keep & (shift != -100), (1, 0))[:, :-1]  # the scored tokens, unshifted
    assert int(scored.sum()) > 0 and bool((cm.bool() | ~scored).all())
    assert_bitwise_equal(out.loss, -(lp[scored]).sum() / int(scored.sum()))
    assert not bitwise_equal(out.loss, plain)  # control: without shift_labels every completion token counts
    ref = model.loss_function(logits=out.logits.double(), labels=labels, shift_labels=shift,
                              vocab_size=model.config.vocab_size)
    assert abs(float(out.loss) - float(ref)) <= 1e-5 * abs(float(ref))
    # shift_labels equal to the shifted labels: the labels' loss, bit for bit
    with torch.no_grad():
        same = model(ids, attention_mask=am, labels=labels,
                     shift_labels=torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]).loss
    assert_bitwise_equal(same, plain)
    # ignore_index: the labels it marks are ignored, as -100 is
    with torch.no_grad():
        minus1 = model(ids, attention_mask=am, labels=ids.masked_fill(cm == 0, -1), ignore_index=-1).loss
    assert_bitwise_equal(minus1, plain)
    with pytest.raises(ValueError, match="shift_labels mark padding tokens"):
        model(ids, attention_mask=am, labels=labels, shift_labels=ids)
    # named errors: ignore_index not an integer (was AttributeError: 'bool' object has no attribute 'sum'), a label that
    # is neither a token id nor ignore_index (was aligned::token_logprobs' token_ids error)
    with pytest.raises(ValueError, match=r"patched model: ignore_index must be an integer .*got None"):
        model(ids, attention_mask=am, labels=labels, ignore_index=None)
    with pytest.raises(ValueError, match=r"patched model: ignore_index must be an integer .*got True"):
        model(ids, attention_mask=am, labels=labels, ignore_index=True)
    with pytest.raises(ValueError, match=r"patched model: ignore_index must be an integer .*got tensor\(True\)"):
        model(ids, attention_mask=am, labels=labels, ignore_index=torch.tensor(True))
    with pytest.raises(ValueError, match=r"patched model: labels must be token ids in \[0, \d+\) or ignore_index "
                                         r"\(-1\), got -100"):
        model(ids, attention_mask=am, labels=labels.masked_fill(am == 0, -1), ignore_index=-1)
    with torch.no_grad():  # control: a 0-d integer tensor is an integer
        assert_bitwise_equal(model(ids, attention_mask=am, labels=labels, ignore_index=torch.tensor(-100)).loss, plain)


def test_labels_on_padding_are_refused(model):
    seqs = random_sequences([6, 3], 4)
    ids, am, _, _ = padded_batch(seqs, [1, 1])
    with pytest.raises(ValueError, match="labels mark padding tokens"):
        model(ids, attention_mask=am, labels=ids)
    with pytest.raises(ValueError, match="labels must have the shape of input_ids"):
        model(ids, attention_mask=am, labels=ids[:, :2])


# ---- entropy ------------------------------------------------------------------------------------------------


def test_entropy_per_token_is_batch_invariant_and_accurate(model):
    seqs = random_sequences(LENS, 5)
    singles = []
    for s, st in zip(seqs, STARTS):
        cm = torch.zeros(1, len(s), dtype=torch.long)
        cm[0, st:] = 1
        with torch.no_grad():
            out = model(s[None], completion_mask=cm, return_entropy=True, temperature=0.7, return_logits=True)
        z = out.logits[0, st - 1:len(s) - 1].double() / 0.7
        ref = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
        torch.testing.assert_close(out.entropy[0, st:].double(), ref, rtol=1e-5, atol=1e-5)
        assert bitwise_equal(out.entropy[0, :st], torch.zeros(st))
        singles.append(out.entropy[0, st:])
    ids, am, cm, off = padded_batch(seqs, STARTS, max(LENS) + 1, left=True)
    with torch.no_grad():
        ent = model(ids, attention_mask=am, completion_mask=cm, return_entropy=True, temperature=0.7).entropy
    for i, (s, st) in enumerate(zip(seqs, STARTS)):
        assert_bitwise_equal(ent[i, off[i] + st:off[i] + len(s)], singles[i])
    # control: another temperature gives other bits
    with torch.no_grad():
        hot = model(ids, attention_mask=am, completion_mask=cm, return_entropy=True, temperature=1.3).entropy
    assert not bitwise_equal(hot, ent)
    with pytest.raises(ValueError, match="return_entropy=True needs completion_mask"):
        model(ids, return_entropy=True)


def test_entropy_rows_do_not_depend_on_the_row_count_for_any_vocab():
    # Vocabulary sizes that are not a multiple of the vector width: the row is widened, so torch's elementwise
    # kernels meet every row at the same lane alignment whatever the number of rows.
    g = torch.Generator().manual_seed(0)
    for vocab in (1000, 151_937 // 16, 33):
        z = torch.randn(37, vocab, generator=g).to(torch.bfloat16) * 4
        batch = _entropy(z, 0.9)
        for r in (0, 17, 36):
            assert_bitwise_equal(_entropy(z[r:r + 1], 0.9), batch[r:r + 1])
            assert_bitwise_equal(_entropy(z[r:].contiguous(), 0.9)[0], batch[r])
        assert not bitwise_equal(_entropy(z, 1.1), batch)  # control


@pytest.mark.parametrize("vocab", [32_768 + 7, 151_936])
def test_entropy_of_a_lone_row_does_not_depend_on_threads(vocab):
    # Past torch's grain size (32768 elements) torch.sum splits a lone row's sum across threads: with two threads
    # the entropy of a row alone differed from the same row in a batch and from one thread (151936: 6 of 8 rows).
    g = torch.Generator().manual_seed(1)
    z = torch.randn(8, vocab, generator=g).to(torch.bfloat16) * 4
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _entropy(z, 0.8)
        torch.set_num_threads(2)
        two = _entropy(z, 0.8)
        lone = torch.cat([_entropy(z[r:r + 1], 0.8) for r in range(z.shape[0])])
    finally:
        torch.set_num_threads(prev)
    assert_bitwise_equal(two, one)
    assert_bitwise_equal(lone, one)
    ref = -(torch.softmax(z.double() / 0.8, -1) * torch.log_softmax(z.double() / 0.8, -1)).sum(-1)
    torch.testing.assert_close(one.double(), ref, rtol=1e-5, atol=1e-5)
    assert not bitwise_equal(_entropy(z, 0.9), one)  # control


def test_entropy_of_masked_logits_and_its_gradient():
    # review 127: a logit at -inf (a masked token) made the row's entropy NaN (exp(-inf) * -inf = 0 * -inf); its
    # p is 0, so it adds 0, and its gradient is 0 (the entropy's own backward, checked against float64 autograd).
    g = torch.Generator().manual_seed(2)
    z = torch.randn(3, 130, generator=g) * 3
    z[0, 1:] = float("-inf")  # one finite logit: entropy 0
    z[1, ::2] = float("-inf")
    z[2, 5] = float("nan")  # a NaN row stays NaN (the README's policy)
    x = z.clone().requires_grad_(True)
    ent = _entropy(x, 0.7)
    assert bits(ent[0]) in (bits(torch.tensor(0.0)), bits(torch.tensor(-0.0)))
    keep = torch.isfinite(z[1] / 0.7)
    ref = -(torch.softmax(z[1][keep].double() / 0.7, -1) * torch.log_softmax(z[1][keep].double() / 0.7, -1)).sum()
    torch.testing.assert_close(ent[1].double(), ref, rtol=1e-6, atol=1e-6)
    assert bool(torch.isnan(ent[2]))
    weights = torch.tensor([0.5, -2.0])  # per-row weights: a backward that mixed up the rows' g would show
    (ent[:2] * weights).sum().backward()
    assert bool(torch.isfinite(x.grad[:2]).all())
    assert bitwise_equal(x.grad[0], torch.zeros(130))  # one finite logit: the entropy is 0 wherever it moves
    # the gradient against float64 autograd of the finite logits' entropy (the masked ones get 0)
    y = z[1][keep].double().requires_grad_(True)
    h = -(torch.softmax(y / 0.7, -1) * torch.log_softmax(y / 0.7, -1)).sum()
    (h * -2.0).backward()
    torch.testing.assert_close(x.grad[1][keep].double(), y.grad, rtol=1e-5, atol=1e-6)
    assert bitwise_equal(x.grad[1][~keep], torch.zeros(int((~keep).sum())))


def test_entropy_gradient_is_row_invariant_and_keeps_only_the_logits():
    # The backward is the entropy's own (-p (log p + 1), then log_softmax's backward): it keeps only the logits, which
    # the log-probs' backward keeps anyway. Was: the elementwise graph kept exp(log p), the masked log p and a bool
    # mask, 9 bytes per logit, until the loss's backward, also for an entropy only logged (5.6 GB at [4096, 151936]).
    g = torch.Generator().manual_seed(3)
    z = (torch.randn(5, 1000, generator=g) * 4).to(torch.bfloat16)
    weights = torch.tensor([0.5, -2.0, 1.0, 3.0, -0.25])

    def grad_of(rows):
        x = z[rows].clone().requires_grad_(True)
        (_entropy(x, 0.9) * weights[rows]).sum().backward()
        return x.grad

    batch = grad_of(slice(0, 5))
    for r in (0, 2, 4):  # a row's gradient alone is its gradient in the batch, bit for bit
        assert_bitwise_equal(grad_of(slice(r, r + 1)), batch[r:r + 1])
    # control: the comparison can fail — row 0 alone with another weight gives other bits (a backward that mixed up
    # the rows' g would show)
    weights[0] = 0.75
    assert not bitwise_equal(grad_of(slice(0, 1)), batch[0:1])
    weights[0] = 0.5
    # a temperature tensor that requires grad is refused by log_softmax's rule (inside the Function its autograd
    # setup does not run: the temperature silently got no gradient)
    with pytest.raises(ValueError, match=r"aligned::log_softmax: the temperature tensor requires grad"):
        _entropy(z.clone().requires_grad_(True), torch.full((5,), 0.9, requires_grad=True))
    with torch.no_grad():  # control: as log_softmax itself, accepted where no graph is built
        _entropy(z, torch.full((5,), 0.9, requires_grad=True))
    ref = z.double().requires_grad_(True)
    (-(torch.softmax(ref / 0.9, -1) * torch.log_softmax(ref / 0.9, -1)).sum(-1) * weights).sum().backward()
    torch.testing.assert_close(batch.double(), ref.grad, rtol=2e-2, atol=1e-4)  # (bf16 gradient)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        _entropy(z.clone().requires_grad_(True), 0.9)
    assert saved == [(5, 1000)], saved  # the logits
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        lsm = aligned_ops.log_softmax(z.clone().requires_grad_(True), 0.9).masked_fill(z == 0, 0.0)
        lsm.exp() * lsm  # control: the elementwise graph keeps [5, 1000] tensors the hook sees
    assert len(saved) >= 3, saved


def test_row_local_sum_keeps_nothing_for_backward():
    from aligned_ops.ops.moe import row_local_sum

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        row_local_sum(torch.randn(2, 128, requires_grad=True))
    assert saved == []
    with pytest.raises(ValueError, match=r"row_local_sum: x must be float32 \[n, w\] with w a multiple of 64"):
        row_local_sum(torch.randn(2, 128, dtype=torch.float64))


# ---- packed rows marked by position_ids restarts ------------------------------------------------------------


def _pack_by_positions(seqs):
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    return ids, pos


def test_packed_by_position_ids_splits_into_sequences(model):
    # Was: one sequence (tokens attended across sequences, max |d logit| 3.84, no error).
    seqs = random_sequences(LENS, 6)
    ids, pos = _pack_by_positions(seqs)
    cm = torch.zeros_like(ids)
    at = 0
    for s, st in zip(seqs, STARTS):
        cm[0, at + st:at + len(s)] = 1
        at += len(s)
    with torch.no_grad():
        packed = model(ids, position_ids=pos, completion_mask=cm, return_logits=True)
        hidden = model.model(ids, position_ids=pos).last_hidden_state
        as_one = model(ids, position_ids=torch.arange(ids.shape[1])[None], return_logits=True).logits
        assert_bitwise_equal(completion_logprobs(model, ids, cm, position_ids=pos), packed.logprobs)
    at = 0
    for i, (s, st) in enumerate(zip(seqs, STARTS)):
        alone = _alone(model, s, return_logits=True)
        assert_bitwise_equal(packed.logits[0, at:at + len(s)], alone.logits[0])
        with torch.no_grad():
            assert_bitwise_equal(hidden[0, at:at + len(s)], model.model(s[None]).last_hidden_state[0])
        cm1 = torch.zeros(1, len(s), dtype=torch.long)
        cm1[0, st:] = 1
        with torch.no_grad():
            lp1 = completion_logprobs(model, s[None], cm1)
        assert_bitwise_equal(packed.logprobs[0, at + st:at + len(s)], lp1[0, st:])
        if i > 0:  # control: read as one sequence, every later sequence attends to the earlier ones
            assert not bitwise_equal(as_one[0, at:at + len(s)], alone.logits[0])
        at += len(s)


def test_packed_rows_in_a_batch_and_with_padding(model):
    seqs = random_sequences([7, 4, 10, 3, 6], 7)
    rows = [seqs[:2], seqs[2:]]  # two packed rows; the first right-padded
    width = max(sum(len(s) for s in r) for r in rows)
    ids = torch.zeros(2, width, dtype=torch.long)
    pos = torch.zeros_like(ids)
    am = torch.zeros_like(ids)
    spans = []
    for b, r in enumerate(rows):
        i, p = _pack_by_positions(r)
        ids[b, :i.shape[1]], pos[b, :i.shape[1]], am[b, :i.shape[1]] = i[0], p[0], 1
        at = 0
        for s in r:
            spans.append((b, at, s))
            at += len(s)
    with torch.no_grad():
        logits = model(ids, attention_mask=am, position_ids=pos).logits
    for b, at, s in spans:
        assert_bitwise_equal(logits[b, at:at + len(s)], _alone(model, s).logits[0])


def test_packed_by_hf_flash_attention_kwargs_splits_into_sequences(model):
    # HF's DataCollatorWithFlattening(return_flash_attn_kwargs=True) marks a packed row with cu_seq_lens_q /
    # cu_seq_lens_k (and, with return_position_ids=False, nothing else); HF's varlen attention keeps the sequences
    # apart. Was: the keywords were swallowed, the row ran as one sequence (bf16: 50 % of the logits bitwise, max
    # |d| 4.65, no error).
    from transformers import DataCollatorWithFlattening

    seqs = random_sequences(LENS, 8)
    feats = [{"input_ids": s.tolist()} for s in seqs]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)(feats)
    assert "position_ids" not in batch and "cu_seq_lens_q" in batch
    ids = batch.pop("input_ids")
    labels = batch.pop("labels")
    with torch.no_grad():
        out = model(ids, labels=labels, **batch)
        hidden = model.model(ids, **batch).last_hidden_state
        # with position_ids as well (the collator's default) the same bits
        both = model(ids, position_ids=_pack_by_positions(seqs)[1], **batch).logits
        as_one = model(ids).logits
        by_pos = model(ids, labels=labels, position_ids=_pack_by_positions(seqs)[1])
    assert_bitwise_equal(both, out.logits)
    assert_bitwise_equal(out.loss, by_pos.loss)  # the collator's labels: each sequence's first token is -100
    at = 0
    for i, s in enumerate(seqs):
        alone = _alone(model, s)
        assert_bitwise_equal(out.logits[0, at:at + len(s)], alone.logits[0])
        with torch.no_grad():
            assert_bitwise_equal(hidden[0, at:at + len(s)], model.model(s[None]).last_hidden_state[0])
        if i > 0:  # control: without the keywords the row is one sequence
            assert not bitwise_equal(as_one[0, at:at + len(s)], alone.logits[0])
        at += len(s)
    cu = batch["cu_seq_lens_q"]
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k differ"):
        model(ids, cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, ids.shape[1]], dtype=cu.dtype))
    with pytest.raises(ValueError, match="cu_seqlens and cu_seq_lens_q / cu_seq_lens_k differ"):
        model(ids, cu_seq_lens_q=cu, cu_seqlens=torch.tensor([0, ids.shape[1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="either attention_mask .* or cu_seq_lens_q"):
        model.model(ids, cu_seq_lens_k=cu, attention_mask=torch.ones_like(ids))


def test_one_row_of_position_ids_is_broadcast_over_the_batch(model):
    # HF broadcasts position_ids [1, S] over a batch [B, S] (its default arange(S)[None] is that shape). Was: refused
    # ("position_ids must have one entry per token").
    seqs = random_sequences([5, 3], 9)
    ids = torch.stack([torch.cat(seqs), torch.cat(seqs[::-1])])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        out = model(ids, position_ids=pos).logits
        each = model(ids, position_ids=pos.expand(2, -1).clone()).logits
        hidden = model.model(ids, position_ids=pos).last_hidden_state
        assert_bitwise_equal(hidden, model.model(ids, position_ids=pos.expand(2, -1).clone()).last_hidden_state)
    assert_bitwise_equal(out, each)
    assert_bitwise_equal(out[0, 5:], _alone(model, seqs[1]).logits[0])  # row 0's second sequence, split at 5
    # control: the same row of positions in row 1 splits at 5 too, which is not where its sequences meet
    assert not bitwise_equal(out[1, 3:], _alone(model, seqs[0]).logits[0])
    with pytest.raises(ValueError, match="position_ids must have one entry per token of input_ids"):
        model(torch.cat([ids, ids]), position_ids=torch.cat([pos, pos]))  # [2, S] for 4 rows: not HF's broadcast


def test_ambiguous_position_ids_are_refused(model):
    ids = torch.randint(0, 500, (1, 8))
    with pytest.raises(ValueError, match="position_ids jump from 3 to 1 at packed token 4"):
        model(ids, position_ids=torch.tensor([[0, 1, 2, 3, 1, 2, 3, 4]]))
    with pytest.raises(ValueError, match="position_ids must have one entry per token of input_ids"):
        model(ids, position_ids=torch.arange(4)[None])
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="position_ids restart at 0 inside a sequence of cu_seqlens"):
        model(ids.reshape(-1), cu_seqlens=cu, position_ids=torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]))
    # a sequence's first token has no prediction, also when position_ids mark where it starts
    cm = torch.zeros_like(ids)
    cm[0, 4] = 1
    with pytest.raises(ValueError, match="marks the first token of a sequence"):
        model(ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]), completion_mask=cm)


# ---- framework settings: autocast, dropout --------------------------------------------------------------------


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_region_does_not_reach_the_aligned_ops(model, tiny_checkpoint, autocast_dtype):
    # Was (autocast to the other 16-bit dtype than the model's, e.g. Trainer/accelerate fp16 mixed precision on a bf16
    # model): RuntimeError "Unexpected floating ScalarType in at::autocast::prioritize" from torch.cat inside the
    # q/k/v join. The patched forwards turn autocast off themselves (the adapters did, each on its own).
    seqs = random_sequences(LENS, 5)
    ids, am, cm, _ = padded_batch(seqs, STARTS, max(LENS) + 1, left=False)
    with torch.no_grad():
        want = model(ids, attention_mask=am, completion_mask=cm, temperature=0.7, return_logits=True)
        want_h = model.model(ids, attention_mask=am).last_hidden_state
        with torch.autocast("cpu", dtype=autocast_dtype):
            got = model(ids, attention_mask=am, completion_mask=cm, temperature=0.7, return_logits=True)
            got_h = model.model(ids, attention_mask=am).last_hidden_state
    assert got.logits.dtype == model.dtype and got_h.dtype == model.dtype
    assert_bitwise_equal(got.logprobs, want.logprobs)
    assert_bitwise_equal(got.logits, want.logits)
    assert_bitwise_equal(got_h, want_h)
    # control: the same region does reach a stock HF model's ops (its fp32 linears run in the autocast dtype)
    if model.dtype == torch.float32:
        from transformers import AutoModelForCausalLM

        stock = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen2", torch.float32, seed=3),
                                                     dtype=torch.float32)
        with torch.no_grad():
            plain = stock(ids, attention_mask=am).logits
            with torch.autocast("cpu", dtype=autocast_dtype):
                cast = stock(ids, attention_mask=am).logits
        assert not bitwise_equal(cast.float(), plain)


def test_attention_dropout_in_training_mode_is_refused(tiny_checkpoint):
    # Was: a model with attention_dropout > 0 in train() mode ran the aligned forward without dropout, silently
    # not the configured model (HF drops attention weights in training mode).
    from transformers import AutoModelForCausalLM

    d = tiny_checkpoint("qwen2", torch.bfloat16, seed=3)
    m = patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attention_dropout=0.1))
    plain = patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16))
    seqs = random_sequences(LENS, 6)
    ids, am, cm, _ = padded_batch(seqs, STARTS, max(LENS), left=True)
    with torch.no_grad():  # eval mode: no dropout on either side, so it runs, with the dropout-free model's bits
        assert_bitwise_equal(completion_logprobs(m.eval(), ids, cm, attention_mask=am),
                             completion_logprobs(plain.eval(), ids, cm, attention_mask=am))
    m.train()
    with pytest.raises(ValueError, match=r"^aligned_ops patched model: attention_dropout=0\.1 \(layer 0\) in "
                                         r"training mode.*attention_dropout=0\.0 or call model\.eval\(\)$"):
        completion_logprobs(m, ids, cm, attention_mask=am)
    with pytest.raises(ValueError, match=r"^aligned_ops patched backbone \(model\.model\): attention_dropout=0\.1"):
        m.model(ids, attention_mask=am)
    # control: training mode without dropout runs, with the eval bits
    plain.train()
    with torch.no_grad():
        assert_bitwise_equal(completion_logprobs(plain, ids, cm, attention_mask=am),
                             completion_logprobs(plain.eval(), ids, cm, attention_mask=am))


def test_neftune_in_training_mode_is_refused(tiny_checkpoint):
    # NEFTune (HF Trainer / TRL's neftune_noise_alpha) adds noise to the embeddings in training mode, which the engine
    # never does. Was: its forward hook met the packed [tokens, hidden] embeddings and raised a bare IndexError
    # ("Dimension out of range") from inside transformers.
    from transformers import AutoModelForCausalLM
    from transformers.integrations.neftune import activate_neftune, deactivate_neftune

    d = tiny_checkpoint("qwen2", torch.bfloat16, seed=3)
    m = patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16))
    ids = torch.randint(0, 500, (2, 9))
    with torch.no_grad():
        plain = m.eval()(ids).logits
    handle = activate_neftune(m, 5.0)
    m.train()
    with pytest.raises(ValueError, match=r"^aligned_ops patched model: NEFTune \(neftune_noise_alpha=5\.0\) in "
                                         r"training mode"):
        m(ids)
    with pytest.raises(ValueError, match=r"^aligned_ops patched backbone \(model\.model\): NEFTune"):
        m.model(ids)
    with torch.no_grad():  # control: in eval mode NEFTune adds nothing (HF's hook checks module.training)
        assert_bitwise_equal(m.eval()(ids).logits, plain)
    deactivate_neftune(m, handle)
    with torch.no_grad():  # and after deactivate_neftune training mode runs, with the eval bits
        assert_bitwise_equal(m.train()(ids).logits, plain)
