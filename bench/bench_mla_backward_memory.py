"""Peak resident memory (and time) of the trainer's MLA attention BACKWARD as the user's process sees it, in the
two forms on the same problem (issue 26 item 4):

  * absorbed: ``mla_attention_varlen`` backward — q [T, H, R + dr], one latent row kv [T, R + dr], out
    [T, H, R];
  * expanded: ``attention_varlen`` backward — q, k [T, H, dn + dr], v zero-padded to dn + dr (as the trainer
    runs it), out [T, H, dn + dr].

How it measures (each form x dtype in its OWN fresh process, ``--processes`` of them): the inputs are built and
the forward runs (its outputs are what a backward must hold anyway), one tiny backward runs (lazy initialisation),
the kernel's peak-RSS counter is reset (/proc/self/clear_refs "5") and the RSS read (the baseline), then
``torch.autograd.grad`` of the full problem runs ``--calls`` times: peak = VmHWM - baseline, retained = VmRSS
after the last call (its gradients freed) - baseline; "grads" = the bytes of the gradients the call returns
(what any backward must allocate). "fp32 temporaries (formula)": what the absorbed glue widens to fp32 around the
kernel (csrc/torch/glue/attention.h mla_attention_varlen_backward: grad_out and out zero-padded to R + dr, q,
and the fp32 dq — 4 x T x H x (R + dr) x 4 bytes in bf16; 2 x in fp32, where q's widening is a no-op and dq is
the result). They are not avoidable in the glue without changing the kernel: attention's backward takes one dtype
for q, k, v, out, grad_out and values as wide as keys; dkv = dk + dv must be summed in fp32 before its one
rounding. Avoiding them needs a backward kernel that reads bf16 operands (widening exactly, as the glue does),
takes values narrower than keys and writes fp32 dk / dv.

Measured 2026-12-04 (load average 45 on 2 cores: the seconds are not comparable, the bytes are), T = 4 x 512,
H = 16, R + dr = 512 + 64, expanded dn + dr = 128 + 64, dv = 128; peak MiB max / min over 2 processes:
bf16 absorbed 312.6 / 308.1 (grads 38.2, fp32 temporaries by formula 288), expanded 84.0 / 68.0 (grads 32.0);
fp32 absorbed 238.3 / 224.9 (grads 76.5, formula 144), expanded 160.0 / 144.0 (grads 64.0).

    PYTHONPATH=$PWD/python python3 bench/bench_mla_backward_memory.py [--seqs 4 --seqlen 512 --heads 16
        --kv-lora-rank 512 --rope 64 --nope 128 --v 128] [--dtypes bfloat16,float32] [--processes 2] [--calls 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


from common import proc_status_bytes as _status  # noqa: E402  (bench/ is the script's directory)


def child(args):
    import torch

    import aligned_ops

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    H, R, dr, dn, dv = args.heads, args.kv_lora_rank, args.rope, args.nope, args.v
    lens = [args.seqlen] * args.seqs
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = (dn + dr) ** -0.5
    if args.form == "absorbed":
        leaves = [(torch.randn(T, H, R + dr) * 0.5).to(dtype).requires_grad_(True),
                  (torch.randn(T, R + dr) * 0.5).to(dtype).requires_grad_(True)]

        def forward(n, cu_):
            q, kv = leaves[0][:n], leaves[1][:n]
            return aligned_ops.mla_attention_varlen(q, kv, cu_, cu_, R, scale)[0]
    else:
        dqk = dn + dr
        leaves = [(torch.randn(T, H, dqk) * 0.5).to(dtype).requires_grad_(True) for _ in range(2)]
        leaves.append((torch.randn(T, H, dv) * 0.5).to(dtype).requires_grad_(True))

        def forward(n, cu_):
            q, k, v = (t[:n] for t in leaves)
            v = torch.nn.functional.pad(v, (0, dqk - dv))
            return aligned_ops.attention_varlen(q, k, v.contiguous(), cu_, cu_, scale, True)[0]

    small = torch.tensor([0, 8], dtype=torch.int32)
    out_small = forward(8, small)
    torch.autograd.grad(out_small, leaves, torch.ones_like(out_small), allow_unused=True)  # lazy initialisation
    out = forward(T, cu)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss0 = _status("VmRSS")
    times, grads_bytes = [], 0
    for i in range(args.calls):
        t0 = time.perf_counter()
        grads = torch.autograd.grad(out, leaves, gy, retain_graph=i + 1 < args.calls)
        times.append(time.perf_counter() - t0)
        grads_bytes = sum(g.numel() * g.element_size() for g in grads)
        del grads
    peak = _status("VmHWM") - rss0
    retained = _status("VmRSS") - rss0
    # grad_out and out widened + zero-padded to R + dr, q widened and dq in fp32 (bf16 / fp16: rounded afterwards);
    # in fp32 q's widening is a no-op and dq is the returned gradient itself
    fp32_tmp = (4 if dtype != torch.float32 else 2) * T * H * (R + dr) * 4 if args.form == "absorbed" else 0
    print(json.dumps({"form": args.form, "dtype": args.dtype, "T": T, "peak": peak, "retained": retained,
                      "grads": grads_bytes, "fp32_formula": fp32_tmp, "seconds": min(times)}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--nope", type=int, default=128)
    p.add_argument("--v", type=int, default=128)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--child", action="store_true")
    p.add_argument("--form", choices=("absorbed", "expanded"))
    p.add_argument("--dtype")
    args = p.parse_args()
    if args.child:
        return child(args)
    rows = []
    for dtype in args.dtypes.split(","):
        for form in ("absorbed", "expanded"):
            for _ in range(args.processes):
                cmd = [sys.executable, __file__, "--child", "--form", form, "--dtype", dtype]
                for k in ("seqs", "seqlen", "heads", "kv_lora_rank", "rope", "nope", "v", "calls"):
                    cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ).stdout
                rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"load average {os.getloadavg()}; T = {rows[0]['T']}, H = {args.heads}, R + dr = "
          f"{args.kv_lora_rank}+{args.rope}, dn + dr = {args.nope}+{args.rope}, dv = {args.v}")
    print("| dtype | form | peak MiB (max / min) | retained MiB (max) | grads MiB | fp32 temporaries MiB (formula) | "
          "s (min) |")
    print("|---|---|---|---|---|---|---|")
    mib = 1 / 2**20
    for dtype in args.dtypes.split(","):
        for form in ("absorbed", "expanded"):
            rs = [r for r in rows if r["dtype"] == dtype and r["form"] == form]
            print(f"| {dtype} | {form} | {max(r['peak'] for r in rs) * mib:.1f} / {min(r['peak'] for r in rs) * mib:.1f}"
                  f" | {max(r['retained'] for r in rs) * mib:.1f} | {rs[0]['grads'] * mib:.1f} | "
                  f"{rs[0]['fp32_formula'] * mib:.1f} | {min(r['seconds'] for r in rs):.2f} |")


if __name__ == "__main__":
    main()
