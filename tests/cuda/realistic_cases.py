"""Realistic shapes for the GPU kernels, written once and run two ways (no GPU is needed for the second):

* tests/cuda/test_cuda_realistic.py: CPU backend vs the CUDA/ROCm build, at the full shapes (Qwen vocab
  V = 151,936; linear (M, N, K) = (1, 4096, 4096) and (3, 1536, 4096); sliced / non-contiguous logits, q, x);
* tests/emulated/test_emulated_realistic.py: CPU backend vs the same kernel source under aligned_ops.emulate,
  at both warp widths, where a full shape costs too much under the emulator at a smaller one.

Each case takes `run(op, *args)`, which runs op on the CPU backend and on the backend under test, asserts
equal bits and returns the CPU result, and `scale`: "full" or "small". Memory on the GPU stays under 1 GiB.
"""

from __future__ import annotations

import torch

import aligned_ops

ops = torch.ops.aligned
QWEN_VOCAB = 151_936


def _randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def logits_full_vocab(run, scale: str, dtype=torch.bfloat16):
    """log_softmax / logsumexp / token_logprobs (+ backward) over the Qwen vocabulary, from logits that are
    sliced the way a trainer slices them: the last position dropped from [B, T, V] (rows strided), and a window of
    a wider buffer (row stride > V)."""
    V = QWEN_VOCAB if scale == "full" else 151_93  # 15,193: not a multiple of 32 either
    B, T = (2, 3) if scale == "full" else (1, 3)
    full = _randn(B, T, V, dtype=dtype, scale=4.0, seed=1)
    full[0, 0, 7] = 60.0  # one dominant logit (Sterbenz regime of the shift)
    z_sliced = full[:, :-1]  # [B, T-1, V], non-contiguous in the row dimension
    z = z_sliced.reshape(-1, V) if z_sliced.is_contiguous() else z_sliced.contiguous().view(-1, V)
    wide = _randn(z.shape[0], V + 96, dtype=dtype, scale=4.0, seed=2)[:, 32:32 + V]  # row stride V + 96
    rows = z.shape[0]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (rows,), generator=g)
    temps = torch.rand(rows, generator=g) + 0.5
    for logits in (z, wide):
        lsm = run(ops.log_softmax, logits, 0.9, None)
        tlp = run(ops.token_logprobs, logits, ids, 1.0, temps)
        run(ops.logsumexp, logits, 1.0, temps)
        assert torch.equal(run(ops.token_logprobs, logits, ids, 0.9, None).view(torch.int32),
                           lsm[torch.arange(rows), ids].view(torch.int32))
        run(ops.token_logprobs_backward, torch.randn(rows, generator=g), logits, ids, 1.0, temps)
        assert torch.isfinite(tlp).all()
    return lsm


def linear_decode_and_prefill(run, scale: str, dtype=torch.bfloat16):
    """aligned::linear at decode / small-batch shapes, x a column window of a wider activation (non-contiguous),
    with and without bias, plus linear_partial (the TP rank's sub-tree)."""
    shapes = [(1, 4096, 4096), (3, 1536, 4096)] if scale == "full" else [(1, 512, 1024), (3, 192, 1024), (16, 96, 520)]
    for M, N, K in shapes:
        x_wide = _randn(M, K + 64, dtype=dtype, seed=M)
        x = x_wide[:, 64:]  # row stride K + 64
        w = _randn(N, K, dtype=dtype, scale=0.02, seed=N)
        b = _randn(N, dtype=dtype, seed=K)
        run(ops.linear, x, w, b)
        y = run(ops.linear, x.contiguous(), w, None)
        run(ops.linear_partial, x.contiguous(), w, 4)
        assert torch.isfinite(y.float()).all()


def rms_norm_rows(run, scale: str, dtype=torch.bfloat16):
    H = 4096 if scale == "full" else 1024
    for rows in (1, 3, 64):
        resid = _randn(rows, 2 * H, dtype=dtype, seed=rows)
        x = resid[:, :H]  # a column window: row stride 2H
        w = _randn(H, dtype=dtype, seed=7)
        run(ops.rms_norm, x, w, 1e-6)
        run(ops.fused_add_rms_norm, x.contiguous(), resid[:, H:].contiguous(), w, 1e-6)


def attention_sliced_q(run, scale: str, dtype=torch.bfloat16):
    """attention_varlen and paged decode with q a head slice of a packed qkv projection ([T, (Hq + 2 Hkv) D], as
    vLLM passes it: non-contiguous in the token dimension)."""
    if scale == "full":
        hq, hkv, d, lens, bs = 32, 8, 128, [1, 700, 4100], 16
    else:
        hq, hkv, d, lens, bs = 4, 2, 64, [1, 90, 530], 16  # 530 keys: crosses a 512-key split
    T = sum(lens)
    qkv = _randn(T, (hq + 2 * hkv) * d, dtype=dtype, seed=11)
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].reshape(T, hkv, d)
    v = qkv[:, (hq + hkv) * d:].reshape(T, hkv, d)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    out, _ = run(ops.attention_varlen, q, k, v, cu, cu, d**-0.5, True)
    # decode over a paged cache: the last token of each sequence, q sliced from the packed projection
    need = [(n + bs - 1) // bs for n in lens]
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(5)).to(torch.int32)
    o = 0
    for i, nb in enumerate(need):
        table[i, :nb] = perm[o: o + nb]
        o += nb
    kc = torch.zeros(sum(need), bs, hkv, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    starts = cu.tolist()
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        slot = table[i, pos // bs].long() * bs + pos % bs
        kc.view(-1, hkv, d)[slot] = k[starts[i]: starts[i] + n]
        vc.view(-1, hkv, d)[slot] = v[starts[i]: starts[i] + n]
    last = torch.tensor([s - 1 for s in starts[1:]])
    qd = qkv[:, : hq * d].view(T, hq, d)[last]
    dec = run(ops.paged_attention, qd, kc, vc, table, torch.tensor(lens, dtype=torch.int32),
              torch.arange(len(lens) + 1, dtype=torch.int32), d**-0.5)
    # decode == the training path's last rows, bit for bit
    assert torch.equal(dec.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       out[last].view(torch.int16 if dtype != torch.float32 else torch.int32))


CASES = {
    "logits_full_vocab": logits_full_vocab,
    "linear_decode_and_prefill": linear_decode_and_prefill,
    "rms_norm_rows": rms_norm_rows,
    "attention_sliced_q": attention_sliced_q,
}
