"""The bits corpus: a sha256 of every aligned op's outputs (and gradients) on fixed inputs, per configuration.

What it is for: a refactor that must not change a bit (the C++ glue restructure of issue 20, and any later one)
proves it by regenerating nothing — tests/golden/test_op_bits.py recomputes every entry and compares it with
op_bits.json, naming each entry that differs. The corpus holds hashes, not tensors (small, reviewable diffs).

Coverage: every op family — dense (rms_norm, fused_add_rms_norm, silu_and_mul, rotary + backwards), logits
(logsumexp, log_softmax, token_logprobs + backwards, the fused LM head's pieces and the op itself with its
gradient), the `fma` linear (linear, linear_partial, linear_backward, autograd), the `mma` linear (linear_mma,
linear_mma_partial, linear_mma_backward, autograd, the scalar model; moe_experts under mma; refusals where the
process has no unit), the `exact` linear (one-shot,
packed, k_parts, the CPU fp64 routes, the TP pieces, the scalar references), attention (varlen + backward, the
KV-cache write, paged, and the planned forms; under the mma profile on the emulated GPUs, the CPU's refusal
on the CPU levels), moe (routing softmax / sigmoid + backward, experts with and
without a shared expert and gate + backward, the reference), and the elementwise test hooks. Every dtype an op
accepts (fp32 / bf16 / fp16), odd shapes, few-row shapes that take the CPU's split-row paths (4 threads).

Configurations: each CPU ISA level (ALIGNED_CPU_ISA = generic / avx2 / avx512; the level is chosen once per
process, so one subprocess per level) and the emulated GPUs sm_90 and gfx942 (aligned_ops.emulate, run inside
the generic level's subprocess). Under emulation every op runs: the ops with GPU glue run the GPU kernel source
(the corpus records that a kernel was launched), the others run the CPU kernels — both are part of the contract.

Inputs are generated from integers (a splitmix64 hash of the element index, in numpy's wrapping uint64), not
torch's RNG, so the corpus does not depend on the RNG of a torch release.

Usage:
  python tests/golden/make_op_bits.py --write        regenerate op_bits.json (every configuration)
  python tests/golden/make_op_bits.py --check        recompute and list the entries that differ
  python tests/golden/make_op_bits.py --replace P    recompute the entries starting with P (one hash for every
                                                     configuration) and write them: a change meant to alter them
Regenerating changes recorded bits: a commit that does so must say in its message which ops changed and why
(e.g. "moe_routing: sigmoid in the stable form (issue 21 item 6)"). A refactor never regenerates.

Internal: ``--run CONFIG[,CONFIG...]`` (with ALIGNED_CPU_ISA set) prints the JSON of one process's entries.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CORPUS = HERE / "op_bits.json"
EMULATED = ("sm_90", "gfx942")
THREADS = 4  # > the rows of the few-row cases: the CPU's split-row paths run (results never depend on it)
# Negative control: ALIGNED_OP_BITS_PLANT=<entry> flips one bit of that entry's output before it is hashed.
PLANT_ENV = "ALIGNED_OP_BITS_PLANT"


# ---- deterministic inputs ------------------------------------------------------------------------------------


def _splitmix(idx):
    import numpy as np

    z = (idx.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(1)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniform(seed, shape, lo=-1.0, hi=1.0):
    """fp32 tensor of `shape`, values in [lo, hi), a pure function of (seed, index)."""
    import numpy as np
    import torch

    n = 1
    for s in shape:
        n *= s
    idx = np.arange(n, dtype=np.uint64) + np.uint64(seed) * np.uint64(0x100000001B3)
    u = (_splitmix(idx) >> np.uint64(40)).astype(np.float64) / float(1 << 24)
    return torch.from_numpy((lo + (hi - lo) * u).astype(np.float32)).reshape(shape)


def integers(seed, shape, lo, hi):
    """int64 tensor in [lo, hi), a pure function of (seed, index)."""
    import numpy as np
    import torch

    n = 1
    for s in shape:
        n *= s
    idx = np.arange(n, dtype=np.uint64) + np.uint64(seed) * np.uint64(0x100000001B3)
    v = (_splitmix(idx) % np.uint64(hi - lo)).astype(np.int64) + lo
    return torch.from_numpy(v).reshape(shape)


def rand(seed, shape, dtype, scale=1.0):
    return (uniform(seed, shape) * scale).to(dtype)


# ---- the cases -----------------------------------------------------------------------------------------------
# Each case returns {output name: tensor}; entry = "<case>/<output name>". Cases are generators of
# (case name, thunk) so a run can filter by name without computing the others.


def _dtypes():
    import torch

    return (("f32", torch.float32), ("bf16", torch.bfloat16), ("f16", torch.float16))


def _grads(fn, inputs, grad_out_seed=99):
    """outputs of fn(*inputs) and the gradients of sum(out * fixed weights) w.r.t. the floating inputs."""
    import torch

    xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*xs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    diff = [o for o in outs if o is not None and o.is_floating_point() and o.requires_grad]
    res = {f"out{i}": o.detach() for i, o in enumerate(outs) if o is not None}
    if diff:
        loss = sum((o.float() * uniform(grad_out_seed + i, tuple(o.shape))).sum() for i, o in enumerate(diff))
        needs = [x for x in xs if x.requires_grad]
        gs = torch.autograd.grad(loss, needs, allow_unused=True)
        k = 0
        for i, x in enumerate(xs):
            if x.requires_grad:
                if gs[k] is not None:
                    res[f"grad{i}"] = gs[k]
                k += 1
    return res


def cases():
    import torch

    import aligned_ops

    ops = torch.ops.aligned

    # ---- dense ----
    for tag, dt in _dtypes():
        for rows, H in ((1, 37), (5, 64), (3, 1000)):
            x, w, r = rand(1, (rows, H), dt), rand(2, (H,), dt, 0.5), rand(3, (rows, H), dt)
            yield f"rms_norm/{tag}/{rows}x{H}", lambda x=x, w=w: _grads(lambda a, b: ops.rms_norm(a, b, 1e-6),
                                                                          (x, w))
            yield f"rms_norm_f32w/{tag}/{rows}x{H}", lambda x=x, w=w: {
                "out": ops.rms_norm(x, w.float(), 1e-5)}
            yield f"fused_add_rms_norm/{tag}/{rows}x{H}", lambda x=x, w=w, r=r: dict(
                zip(("out", "residual"), ops.fused_add_rms_norm(x, r, w, 1e-6)))
            g = rand(4, (rows, H), dt)
            yield f"rms_norm_backward/{tag}/{rows}x{H}", lambda g=g, x=x, w=w: dict(
                zip(("dx", "dw"), ops.rms_norm_backward(g, x, w, 1e-6)))
        for rows, d in ((1, 4100), (3, 19), (6, 64)):  # rows=1, d>=4096: the CPU's column-split path
            x = rand(5, (rows, 2 * d), dt, 3.0)
            yield f"silu_and_mul/{tag}/{rows}x{d}", lambda x=x: _grads(ops.silu_and_mul, (x,))
            g = rand(6, (rows, d), dt)
            yield f"silu_and_mul_backward/{tag}/{rows}x{d}", lambda g=g, x=x: {
                "dx": ops.silu_and_mul_backward(g, x)}
        for T, heads, D, rot, neox in ((3, 2, 16, 16, True), (5, 3, 24, 8, False)):
            x = rand(7, (T, heads, D), dt)
            pos = integers(8, (T,), 0, 40)
            cache = uniform(9, (40, rot))  # any fp32 table: the op reads it, the corpus need not be RoPE's
            yield f"rotary/{tag}/{T}x{heads}x{D}/rot{rot}/neox{int(neox)}", \
                lambda x=x, p=pos, c=cache, rot=rot, n=neox: _grads(
                    lambda a: ops.rotary_embedding(p, a, c, rot, n), (x,))
            yield f"rotary_backward/{tag}/{T}x{heads}x{D}/rot{rot}/neox{int(neox)}", \
                lambda x=x, p=pos.to(torch.int32), c=cache, rot=rot, n=neox: {
                    "out": ops.rotary_embedding_backward(p, x, c, rot, n)}

    # ---- logits ----
    for tag, dt in _dtypes():
        for T, V in ((1, 9000), (3, 53), (7, 300)):  # T=1, V>=8192: the CPU's split-row path
            z = rand(10, (T, V), dt, 8.0)
            ids = integers(11, (T,), 0, V)
            temps = uniform(12, (T,), 0.5, 1.5)
            g1, gV = uniform(13, (T,)), uniform(14, (T, V))
            key = f"{tag}/{T}x{V}"
            yield f"logsumexp/{key}", lambda z=z: {"out": ops.logsumexp(z, 0.7)}
            yield f"logsumexp_temps/{key}", lambda z=z, t=temps: {"out": ops.logsumexp(z, 1.0, t)}
            yield f"log_softmax/{key}", lambda z=z, t=temps: {"out": ops.log_softmax(z, 1.3, t)}
            yield f"token_logprobs/{key}", lambda z=z, i=ids: _grads(lambda a: ops.token_logprobs(a, i, 0.9), (z,))
            yield f"token_logprobs_pairs/{key}", lambda z=z, i=ids, t=temps: dict(
                zip(("logp", "pairs"), ops.token_logprobs_pairs(z, i, 1.0, t)))
            yield f"token_logprobs_backward/{key}", lambda g=g1, z=z, i=ids, t=temps: {
                "dz": ops.token_logprobs_backward(g, z, i, 1.0, t)}
            yield f"logsumexp_backward/{key}", lambda g=g1, z=z: {"dz": ops.logsumexp_backward(g, z, 0.8)}
            yield f"log_softmax_backward/{key}", lambda g=gV, z=z: {"dz": ops.log_softmax_backward(g, z, 1.1)}
            yield f"log_softmax_grad/{key}", lambda z=z: _grads(lambda a: ops.log_softmax(a, 1.0), (z,))

            def cols(z=z, ids=ids, t=temps, g=g1, V=V):
                _, pairs = ops.token_logprobs_pairs(z, ids, 1.0, t)
                a = V // 3
                return {"dz": ops.token_logprobs_backward_cols(g, z[:, a:a + V // 2].contiguous(), ids, pairs, a, V,
                                                               1.0, t)}
            yield f"token_logprobs_backward_cols/{key}", cols
        # special rows: -inf, +inf and NaN logits
        z = rand(15, (4, 40), dt, 4.0)
        z[0, 3] = float("-inf")
        z[1, :] = float("-inf")
        z[2, 7] = float("inf")
        z[3, 9] = float("nan")
        ids = torch.tensor([3, 0, 7, 1])
        yield f"logits_special/{tag}", lambda z=z, i=ids: {
            "lse": ops.logsumexp(z, 1.0), "logp": ops.log_softmax(z, 1.0), "tok": ops.token_logprobs(z, i, 1.0),
            "dz": ops.token_logprobs_backward(torch.ones(4), z, i, 1.0)}
        # the fused LM head, forward and gradient (chunked: several token and vocabulary chunks)
        h, W, b = rand(16, (6, 40), dt), rand(17, (70, 40), dt, 0.3), rand(18, (70,), dt, 0.1)
        ids = integers(19, (6,), 0, 70)
        yield f"fused_token_logprobs/{tag}", lambda h=h, W=W, b=b, i=ids: _grads(
            lambda a, w, c: aligned_ops.fused_token_logprobs(a, w, i, 0.9, bias=c, token_chunk=4, vocab_chunk=32),
            (h, W, b))

    # ---- the fma linear ----
    for tag, dt in _dtypes():
        for M, K, N in ((1, 37, 19), (5, 64, 40), (40, 24, 40)):  # M=40, N=40: the CPU's row-chunk tiling
            x, w, b = rand(20, (M, K), dt), rand(21, (N, K), dt, 0.2), rand(22, (N,), dt, 0.1)
            key = f"{tag}/{M}x{K}x{N}"
            yield f"linear/{key}", lambda x=x, w=w, b=b: _grads(aligned_ops.linear, (x, w, b))
            yield f"linear_nobias_3d/{key}", lambda x=x, w=w: {"out": ops.linear(x.reshape(1, M, K), w)}
            yield f"linear_strided_weight/{key}", lambda x=x, w=w: {"out": ops.linear(x, w.t().contiguous().t())}
            for lanes in (1, 2, 4, 8):
                yield f"linear_partial/{key}/lanes{lanes}", lambda x=x, w=w, l=lanes: {
                    "out": ops.linear_partial(x, w, l)}
            g = rand(23, (M, N), dt)
            yield f"linear_backward/{key}", lambda g=g, x=x, w=w: dict(
                zip(("dx", "dw", "db"), ops.linear_backward(g, x, w, True, True, True)))
        x, w = rand(24, (3, 21), dt), rand(25, (5, 21), dt)
        yield f"linear_partial_reference/{tag}", lambda x=x, w=w: {"out": ops._linear_partial_reference(x, w, 4)}

    # ---- the mma linear (bf16 only; the CPU's unit, AVX512-BF16 vdpbf16ps; the emulated GPUs' bf16 MMA) ----
    # Where the process has no unit (the generic / avx2 levels) every op but the scalar reference refuses by name:
    # the entry is then "<name>/refused", the hash of the refusal's first line (the refusal is part of the
    # contract too). The emulated GPUs (run in the generic level's process) run the GPU kernels under the
    # default model ("mmasim"), moe_experts' mma profile included (csrc/gpu/moe_kernels.cuh); there
    # _linear_mma_reference is the arch's unit model too.
    has_unit = aligned_ops.mma_unit() is not None

    def refused(thunk):
        try:
            thunk()
        except RuntimeError as e:
            msg = str(e).splitlines()[0]
            return {"refused": torch.tensor(list(msg.encode()), dtype=torch.uint8)}
        raise AssertionError("an mma op ran without the unit")

    def mma_case(thunk):
        if has_unit:
            return thunk
        def unit_or_refused(thunk=thunk):
            if aligned_ops.emulation.active() is not None:
                try:
                    return thunk()  # the emulated GPU's kernel (the linear_mma family)
                except RuntimeError:
                    pass  # an op with no GPU mma kernel would run the CPU backend: its refusal, as below
            return refused(thunk)
        return unit_or_refused

    bf = torch.bfloat16
    for M, K, N in ((1, 37, 19), (5, 64, 40), (12, 96, 33), (40, 24, 40)):  # M=12: the row-lane path
        x, w, b = rand(26, (M, K), bf), rand(27, (N, K), bf, 0.2), rand(28, (N,), bf, 0.1)
        key = f"bf16/{M}x{K}x{N}"
        yield f"linear_mma/{key}", mma_case(lambda x=x, w=w, b=b: _grads(aligned_ops.linear_mma, (x, w, b)))
        yield f"linear_mma_strided_weight/{key}", mma_case(
            lambda x=x, w=w: {"out": ops.linear_mma(x, w.t().contiguous().t())})
        for lanes in (1, 2, 4, 8):
            yield f"linear_mma_partial/{key}/lanes{lanes}", mma_case(lambda x=x, w=w, l=lanes: {
                "out": ops.linear_mma_partial(x, w, l)})
        g = rand(29, (M, N), bf)
        yield f"linear_mma_backward/{key}", mma_case(lambda g=g, x=x, w=w: dict(
            zip(("dx", "dw", "db"), ops.linear_mma_backward(g, x, w, True, True, True))))
    x, w = rand(24, (3, 21), bf), rand(25, (5, 21), bf)
    yield "linear_mma_reference/bf16", lambda x=x, w=w: {"out": ops._linear_mma_reference(x, w, 4)}

    # ---- the exact linear ----
    for tag, dt in _dtypes():
        for M, K, N in ((1, 37, 19), (5, 130, 33)):
            x, w, b = rand(30, (M, K), dt, 2.0), rand(31, (N, K), dt, 0.5), rand(32, (N,), dt, 0.1)
            if K > 100:  # a massive activation (the canonical form rounds) and a tiny weight row
                x[0, 5] = 3000.0
                w[1] = w[1] * 1e-3
            key = f"{tag}/{M}x{K}x{N}"
            yield f"linear_exact/{key}", lambda x=x, w=w, b=b: {"out": ops.linear_exact(x, w, b)}
            yield f"linear_exact_reference/{key}", lambda x=x, w=w, b=b: {
                "out": ops._linear_exact_reference(x, w, b)}

            def packed(x=x, w=w, b=b, N=N):
                wd, we, wb = ops.linear_exact_pack_weight(w)
                return {"wd": wd, "we": we, "wb": wb, "out": ops.linear_exact_packed(x, wd, we, wb, N, b, 1),
                        "out_kparts3": ops.linear_exact_packed(x, wd, we, wb, N, b, 3)}
            yield f"linear_exact_packed/{key}", packed

            def f64(x=x, w=w, b=b, N=N):
                wd, we, wb = ops.linear_exact_pack_weight(w)
                bounds = ops.linear_exact_f64_bounds(w)
                res = {"bounds": bounds, "pairs": ops._linear_exact_f64_pairs(x, bounds),
                       "routes": ops._linear_exact_f64_routes(x, w, bounds)}
                for mode in ("auto", "all", "off"):
                    os.environ["ALIGNED_EXACT_F64"] = mode
                    try:
                        res[f"out_{mode}"] = ops.linear_exact_packed(x, wd, we, wb, N, b, 1, w, bounds)
                    finally:
                        os.environ.pop("ALIGNED_EXACT_F64", None)
                return res
            yield f"linear_exact_f64/{key}", f64

            def tp(x=x, w=w, b=b, N=N, K=K, dt=dt):
                cut = K // 2
                xs, ws = (x[:, :cut], x[:, cut:]), (w[:, :cut], w[:, cut:])
                x_scan = torch.maximum(ops.linear_exact_row_scan(xs[0]), ops.linear_exact_row_scan(xs[1]))
                w_scan = torch.maximum(ops.linear_exact_row_scan(ws[0]), ops.linear_exact_row_scan(ws[1]))
                partial = None
                for xr, wr in zip(xs, ws):
                    wd, we, wb = ops.linear_exact_pack_weight_scanned(wr.contiguous(), w_scan)
                    p = ops.linear_exact_partial(xr.contiguous(), wd, we, wb, N, x_scan)
                    partial = p if partial is None else partial + p
                return {"x_scan": x_scan, "partial": partial,
                        "out": ops.linear_exact_finish(partial, x_scan, we, wb, b, dt)}
            yield f"linear_exact_tp/{key}", tp

    # ---- attention ----
    def cu(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)

    def varlen_case(seed, tag, dt, lens_q, lens_k, Hq, Hkv, D, causal):
        """A packed varlen attention case: q, k, v from seeds seed, seed + 1, seed + 2, the cu_seqlens, its key."""
        q = rand(seed, (sum(lens_q), Hq, D), dt)
        k, v = rand(seed + 1, (sum(lens_k), Hkv, D), dt), rand(seed + 2, (sum(lens_k), Hkv, D), dt)
        key = f"{tag}/q{'-'.join(map(str, lens_q))}/k{'-'.join(map(str, lens_k))}/h{Hq}x{Hkv}x{D}/c{int(causal)}"
        return q, k, v, cu(lens_q), cu(lens_k), key

    for tag, dt in _dtypes():
        for lens_q, lens_k, Hq, Hkv, D, causal in (
            ([5, 1, 9], [5, 1, 9], 4, 2, 16, True),
            ([40, 33, 50], [40, 33, 50], 2, 2, 8, True),  # many row blocks: the CPU's block-per-thread path
            ([3, 2], [7, 600], 2, 1, 12, True),  # 600 keys: two 512-key splits
            ([4, 6], [9, 6], 3, 3, 20, False),
        ):
            q, k, v, cq, ck, key = varlen_case(40, tag, dt, lens_q, lens_k, Hq, Hkv, D, causal)
            yield f"attention_varlen/{key}", lambda q=q, k=k, v=v, cq=cq, ck=ck, c=causal: _grads(
                lambda a, b, e: aligned_ops.attention_varlen(a, b, e, cq, ck, 0.3, c), (q, k, v))

            def planned(q=q, k=k, v=v, cq=cq, ck=ck, c=causal, Hq=Hq, Hkv=Hkv, D=D):
                plan = aligned_ops.AttentionPlan().plan_varlen(cq, ck, Hq, Hkv, D, c)
                return _grads(lambda a, b, e: aligned_ops.attention_varlen(a, b, e, cq, ck, 0.3, c, plan=plan),
                              (q, k, v))
            yield f"attention_varlen_planned/{key}", planned
        # paged: a chunk after cached tokens, a decode token, a long context (two splits)
        nb, bs, Hq, Hkv, D = 40, 16, 4, 2, 16
        kc, vc = rand(43, (nb, bs, Hkv, D), dt), rand(44, (nb, bs, Hkv, D), dt)
        table = integers(45, (3, 39), 0, nb).to(torch.int32)
        seq_lens = torch.tensor([13, 2, 610], dtype=torch.int32)
        qsl = cu([6, 1, 3])
        q = rand(46, (10, Hq, D), dt)
        yield f"paged_attention/{tag}", lambda q=q, kc=kc, vc=vc, t=table, s=seq_lens, l=qsl: {
            "out": ops.paged_attention(q, kc, vc, t, s, l, 0.25)}

        def paged_planned(q=q, kc=kc, vc=vc, t=table, s=seq_lens, l=qsl, nb=nb, bs=bs):
            plan = aligned_ops.AttentionPlan().plan_paged(l, s, t, 4, 2, 16, nb, bs)
            return {"out": aligned_ops.paged_attention(q, kc, vc, scale=0.25, plan=plan)}
        yield f"paged_attention_planned/{tag}", paged_planned

        def cache_write(kc=kc, vc=vc, dt=dt):
            k, v = rand(47, (5, 2, 16), dt), rand(48, (5, 2, 16), dt)
            slots = torch.tensor([3, -1, 17, 639, 2], dtype=torch.int64)
            kc2, vc2 = kc.clone(), vc.clone()
            ops.reshape_and_cache(k, v, kc2, vc2, slots)
            return {"k_cache": kc2, "v_cache": vc2}
        yield f"reshape_and_cache/{tag}", cache_write

    # ---- moe ----
    for tag, dt in _dtypes():
        T, E, H, I, k = 7, 6, 24, 10, 2
        z = rand(50, (T, E), dt, 3.0)
        for scoring in ("softmax", "sigmoid"):
            for renorm in (True, False):
                yield f"moe_routing/{tag}/{scoring}/renorm{int(renorm)}", \
                    lambda z=z, s=scoring, r=renorm: _grads(lambda a: ops.moe_routing(a, k, s, r), (z,))
        x = rand(51, (T, H), dt)
        w13, w2 = rand(52, (E, 2 * I, H), dt, 0.3), rand(53, (E, H, I), dt, 0.3)
        tw, ids, _ = ops.moe_routing(z, k, "softmax", True)
        sw13, sw2, sg = rand(54, (2 * 8, H), dt, 0.3), rand(55, (H, 8), dt, 0.3), rand(56, (1, H), dt, 0.3)
        yield f"moe_experts/{tag}", lambda x=x, tw=tw, ids=ids, w13=w13, w2=w2: _grads(
            lambda a, b, c, d: ops.moe_experts(a, b, ids, c, d), (x, tw, w13, w2))
        yield f"moe_experts_shared/{tag}", lambda x=x, tw=tw, ids=ids, w13=w13, w2=w2, a=sw13, b=sw2, c=sg: _grads(
            lambda *t: ops.moe_experts(t[0], t[1], ids, t[2], t[3], t[4], t[5], t[6]), (x, tw, w13, w2, a, b, c))
        if dt == torch.bfloat16:  # the experts' projections under the mma profile (+ its backward)
            yield f"moe_experts_mma/{tag}", mma_case(lambda x=x, tw=tw, ids=ids, w13=w13, w2=w2: _grads(
                lambda a, b, c, d: ops.moe_experts(a, b, ids, c, d, linear_profile="mma"), (x, tw, w13, w2)))
            yield f"moe_experts_shared_mma/{tag}", mma_case(
                lambda x=x, tw=tw, ids=ids, w13=w13, w2=w2, a=sw13, b=sw2, c=sg: _grads(
                    lambda *t: ops.moe_experts(t[0], t[1], ids, t[2], t[3], t[4], t[5], t[6], "mma"),
                    (x, tw, w13, w2, a, b, c)))
        yield f"moe_experts_reference/{tag}", lambda x=x, tw=tw, ids=ids, w13=w13, w2=w2, a=sw13, b=sw2, c=sg: {
            "out": ops._moe_experts_reference(x, tw, ids, w13, w2, a, b, c)}

    # ---- moe: grouped sigmoid routing (DeepSeek-V3 noaux_tc; added by --add, existing entries untouched) ----
    for tag, dt in _dtypes():
        T, E = 9, 16
        z = rand(57, (T, E), dt, 6.0)
        z[2] = -100.0  # the logit form of the weights
        z[3, :8] = 20.0  # saturated scores: ties decided by the bias, then the index
        bias = rand(58, (E,), torch.float32, 0.2)
        for k, ng, tg, renorm, scale in ((4, 4, 2, True, 2.5), (3, 1, 1, True, 2.827), (2, 8, 8, False, 1.0)):
            yield f"moe_grouped_routing/{tag}/k{k}g{ng}t{tg}/renorm{int(renorm)}", \
                lambda z=z, b=bias, k=k, ng=ng, tg=tg, r=renorm, c=scale: _grads(
                    lambda a: ops.moe_grouped_routing(a, b, k, ng, tg, r, c), (z,))

    # ---- MLA: latent attention (one shared [latent || rope] row per token; added by --add, existing entries
    # untouched). Row widths within the GPU kernels' head_dim (the emulated configs run the GPU source).
    for tag, dt in _dtypes():
        for R, rope, lens_q, lens_k in ((40, 8, [5, 1, 9], [5, 1, 9]), (24, 0, [3, 2], [7, 600])):
            D = R + rope
            q, kv = rand(70, (sum(lens_q), 3, D), dt), rand(71, (sum(lens_k), D), dt)
            cq, ck = cu(lens_q), cu(lens_k)
            key = f"{tag}/r{R}+{rope}/q{'-'.join(map(str, lens_q))}/k{'-'.join(map(str, lens_k))}"
            yield f"mla_attention_varlen/{key}", lambda q=q, kv=kv, cq=cq, ck=ck, R=R: _grads(
                lambda a, b: aligned_ops.mla_attention_varlen(a, b, cq, ck, R, 0.3), (q, kv))

            def mla_planned_varlen(q=q, kv=kv, cq=cq, ck=ck, R=R, D=D):
                plan = aligned_ops.AttentionPlan().plan_varlen(cq, ck, 3, 1, D)
                return _grads(lambda a, b: aligned_ops.mla_attention_varlen(a, b, cq, ck, R, 0.3, plan=plan), (q, kv))
            yield f"mla_attention_varlen_planned/{key}", mla_planned_varlen
        nb, bs, R, rope = 40, 16, 40, 8
        cache = rand(72, (nb, bs, R + rope), dt)
        table = integers(73, (3, 39), 0, nb).to(torch.int32)
        seq_lens = torch.tensor([13, 2, 610], dtype=torch.int32)
        qsl = cu([6, 1, 3])
        q = rand(74, (10, 2, R + rope), dt)
        yield f"mla_paged_attention/{tag}", lambda q=q, c=cache, t=table, s=seq_lens, l=qsl: {
            "out": ops.mla_paged_attention(q, c, t, s, l, 40, 0.25)}

        def mla_planned(q=q, c=cache, t=table, s=seq_lens, l=qsl, nb=nb, bs=bs):
            plan = aligned_ops.AttentionPlan().plan_paged(l, s, t, 2, 1, 48, nb, bs)
            return {"out": aligned_ops.mla_paged_attention(q, c, kv_lora_rank=40, scale=0.25, plan=plan)}
        yield f"mla_paged_attention_planned/{tag}", mla_planned

        def mla_cache_write(c=cache, dt=dt):
            row = rand(75, (5, 48 + 3), dt)
            slots = torch.tensor([3, -1, 17, 639, 2], dtype=torch.int64)
            c2 = c.clone()
            ops.mla_reshape_and_cache(row[:, :40], row[:, 40:48], c2, slots)
            return {"kv_cache": c2}
        yield f"mla_reshape_and_cache/{tag}", mla_cache_write

    # ---- MLA at DeepSeek-V3 / Kimi-K2 width (512 + 64): the GPU forward's wide variant under emulation; added by
    # --add
    for tag, dt in _dtypes():
        R, rope = 512, 64
        q, kv = rand(76, (9, 2, R + rope), dt), rand(77, (40, R + rope), dt)
        cq, ck = cu([5, 4]), cu([5, 35])
        yield f"mla_wide_attention_varlen/{tag}", lambda q=q, kv=kv, cq=cq, ck=ck: dict(
            zip(("out", "lse"), ops.mla_attention_varlen(q, kv, cq, ck, 512, 0.04, True)))
        cache = rand(78, (6, 16, R + rope), dt)
        table = torch.tensor([[4, 1, 5], [0, 2, 3]], dtype=torch.int32)
        yield f"mla_wide_paged_attention/{tag}", lambda q=q, c=cache, t=table: {
            "out": ops.mla_paged_attention(q, c, t, torch.tensor([40, 20], dtype=torch.int32), cu([5, 4]), 512, 0.04)}

    # ---- MLA backward at 512 + 64 (the GPU backward's wide variants under emulation); added by --add
    for tag, dt in _dtypes():
        q, kv = rand(79, (9, 2, 576), dt), rand(80, (40, 576), dt)
        cq, ck = cu([5, 4]), cu([5, 35])
        yield f"mla_wide_backward/{tag}", lambda q=q, kv=kv, cq=cq, ck=ck: _grads(
            lambda a, b: aligned_ops.mla_attention_varlen(a, b, cq, ck, 512, 0.04), (q, kv))

    # ---- attention under the mma profile (bf16; csrc/common/attention_mma.h): the GPU kernel, which the emulated
    # configs run (forward, backward, paged, planned); the CPU levels record the CPU's refusal by name (the CPU's
    # mma profile has no attention). Added by --add attention_mma, existing entries untouched.
    def gpu_mma_attention(thunk):
        def run(thunk=thunk):
            return thunk() if aligned_ops.emulation.active() is not None else refused(thunk)
        return run

    bf = torch.bfloat16
    for lens_q, lens_k, Hq, Hkv, D, causal in (
        ([5, 1, 9], [5, 1, 9], 4, 2, 16, True),
        ([3, 2], [7, 600], 2, 1, 32, True),  # 600 keys: two 512-key splits
        ([4, 6], [9, 6], 3, 3, 16, False),
    ):
        q, k, v, cq, ck, key = varlen_case(90, "bf16", bf, lens_q, lens_k, Hq, Hkv, D, causal)
        yield f"attention_mma_varlen/{key}", gpu_mma_attention(lambda q=q, k=k, v=v, cq=cq, ck=ck, c=causal: _grads(
            lambda a, b, e: aligned_ops.attention_varlen(a, b, e, cq, ck, 0.3, c, profile="mma"), (q, k, v)))

        def mma_planned(q=q, k=k, v=v, cq=cq, ck=ck, c=causal, Hq=Hq, Hkv=Hkv, D=D):
            plan = aligned_ops.AttentionPlan().plan_varlen(cq, ck, Hq, Hkv, D, c)
            return {"out": aligned_ops.attention_varlen(q, k, v, cq, ck, 0.3, c, plan=plan, profile="mma")[0]}
        yield f"attention_mma_varlen_planned/{key}", gpu_mma_attention(mma_planned)
    nb, bs, Hq, Hkv, D = 40, 16, 4, 2, 16
    kc, vc = rand(93, (nb, bs, Hkv, D), bf), rand(94, (nb, bs, Hkv, D), bf)
    table = integers(95, (3, 39), 0, nb).to(torch.int32)
    seq_lens = torch.tensor([13, 2, 610], dtype=torch.int32)
    qsl = cu([6, 1, 3])
    q = rand(96, (10, Hq, D), bf)
    yield "attention_mma_paged/bf16", gpu_mma_attention(lambda q=q, kc=kc, vc=vc, t=table, s=seq_lens, l=qsl: {
        "out": aligned_ops.paged_attention(q, kc, vc, t, s, l, 0.25, profile="mma")})

    # ---- elementwise hooks and the error words ----
    xe = torch.cat([uniform(60, (200,), -100.0, 100.0), torch.tensor([0.0, -0.0, 1e-40, float("inf"), -1.0])])
    yield "exp_f32", lambda: {"out": ops._exp_f32(xe)}
    yield "log_f32", lambda: {"out": ops._log_f32(xe.abs())}
    yield "device_error_flags", lambda: {"out": ops._device_error_flags(xe)}


# ---- hashing and one process's run ---------------------------------------------------------------------------


def digest(t) -> str:
    import torch

    t = t.detach().contiguous()
    if t.is_floating_point():
        t = t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.numpy().tobytes())
    return h.hexdigest()


def _flip_one_bit(t):
    import torch

    out = t.detach().clone().contiguous()
    if out.dtype == torch.bool:
        out.view(-1)[0] = not bool(out.view(-1)[0])
    else:
        out.view(-1).view(torch.uint8)[0] ^= 1  # the lowest bit of the first element (little-endian)
    return out


def run_config(config: str, only: str | None = None, called: set | None = None) -> dict:
    """{entry: {"sha256": hex, "gpu": bool (emulated configs)}} of one configuration in this process; the
    aligned ops the cases reached (autograd's backward ops included) are added to `called` when given."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import aligned_ops

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "aligned":
                called.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(THREADS)
    plant = os.environ.get(PLANT_ENV)
    out = {}
    for name, thunk in cases():
        if only and not name.startswith(only):
            continue
        with Record() if called is not None else _nothing():
            if config in EMULATED:
                with aligned_ops.emulate(config) as emu:
                    res = thunk()
                gpu = any(not ln.kernel.startswith("<") for ln in emu.launches)
            else:
                res = thunk()
                gpu = None
        for part, t in res.items():
            entry = f"{name}/{part}"
            if plant == entry:
                t = _flip_one_bit(t)
            rec = {"sha256": digest(t)}
            if gpu is not None:
                rec["gpu"] = gpu
            out[entry] = rec
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _level_of_this_process() -> str:
    import torch

    import aligned_ops  # noqa: F401

    return torch.ops.aligned._cpu_isa()


def available_levels() -> list[str]:
    """The CPU levels this machine runs (each forced by ALIGNED_CPU_ISA in its own process): tests/_isa_matrix.py's
    supported_levels(), where the dispatcher's rule is written once (tests/ joins sys.path here as under pytest's
    conftest: this file also runs as a script, from tests/golden)."""
    if str(HERE.parent) not in sys.path:
        sys.path.insert(0, str(HERE.parent))
    from _isa_matrix import supported_levels

    return supported_levels()


def configs_of(level: str, emulated=EMULATED) -> list[str]:
    """The configurations one level's process computes: the level, and the emulated archs in the generic level's
    process (emulation runs the generic CPU kernels where an op has no GPU glue)."""
    return [level] + (list(emulated) if level == "generic" else [])


def _package_root() -> str:
    """The folder holding the aligned_ops this process would import (the installed wheel in CI, python/ of a dev
    build via PYTHONPATH): the subprocesses must run the same build, not the source tree's unbuilt copy."""
    import importlib.util

    spec = importlib.util.find_spec("aligned_ops")
    if spec is None or not spec.submodule_search_locations:
        return str(ROOT / "python")
    return os.path.dirname(os.path.abspath(list(spec.submodule_search_locations)[0]))


def compute_all(levels=None, emulated=EMULATED, extra_env=None) -> dict:
    """{config: {entry: record}} for each CPU level (and the emulated archs, in the generic level's process).
    One subprocess per level, run side by side."""
    levels = list(levels or available_levels())
    procs = {}
    for level in levels:
        configs = configs_of(level, emulated)
        env = {**os.environ, "ALIGNED_CPU_ISA": level, "PYTHONPATH": _package_root(), **(extra_env or {})}
        procs[level] = (configs, subprocess.Popen(
            [sys.executable, str(pathlib.Path(__file__).resolve()), "--run", ",".join(configs)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    result, called = {}, set()
    for level, (configs, p) in procs.items():
        stdout, stderr = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"make_op_bits: the {level} process failed:\n{stderr[-4000:]}")
        got = json.loads(stdout)
        result.update(got["records"])
        called.update(got["called"])
    return result, sorted(called)


def to_corpus(result: dict) -> dict:
    """The file's content. entries: per entry, its sha256 when every configuration agrees (the contract's
    expectation: CPU levels and emulated GPUs compute the same bits), else {sha256: [configurations]}.
    gpu_launched: per entry the emulated archs under which it launched a GPU kernel (the others run the
    CPU kernels there, as the ops without GPU glue do)."""
    configs = sorted(result)
    by_entry: dict = {}
    launched: dict = {}
    for config in configs:
        for entry, rec in result[config].items():
            by_entry.setdefault(entry, {}).setdefault(rec["sha256"], []).append(config)
            if rec.get("gpu"):
                launched.setdefault(entry, []).append(config)
    entries = {}
    for entry, hashes in sorted(by_entry.items()):
        only = next(iter(hashes)) if len(hashes) == 1 else None
        entries[entry] = only if only and hashes[only] == configs else hashes
    return {"configs": configs, "entries": entries, "gpu_launched": dict(sorted(launched.items()))}


def dump_corpus(corpus: dict) -> str:
    """JSON with one entry per line (reviewable diffs)."""
    lines = ["{", f' "configs": {json.dumps(corpus["configs"])},', ' "entries": {']
    items = list(corpus["entries"].items())
    lines += [f"  {json.dumps(k)}: {json.dumps(v)}" + ("," if i + 1 < len(items) else "")
              for i, (k, v) in enumerate(items)]
    lines += [" },", ' "gpu_launched": {']
    items = list(corpus["gpu_launched"].items())
    lines += [f"  {json.dumps(k)}: {json.dumps(v)}" + ("," if i + 1 < len(items) else "")
              for i, (k, v) in enumerate(items)]
    lines += [" }", "}"]
    return "\n".join(lines) + "\n"


def expected_of(corpus: dict, config: str) -> dict:
    """{entry: sha256} the corpus records for one configuration."""
    out = {}
    for entry, rec in corpus["entries"].items():
        if isinstance(rec, str):
            out[entry] = rec
            continue
        for h, cfgs in rec.items():
            if config in cfgs:
                out[entry] = h
    return out


def differences(corpus: dict, config: str, records: dict, only: str | None = None) -> list[str]:
    """The entries of one configuration whose recomputed hash differs from the corpus, or that are missing on
    either side, or (emulated archs) whose GPU launch appeared or vanished — sorted, by name. `only`: the run
    computed just the cases whose names start with it."""
    exp = {e: h for e, h in expected_of(corpus, config).items() if not only or e.startswith(only)}
    got = {e: r["sha256"] for e, r in records.items()}
    bad = {e for e in set(exp) | set(got) if exp.get(e) != got.get(e)}
    if config in EMULATED:
        for e, r in records.items():
            expected_launch = config in corpus["gpu_launched"].get(e, [])
            if bool(r.get("gpu")) != expected_launch:
                bad.add(f"{e} (GPU kernel launch {'missing' if expected_launch else 'unexpected'})")
    return sorted(bad)


def _run_prefix(prefix: str, levels) -> dict:
    """{config: {entry: record}} of the cases starting with ``prefix``, one subprocess per level, side by side."""
    procs = {}
    for level in levels:
        env = {**os.environ, "ALIGNED_CPU_ISA": level, "PYTHONPATH": _package_root()}
        procs[level] = subprocess.Popen(
            [sys.executable, str(pathlib.Path(__file__).resolve()), "--run", ",".join(configs_of(level)), "--only",
             prefix], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    result = {}
    for level, p in procs.items():
        stdout, stderr = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"make_op_bits: the {level} process failed:\n{stderr[-4000:]}")
        result.update(json.loads(stdout)["records"])
    return result


def _replace_entries(prefix: str) -> int:
    """--replace: recompute the recorded entries starting with PREFIX and write their new hashes, for a change that
    means to change those bits (the commit says which and why). Only entries every configuration agrees on (one
    hash, before and after) are replaced, so a machine without some CPU level can do it: the contract makes such an
    entry the same bits on every level. Entries that differ between configurations need --write on a machine with
    every level."""
    corpus = json.loads(CORPUS.read_text())
    old = {e: h for e, h in corpus["entries"].items() if e.startswith(prefix)}
    if not old:
        raise SystemExit(f"make_op_bits --replace: no recorded entry starts with {prefix!r}")
    split = [e for e, h in old.items() if not isinstance(h, str)]
    if split:
        raise SystemExit(f"make_op_bits --replace: {len(split)} of these entries differ between configurations (e.g. "
                         f"{split[0]}): regenerate with --write on a machine with every level")
    new = to_corpus(_run_prefix(prefix, available_levels()))["entries"]
    if set(new) != set(old):
        raise SystemExit(f"make_op_bits --replace: the cases starting with {prefix!r} are not the recorded ones "
                         f"(new: {sorted(set(new) - set(old))[:3]}, gone: {sorted(set(old) - set(new))[:3]})")
    split = [e for e, h in new.items() if not isinstance(h, str)]
    if split:
        raise SystemExit(f"make_op_bits --replace: the configurations now disagree on {split}: a contract break")
    changed = sorted(e for e in new if new[e] != old[e])
    corpus["entries"].update(new)
    CORPUS.write_text(dump_corpus(corpus))
    print(f"replaced {len(changed)} of {len(new)} entries starting with {prefix!r}: {', '.join(changed) or 'none'}")
    return 0


def _add_entries(prefix: str) -> int:
    """--add: new entries only, merged into the recorded corpus (every configuration); existing entries and their
    hashes are left exactly as they are."""
    corpus = json.loads(CORPUS.read_text())
    old = [e for e in corpus["entries"] if e.startswith(prefix)]
    if old:
        raise SystemExit(f"make_op_bits --add: {len(old)} entries starting with {prefix!r} are already recorded "
                         f"(e.g. {old[0]}); --add never changes a recorded entry")
    levels = available_levels()
    if set(levels) != set(corpus["configs"]) - set(EMULATED):
        raise SystemExit(f"make_op_bits --add: this machine runs levels {levels}, the corpus records "
                         f"{corpus['configs']}: add on a machine with the same levels")
    result = _run_prefix(prefix, levels)
    new = to_corpus(result)
    if not new["entries"]:
        raise SystemExit(f"make_op_bits --add: no case starts with {prefix!r}")
    corpus["entries"] = dict(sorted({**corpus["entries"], **new["entries"]}.items()))
    corpus["gpu_launched"] = dict(sorted({**corpus["gpu_launched"], **new["gpu_launched"]}.items()))
    CORPUS.write_text(dump_corpus(corpus))
    split = [e for e, h in new["entries"].items() if not isinstance(h, str)]
    print(f"added {len(new['entries'])} entries to {CORPUS.relative_to(ROOT)} ({len(split)} differ between configs)")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="regenerate op_bits.json (justify in the commit)")
    ap.add_argument("--check", action="store_true", help="recompute and list the entries that differ")
    ap.add_argument("--add", metavar="PREFIX", help="compute only the entries whose names start with PREFIX and add "
                    "them to op_bits.json; refuses if any of them is already recorded (existing entries never change)")
    ap.add_argument("--replace", metavar="PREFIX", help="recompute the recorded entries whose names start with PREFIX "
                    "and write their new hashes (entries every configuration agrees on; say why in the commit)")
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--only", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.run:  # (the parent's PYTHONPATH names the aligned_ops build to run: _package_root)
        configs = a.run.split(",")
        level = _level_of_this_process()
        res, called = {}, set()
        for i, c in enumerate(configs):
            if c not in EMULATED and c != level:
                raise SystemExit(f"make_op_bits: asked for level {c} but this process runs {level}")
            res[c] = run_config(c, a.only, called if i == 0 else None)
        json.dump({"records": res, "called": sorted(called)}, sys.stdout)
        return 0
    if a.add:
        return _add_entries(a.add)
    if a.replace:
        return _replace_entries(a.replace)
    if not (a.write or a.check):
        ap.error("pass --write, --check or --add PREFIX")
    result, _ = compute_all()
    if a.write:
        corpus = to_corpus(result)
        CORPUS.write_text(dump_corpus(corpus))
        n = len(corpus["entries"])
        split = [e for e, h in corpus["entries"].items() if not isinstance(h, str)]
        print(f"wrote {CORPUS.relative_to(ROOT)}: {n} entries x {len(corpus['configs'])} configs"
              f" ({len(split)} entries whose bits differ between configs)")
        return 0
    corpus = json.loads(CORPUS.read_text())
    bad = {c: differences(corpus, c, recs) for c, recs in result.items()}
    for c, names in bad.items():
        for n in names:
            print(f"{c}: {n}")
    return 1 if any(bad.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
