"""Trainer side, MoE: patched HF Qwen3-MoE / Qwen2-MoE are padding/packing/batch/chunking invariant (bitwise),
close to float64 stock HF (both checks shared with the DeepSeek-V3 tests: _hf_moe_checks.py), differentiable with deterministic gradients; the aux loss uses the routing's own fp32 scores;
routing-flip diagnostics count what they should."""

import pytest
import torch
from _hf_moe_checks import check_batch_padding_packing_chunking, check_close_to_float64_stock_hf

from aligned_ops.diagnostics import mismatch_metrics, routing_flip_metrics
from aligned_ops.integrations.hf import patch_model
from aligned_ops.testing.tiny_model import build_tiny_moe
from aligned_ops.testing import assert_bitwise_equal, bitwise_equal
from aligned_ops.testing.rollouts import random_sequences

ARCHS = [("qwen3_moe", torch.float32), ("qwen3_moe", torch.bfloat16), ("qwen2_moe", torch.float32)]


@pytest.fixture(scope="module", params=ARCHS, ids=["q3moe-fp32", "q3moe-bf16", "q2moe-fp32"])
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    arch, dtype = request.param
    d = build_tiny_moe(tmp_path_factory.mktemp("hfmoe") / "m", dtype, seed=5, arch=arch, num_experts_per_tok=3)
    return patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=dtype))


LENS = [5, 40, 2, 71, 9]


def test_batch_padding_packing_chunking_invariance(model):
    check_batch_padding_packing_chunking(model, LENS, pad=2)


def test_close_to_float64_stock_hf(model):
    check_close_to_float64_stock_hf(model)


def test_backward_deterministic_and_aux_loss_from_routing_scores(model):
    if next(model.parameters()).dtype != torch.float32:
        pytest.skip("fp32 gradient check")
    s = random_sequences([24], 4)[0][None]
    cm = torch.zeros_like(s)
    cm[0, 8:] = 1
    grads = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        out = model(s, completion_mask=cm, return_logits=False, output_router_logits=True, return_routing=True)
        loss = -out.logprobs.sum() + 0.01 * out.aux_loss
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    router = [n for n in grads[0] if n.endswith("mlp.gate.weight")]
    experts = [n for n in grads[0] if "experts" in n]
    assert router and experts
    for n in grads[0]:
        assert bitwise_equal(grads[0][n], grads[1][n]), n
    assert all(grads[0][n].abs().sum() > 0 for n in router)
    # aux loss == Switch formula on the scores aligned::moe_routing returns (recomputed here from the op)
    cfg = model.config
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    counts, probs, rows = torch.zeros(E), torch.zeros(E), 0
    import aligned_ops

    with torch.no_grad():
        captured = []
        orig = aligned_ops.moe_routing

        def spy(logits, *a, **kw):
            r = orig(logits, *a, **kw)
            captured.append(r)
            return r

        aligned_ops.moe_routing = spy  # the package attribute the MoE block (aligned_ops.models.moe) calls
        try:
            out = model(s, completion_mask=cm, return_logits=False, output_router_logits=True)
        finally:
            aligned_ops.moe_routing = orig
    for _, ids, scores in captured:
        counts += torch.bincount(ids.reshape(-1), minlength=E).float()
        probs += scores.sum(0)
        rows += scores.shape[0]
    expect = torch.sum((counts / rows) * (probs / rows)) * E
    assert_bitwise_equal(out.aux_loss, expect)
    assert len(captured) == sum(1 for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    assert k == 3



def test_labels_loss_adds_the_aux_loss_as_hf_does(model):
    """HF's Qwen-MoE forward with ``labels`` and ``output_router_logits`` (the argument, else
    ``config.output_router_logits``) returns ``loss = CE + router_aux_loss_coef * aux_loss``. The patched forward
    returned the CE alone (and ignored the config's switch): an MoE fine-tuning loss silently lost its load-balancing
    term (found at router_aux_loss_coef 0.5: 6.330 where stock HF gives 7.397)."""
    import copy

    from aligned_ops.integrations.hf import unpatch_model

    s = random_sequences([23], 4)[0][None]
    coef = model.router_aux_loss_coef
    assert coef > 0
    with torch.no_grad():
        ce = model(s, labels=s).loss  # control: no router logits asked, the CE alone (as HF)
        out = model(s, labels=s, output_router_logits=True)
        assert out.aux_loss > 0 and not bitwise_equal(out.loss, ce)
        assert_bitwise_equal(out.loss, ce + coef * out.aux_loss)
        configured = copy.deepcopy(model)
        configured.config.output_router_logits = True  # what MoE fine-tuning recipes set
        assert_bitwise_equal(configured(s, labels=s).loss, out.loss)
        assert model(s, labels=s, output_router_logits=False).loss == ce  # the argument wins over the config
        if next(model.parameters()).dtype == torch.float32:  # stock HF: the same objective, to fp32 rounding
            stock = unpatch_model(copy.deepcopy(model))
            want = stock(input_ids=s, labels=s, output_router_logits=True).loss
            assert abs(float(out.loss) - float(want)) < 1e-4 and abs(float(ce) - float(want)) > 10 * 1e-4

def test_routing_flip_metrics_counts_and_split():
    t = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 0], [3, 2]]])  # [T=3, L=2, k=2]
    r = t.clone()
    r[1, 1] = torch.tensor([6, 5])  # token 1, layer 1 flips
    lp_t = torch.tensor([-1.0, -2.0, -3.0])
    lp_r = torch.tensor([-1.0, -2.5, -3.125])
    m = mismatch_metrics(lp_t, lp_r, trainer_experts=t, rollout_experts=r[:, :, [1, 0]])  # order inside top-k ignored
    assert m["routing_flips"] == 1.0 and m["num_tokens_routing_flipped"] == 1.0
    assert m["abs_diff_max_routing_flipped"] == 0.5 and m["abs_diff_max_routing_agreed"] == 0.125
    assert m["abs_diff_mean_routing_agreed"] == 0.0625
    # no flip: the flipped split is 0, and a shape mismatch is a clear error
    m = routing_flip_metrics(t[None], t[None], torch.zeros(1, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.bool))
    assert m["routing_flips"] == 0.0 and m["abs_diff_mean_routing_flipped"] == 0.0
    with pytest.raises(ValueError, match="trainer_experts shape"):
        mismatch_metrics(lp_t, lp_r, trainer_experts=t, rollout_experts=r[:2])


def test_unsupported_moe_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    d = build_tiny_moe(tmp_path / "m", torch.float32, seed=1, num_hidden_layers=1)
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    m.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="MoE experts need silu, got 'gelu'"):
        patch_model(m)
    m.config.hidden_act = "silu"
    # A config naming another MoE architecture is refused (what the vLLM plugin checks); patch_model itself
    # goes by the model's class, which is Qwen3-MoE here.
    from aligned_ops.integrations import check_hf_config

    m.config.architectures = ["MixtralForCausalLM"]
    with pytest.raises(ValueError, match="unsupported architecture 'MixtralForCausalLM'"):
        check_hf_config(m.config, "vLLM plugin")


def test_aux_loss_under_gradient_checkpointing(tiny_checkpoint):
    # Was: with reentrant checkpointing each layer's forward runs under no_grad, so the routing scores recorded there
    # had no graph and aux_loss silently gave the routers no gradient (the routers' grads differed from the run
    # without checkpointing). Refused by name; non-reentrant checkpointing gives the unchecked run's bits.
    from transformers import AutoModelForCausalLM

    d = tiny_checkpoint("moe", torch.bfloat16)
    seqs = random_sequences([9, 14, 5], 11)
    ids = torch.zeros(3, 14, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, 14 - len(s):], am[b, 14 - len(s):] = s, 1
    cm = am.clone()
    cm[:, :10] = 0

    def run(use_reentrant):
        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
        if use_reentrant is not None:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        patch_model(m).train()
        with torch.no_grad():  # scoring without autograd records no graph either way: runs
            m(ids, attention_mask=am, completion_mask=cm, output_router_logits=True)
        out = m(ids, attention_mask=am, completion_mask=cm, temperature=0.9, output_router_logits=True)
        (-out.logprobs.sum() + 0.01 * out.aux_loss).backward()
        return out.aux_loss, [p.grad for p in m.parameters()]

    aux, grads = run(None)
    with pytest.raises(ValueError, match=r"^aligned_ops patched model: output_router_logits=True under reentrant "
                                         r"gradient checkpointing.*use_reentrant': False\}$"):
        run(True)
    # a config asking for router logits (HF's default for output_router_logits) does not make completion_logprobs,
    # which returns no aux loss, refuse reentrant checkpointing
    from aligned_ops.integrations.hf import completion_logprobs

    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    m.config.output_router_logits = True
    completion_logprobs(patch_model(m).train(), ids, cm, attention_mask=am, temperature=0.9).sum().backward()
    aux_nr, grads_nr = run(False)  # control: non-reentrant checkpointing, every gradient the unchecked run's bits
    assert_bitwise_equal(aux_nr, aux)
    assert len(grads_nr) == len(grads) and all(g is not None for g in grads)
    for got, want in zip(grads_nr, grads):
        assert_bitwise_equal(got, want)


def test_tuple_output_keeps_hf_s_aux_loss_position(model):
    # HF's Qwen-MoE classes return (loss, aux_loss, logits, ...) with output_router_logits (MoeCausalLMOutputWithPast);
    # the control of test_hf_deepseek_v3.py's tuple test (whose HF class has no aux_loss).
    s = random_sequences([11], 6)[0][None]
    with torch.no_grad():
        full = model(s, labels=s, output_router_logits=True)
        loss, aux, logits = model(s, labels=s, output_router_logits=True, return_dict=False)
    assert_bitwise_equal(loss, full.loss)
    assert_bitwise_equal(aux, full.aux_loss)
    assert_bitwise_equal(logits, full.logits)
