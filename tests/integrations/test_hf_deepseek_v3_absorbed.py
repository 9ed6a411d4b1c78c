"""Trainer side, DeepSeek-V3 in the ABSORBED (latent) MLA form (issue 26 item 4): ``patch_model(model,
mla_form="absorbed")`` runs each layer's attention as ``[q_nope·W_UK || rope(q_pe)]`` against one latent row
``[kv_a_layernorm(c) || rope(k_pe)]`` per token (``mla_attention_varlen``), then ``o_latent·W_UV`` -> o_proj.

What it proves: the absorbed trainer is close to float64 stock HF and to the expanded form (the same function,
other rounding); a sequence's log-probs are the same bits alone, in a padded batch (left/right), packed and chunked;
it really runs the latent op (trace) and reads kv_b_proj through W_UK/W_UV (negative controls: a changed kv_b_proj
element moves the bits; the expanded form's bits differ); gradients reach q_b_proj / q_proj, kv_a_proj_with_mqa
and kv_b_proj and match float64 autograd of stock HF; bad ``mla_form`` values are refused by message; compiled
(torch.compile, inductor) the model gives eager's log-probs and gradients, and a dense decoder layer compiles with
fullgraph=True to eager's bits, forward and backward (negative control: a changed kv_b_proj element moves the
compiled bits). Cases include v_head_dim != qk_nope_head_dim (the tiny builder's "dv-ne-dn" variant)."""

import contextlib
import copy
import pickle

import pytest
import torch
from _hf_moe_checks import check_batch_padding_packing_chunking, check_close_to_float64_stock_hf, single

from aligned_ops.integrations.hf import completion_logprobs, patch_model, unpatch_model
from aligned_ops.testing import assert_bitwise_equal, bits, count_bitwise_equal
from aligned_ops.testing.rollouts import random_sequences
from aligned_ops.testing.tiny_model import build_tiny_deepseek_v3

CASES = {
    "fp32": (torch.float32, {}),
    "bf16": (torch.bfloat16, {}),
    "fp32-no-q-lora-kimi-groups": (torch.float32, {"q_lora_rank": None, "n_group": 1, "topk_group": 1,
                                                   "routed_scaling_factor": 2.827, "num_experts_per_tok": 3}),
    # v_head_dim (36) != qk_nope_head_dim (24), 5 heads: W_UK and W_UV have other shapes (models/tiny.py variant)
    "fp32-dv-ne-dn": (torch.float32, {"variant": "dv-ne-dn"}),
    # seed 4: with seed 3's 5-head bf16 weights a routing near-tie flips between the forms at the 8th token (the
    # close-to-expanded / float64 checks need >= 16 / 24 tokens whose whole prefix routed alike)
    "bf16-dv-ne-dn": (torch.bfloat16, {"variant": "dv-ne-dn", "seed": 4}),
}
LENS = [5, 33, 2, 47, 9]


def _load(d, dtype, form):
    from transformers import AutoModelForCausalLM

    return patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=dtype), mla_form=form)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def models(request, tmp_path_factory):
    """(absorbed, expanded): the same checkpoint patched in each form."""
    dtype, over = CASES[request.param]
    over = dict(over)
    seed = over.pop("seed", 3)
    d = build_tiny_deepseek_v3(tmp_path_factory.mktemp("ds") / "m", dtype, seed=seed, **over)
    return _load(d, dtype, "absorbed"), _load(d, dtype, "expanded")


def test_runs_the_latent_op(models):
    """The absorbed model runs mla_attention_varlen once per layer (no attention_varlen); the expanded one the
    opposite — the selection reaches the block."""
    from aligned_ops.testing.trace import trace_aligned_ops

    absorbed, expanded = models
    ids = torch.arange(3, 12)[None]
    names = []
    for m in (absorbed, expanded):
        with trace_aligned_ops() as t, torch.no_grad():
            m(input_ids=ids)
        names.append([c.name for c in t.calls])
    L = absorbed.config.num_hidden_layers
    mla = [n for n in names[0] if n.startswith("aligned::mla_attention_varlen")]
    assert len(mla) == L and not [n for n in names[0] if n.startswith("aligned::attention_varlen")]
    assert not [n for n in names[1] if n.startswith("aligned::mla_")]
    assert len([n for n in names[1] if n.startswith("aligned::attention_varlen")]) == L


def test_batch_padding_packing_chunking_invariance(models):
    check_batch_padding_packing_chunking(models[0], LENS, pad=3)


def test_one_latent_plan_per_forward_same_bits_and_gradients(models, monkeypatch):
    """Every layer's mla_attention_varlen runs the ONE plan the forward made from the host cu_seqlens (one KV head
    of width kv_lora_rank + d_rope); the log-probs and every parameter's gradient are the same bits as planning
    inside each call (the backward through the planned form included)."""
    import aligned_ops
    from aligned_ops.integrations import hf
    from aligned_ops.testing.rollouts import padded_batch

    model = models[0]
    if next(model.parameters()).dtype != torch.float32:
        pytest.skip("fp32 model only")
    seqs = random_sequences([7, 40, 3], 1)
    ids, mask, cm, _ = padded_batch(seqs, [1, 5, 1])
    plans = []
    real_plan = aligned_ops.AttentionPlan.plan_varlen

    def spy_plan(self, cu_q, cu_k, *a, **k):
        plans.append(a[:3])
        return real_plan(self, cu_q, cu_k, *a, **k)

    monkeypatch.setattr(aligned_ops.AttentionPlan, "plan_varlen", spy_plan)

    def score():
        model.zero_grad()
        lp = completion_logprobs(model, ids, cm, attention_mask=mask)
        lp.sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad()
        return lp.detach(), grads

    lp_plan, g_plan = score()
    attn = model.model.layers[0].self_attn
    assert plans == [(attn.num_heads, 1, attn.kv_lora_rank + attn.qk_rope_head_dim)], plans
    monkeypatch.setattr(hf._ForwardPlans, "get", lambda self, *a: None)  # plan inside every call, per layer
    lp_call, g_call = score()
    assert len(plans) == 1
    assert_bitwise_equal(lp_plan, lp_call)
    assert len(g_plan) == len(g_call) > 0
    for a, b in zip(g_plan, g_call):
        assert_bitwise_equal(a, b)


def test_negative_control_kv_b_proj_reaches_the_bits(models):
    """The invariance above can fail: one element of a layer's kv_b_proj changed (its W_UK part, then its W_UV
    part) gives other bits; restored, the same bits again. Also the expanded form's bits differ from the absorbed
    form's (two roundings of one function: rollout and trainer must run the same form)."""
    absorbed, expanded = models
    s = random_sequences([24], 7)[0]
    ref, _ = single(absorbed, s, 1)
    attn = absorbed.model.layers[1].self_attn
    w = attn.kv_b_proj.weight
    dn, dv = attn.qk_nope_head_dim, attn.v_head_dim
    for row in (1, dn + 2):  # head 0: a k_nope row (W_UK), a v row (W_UV)
        old = w[row, 3].clone()
        try:
            with torch.no_grad():
                w[row, 3] += 0.25
            lp, _ = single(absorbed, s, 1)
        finally:
            with torch.no_grad():
                w[row, 3] = old
        assert not torch.equal(bits(lp), bits(ref)), row
    assert_bitwise_equal(single(absorbed, s, 1)[0], ref)  # restored (the derived W_UK/W_UV re-derived)
    lp_e, _ = single(expanded, s, 1)
    assert count_bitwise_equal(lp_e, ref) < ref.numel()


def test_close_to_float64_stock_hf(models):
    """Both forms against float64 stock HF (unpatched), on the completion tokens of 4 sequences whose whole prefix
    routed like float64's in every layer (a flip at an earlier token legitimately moves every later token through
    attention: the shared check's per-token mask would blame the form for it) — at least 24 tokens in all; fp32
    2e-5 (measured ~2e-6), bf16 0.15 (the MoE tests' tolerance; measured ~0.03). fp32 also passes the shared
    per-token check."""
    from aligned_ops.integrations.routing_capture import capture_hf_routing

    absorbed, expanded = models
    if next(absorbed.parameters()).dtype == torch.float32:
        check_close_to_float64_stock_hf(absorbed)
    m64 = unpatch_model(copy.deepcopy(expanded)).to(torch.float64)
    m64.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    tol = 2e-5 if next(absorbed.parameters()).dtype == torch.float32 else 0.15
    for m in (absorbed, expanded):
        errs = []
        for seed in range(4):
            s = random_sequences([30], seed)[0]
            with torch.no_grad(), capture_hf_routing(m64) as rec:
                ref = torch.log_softmax(m64(s[None]).logits[0], -1)[9:29].gather(-1, s[10:, None])[:, 0]
            lp, ex = single(m, s, 10)
            same = torch.ones(30, dtype=torch.bool)
            for layer, ids in enumerate(rec):
                same &= (ids.sort(-1).values == ex[:, layer].sort(-1).values).all(-1)
            # token t's log-prob comes from position t - 1's hidden state: it and every earlier position routed alike
            clean = same.long().cumprod(0).bool()[9:29]
            errs.append((lp[clean].double() - ref[clean]).abs())
        errs = torch.cat(errs)
        assert errs.numel() >= 24, errs.numel()
        assert errs.max() < tol, (m is absorbed, errs.max())


def test_close_to_expanded(models):
    """Absorbed vs expanded log-probs on the tokens whose prefix's expert choices agree (fp32: 2e-5, bf16: 0.15)."""
    absorbed, expanded = models
    s = random_sequences([40], 11)[0]
    lp_a, ex_a = single(absorbed, s, 8)
    lp_e, ex_e = single(expanded, s, 8)
    same = (ex_a.sort(-1).values == ex_e.sort(-1).values).all(-1).all(-1)
    keep = same.long().cumprod(0).bool()[7:-1]  # positions 7..38 (they predict tokens 8..39) and all before
    assert keep.sum() >= 16, same
    tol = 2e-5 if next(absorbed.parameters()).dtype == torch.float32 else 0.15
    err = (lp_a[keep] - lp_e[keep]).abs().max()
    assert err < tol, err


@pytest.mark.parametrize("q_lora_rank,variant", [(96, "default"), (None, "default"), (96, "dv-ne-dn")])
def test_gradients_match_float64_autograd(tmp_path, q_lora_rank, variant):
    """Backward through mla_attention_varlen and the absorbed projections: the gradients of every attention
    projection (incl. kv_b_proj, reached through W_UK and W_UV) match float64 autograd of stock HF within 1e-4 of
    their scale, as the expanded form's do. All layers dense (no routing flip can move a gradient)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = build_tiny_deepseek_v3(tmp_path / "m", torch.float32, seed=5, first_k_dense_replace=3,
                               q_lora_rank=q_lora_rank, variant=variant)
    assert (variant == "dv-ne-dn") == (AutoConfig.from_pretrained(d).v_head_dim != AutoConfig.from_pretrained(d)
                                        .qk_nope_head_dim)
    s = random_sequences([26], 2)[0]
    cm = torch.zeros(1, 26, dtype=torch.long)
    cm[0, 6:] = 1
    names = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")

    def grads(m):
        return {(i, n): getattr(layer.self_attn, n).weight.grad.double() for i, layer in enumerate(m.model.layers)
                for n in names if getattr(layer.self_attn, n, None) is not None}

    m64 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(torch.float64)
    logp = torch.log_softmax(m64(s[None]).logits[0], -1)[5:25].gather(-1, s[6:, None])[:, 0]
    logp.sum().backward()
    ref = grads(m64)
    for form in ("absorbed", "expanded"):
        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        patch_model(m, mla_form=form)
        completion_logprobs(m, s[None], cm).sum().backward()
        got = grads(m)
        assert got.keys() == ref.keys() and any(k[1] == "kv_b_proj" for k in got)
        for k, g in ref.items():
            assert float(g.abs().max()) > 0, k
            err = float((got[k] - g).abs().max() / g.abs().max())
            assert err < 1e-4, (form, k, err)  # measured <= 1.7e-6


def test_expanded_form_refuses_v_head_dim_above_the_qk_head(tmp_path):
    """v_head_dim > qk_nope_head_dim + qk_rope_head_dim: the expanded form (v padded to the q/k head, as vLLM's
    non-MLA attention) is refused by name before patching (it failed inside aligned::attention_varlen_planned:
    'k and v must have the same shape'); the absorbed form runs it (control: it equals stock HF in fp32)."""
    from transformers import AutoModelForCausalLM

    d = build_tiny_deepseek_v3(tmp_path / "m", torch.float32, seed=2, num_hidden_layers=2, qk_nope_head_dim=16,
                               qk_rope_head_dim=16, v_head_dim=64)
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^aligned_ops \(patch_model\): DeepseekV3ForCausalLM v_head_dim 64 > "
                                         r"qk_nope_head_dim \+ qk_rope_head_dim = 32 is not supported in the expanded "
                                         r"MLA form"):
        patch_model(m, mla_form="expanded")
    assert not getattr(m, "_aligned_patched", False)
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(ids).logits
        out = patch_model(m, mla_form="absorbed")(ids).logits
    assert (out - ref).abs().max().item() < 1e-4  # fp32 rounding only: the same function


def test_refusals_and_repatch(tmp_path):
    from transformers import AutoModelForCausalLM

    from aligned_ops.models.deepseek_v3 import ABSORBED
    from aligned_ops.testing.tiny_model import build_tiny_qwen2

    d = build_tiny_deepseek_v3(tmp_path / "m", torch.float32, seed=2)
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"mla_form must be one of \['absorbed', 'expanded'\], got 'latent'"):
        patch_model(m, mla_form="latent")
    with pytest.raises(ValueError, match="mla_form must be one of"):
        patch_model(m, mla_form=object())
    with pytest.raises(ValueError, match=r"variant must be one of \['default', 'dv-ne-dn'\], got 'dv'"):
        build_tiny_deepseek_v3(tmp_path / "bad", torch.float32, variant="dv")
    attn = m.model.layers[0].self_attn
    attn.kv_b_proj.bias = torch.nn.Parameter(torch.zeros(attn.kv_b_proj.weight.shape[0]))
    with pytest.raises(ValueError, match="layer 0 kv_b_proj has a bias; the absorbed MLA form"):
        patch_model(m, mla_form="absorbed")
    attn.kv_b_proj.bias = None
    assert not getattr(m, "_aligned_patched", False)
    patch_model(m, mla_form=ABSORBED)  # positive control: the object form is accepted too
    assert patch_model(m, mla_form="absorbed") is m  # idempotent
    with pytest.raises(ValueError, match="already patched with another form; call unpatch_model"):
        patch_model(m, mla_form="expanded")
    unpatch_model(m)
    assert "_aligned_mla_form" not in m.model.layers[0].__dict__
    patch_model(m, mla_form="expanded")  # pinned (the default follows ALIGNED_OPS_MLA_FORM, absorbed)
    with pytest.raises(ValueError, match="already patched with another form"):
        patch_model(m, mla_form="absorbed")
    q = AutoModelForCausalLM.from_pretrained(build_tiny_qwen2(tmp_path / "q", torch.float32, seed=0),
                                             dtype=torch.float32)
    with pytest.raises(ValueError, match="mla_form='absorbed', but Qwen2ForCausalLM has no MLA attention"):
        patch_model(q, mla_form="absorbed")
    patch_model(copy.deepcopy(q))  # positive control


def test_trl_repatch_keeps_the_form_and_refuses_the_other(tmp_path, monkeypatch):
    """The TRL adapter re-patches the policy under TRL's wrapper: it keeps the model's profile and MLA form, and
    refuses a form the vLLM plugin does not run (ALIGNED_OPS_MLA_FORM, default absorbed: the two forms never agree
    bit for bit)."""
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM

    from aligned_ops.integrations.trl import _repatch
    from aligned_ops.models.deepseek_v3 import ABSORBED, EXPANDED

    monkeypatch.delenv("ALIGNED_OPS_MLA_FORM", raising=False)
    monkeypatch.delenv("VLLM_ALIGNED_OPS_MLA_FORM", raising=False)
    d = build_tiny_deepseek_v3(tmp_path / "m", torch.float32, seed=2)
    m = patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), mla_form="absorbed")
    _repatch(m, None)  # the plugin's default form: carried through
    assert m.model.layers[0].__dict__["_aligned_mla_form"] is ABSORBED
    # a deep copy of the patched model carries the same form (review 137: forms are singletons, as profiles are;
    # the copy was "patched with mla_form='absorbed', but the plugin runs the 'absorbed' form")
    twin = copy.deepcopy(m)
    assert twin.model.layers[0].__dict__["_aligned_mla_form"] is ABSORBED
    patch_model(twin, mla_form="absorbed")  # patch_model's own identity check on the copy (before any re-patch)
    _repatch(twin, None)
    assert pickle.loads(pickle.dumps(EXPANDED)) is EXPANDED
    monkeypatch.setenv("ALIGNED_OPS_MLA_FORM", "expanded")
    with pytest.raises(ValueError, match="patched with mla_form='absorbed', but the vLLM plugin runs the 'expanded'"):
        _repatch(m, None)
    assert m.model.layers[0].__dict__["_aligned_mla_form"].name == "absorbed"  # refused before unpatching
    unpatch_model(m)
    patch_model(m, mla_form="expanded")
    _repatch(m, None)  # control: the expanded form is carried through when the plugin runs it
    assert m.model.layers[0].__dict__["_aligned_mla_form"] is EXPANDED


@pytest.fixture(scope="module")
def dv_model(tmp_path_factory):
    """A fresh fp32 absorbed model of the dv != dn variant (its own: the compile tests change a weight)."""
    d = build_tiny_deepseek_v3(tmp_path_factory.mktemp("ds_dv") / "m", torch.float32, seed=6, variant="dv-ne-dn")
    return _load(d, torch.float32, "absorbed")


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@contextlib.contextmanager
def _inductor_compiles():
    """Asserts, on exit, that Dynamo captured at least one graph and inductor generated at least one kernel in
    the block (a compiled call that fell back to eager everywhere would pass a bits-equal-to-eager check by
    itself). The FX-graph and AOTAutograd caches are off so a cache hit cannot stand in for codegen."""
    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    torch._dynamo.reset()
    counters.clear()
    metrics.reset()
    with torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    assert counters["stats"]["unique_graphs"] > 0, dict(counters["stats"])
    assert metrics.generated_kernel_count > 0


@pytest.mark.slow  # inductor compiles a forward and a backward graph (minutes on 2 busy cores)
def test_torch_compile_matches_eager_forward_and_gradients(dv_model):
    """The whole absorbed trainer under torch.compile (inductor; not fullgraph: the patched forward packs the batch
    with host-side checks, as every patched model — test_hf.py) gives eager's log-probs and every parameter's
    gradient, bit for bit. Negative control: a kv_b_proj element changed in place moves the compiled log-probs
    (the compiled graph reads the weight, and the comparison can fail)."""
    from aligned_ops.testing.rollouts import padded_batch

    model = dv_model
    seqs = random_sequences([19, 7, 12], 4)
    ids, mask, cm, _ = padded_batch(seqs, [3, 2, 5])

    def run(m):
        model.zero_grad(set_to_none=True)
        lp = m(ids, attention_mask=mask, completion_mask=cm, return_logits=False).logprobs
        (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
        return lp.detach(), _grads(model)

    lp_eager, g_eager = run(model)
    compiled = torch.compile(model, backend="inductor")
    with _inductor_compiles():
        lp_comp, g_comp = run(compiled)
    assert_bitwise_equal(lp_comp, lp_eager)
    assert g_comp.keys() == g_eager.keys() and "model.layers.1.self_attn.kv_b_proj.weight" in g_comp
    for n in g_eager:
        assert_bitwise_equal(g_comp[n], g_eager[n], n)
    with torch.no_grad():
        assert_bitwise_equal(compiled(ids, attention_mask=mask, completion_mask=cm, return_logits=False).logprobs,
                             lp_eager)
        w = model.model.layers[1].self_attn.kv_b_proj.weight
        old = w[2, 5].clone()
        w[2, 5] += 0.25
        try:
            moved = compiled(ids, attention_mask=mask, completion_mask=cm, return_logits=False).logprobs
        finally:
            w[2, 5] = old
    assert count_bitwise_equal(moved, lp_eager) < lp_eager.numel()
    model.zero_grad(set_to_none=True)


@pytest.mark.slow  # inductor compiles a forward and a backward graph (minutes on 2 busy cores)
def test_dense_decoder_layer_compiles_fullgraph(dv_model):
    """A dense decoder layer in the absorbed form (norms, q / latent down-projections, rope, W_UK / W_UV derivation,
    the absorbed projections, mla_attention_varlen with the forward's plan, o_proj, MLP) compiles with
    fullgraph=True (inductor) and gives eager's output, input gradient and parameter gradients bit for bit. (A
    sparse layer breaks the graph at the MoE routing recorder, as in every MoE model: not the absorbed form's.)"""
    model = dv_model
    layer = model.model.layers[0]
    assert not hasattr(layer.mlp, "gate")  # dense
    caught = []
    handle = layer.register_forward_pre_hook(lambda mod, args: caught.append(args))
    try:
        with torch.no_grad():
            model(random_sequences([23], 9)[0][None])
    finally:
        handle.remove()
    hidden, residual, ctx = caught[0]
    assert residual is None

    def run(fn):
        layer.zero_grad(set_to_none=True)
        h = hidden.detach().clone().requires_grad_(True)
        out, res = fn(h, None, ctx)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), res.detach(), h.grad, {n: p.grad.clone() for n, p in layer.named_parameters()
                                                     if p.grad is not None}

    eager = run(layer)
    with _inductor_compiles():
        comp = run(torch.compile(layer, backend="inductor", fullgraph=True))
    for a, b in zip(eager[:3], comp[:3]):
        assert_bitwise_equal(b, a)
    assert eager[3].keys() == comp[3].keys() and "self_attn.kv_b_proj.weight" in eager[3]
    for n in eager[3]:
        assert_bitwise_equal(comp[3][n], eager[3][n], n)
    layer.zero_grad(set_to_none=True)


def test_compiled_model_refuses_negative_temperature(dv_model):
    """The temperature check runs outside the compiled graph (hf.py: torch.compiler.disable) but still runs: a
    compiled patched model given a completion_mask and temperature=-1.0 raises ValueError by message (the check's
    own, not a tracing error), as eager does."""
    from aligned_ops.testing.rollouts import padded_batch

    ids, mask, cm, _ = padded_batch(random_sequences([6, 4], 5), [2, 3])
    compiled = torch.compile(dv_model, backend="eager")  # Dynamo only: the check sits in front of any backend
    with torch.no_grad():
        for m in (dv_model, compiled):
            with pytest.raises(ValueError,
                               match=r"completion_logprobs: temperature must be non-negative \(0 = greedy\), got -1\.0"):
                m(ids, attention_mask=mask, completion_mask=cm, temperature=-1.0, return_logits=False)


def test_inductor_compiles_check_fails_without_compilation(dv_model):
    """Negative control of _inductor_compiles (the compile tests' proof that something was compiled): an eager
    call in the block captures no graph and generates no kernel, and the check fails."""
    ids = random_sequences([6], 5)[0][None]
    with pytest.raises(AssertionError):
        with _inductor_compiles(), torch.no_grad():
            dv_model(ids)
