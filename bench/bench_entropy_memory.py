"""Resident memory of the trainer's per-token entropy (``model(..., return_entropy=True)``: TRL's entropy metric
and ``top_entropy_quantile``, OpenRLHF's / verl's entropy) as the user's process sees it, in two forms on the same
logits:

  * aligned: ``integrations.hf._entropy`` (an autograd Function whose backward is the entropy's own,
    -p (log p + 1), then log_softmax's backward: it saves only the logits);
  * elementwise: the same forward as torch's elementwise graph (log_softmax -> widen -> mask -inf -> exp * log p ->
    the row-local sum), what it was before: autograd keeps exp(log p), the masked log p and a bool mask.

How it measures (each form in its OWN fresh process, ``--processes`` of them): the logits [n, V] (bf16, requiring
grad) are built and one tiny call runs (lazy initialisation); the RSS is read (the baseline) and the kernel's peak
counter reset (/proc/self/clear_refs "5"); the entropy's forward runs: "kept" = VmRSS after it - baseline (what
the graph holds until the loss's backward, also for an entropy that is only logged); then its backward: "peak" =
VmHWM over forward + backward - baseline. The logits' gradient (n x V x 2 bytes) is part of both peaks.

    PYTHONPATH=$PWD/python python3 bench/bench_entropy_memory.py [--rows 1024 --vocab 151936] [--processes 2]
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
    from aligned_ops.integrations.hf import _entropy, _widened
    from aligned_ops.ops.moe import row_local_sum

    def elementwise(x, t):  # the same forward bits as torch's elementwise graph (the peer)
        lsm = _widened(aligned_ops.log_softmax(x, t))
        lsm = lsm.masked_fill(lsm == float("-inf"), 0.0)
        return -row_local_sum(lsm.exp() * lsm)

    entropy = _entropy if args.form == "aligned" else elementwise
    torch.manual_seed(0)
    x = (torch.randn(args.rows, args.vocab) * 4).to(torch.bfloat16).requires_grad_(True)
    entropy(x[:2].detach().clone().requires_grad_(True), 0.9).sum().backward()  # lazy initialisation
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = time.perf_counter()
    h = entropy(x, 0.9)
    kept = _status("VmRSS") - base
    h.sum().backward()
    seconds = time.perf_counter() - t0
    print(json.dumps({"form": args.form, "kept": kept, "peak": _status("VmHWM") - base, "s": seconds}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--form", choices=["aligned", "elementwise"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.form:
        return child(args)
    mib = 2 ** 20
    print(f"entropy of [{args.rows}, {args.vocab}] bf16 logits; logits {args.rows * args.vocab * 2 / mib:.1f} MiB, "
          f"fp32 log-probs {args.rows * args.vocab * 4 / mib:.1f} MiB")
    rows = {}
    for form in ("aligned", "elementwise"):
        for _ in range(args.processes):
            out = subprocess.run([sys.executable, __file__, "--form", form, "--rows", str(args.rows), "--vocab",
                                  str(args.vocab)], capture_output=True, text=True, env=os.environ, check=True)
            rows.setdefault(form, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    for form, runs in rows.items():
        kept = [r["kept"] / mib for r in runs]
        peak = [r["peak"] / mib for r in runs]
        print(f"{form:12s} kept until backward MiB max/min {max(kept):8.1f} / {min(kept):8.1f}   "
              f"peak fwd+bwd MiB {max(peak):8.1f} / {min(peak):8.1f}   s {min(r['s'] for r in runs):.2f}")


if __name__ == "__main__":
    main()
