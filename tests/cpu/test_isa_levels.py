"""Every CPU ISA level (generic x86-64, AVX2+FMA, AVX-512) computes identical bits for every dense op.

The level is picked once per process (ALIGNED_CPU_ISA), so each level runs in its own process (the shared
per-level worker, tests/_isa_matrix.py) and writes its outputs to a file; the files are compared through
integer views. Shapes include odd lengths so that vector
tails, masked loads and the scalar remainder paths all run."""

import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent(
    """
    import sys, torch, aligned_ops
    ops = torch.ops.aligned
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    out = {"isa": ops._cpu_isa()}
    bits = torch.randint(-2**31, 2**31, (100003,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    unif = torch.empty(100003).uniform_(-110, 95, generator=g)
    out["exp_bits"], out["exp_unif"] = ops._exp_f32(bits), ops._exp_f32(unif)
    out["log_bits"], out["log_unif"] = ops._log_f32(bits), ops._log_f32(unif.abs())
    cache = aligned_ops.rotary_cos_sin_cache(64, 512)
    out["rope_cache"] = cache  # the table itself (once seen to differ between processes when torch's cos built it)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        n = str(dt)
        for H in (1, 37, 1536, 1000):
            x = (torch.randn(67, H, generator=g) * 3).to(dt)
            r = torch.randn(67, H, generator=g).to(dt)
            w = (torch.rand(H, generator=g) + 0.5).to(dt)
            gr = torch.randn(67, H, generator=g).to(dt)
            out[f"rms{n}{H}"] = ops.rms_norm(x, w, 1e-6)
            out[f"rmsw32{n}{H}"] = ops.rms_norm(x, w.float(), 1e-5)
            out[f"fused{n}{H}"] = ops.fused_add_rms_norm(x, r, w, 1e-6)
            out[f"rmsbwd{n}{H}"] = ops.rms_norm_backward(gr, x, w, 1e-6)
            out[f"rmsbwdw32{n}{H}"] = ops.rms_norm_backward(gr, x, w.float(), 1e-6)
        for d in (1, 45, 896):
            x = (torch.randn(33, 2 * d, generator=g) * 6).to(dt)
            gr = torch.randn(33, d, generator=g).to(dt)
            out[f"silu{n}{d}"] = ops.silu_and_mul(x)
            out[f"silubwd{n}{d}"] = ops.silu_and_mul_backward(gr, x)
        pos = torch.randint(0, 512, (29,), generator=g)
        for hd, rot in ((64, 64), (80, 64), (128, 64)):
            q = torch.randn(29, 5, hd, generator=g).to(dt)
            for neox in (True, False):
                out[f"rope{n}{hd}{neox}"] = ops.rotary_embedding(pos, q, cache, rot, neox)
                out[f"ropebwd{n}{hd}{neox}"] = ops.rotary_embedding_backward(pos, q, cache, rot, neox)
        for V in (1, 31, 1000, 32003):
            z = (torch.randn(9, V, generator=g) * 5).to(dt)
            z[3, V // 2] = -float("inf")
            z[5] = torch.finfo(dt).min  # fully masked row: -log V
            z[6] = z[6] + 1000.0  # large logits: the shift-exact (m, L) row
            z[7, V // 3] = float("inf")  # +inf: lse +inf, logp NaN
            ids = torch.randint(0, V, (9,), generator=g)
            temps = torch.rand(9, generator=g) + 0.4
            gr = torch.randn(9, generator=g)
            grf = torch.randn(9, V, generator=g)
            for t, ts in ((1.0, None), (0.7, None), (1.0, temps)):
                k = f"{n}{V}{t}{ts is None}"
                out["lse" + k] = ops.logsumexp(z, t, ts)
                out["lsm" + k] = ops.log_softmax(z, t, ts)
                out["tlp" + k] = ops.token_logprobs(z, ids, t, ts)
                out["tlpbwd" + k] = ops.token_logprobs_backward(gr, z, ids, t, ts)
                out["lsebwd" + k] = ops.logsumexp_backward(gr, z, t, ts)
                out["lsmbwd" + k] = ops.log_softmax_backward(grf, z, t, ts)
                pairs = ops.token_logprobs_pairs(z, ids, t, ts)[1]
                c0, c1 = V // 3, V // 3 + min(V - V // 3, 1003)  # a column tile (the fused LM head's dW sweep)
                out["tlpcols" + k] = ops.token_logprobs_backward_cols(gr, z[:, c0:c1].contiguous(), ids, pairs, c0,
                                                                      V, t, ts)
        # one row, two threads: the intra-row split kernels (dense_split_kernels.h)
        z1 = (torch.randn(1, 40003, generator=g) * 5).to(dt)
        ids1 = torch.randint(0, 40003, (1,), generator=g)
        out[f"split_lse{n}"] = ops.logsumexp(z1, 0.7, None)
        out[f"split_lsm{n}"] = ops.log_softmax(z1, 1.0, None)
        out[f"split_tlp{n}"] = ops.token_logprobs(z1, ids1, 1.0, torch.tensor([1.3]))
        out[f"split_lsebwd{n}"] = ops.logsumexp_backward(torch.tensor([0.7]), z1, 0.9, None)
        out[f"split_lsmbwd{n}"] = ops.log_softmax_backward(torch.randn(1, 40003, generator=g), z1, 1.0, None)
        out[f"split_silu{n}"] = ops.silu_and_mul((torch.randn(1, 2 * 8960, generator=g) * 6).to(dt))
    # MoE routing at the edges (moe.h: sigmoid_score below -88.7, the logit form of the weights, NaN rows)
    zr = torch.cat([torch.randn(20, 16, generator=g) * 4, -88.0 - 40 * torch.rand(6, 16, generator=g),
                    torch.full((1, 16), -float("inf")), torch.randn(2, 16, generator=g) - 20.0])
    zr[3, 7] = float("nan")
    for scoring in ("softmax", "sigmoid"):
        for renorm in (True, False):
            for dt in (torch.float32, torch.bfloat16):
                k = f"moe{scoring}{renorm}{dt}"
                w, ids, sc = ops.moe_routing(zr.to(dt), 4, scoring, renorm)
                out[k] = (w, ids.to(torch.int32).view(torch.float32), sc)
                out[k + "bwd"] = ops.moe_routing_backward(torch.randn(w.shape, generator=g),
                                                          torch.randn(sc.shape, generator=g), zr.to(dt), ids,
                                                          scoring, renorm)
    torch.save(out, sys.argv[1])
    """
)


ISA_FAMILIES = {"dense": SCRIPT}  # run on every level by tests/_isa_matrix.py


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal on the raw bits: NaN == NaN (same payload), +0 != -0."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        view = {4: torch.int32, 2: torch.int16}[a.element_size()]
        return torch.equal(a.view(view), b.view(view))
    return torch.equal(a, b)


@pytest.mark.slow
def test_every_isa_level_gives_identical_bits(isa_matrix):
    levels = isa_matrix.levels_to_compare()
    results = {}
    for isa, res in isa_matrix.run_levels(levels, "dense").items():  # the levels' workers side by side
        results[isa] = torch.load(res.path)
        assert results[isa].pop("isa") == isa  # the forced level really ran
    base = results["generic"]
    for isa in levels[1:]:
        assert results[isa].keys() == base.keys()
        diff = []
        for k, v in base.items():
            vs = v if isinstance(v, tuple) else (v,)
            ws = results[isa][k] if isinstance(v, tuple) else (results[isa][k],)
            if not all(bits_equal(a, b) for a, b in zip(vs, ws)):
                diff.append(k)
        assert not diff, f"{isa} differs from generic in {diff}"


def test_checker_detects_a_different_result(tmp_path):
    # Negative control for the comparison above: the same file compare reports a one-bit change.
    a = {"x": torch.tensor([1.0, 2.0])}
    b = {"x": torch.tensor([1.0, torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)).item()])}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    assert not bits_equal(torch.load(tmp_path / "a.pt")["x"], torch.load(tmp_path / "b.pt")["x"])
    assert not bits_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert bits_equal(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
