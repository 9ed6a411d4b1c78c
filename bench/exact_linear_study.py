"""Accuracy study for the `exact` linear profile (docs/exact_linear.md): an fp64/int64 simulation of the
canonical integer representation, against torch's bf16 GEMM (fp32 accumulation, oneDNN) and an fp64 product of
the same bf16 inputs.

Representation (csrc/common/exact_linear.h is the definition; this file mirrors it):
  * per row of x: E = floor(log2 max|x_k|); Sx digits; X_k = RNE(x_k * 2^(8*Sx - 3 - E)) (|X| < 2^(8Sx-2))
  * per row n of the weight: E_w likewise with 3 digits; the 2-digit form is its top two balanced base-256 digits
  * y = round_fp32(sum_k X_k W_k * 2^(scale)), then round to bf16.
Digit rules compared: fixed (Sx, Sw), or `auto(T)`: t = E - median exponent of the row;
  Sx = 2 if t <= T, 3 if t <= T + 8, else 4; Sw = 3 where Sx >= 3 else 2.

Run: PYTHONPATH=python python3 bench/exact_linear_study.py [--quick]
"""
import argparse
import sys

import torch


def row_exp(v):  # floor(log2 max |v|) per row (zero rows: 0)
    m = v.abs().amax(dim=1)
    _, e = torch.frexp(torch.where(m > 0, m, torch.ones_like(m)))
    return (e - 1).to(torch.int64)


def med_exp(v):
    a = v.abs()
    _, e = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))
    e = (e - 1).double()
    e = torch.where(a > 0, e, torch.full_like(e, float("nan")))
    return torch.nanmedian(e, dim=1).values.nan_to_num(0).to(torch.int64)


def quant(v, S, E):
    """RNE(v * 2^(8S-3-E)) per row, as float64 integers (exact: |.| < 2^30)."""
    s = (8 * S - 3 - E).double()
    return torch.round(v.double() * torch.exp2(s)[:, None]), s


def lsb_exp(v):
    """per element: exponent of the lowest set bit of the significand (inf for zeros)."""
    a = v.abs().double()
    m, e = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))
    mi = (m * 2**53).to(torch.int64)
    tz = (mi & -mi).double().log2()
    low = (e - 53).double() + tz
    return torch.where(a > 0, low, torch.full_like(low, float("inf")))


def exact_digits(v, cap):
    """smallest S in 2..cap such that every element of the row is an integer multiple of the unit 2^(E-8S+3)."""
    E = row_exp(v).double()
    need = E - lsb_exp(v).amin(dim=1) + 3  # 8S >= need
    S = torch.ceil(need / 8).clamp(2, cap).to(torch.int64)
    return S


def w_digits(w, S=3):
    E = row_exp(w)
    W3, s3 = quant(w, torch.full_like(E, S), E)
    d0 = torch.remainder(W3 + 128, 256) - 128
    W2 = (W3 - d0) / 256
    return W3, s3, W2, s3 - 8


def exact_dot(X, W):
    """sum_k X W exactly as (hi, lo) float64 parts, then one rounding to fp64 (then fp32 below)."""
    Xh = torch.floor(X / 65536)
    Xl = X - Xh * 65536
    Sh = (Xh.to(torch.int64) @ W.to(torch.int64).T).double()
    Sl = (Xl.to(torch.int64) @ W.to(torch.int64).T).double()
    return Sh * 65536 + Sl


def sim(x, w, rule):
    x = x.double()
    E = row_exp(x)
    if rule[0] == "exact":
        Sx = exact_digits(x, rule[1])
        Sw = int(exact_digits(w.double(), rule[2]).max())
        X, sx = quant(x, Sx, E)
        W, sw, _, _ = w_digits(w.double(), Sw)
        y = exact_dot(X, W) * torch.exp2(-(sx[:, None] + sw[None, :]))
        return y.float(), (Sx * Sw).double().mean().item()
    if rule[0] == "auto":
        T = rule[1]
        t = E - med_exp(x)
        Sx = torch.where(t <= T, 2, torch.where(t <= T + 8, 3, 4))
        use3 = Sx >= 3
    else:
        Sx = torch.full_like(E, rule[0])
        use3 = torch.full_like(E, rule[1] == 3, dtype=torch.bool)
    X, sx = quant(x, Sx, E)
    W3, s3, W2, s2 = w_digits(w.double())
    y3 = exact_dot(X, W3) * torch.exp2(-(sx[:, None] + s3[None, :]))
    y2 = exact_dot(X, W2) * torch.exp2(-(sx[:, None] + s2[None, :]))
    y = torch.where(use3[:, None], y3, y2)
    pairs = (Sx * torch.where(use3, 3, 2)).double().mean().item()
    return y.float(), pairs


def err(y, ref):
    nz = ref != 0
    r = ((y.double() - ref).abs() / ref.abs())[nz]
    return r.max().item(), r.mean().item()


def cases(quick):
    g = torch.Generator().manual_seed(0)
    M, K, N = (32, 1536, 256) if quick else (64, 1536, 512)
    out = []

    def mk(scale_x=None, chans=None, wscale=None, rows=None):
        x = torch.randn(M, K, generator=g)
        w = torch.randn(N, K, generator=g) * 0.02
        if chans is not None:
            if rows is None:
                x[:, chans] *= scale_x
            else:
                x[rows][:, chans] *= scale_x
                x[rows, :] = x[rows, :]
                for r in rows:
                    x[r, chans] *= scale_x
            if wscale is not None:
                w[:, chans] *= wscale
        return x.bfloat16(), w.bfloat16()

    out.append(("random N(0,1) x N(0,0.02)", *mk()))
    ch = torch.randperm(K, generator=g)[:4]
    for s in (1e2, 1e3, 1e4):
        out.append((f"4 outlier channels x{s:.0e}, ordinary weights", *mk(s, ch)))
    for s in (1e2, 1e3, 1e4):
        out.append((f"adversarial: outliers x{s:.0e} meet weights x1e-3", *mk(s, ch, 1e-3)))
    for s in (1e3, 1e4):
        # BOS-like: only row 0 carries the massive activation (after RMSNorm the others are ~1)
        x, w = mk()
        x = x.float()
        w = w.float()
        x[0, ch] *= s
        w[:, ch] *= 1e-3
        out.append((f"BOS-like row x{s:.0e} (1 row), weights x1e-3", x.bfloat16(), w.bfloat16()))
    return out


def model_cases():
    """Inputs and weights of every nn.Linear of the tiny test model (bf16, real forward on a prompt)."""
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aligned_ops.testing.tiny_model import build_tiny_qwen2

    res = []
    with tempfile.TemporaryDirectory() as d:
        for hidden, inter, layers in ((128, 256, 2), (896, 4864, 2)):
            p = build_tiny_qwen2(f"{d}/m{hidden}", dtype=torch.bfloat16, hidden_size=hidden,
                                 intermediate_size=inter, num_hidden_layers=layers,
                                 num_attention_heads=max(4, hidden // 64), num_key_value_heads=2)
            tok = AutoTokenizer.from_pretrained(p)
            model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.bfloat16)
            caps = []
            hooks = [m.register_forward_hook(lambda mod, inp, o, n=n: caps.append((n, inp[0].detach(), mod.weight)))
                     for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
            ids = tok("A rollout engine and a trainer must agree on every log-probability, bit for bit. " * 3,
                      return_tensors="pt").input_ids
            with torch.no_grad():
                model(ids)
            for h in hooks:
                h.remove()
            for n, xin, wt in caps:
                x2 = xin.reshape(-1, xin.shape[-1])
                wt2 = wt.detach()[:512]
                res.append((f"tiny Qwen2 h{hidden}: {n}", x2, wt2))
    return res


RULES = [(2, 2), (3, 3), (4, 3), ("exact", 4, 3), ("exact", 4, 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(2)
    cs = cases(a.quick)
    if a.models:
        cs += model_cases()
    rn = ["torch bf16"] + [f"S{r[0]}x{r[1]}" if r[0] not in ("auto", "exact") else f"{r[0]}{r[1:]}" for r in RULES]
    print("| case | " + " | ".join(rn) + " |")
    print("|---|" + "---|" * len(rn))
    agg = {}
    for name, x, w in cs:
        ref = x.double() @ w.double().T
        yt = torch.nn.functional.linear(x, w)
        et = err(yt, ref)
        cells = [f"{et[0]:.2e} / {et[1]:.2e}"]
        for r in RULES:
            y32, pairs = sim(x, w, r)
            e = err(y32.bfloat16(), ref)
            ok = e[0] <= et[0] * 1.0000001 and e[1] <= et[1] * 1.02
            cells.append(f"{e[0]/et[0]:.2f} / {e[1]/et[1]:.2f}{'' if ok else ' ✗'} ({pairs:.1f})")
            agg.setdefault(r, []).append(ok)
        print(f"| {name} | " + " | ".join(cells) + " |")
        sys.stdout.flush()
    print()
    for r, oks in agg.items():
        print(r, f"{sum(oks)}/{len(oks)} cases at or below torch (max and mean)")


if __name__ == "__main__":
    main()
