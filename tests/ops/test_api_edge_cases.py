"""Edge cases of the public API found by a probe: each either crashed with an error that named neither the op nor the
argument, ran silently wrong, or failed under torch.compile(fullgraph=True). Grouped by item; every group has a
positive control (a valid call that runs). Bits are compared through integer views (aligned_ops.testing)."""

from __future__ import annotations

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, bitwise_equal

ops = torch.ops.aligned


# ---- 1. a 0-d tensor temperature under torch.compile(fullgraph=True) ------------------------------------------------
# It was read with float(tensor): a SymFloat under Dynamo, which the ops' `float temperature` argument refuses. It is
# now the per-row temperatures expanded to the rows; the kernels read temps[row] where they read the scalar.


def _logits(T=5, V=97, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(T, V, generator=g) * 4).to(dtype)
    return z, torch.randint(0, V, (T,), generator=g), torch.randn(T, V, generator=g)


def _logits_fn(name, ids):
    if name == "token_logprobs":
        return lambda z, t: aligned_ops.token_logprobs(z, ids, t)
    return lambda z, t: getattr(aligned_ops, name)(z, t)


def _forward_backward(fn, leaves, t, gw):
    leaves = [x.clone().requires_grad_(True) for x in leaves]
    y = fn(*leaves, t)
    (y * gw.flatten()[: y.numel()].reshape(y.shape)).sum().backward()
    return [y.detach()] + [x.grad for x in leaves]


def _assert_all_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert_bitwise_equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_0d_temperature_per_row_path_equals_scalar_path_bitwise(dtype):
    # What the fix relies on: the per-row temperatures (all equal) give the scalar temperature's bits, every op.
    z, ids, gz = _logits(dtype=dtype)
    T = z.shape[0]
    for tau in (0.7, 1.0, 2.5e-3, 3.0):
        t32 = float(torch.tensor(tau))  # the value a 0-d fp32 tensor holds
        ts = torch.full((T,), t32)
        g = gz[:, 0].contiguous()
        for scalar, rows in [
            (ops.token_logprobs(z, ids, t32, None), ops.token_logprobs(z, ids, 1.0, ts)),
            (ops.log_softmax(z, t32, None), ops.log_softmax(z, 1.0, ts)),
            (ops.logsumexp(z, t32, None), ops.logsumexp(z, 1.0, ts)),
            (ops.token_logprobs_backward(g, z, ids, t32, None), ops.token_logprobs_backward(g, z, ids, 1.0, ts)),
            (ops.logsumexp_backward(g, z, t32, None), ops.logsumexp_backward(g, z, 1.0, ts)),
            (ops.log_softmax_backward(gz, z, t32, None), ops.log_softmax_backward(gz, z, 1.0, ts)),
        ]:
            assert_bitwise_equal(scalar, rows)


@pytest.mark.parametrize("name", ["token_logprobs", "log_softmax", "logsumexp"])
def test_0d_temperature_compiles_fullgraph_with_eager_bits(name):
    z, ids, gw = _logits()
    fn = _logits_fn(name, ids)
    eager_float = _forward_backward(fn, [z], 0.7, gw)  # positive control: the documented float form
    eager_0d = _forward_backward(fn, [z], torch.tensor(0.7), gw)
    torch._dynamo.reset()
    cf = torch.compile(fn, fullgraph=True)  # failed: "Expected a value of type 'float' ... found type 'SymFloat'"
    compiled_0d = _forward_backward(cf, [z], torch.tensor(0.7), gw)
    _assert_all_bitwise(eager_float, eager_0d)
    _assert_all_bitwise(eager_float, compiled_0d)
    # another value through the same compiled function: the temperature is an input, not a constant of the graph
    _assert_all_bitwise(_forward_backward(fn, [z], 1.3, gw), _forward_backward(cf, [z], torch.tensor(1.3), gw))


@pytest.mark.parametrize("name", ["token_logprobs", "log_softmax", "logsumexp"])
def test_float_temperature_compiles_dynamic_with_eager_bits(name):
    # Was: torch.compile(dynamic=True) (floats become SymFloat inputs) died in Dynamo tracing the temperature check:
    # InternalTorchDynamoError: RecursionError: maximum recursion depth exceeded (also from a patched HF model,
    # torch.compile(model, dynamic=True) with completion_mask). A symbolic temperature goes to the op unchecked; the
    # op checks it when it runs (csrc/torch/checks/logits.h).
    z, ids, gw = _logits()
    fn = _logits_fn(name, ids)
    torch._dynamo.reset()
    cf = torch.compile(fn, dynamic=True)
    for t in (0.7, 1.3):  # control: a second value is not the first's bits, and is eager's
        _assert_all_bitwise(_forward_backward(fn, [z], t, gw), _forward_backward(cf, [z], t, gw))
    assert not bitwise_equal(fn(z, 0.7), fn(z, 1.3))
    with pytest.raises(RuntimeError, match=rf"aligned::{name}: temperature must be finite and > 0, got -1"):
        cf(z, -1.0)


def test_0d_temperature_fused_token_logprobs_compiles_fullgraph_with_eager_bits():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(6, 16, generator=g).to(torch.bfloat16)
    w = (torch.randn(50, 16, generator=g) * 0.5).to(torch.bfloat16)
    ids = torch.randint(0, 50, (6,), generator=g)
    gw = torch.randn(6, generator=g)

    def fn(h, w, t):
        return aligned_ops.fused_token_logprobs(h, w, ids, t, token_chunk=4, vocab_chunk=16)

    eager_float = _forward_backward(fn, [h, w], 0.7, gw)
    eager_0d = _forward_backward(fn, [h, w], torch.tensor(0.7), gw)
    torch._dynamo.reset()
    compiled_0d = _forward_backward(torch.compile(fn, fullgraph=True), [h, w], torch.tensor(0.7), gw)
    _assert_all_bitwise(eager_float, eager_0d)
    _assert_all_bitwise(eager_float, compiled_0d)
    # and the unfused path at the float temperature (what the fused op promises)
    unfused = _forward_backward(lambda h, w, t: aligned_ops.token_logprobs(aligned_ops.linear(h, w), ids, t), [h, w],
                                0.7, gw)
    _assert_all_bitwise(eager_float, unfused)


# ---- 8. the Python-side temperature errors name the op and the argument -----------------------------------------


@pytest.mark.parametrize("name", ["token_logprobs", "log_softmax", "logsumexp", "fused_token_logprobs"])
def test_temperature_errors_name_the_op_and_the_argument(name):
    z, ids, _ = _logits(T=3, V=11, dtype=torch.float32)
    if name == "fused_token_logprobs":
        w = torch.randn(11, 11)
        call = lambda t: aligned_ops.fused_token_logprobs(z, w, ids, t)  # noqa: E731
    else:
        call = lambda t: _logits_fn(name, ids)(z, t)  # noqa: E731
    assert call(0.5).shape[0] == 3  # positive control
    assert call(torch.tensor(0.5)).shape[0] == 3
    for bad in (0.0, -1.0, float("nan"), float("inf"), torch.tensor(0.0), torch.tensor(-2.0)):
        with pytest.raises(ValueError, match=rf"^aligned_ops\.{name}: temperature must be finite and > 0"):
            call(bad)
    for bad in (1e-50, 1e39, torch.tensor(1e-50, dtype=torch.float64)):
        with pytest.raises(ValueError, match=rf"^aligned_ops\.{name}: temperature .* not representable in float32"):
            call(bad)
    with pytest.raises(TypeError, match=rf"^aligned_ops\.{name}: temperature must be a float"):
        call("hot")


def test_0d_temperature_is_checked_with_no_rows():
    # a 0-d tensor on no rows was not checked at all (the per-row check reads rows); a float always was
    z = torch.empty(0, 7)
    assert aligned_ops.logsumexp(z, torch.tensor(0.5)).shape == (0,)  # positive control
    with pytest.raises(ValueError, match=r"^aligned_ops\.logsumexp: temperature must be finite and > 0"):
        aligned_ops.logsumexp(z, torch.tensor(0.0))


@pytest.mark.parametrize("name", ["token_logprobs", "log_softmax", "logsumexp", "fused_token_logprobs"])
@pytest.mark.parametrize("logits_grad", [True, False])
def test_a_temperature_tensor_that_requires_grad_is_refused(name, logits_grad):
    """The ops treat the temperature as a constant (their backward returns no gradient for it): a per-row or 0-d
    temperature tensor that required grad ran, and its .grad stayed None where torch's log_softmax(z / t) gives one
    (token_logprobs: -6.77 on the first row of this probe's case) — silently. It is refused at the autograd-recorded
    call, naming the op (the raw op too). Positive controls: the same tensor detached, and the same call under
    no_grad, run, to the bits of the detached call."""
    z, ids, gw = _logits(T=3, V=11, dtype=torch.float32)
    w = torch.randn(11, 11, generator=torch.Generator().manual_seed(1))
    if name == "fused_token_logprobs":
        call = lambda x, t: aligned_ops.fused_token_logprobs(x, w, ids, t)  # noqa: E731
    else:
        call = _logits_fn(name, ids)
    x = z.clone().requires_grad_(logits_grad)
    for t in (torch.tensor([0.5, 1.0, 2.0]), torch.tensor(0.7)):
        ok = call(x, t)  # positive control: a constant temperature tensor
        if logits_grad:
            (ok * gw.flatten()[: ok.numel()].reshape(ok.shape)).sum().backward()
        with torch.no_grad():
            assert_bitwise_equal(call(x, t.clone().requires_grad_(True)), ok.detach())
        with pytest.raises(ValueError, match=rf"^aligned::{name}: the temperature tensor requires grad, but the op "
                                             r"treats it as a constant"):
            call(x, t.clone().requires_grad_(True))
    raw = {"token_logprobs": lambda t: ops.token_logprobs(x, ids, 1.0, t),
           "log_softmax": lambda t: ops.log_softmax(x, 1.0, t), "logsumexp": lambda t: ops.logsumexp(x, 1.0, t),
           "fused_token_logprobs": lambda t: ops.fused_token_logprobs(x, w, None, ids, 1.0, t, 0, 0)}[name]
    with pytest.raises(ValueError, match=rf"^aligned::{name}: the temperature tensor requires grad"):
        raw(torch.tensor([0.5, 1.0, 2.0], requires_grad=True))


# ---- 9. fused_token_logprobs: errors name it, not its pieces (token_logprobs_pairs, linear) -----------------------


def test_fused_token_logprobs_errors_name_the_fused_op():
    g = torch.Generator().manual_seed(5)
    h, w, ids = torch.randn(4, 8, generator=g), torch.randn(11, 8, generator=g), torch.tensor([0, 3, 10, 5])
    assert aligned_ops.fused_token_logprobs(h, w, ids).shape == (4,)  # positive control
    assert aligned_ops.fused_token_logprobs(h, w, ids.int(), torch.full((4,), 0.5)).shape == (4,)
    op = r"^aligned::fused_token_logprobs: "
    for bad_ids in (ids.float(), ids.short(), torch.ones(4, dtype=torch.bool)):
        with pytest.raises(ValueError, match=op + "token_ids must be int64 or int32"):
            aligned_ops.fused_token_logprobs(h, w, bad_ids)
    for dt in (torch.float64, torch.int32):
        with pytest.raises(ValueError, match=op + "hidden must be float32, bfloat16 or float16"):
            aligned_ops.fused_token_logprobs(h.to(dt), w.to(dt), ids)
    for temps in (torch.tensor([1.0, 1.0, -1.0, 1.0]), torch.tensor([1.0, float("nan"), 1.0, 1.0]),
                  torch.tensor([1.0, 1.0, 1.0, 1e-40])):
        with pytest.raises(ValueError, match=op + "every temperature must be finite and > 0"):
            aligned_ops.fused_token_logprobs(h, w, ids, temps)
    with pytest.raises(ValueError, match=op + "temperature must be finite and > 0"):
        ops.fused_token_logprobs(h, w, None, ids, 0.0, None, 0, 0)  # the op itself, not only the wrapper


# ---- 2. moe_layer: the router's experts must be w13's / w2's ------------------------------------------------------


def _moe(E_router=4, E_w=4, H=8, I=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, H, generator=g)
    router = torch.randn(E_router, H, generator=g)
    return x, router, torch.randn(E_w, 2 * I, H, generator=g), torch.randn(E_w, H, I, generator=g)


def test_moe_layer_router_experts_must_match_the_weights():
    x, router, w13, w2 = _moe()
    out, (logits, _, ids, _) = aligned_ops.moe_layer(x, router, w13, w2, 2, return_routing=True)  # positive control
    assert out.shape == x.shape and logits.shape == (3, 4)
    x, router, w13, w2 = _moe(E_router=5)
    router[4] = -100 * x.sum(0) / x.sum(0).norm()  # no token picks expert 4: this ran, silently, with 5 vs 4
    assert int(ops.moe_routing(ops.linear(x, router, None), 2, "softmax", True)[1].max()) < 4
    msg = r"^aligned_ops\.moe_layer: router_weight has 5 experts \(rows\) but w13 has 4 and w2 4"
    with pytest.raises(ValueError, match=msg):
        aligned_ops.moe_layer(x, router, w13, w2, 2)
    router[4] = 100 * x.sum(0).sign()  # every token picks it: was "moe_experts: topk_ids must lie in [0, 4)"
    with pytest.raises(ValueError, match=msg):
        aligned_ops.moe_layer(x, router, w13, w2, 2)
    x, router, w13, w2 = _moe(E_router=3)  # fewer router rows: expert 3 never used
    with pytest.raises(ValueError, match=r"router_weight has 3 experts \(rows\) but w13 has 4 and w2 4"):
        aligned_ops.moe_layer(x, router, w13, w2, 2)
    x, router, w13, w2 = _moe()
    with pytest.raises(ValueError, match=r"^aligned_ops\.moe_layer: router_weight has 4 .* w13 has 4 and w2 5"):
        aligned_ops.moe_layer(x, router, w13, torch.randn(5, 8, 3), 2)
    with pytest.raises(ValueError, match=r"^aligned_ops\.moe_layer: router_weight must be 2-D"):
        aligned_ops.moe_layer(x, router[None], w13, w2, 2)
    with pytest.raises(ValueError, match=r"^aligned_ops\.moe_layer: router_weight must be \[4, 8\]"):
        aligned_ops.moe_layer(x, router[:, :7], w13, w2, 2)
    # the shared expert's shapes: moe_experts names them
    with pytest.raises(RuntimeError, match=r"aligned::moe_experts: shared_w13 must be"):
        aligned_ops.moe_layer(x, router, w13, w2, 2, shared_w13=torch.randn(6, 7), shared_w2=torch.randn(8, 3))
    with pytest.raises(RuntimeError, match=r"aligned::moe_experts: shared_w2 must be \[8, 3\]"):
        aligned_ops.moe_layer(x, router, w13, w2, 2, shared_w13=torch.randn(6, 8), shared_w2=torch.randn(8, 4))
    assert aligned_ops.moe_layer(x, router, w13, w2, 2, shared_w13=torch.randn(6, 8),
                                 shared_w2=torch.randn(8, 3)).shape == x.shape  # positive control, shared expert


# ---- 3. emulation scopes exited out of order ----------------------------------------------------------------------


@pytest.mark.emulated
def test_emulation_scopes_must_be_exited_innermost_first():
    x, w = torch.randn(2, 32), torch.ones(32)
    with aligned_ops.emulate("sm_90") as outer:  # positive control: nested `with` blocks
        with aligned_ops.emulate("gfx942") as inner:
            aligned_ops.rms_norm(x, w)
        aligned_ops.rms_norm(x, w)
    assert {launch.arch for launch in inner.launches} == {"gfx942"}
    assert "sm_90" in {launch.arch for launch in outer.launches}  # (an outer scope also lists its inner's launches)

    a, b = aligned_ops.emulate("sm_90"), aligned_ops.emulate("gfx942")
    a.__enter__()
    b.__enter__()
    try:
        # was accepted: the runtime left gfx942 (its innermost) and kept running sm_90 with only gfx942 open
        with pytest.raises(RuntimeError, match=r"^aligned_ops\.emulate: scopes must be exited innermost first: this "
                                               r"sm_90 scope .* still active \(gfx942\)"):
            a.__exit__(None, None, None)
        assert aligned_ops.emulation.active() is b  # nothing changed: gfx942 still runs
        aligned_ops.rms_norm(x, w)
    finally:
        b.__exit__(None, None, None)
        a.__exit__(None, None, None)
    assert b.launches and {launch.arch for launch in b.launches} == {"gfx942"}
    assert "sm_90" not in {launch.arch for launch in a.launches}  # the op ran while only gfx942 was innermost
    assert aligned_ops.emulation.active() is None
    with pytest.raises(RuntimeError, match=r"^aligned_ops\.emulate: this sm_90 scope is not active"):
        a.__exit__(None, None, None)  # exited twice: would have ended whatever scope was open
    assert aligned_ops.emulation.active() is None


# ---- 4. linear_lane_bounds / linear_tp_slices: K must be a non-negative integer -----------------------------------


def test_lane_bounds_and_tp_slices_refuse_negative_k():
    assert aligned_ops.linear_lane_bounds(16) == [(2 * i, 2 * i + 2) for i in range(8)]  # positive controls
    assert aligned_ops.linear_lane_bounds(0) == [(0, 0)] * 8
    assert aligned_ops.linear_tp_slices(16, 2) == [(0, 8), (8, 16)]
    assert aligned_ops.linear_lane_bounds(torch.tensor(16).item()) == aligned_ops.linear_lane_bounds(16)
    for K in (-5, -1):  # returned negative ranges
        with pytest.raises(ValueError, match=rf"^aligned_ops\.linear_lane_bounds: K \(input features\) must be an integer >= 0, "
                                             rf"got {K}"):
            aligned_ops.linear_lane_bounds(K)
    with pytest.raises(ValueError, match=r"^aligned_ops\.linear_tp_slices: K \(input features\) must be an integer >= 0, got -8"):
        aligned_ops.linear_tp_slices(-8, 2)
    for bad in (8.0, "8", None):
        with pytest.raises(TypeError, match=r"^aligned_ops\.linear_lane_bounds: K \(input features\) must be an int"):
            aligned_ops.linear_lane_bounds(bad)
        with pytest.raises(TypeError, match=r"^aligned_ops\.linear_tp_slices: K \(input features\) must be an int"):
            aligned_ops.linear_tp_slices(bad, 2)


# ---- 5. paged attention with neither the metadata nor a plan ------------------------------------------------------


def _one_sequence(T=3, H=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(T, 1, D, generator=g), torch.randn(T, 1, D, generator=g)
    meta = (torch.zeros(1, 1, dtype=torch.int32), torch.tensor([T], dtype=torch.int32),
            torch.tensor([0, T], dtype=torch.int32))
    return q, k, v, meta


def test_paged_attention_without_metadata_or_plan_names_what_is_missing():
    q, k, v, (bt, sl, qsl) = _one_sequence()
    kc, vc = torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8)
    aligned_ops.reshape_and_cache(k, v, kc, vc, torch.arange(3))
    out = aligned_ops.paged_attention(q, kc, vc, bt, sl, qsl)  # positive control: attention_varlen's bits
    assert_bitwise_equal(out, aligned_ops.attention_varlen(q, k, v, qsl, qsl)[0])
    op = r"^aligned_ops\.paged_attention: "
    with pytest.raises(ValueError, match=op + r"block_table, seq_lens, query_start_loc missing: pass .* or plan="):
        aligned_ops.paged_attention(q, kc, vc)  # was "RuntimeError: tensor does not have a device"
    with pytest.raises(ValueError, match=op + r"seq_lens, query_start_loc missing"):
        aligned_ops.paged_attention(q, kc, vc, bt)
    with pytest.raises(ValueError, match=op + r"query_start_loc missing"):
        aligned_ops.paged_attention(q, kc, vc, bt, sl)


def test_mla_paged_attention_without_metadata_or_plan_names_what_is_missing():
    R, D = 6, 8
    q, _, _, (bt, sl, qsl) = _one_sequence(D=D, seed=1)
    kv = torch.randn(3, D, generator=torch.Generator().manual_seed(2))
    cache = torch.zeros(1, 4, D)
    aligned_ops.mla_reshape_and_cache(kv[:, :R].contiguous(), kv[:, R:].contiguous(), cache, torch.arange(3))
    out = aligned_ops.mla_paged_attention(q, cache, bt, sl, qsl, kv_lora_rank=R, scale=0.3)  # positive control
    assert_bitwise_equal(out, aligned_ops.mla_attention_varlen(q, kv, qsl, qsl, R, 0.3)[0])
    op = r"^aligned_ops\.mla_paged_attention: "
    with pytest.raises(ValueError, match=op + r"block_table, seq_lens, query_start_loc missing: pass .* or plan="):
        aligned_ops.mla_paged_attention(q, cache, kv_lora_rank=R, scale=0.3)
    with pytest.raises(ValueError, match=op + r"query_start_loc missing"):
        aligned_ops.mla_paged_attention(q, cache, bt, sl, kv_lora_rank=R, scale=0.3)


# ---- 6. check_device_errors() with its default device on a CPU-only torch -----------------------------------------

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the default device is CUDA where torch has one")


@cpu_only
def test_check_device_errors_default_returns_at_once_on_cpu_only_torch():
    aligned_ops.check_device_errors("cpu")  # positive control: the CPU backend, explicitly
    aligned_ops.check_device_errors(torch.zeros(1))
    aligned_ops.check_device_errors()  # was "AssertionError: Torch not compiled with CUDA enabled"
    with pytest.raises(RuntimeError, match=r"^aligned_ops\.check_device_errors: device 'cuda' is not available"):
        aligned_ops.check_device_errors("cuda")
    with pytest.raises(ValueError, match=r"^aligned_ops\.check_device_errors: device must be a device"):
        aligned_ops.check_device_errors("bogus")


@cpu_only
@pytest.mark.emulated
def test_check_device_errors_default_reads_the_emulated_words():
    logits = torch.randn(3, 37)
    with aligned_ops.emulate("sm_90"):
        aligned_ops.check_device_errors()  # clean before
        ops.log_softmax(logits, 1.0, torch.tensor([1.0, 0.0, 0.7]))  # a bad value: reported by the kernel
        with pytest.raises(RuntimeError, match="every temperature must be finite and > 0"):
            aligned_ops.check_device_errors()
        aligned_ops.check_device_errors()  # reading cleared the words


# ---- 7. AttentionPlan's sizes and device --------------------------------------------------------------------------


def test_attention_plan_sizes_are_checked_by_name():
    plan = aligned_ops.AttentionPlan(4, 4, 64)  # positive controls
    assert (plan.capacity, plan.table_capacity, plan.workspace_floats) == (4, 4, 64)
    assert aligned_ops.AttentionPlan().capacity == 1
    q, k, v, (_, _, cu) = _one_sequence()
    planned = aligned_ops.AttentionPlan(0).plan_varlen(cu, cu, 2, 1, 8)  # grows to fit
    assert_bitwise_equal(aligned_ops.attention_varlen(q, k, v, cu, cu, plan=planned)[0],
                         aligned_ops.attention_varlen(q, k, v, cu, cu)[0])
    rng = r"must be an integer in \[0, \d+\], got "
    # was AttributeError: 'NoneType' object has no attribute 'zero_' / "zeros: Dimension size must be non-negative"
    for kw, got in ((dict(capacity=-5), "-5"), (dict(capacity=2**62), str(2**62)), (dict(table_capacity=-1), "-1"),
                    (dict(workspace_floats=-3), "-3"), (dict(workspace_floats=2**62), str(2**62))):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=rf"^aligned_ops\.AttentionPlan: {name} {rng}{got}$"):
            aligned_ops.AttentionPlan(**kw)
    for bad in (2.5, "4", True, None):
        with pytest.raises(TypeError, match=rf"^aligned_ops\.AttentionPlan: capacity {rng}"):
            aligned_ops.AttentionPlan(capacity=bad)
    with pytest.raises(ValueError, match=rf"^aligned_ops\.AttentionPlan\.ensure: capacity {rng}-1$"):
        plan.ensure(-1)
    assert plan.capacity == 4  # unchanged
    with pytest.raises(ValueError, match=r"^aligned_ops\.AttentionPlan: device must be a device"):
        aligned_ops.AttentionPlan(device="bogus")


# ---- 9. the public function composing inner ops checks its own arguments first ------------------------------------


def test_linear_exact_errors_name_linear_exact_and_the_argument():
    g = torch.Generator().manual_seed(9)
    x, w, b = torch.randn(2, 8, generator=g), torch.randn(5, 8, generator=g), torch.randn(5, generator=g)
    assert_bitwise_equal(aligned_ops.linear_exact(x, w, b), ops.linear_exact(x, w, b))  # positive controls
    assert aligned_ops.linear_exact(x[0], w).shape == (5,)
    op = r"^aligned_ops\.linear_exact: "
    with pytest.raises(ValueError, match=op + r"x must have at least one dimension"):
        aligned_ops.linear_exact(torch.tensor(1.0), w)  # was "x has 0 input features"
    for bad in (torch.randn(4), torch.randn(5).double(), torch.randn(1, 5), torch.tensor(1.0)):
        # was "aligned::linear_exact_packed: bias must be ..."
        with pytest.raises(ValueError, match=op + r"bias must be \[5\] \(weight's out_features\) with x's dtype"):
            aligned_ops.linear_exact(x, w, bad)
    aligned_ops.cache_exact_weights(w)  # the cached (packed) route checks the same
    assert_bitwise_equal(aligned_ops.linear_exact(x, w, b), ops.linear_exact(x, w, b))
    with pytest.raises(ValueError, match=op + r"bias must be \[5\]"):
        aligned_ops.linear_exact(x, w, torch.randn(4))
    # a registered weight's dtype, in_features or rank that is not x's: the packed op's words were "aligned::
    # linear_exact_packed: weight must be the packed weight itself" / "the packed weight has 8", or the pack op's
    for cached in (True, False):
        wt = w.bfloat16() if not cached else w.clone()
        if cached:
            aligned_ops.cache_exact_weights(wt)
        with pytest.raises(ValueError, match=op + r"weight dtype torch.(float32|bfloat16) must equal x dtype"):
            aligned_ops.linear_exact(x.bfloat16() if cached else x, wt)
        with pytest.raises(ValueError, match=op + r"x has 7 input features but weight has 8"):
            aligned_ops.linear_exact(x[:, :7], w if cached else w.clone())
        with pytest.raises(ValueError, match=op + r"weight must be \[out_features, in_features\], got \[40\]"):
            aligned_ops.linear_exact(x, w.reshape(-1) if cached else w.clone().reshape(-1))


def test_the_linear_exact_op_itself_names_linear_exact():
    """torch.ops.aligned.linear_exact (the op the wrapper calls; torch.compile graphs call it too) runs its packed
    forward under its own name: a bad bias named linear_exact_packed, a 0-d x said "x has 0 input features"."""
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(2, 8, generator=g), torch.randn(5, 8, generator=g)
    with pytest.raises(RuntimeError, match=r"^aligned::linear_exact: x must have at least one dimension"):
        ops.linear_exact(torch.tensor(1.0), w)
    for bad in (torch.randn(4), torch.randn(5).double()):
        with pytest.raises(RuntimeError, match=r"^aligned::linear_exact: bias must be \[5\] with x's dtype"):
            ops.linear_exact(x, w, bad)
    ops.linear_exact(x, w, torch.randn(5))  # control


def test_mla_absorbed_weights_errors_name_it_and_the_argument():
    H, dn, dv, R = 3, 4, 5, 6
    kv_b = torch.randn(H * (dn + dv), R)
    absorbed = aligned_ops.mla_absorbed_weights(kv_b, H, dn, dv)  # positive control
    assert absorbed.w_uk_t.shape == (H, R, dn) and absorbed.w_uv.shape == (H, dv, R)
    op = r"^aligned_ops\.mla_absorbed_weights: "
    # (-3) * (-4 + -5) = 27 = the weight's rows: the shape check passed, torch's view failed
    with pytest.raises(ValueError, match=op + r"num_heads must be an integer >= 1, got -3"):
        aligned_ops.mla_absorbed_weights(kv_b, -3, -4, -5)
    with pytest.raises(ValueError, match=op + r"qk_nope_head_dim must be an integer >= 1, got 0"):
        aligned_ops.mla_absorbed_weights(kv_b, H, 0, dn + dv)
    with pytest.raises(ValueError, match=op + r"v_head_dim must be an integer >= 1, got -1"):
        aligned_ops.mla_absorbed_weights(kv_b, H, dn, -1)
    with pytest.raises(TypeError, match=op + r"num_heads must be an integer >= 1, got 3.5"):
        aligned_ops.mla_absorbed_weights(kv_b, 3.5, dn, dv)
    with pytest.raises(ValueError, match=op + r"kv_b_proj weight must be \[num_heads \* \(qk_nope_head_dim"):
        aligned_ops.mla_absorbed_weights(kv_b, 2, dn, dv)
    with pytest.raises(ValueError, match=r"^aligned_ops\.MlaAbsorbedWeights: num_heads must be an integer >= 1"):
        aligned_ops.ops.mla.MlaAbsorbedWeights(kv_b, -3, -4, -5)


# ---- 10. integer and bool arguments of the wrappers: no silent int() / bool() -------------------------------------
# The wrappers passed int(top_k), int(kv_lora_rank), int(token_chunk), ... and the ops' bool arguments as given: a
# 2.7 top_k routed to 2 experts, a 16.5 rotary_dim built a 16-wide table, token_chunk="2" ran, causal=None ran
# NON-causal attention (torch's schema takes None as False) and renormalize="no" renormalised. Each is now refused by
# name (aligned_ops.<function>: <argument>); integer-valued numpy / torch scalars and numpy / 0-d tensor bools still
# run, to the bits of the plain int / bool (the positive controls).


def _int_bool_cases():
    import numpy as np

    g = torch.Generator().manual_seed(11)
    z, x8 = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    q, k, v = (torch.randn(4, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 4], dtype=torch.int32)
    qm, kv = torch.randn(4, 2, 10, generator=g), torch.randn(4, 10, generator=g)
    h, w, ids = torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g), torch.tensor([0, 4, 2])
    cache = aligned_ops.rotary_cos_sin_cache(8, 16)
    pos, xr = torch.tensor([0, 3, 15]), torch.randn(3, 2, 8, generator=g)
    layer = (torch.randn(4, 8, generator=g), torch.randn(4, 6, 8, generator=g), torch.randn(4, 8, 3, generator=g))
    # (function, argument, call(value), the good value, the bad values)
    return [
        ("moe_routing", "top_k", lambda t: aligned_ops.moe_routing(z, t), 2, (2.7, True, "2")),
        ("moe_routing", "renormalize", lambda r: aligned_ops.moe_routing(z, 2, "softmax", r), False, ("no", None, 0)),
        ("moe_grouped_routing", "n_group", lambda n: aligned_ops.moe_grouped_routing(z, None, 2, n, 2), 4, (4.5,)),
        ("moe_grouped_routing", "topk_group", lambda n: aligned_ops.moe_grouped_routing(z, None, 2, 4, n), 2, (2.0,)),
        ("moe_routing", "top_k", lambda t: aligned_ops.moe_layer(x8, *layer, t), 2, (2.5,)),
        ("attention_varlen", "causal", lambda c: aligned_ops.attention_varlen(q, k, v, cu, cu, causal=c)[0], True,
         (None, "no", 1)),
        ("mla_attention_varlen", "kv_lora_rank", lambda r: aligned_ops.mla_attention_varlen(qm, kv, cu, cu, r, 0.3)[0],
         8, (8.5,)),
        ("mla_attention_varlen", "causal", lambda c: aligned_ops.mla_attention_varlen(qm, kv, cu, cu, 8, 0.3, c)[0],
         True, (None,)),
        ("fused_token_logprobs", "token_chunk", lambda c: aligned_ops.fused_token_logprobs(h, w, ids, token_chunk=c),
         2, (2.5, "2")),
        ("fused_token_logprobs", "vocab_chunk", lambda c: aligned_ops.fused_token_logprobs(h, w, ids, vocab_chunk=c),
         3, (3.0,)),
        ("rotary_embedding", "rotary_dim", lambda r: aligned_ops.rotary_embedding(pos, xr, cache, r), 8, (8.5,)),
        ("rotary_embedding", "is_neox", lambda b: aligned_ops.rotary_embedding(pos, xr, cache, 8, b), False,
         (None, "no")),
        ("rotary_cos_sin_cache", "rotary_dim", lambda r: aligned_ops.rotary_cos_sin_cache(r, 16), 8, (8.5,)),
        ("rotary_cos_sin_cache", "max_position", lambda m: aligned_ops.rotary_cos_sin_cache(8, m), 16, (16.9,)),
    ], np


def test_integer_and_bool_arguments_are_not_truncated_or_coerced():
    cases, np = _int_bool_cases()
    for fn, arg, call, good, bads in cases:
        want = call(good)  # positive control
        first = want[0] if isinstance(want, tuple) else want
        alts = [np.bool_(good), torch.tensor(good)] if isinstance(good, bool) else [np.int64(good), torch.tensor(good)]
        for alt in alts:
            got = call(alt)
            assert_bitwise_equal(got[0] if isinstance(got, tuple) else got, first)
        kind = "a bool" if isinstance(good, bool) else "an integer"
        for bad in bads:
            with pytest.raises(TypeError, match=rf"^aligned_ops\.{fn}: {arg} must be {kind}, got {bad!r}"):
                call(bad)
