"""moe_experts on the GPU kernel source (csrc/gpu/moe_kernels.cuh; how a call runs: csrc/gpu/moe_api.h) under
emulation, both linear profiles, at both warp widths (sm_90: 32, gfx942: wave64), under the rotated schedules.

What is proven here, on integer views only:
* `fma`: the GPU kernels equal the CPU backend bit for bit (the profile's CPU == CUDA == HIP promise), every
  dtype, with and without a shared expert and its gate, top-k 1 / 4 / 8; the backward (composed of aligned ops,
  ops/moe.py) too;
* `mma`: the GPU kernels equal moe.h's tree composed from the emulator's model of the unit
  (_linear_mma_reference, the reference of aligned::linear_mma) under both MMA models;
* a token's output is bitwise the same alone and inside batches of T = 1, 7, 64, 200 and a shuffled batch with
  other tokens (other expert mixes, other tile fillings), top-k 1, 2, 8, with and without a shared expert;
* NEGATIVE CONTROLS: a combine in expert-id order instead of the token's rank order is caught by the equality
  with the CPU (fma) and with the reference (mma); a grouped mma tile whose k-block order follows how many tokens
  share the expert is caught by the alone-vs-batch comparison under the order-sensitive model;
* the run makes no host copy and its launch grids depend only on the shapes (not on the ids): graph-capturable;
* a bad expert id makes its token NaN and reports through check_device_errors; bad arguments raise by message.
"""

from __future__ import annotations

import pytest
import torch

import aligned_ops
from aligned_ops.emulation import MMA_MODELS
from aligned_ops.testing import assert_bitwise_equal, count_bitwise_equal

ops = torch.ops.aligned
pytestmark = pytest.mark.emulated

WIDTHS = ["sm_90", "gfx942"]
H, I, E, IS = 40, 24, 8, 16  # H: lanes of 5 k (the mma k-block padded); 2I = 48: 3 column blocks


def make_case(T, k, dt=torch.bfloat16, shared=False, gate=False, seed=0, H=H, I=I, E=E):
    """x, routing weights and ids (ids in the token's top-k rank order, not sorted by expert), expert weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dt)
    logits = torch.randn(T, E, generator=g) * 2.0
    tw, ids, _ = ops.moe_routing(logits, k, "softmax", True)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.3).to(dt)
    w2 = (torch.randn(E, H, I, generator=g) * 0.3).to(dt)
    sw13 = (torch.randn(2 * IS, H, generator=g) * 0.3).to(dt) if shared else None
    sw2 = (torch.randn(H, IS, generator=g) * 0.3).to(dt) if shared else None
    sg = (torch.randn(1, H, generator=g) * 0.3).to(dt) if gate else None
    return x, tw, ids, w13, w2, sw13, sw2, sg


def run(case, profile, rows=None):
    x, tw, ids, w13, w2, sw13, sw2, sg = case
    if rows is not None:
        x, tw, ids = x[rows].contiguous(), tw[rows].contiguous(), ids[rows].contiguous()
    return ops.moe_experts(x, tw, ids, w13, w2, sw13, sw2, sg, profile)


def assert_tokens_invariant(case, profile):
    """Inside an emulate scope: the rows of the T-token batch equal the same tokens alone (T = 1), in the first 7
    and 64 tokens, and inside a shuffled batch of 64 tokens drawn from the whole batch."""
    T = case[0].shape[0]
    full = run(case, profile)
    for t in (0, 5, T - 1):
        assert_bitwise_equal(run(case, profile, [t])[0], full[t], f"token {t} alone")
    for n in (7, 64):
        if n < T:
            assert_bitwise_equal(run(case, profile, list(range(n))), full[:n], f"first {n} tokens")
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(3))[:64]
    assert_bitwise_equal(run(case, profile, perm), full[perm], "a shuffled batch")
    return full


def mma_reference(case):
    """moe.h's tree from the emulator's model of the unit (inside an emulate scope): h = round_bf16(8-lane model
    sum), a = silu_and_mul(h), y = the unrounded 8-lane sum; the shared expert alike, its gate's logit the
    unrounded sum; acc = +0 + w_r * y_r in rank order (+ g * y_s), rounded once."""
    x, tw, ids, w13, w2, sw13, sw2, sg = case
    (T, k), H = ids.shape, w2.shape[1]

    def mlp(xs, a13, a2):
        h = ops._linear_mma_reference(xs, a13, 8).to(torch.bfloat16)
        return ops._linear_mma_reference(ops.silu_and_mul(h), a2, 8)

    y = torch.empty(T, k, H)
    for e in range(E):  # the model's outputs are per row: an expert's rows in one call
        sel = (ids == e).nonzero()
        if len(sel):
            y[sel[:, 0], sel[:, 1]] = mlp(x[sel[:, 0]].contiguous(), w13[e], w2[e])
    acc = torch.zeros(T, H)
    for r in range(k):
        acc = acc + tw[:, r:r + 1] * y[:, r]
    if sw13 is not None:
        ys = mlp(x, sw13, sw2)
        if sg is not None:
            logit = ops._linear_mma_reference(x, sg, 8)
            gate = 1.0 / (1.0 + ops._exp_f32(-logit))
        else:
            gate = torch.ones(T, 1)
        acc = acc + gate * ys
    return acc.to(torch.bfloat16)


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("dt,k,shared,gate", [(torch.bfloat16, 4, True, True), (torch.float32, 8, True, False),
                                              (torch.float16, 1, False, False)])
def test_fma_equals_cpu(arch, dt, k, shared, gate):
    case = make_case(64, k, dt, shared, gate, seed=1)
    cpu = run(case, "fma")
    with aligned_ops.emulate(arch) as em:
        gpu = run(case, "fma")
    assert "moe_grouped_gemm_kernel" in em.kernels()  # the GPU kernels ran, not the CPU backend
    assert_bitwise_equal(gpu, cpu)


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("model", MMA_MODELS)
def test_mma_equals_reference(arch, model):
    case = make_case(40, 4, shared=True, gate=True, seed=2, H=136)  # lanes of 17 k: two k-blocks, one padded
    with aligned_ops.emulate(arch, mma_model=model) as em:
        gpu = run(case, "mma")
        ref = mma_reference(case)
    assert "moe_grouped_mma_kernel" in em.kernels()
    assert_bitwise_equal(gpu, ref)


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("profile", ["fma", "mma"])
@pytest.mark.parametrize("k,shared,gate,experts,dt", [(1, False, False, E, torch.bfloat16),
                                                      (2, True, True, E, torch.bfloat16),
                                                      (8, True, False, 16, torch.bfloat16),
                                                      (4, True, True, 16, torch.float32)])
def test_token_bits_alone_and_in_batches(arch, profile, k, shared, gate, experts, dt):
    # top-8 of 16 experts: the tokens' expert mixes (and so the tiles they share) vary. fp32 (fma only): there
    # every order shows — at these sizes the bf16 roundings of h and of the output hide a reordered fp32 chain
    # (test_negative_control_fma_tile_chain_by_rows)
    if dt == torch.float32 and profile == "mma":
        pytest.skip("the mma profile takes bfloat16")
    case = make_case(200, k, dt, shared=shared, gate=gate, seed=10 + k, E=experts)
    with aligned_ops.emulate(arch, mma_model="fma_chain"):  # the order-sensitive model (mma)
        full = assert_tokens_invariant(case, profile)
    if profile == "fma":
        assert_bitwise_equal(full, run(case, "fma"))  # and the CPU backend's bits


@pytest.mark.parametrize("arch", WIDTHS)
def test_negative_control_combine_by_expert(arch):
    """A combine that adds a token's experts in id order (not its rank order) differs from the CPU (fma) and from
    the reference (mma) — and only then: the same comparisons pass without the fault."""
    case, case_bf = make_case(12, 8, torch.float32, seed=4), make_case(64, 8, seed=4)  # fp32: every order shows
    cpu = run(case, "fma")
    with aligned_ops.emulate(arch, mma_model="fma_chain", _fault="moe_combine_by_expert"):
        bad = run(case, "fma")
        bad_mma, ref = run(case_bf, "mma"), mma_reference(case_bf)
    with aligned_ops.emulate(arch, mma_model="fma_chain"):
        assert_bitwise_equal(run(case, "fma"), cpu)
        assert_bitwise_equal(run(case_bf, "mma"), ref)
    assert count_bitwise_equal(bad, cpu) < cpu.numel()
    with pytest.raises(AssertionError):
        assert_bitwise_equal(bad, cpu)
    with pytest.raises(AssertionError):
        assert_bitwise_equal(bad_mma, ref)


@pytest.mark.parametrize("arch", WIDTHS)
def test_negative_control_tile_order_by_tokens(arch):
    """A grouped mma tile whose k-block order changes once the expert has more than one token in it fails the
    alone-vs-batch check of test_token_bits_alone_and_in_batches under the order-sensitive model. The gate/up
    weights make the order visible through the bf16 roundings: H = 264 gives lanes of 33 k in three k-blocks; x = 1
    and each lane's weights are +2^30 (first block), -2^30 (second), w (third): in ascending block order the big
    terms cancel and w survives, in descending order w is absorbed by -2^30 first and the lane sums to 0."""
    x, tw, ids, w13, w2, *_ = make_case(48, 2, seed=5, H=264)
    x = torch.ones_like(x)
    big = torch.zeros(264)
    for lane in range(8):
        big[33 * lane], big[33 * lane + 16] = 2.0 ** 30, -(2.0 ** 30)
    small = torch.zeros(264, dtype=torch.bool)
    small[32::33] = True
    w13 = torch.where(small, w13.float(), big).to(torch.bfloat16)
    case = (x, tw, ids, w13, w2, None, None, None)
    with aligned_ops.emulate(arch, mma_model="fma_chain", _fault="mma_block_order_by_m"):
        with pytest.raises(AssertionError):
            assert_tokens_invariant(case, "mma")


@pytest.mark.parametrize("arch", WIDTHS)
def test_negative_control_fma_tile_chain_by_rows(arch):
    """A grouped fma tile that runs one sequential chain per output once it holds more than one row (its order
    follows how many tokens share the expert) fails the alone-vs-batch check of test_token_bits_alone_and_in_batches
    — the check the fma profile's invariance rests on — while a token alone (one-row tiles) keeps the CPU's bits. In
    fp32, as that test's fp32 case: the bf16 cases' roundings hide a reordered chain at these sizes."""
    case = make_case(200, 4, torch.float32, shared=True, gate=True, seed=14, E=16)  # the fp32 case's tokens
    with aligned_ops.emulate(arch, _fault="moe_fma_chain_by_m"):
        alone = run(case, "fma", [5])
        with pytest.raises(AssertionError):
            assert_tokens_invariant(case, "fma")
    assert_bitwise_equal(alone, run(case, "fma", [5]))


@pytest.mark.parametrize("arch", WIDTHS)
def test_fma_equals_cpu_384_experts(arch):
    """Kimi-K2's expert count (E = 384 > 256 plan threads: the plan kernel's `e += nt` loop runs), top-8, with
    most experts holding rows and some several: the fma kernels give the CPU's bits."""
    E384, T, k, h, i = 384, 96, 8, 16, 8
    g = torch.Generator().manual_seed(30)
    x = torch.randn(T, h, generator=g).to(torch.bfloat16)
    tw, ids, _ = ops.moe_routing(torch.randn(T, E384, generator=g) * 2.0, k, "softmax", True)
    for t in range(8):  # the last expert holds rows (its tile is the last of the list); no id twice in a token
        if (ids[t] != E384 - 1).all():
            ids[t, 0] = E384 - 1
    w13 = (torch.randn(E384, 2 * i, h, generator=g) * 0.3).to(torch.bfloat16)
    w2 = (torch.randn(E384, h, i, generator=g) * 0.3).to(torch.bfloat16)
    used = torch.bincount(ids.flatten(), minlength=E384)
    assert (used > 0).sum() > 256 and used[256:].sum() > 0 and used.max() > 1
    cpu = ops.moe_experts(x, tw, ids, w13, w2)
    with aligned_ops.emulate(arch) as em:
        gpu = ops.moe_experts(x, tw, ids, w13, w2)
    assert "moe_plan_kernel" in em.kernels()
    assert_bitwise_equal(gpu, cpu)


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("profile", ["fma", "mma"])
def test_no_host_copy_and_grids_from_shapes(arch, profile):
    """The run uploads nothing and its launches (kernels, grids, blocks) are the same for any ids of one shape:
    what a captured CUDA graph replays."""
    a, b = make_case(33, 2, shared=True, gate=True, seed=6), make_case(33, 2, shared=True, gate=True, seed=7)
    b = b[:2] + (torch.zeros_like(b[2]).copy_(b[2].flip(1).remainder(E)),) + a[3:]  # other ids, one expert shape
    launches = []
    for case in (a, b):
        with aligned_ops.emulate(arch) as em:
            run(case, profile)
        assert em.host_copies == []
        launches.append([(l.kernel, l.grid, l.block, l.shared_bytes) for l in em.launches])
    assert launches[0] == launches[1]
    names = {l[0].split("<")[0] for l in launches[0]}
    gemm = {"fma": "moe_grouped_gemm_kernel", "mma": "moe_grouped_mma_kernel"}[profile]
    assert {"moe_plan_kernel", "moe_gather_kernel", gemm, "silu_and_mul_kernel", "moe_combine_kernel"} <= names


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("bad_id", [E, -1])
def test_bad_expert_id_is_nan_and_reported(arch, bad_id):
    x, tw, ids, w13, w2, *_ = make_case(6, 2, seed=8)
    cpu = ops.moe_experts(x, tw, ids, w13, w2)
    bad = ids.clone()
    bad[3, 1] = bad_id  # out of range, above or below
    with aligned_ops.emulate(arch):
        aligned_ops.check_device_errors(x)  # clean words first
        out = ops.moe_experts(x, tw, bad, w13, w2)
        with pytest.raises(RuntimeError, match=r"moe_experts: topk_ids must lie in \[0, experts\)"):
            aligned_ops.check_device_errors(x)
    assert torch.isnan(out[3].float()).all()
    keep = [0, 1, 2, 4, 5]
    assert_bitwise_equal(out[keep], cpu[keep])
    with pytest.raises(RuntimeError, match=r"topk_ids must lie in \[0, 8\)"):  # the CPU checks on the host
        ops.moe_experts(x, tw, bad, w13, w2)


def test_bad_arguments_by_message():
    x, tw, ids, w13, w2, *_ = make_case(5, 2, seed=9)
    with aligned_ops.emulate("sm_90"):
        with pytest.raises(RuntimeError, match="moe_experts: linear_profile must be 'fma' or 'mma', got 'tf32'"):
            ops.moe_experts(x, tw, ids, w13, w2, None, None, None, "tf32")
        with pytest.raises(RuntimeError, match="moe_experts: the mma profile's experts take bfloat16"):
            ops.moe_experts(x.float(), tw, ids, w13.float(), w2.float(), None, None, None, "mma")
        with pytest.raises(RuntimeError, match=r"moe_experts: w2 must be \[8, 40, 24\]"):
            ops.moe_experts(x, tw, ids, w13, w2[:, :, :5].contiguous())
        with pytest.raises(RuntimeError, match="moe_experts: topk_weights must be float32"):
            ops.moe_experts(x, tw.double(), ids, w13, w2)
        assert ops.moe_experts(x[:0], tw[:0], ids[:0], w13, w2).shape == (0, H)
        # int32 ids and non-contiguous inputs: the same bits as int64 / contiguous
        ref = ops.moe_experts(x, tw, ids, w13, w2)
        assert_bitwise_equal(ops.moe_experts(x, tw, ids.int(), w13, w2), ref)
        xt = x.t().contiguous().t()
        assert not xt.is_contiguous()
        assert_bitwise_equal(ops.moe_experts(xt, tw, ids, w13, w2), ref)


@pytest.mark.parametrize("arch", WIDTHS)
def test_backward_fma_equals_cpu(arch):
    """The backward (ops/moe.py, composed of aligned ops) runs on the emulated GPU and gives the CPU's bits."""
    x, tw, ids, w13, w2, sw13, sw2, sg = make_case(5, 2, shared=True, gate=True, seed=12)
    go = torch.randn(5, H, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)

    def grads():
        leaves = [t.clone().requires_grad_(True) for t in (x, tw, w13, w2, sw13, sw2, sg)]
        out = aligned_ops.moe_experts(leaves[0], leaves[1], ids, *leaves[2:])
        return [out] + list(torch.autograd.grad(out, leaves, go))

    cpu = grads()
    with aligned_ops.emulate(arch) as em:
        gpu = grads()
    assert "moe_combine_kernel" in em.kernels() and "gemm_fp32_kernel" in em.kernels()
    for i, (a, b) in enumerate(zip(gpu, cpu)):
        assert_bitwise_equal(a, b, f"output/gradient {i}")


@pytest.mark.parametrize("arch", WIDTHS)
def test_backward_refuses_bad_and_repeated_ids_by_name(arch):
    """On the emulated GPU as on the CPU (ops/moe.py reads the experts' counts once on the host and checks the ids
    there): an id >= E or < 0 and an expert listed twice in a token raise by name, never a silent zero gradient or
    an atomic-order dx. The forward defines the repeat (each rank its own y_r): ids [e, e] give the bits of ids
    [e, e'] with e' a copy of e, on the GPU kernels too."""
    x, tw, ids, w13, w2, *_ = make_case(6, 2, seed=16)
    go = torch.randn(6, H, generator=torch.Generator().manual_seed(17)).to(torch.bfloat16)
    w13, w2 = w13.clone(), w2.clone()
    w13[7], w2[7] = w13[1], w2[1]
    rep, twin = torch.tensor([[1, 1]] + [[0, 2]] * 5), torch.tensor([[1, 7]] + [[0, 2]] * 5)
    with aligned_ops.emulate(arch):
        for profile in ("fma", "mma"):
            assert_bitwise_equal(run((x, tw, rep, w13, w2, None, None, None), profile),
                                 run((x, tw, twin, w13, w2, None, None, None), profile), profile)
        for bad, what in ((E, rf"0 id\(s\) < 0 and 1 id\(s\) >= {E}"), (-3, rf"1 id\(s\) < 0 and 0 id\(s\) >= {E}")):
            b = ids.clone()
            b[2, 1] = bad
            with pytest.raises(RuntimeError, match=rf"aligned::moe_experts_backward: topk_ids must lie in \[0, {E}\), "
                                                   rf"got {what}"):
                ops.moe_experts_backward(go, x, tw, b, w13, w2)
        with pytest.raises(RuntimeError, match="aligned::moe_experts_backward: topk_ids must not list an expert "
                                               "twice in a token"):
            ops.moe_experts_backward(go, x, tw, rep, w13, w2)
        ops.moe_experts_backward(go, x, tw, twin, w13, w2)  # the control: distinct ids in range run


def test_backward_mma_runs_and_is_row_local():
    """Under mma the backward runs on the emulated kernels, deterministic, and a token's dx and routing-weight
    gradient do not depend on the other tokens of the batch."""
    x, tw, ids, w13, w2, *_ = make_case(6, 2, seed=14)
    go = torch.randn(6, H, generator=torch.Generator().manual_seed(15)).to(torch.bfloat16)

    def dx_dtw(rows):
        xl, twl = x[rows].clone().requires_grad_(True), tw[rows].clone().requires_grad_(True)
        out = aligned_ops.moe_experts(xl, twl, ids[rows], w13, w2, linear_profile="mma")
        return torch.autograd.grad(out, (xl, twl), go[rows])

    with aligned_ops.emulate("sm_90", mma_model="fma_chain"):
        full, again, alone = dx_dtw(list(range(6))), dx_dtw(list(range(6))), dx_dtw([4])
    for a, b in zip(full, again):
        assert_bitwise_equal(a, b)
    for a, b in zip(full, alone):
        assert torch.isfinite(a.float()).all()
        assert_bitwise_equal(a[4], b[0])


# ---- routing: one thread per token runs moe.h's row functions (the CPU kernels' own) ---------------------------


def routing_logits(dt, T=33, E=16, seed=20):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T, E, generator=g) * 3.0
    z[2] = -100.0  # sigmoid: the logit form of the weights
    z[3, :8] = 20.0  # saturated sigmoid scores: ties by the logit / bias, then the index
    z[4, 5] = float("nan")  # NaN policy: the whole row
    z[5] = z[5, 0]  # equal logits: the lower id wins
    return z.to(dt)


def routing_grads(fn, z, seed=21):
    """(weights, ids, scores) and the logits' gradient for fixed fp32 gradients of weights and scores."""
    zl = z.clone().requires_grad_(True)
    w, ids, scores = fn(zl)
    g = torch.Generator().manual_seed(seed)
    gw, gs = torch.randn(w.shape, generator=g), torch.randn(scores.shape, generator=g)
    (dz,) = torch.autograd.grad((w * gw).sum() + (scores * gs).sum(), zl)
    return [w, ids, scores, dz]


ROUTINGS = {
    "softmax_renorm": lambda z: aligned_ops.moe_routing(z, 4, "softmax", True),
    "sigmoid": lambda z: aligned_ops.moe_routing(z, 3, "sigmoid", False),
    "sigmoid_renorm": lambda z: aligned_ops.moe_routing(z, 4, "sigmoid", True),
    "grouped": lambda z: aligned_ops.moe_grouped_routing(
        z, torch.linspace(-0.2, 0.2, z.shape[1]), 4, 4, 2, True, 2.5),
    "grouped_nobias": lambda z: aligned_ops.moe_grouped_routing(z, None, 2, 1, 1, False, 1.0),
}


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_routing_equals_cpu(arch, dt):
    z = routing_logits(dt)
    cpu = {name: routing_grads(fn, z) for name, fn in ROUTINGS.items()}
    with aligned_ops.emulate(arch) as em:
        gpu = {name: routing_grads(fn, z) for name, fn in ROUTINGS.items()}
    assert {"moe_routing_kernel", "moe_routing_backward_kernel", "moe_grouped_routing_kernel",
            "moe_grouped_routing_backward_kernel"} <= em.kernels()
    for name in ROUTINGS:
        for i, (a, b) in enumerate(zip(gpu[name], cpu[name])):
            assert_bitwise_equal(a, b, f"{name} output {i}")


@pytest.mark.parametrize("arch", WIDTHS)
def test_routing_backward_bad_ids(arch):
    z = routing_logits(torch.float32, T=8)
    w, ids, _ = ops.moe_routing(z, 2, "softmax", True)
    bad = ids.clone()
    bad[1, 0] = -1
    gw = torch.ones_like(w)
    cpu = ops.moe_routing_backward(gw, None, z, ids, "softmax", True)
    cpu_g = ops.moe_grouped_routing_backward(gw, None, z, ids, True, 1.0)
    with aligned_ops.emulate(arch):
        aligned_ops.check_device_errors(z)
        dz = ops.moe_routing_backward(gw, None, z, bad, "softmax", True)
        dzg = ops.moe_grouped_routing_backward(gw, None, z, bad, True, 1.0)
        with pytest.raises(RuntimeError, match=r"topk_ids must lie in \[0, experts\)"):
            aligned_ops.check_device_errors(z)
    assert torch.isnan(dz[1]).all() and torch.isnan(dzg[1]).all()
    keep = [0, 2, 3, 5, 6, 7]
    assert_bitwise_equal(dz[keep], cpu[keep])
    assert_bitwise_equal(dzg[keep], cpu_g[keep])
