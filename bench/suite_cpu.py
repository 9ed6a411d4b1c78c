"""Where the CPU seconds of a command go, process by process — for CI time work (issue 20: the README's test command
on 2 cores is bound by CPU, not by waiting, so the number to cut is CPU seconds, and a test's wall time under
`-n 2` says little: it grows with whatever the other worker runs, and the background jobs' CPU shows up in the test
that happens to reap them).

Every Python process the command starts (pytest and its xdist workers, vLLM engines and their TP workers, CLI runs,
torch.distributed ranks, ISA-level workers) appends one record at exit — its argv, its own user + system CPU, its
wall time and whether it imported vllm / torch / transformers — through a ``sitecustomize`` put first on
PYTHONPATH. A process killed by SIGKILL writes nothing (vLLM's TP workers are sent SIGTERM first, which is caught;
the record count and the command's own CPU total, from ``os.wait4``, say how much is unaccounted).

    python3 bench/suite_cpu.py [--out records.jsonl] -- python3 -m pytest -q -n 2
    python3 bench/suite_cpu.py --report records.jsonl        # the table again, from saved records

(A sitecustomize of your own on PYTHONPATH is shadowed for the run.)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time

SITECUSTOMIZE = r'''
import atexit, json, os, resource, signal, sys, time
_t0 = time.time()
_path = os.environ.get("ALIGNED_SUITE_CPU_RECORDS")
def _record(*_):
    if not _path:
        return
    r = resource.getrusage(resource.RUSAGE_SELF)
    mods = sys.modules
    rec = dict(pid=os.getpid(), ppid=os.getppid(), argv=" ".join(getattr(sys, "argv", []))[:400],
               cpu=r.ru_utime + r.ru_stime, wall=time.time() - _t0,
               vllm="vllm" in mods, torch="torch" in mods, transformers="transformers" in mods)
    try:
        with open(_path, "a") as f:  # one short write per process: appends from many processes do not interleave
            f.write(json.dumps(rec) + "\n")
    except OSError:
        pass
atexit.register(_record)
def _on_term(signum, frame):  # record, then die of SIGTERM as before (a handler installed later replaces this one)
    _record()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
    signal.signal(signal.SIGTERM, _on_term)
'''


def _is_pytest_main(argv: str) -> bool:
    first = argv.split(" ")[0]
    return first.endswith(os.path.join("pytest", "__main__.py")) or os.path.basename(first) in ("pytest", "py.test")


def kind(rec: dict, by_pid: dict) -> str:
    """A short name for what a process was, from its argv (and, for spawned children, its parent's)."""
    argv = rec["argv"]
    parent = by_pid.get(rec["ppid"])
    if _is_pytest_main(argv):
        return "pytest"
    if argv.startswith("-c") and parent is not None and _is_pytest_main(parent["argv"]):
        return "pytest-xdist worker (in-process tests)"  # execnet starts each worker as `python -c`
    if argv.startswith("-c"):
        if rec["vllm"] and parent is not None and parent["vllm"]:
            return "vLLM TP worker (spawned by an engine)"
        m = re.search(r"isa_matrix\d*/(\w+)/", argv)
        if m:
            return f"ISA-level worker ({m.group(1)})"
        return "other `python -c` child" + (" (imports vllm)" if rec["vllm"] else "")
    script = os.path.basename(argv.split(" ")[0])
    if script == "cli.py":
        words = argv.split(" ")
        sub = words[1] if len(words) > 1 else "?"
        role = " (engine)" if rec["vllm"] else ""
        return f"aligned-ops {sub}{role}"
    return script + (" (imports vllm)" if rec["vllm"] else "")


def report(path: str, total_cpu: float | None = None, wall: float | None = None) -> None:
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    by_pid = {r["pid"]: r for r in recs}
    groups = collections.defaultdict(lambda: [0.0, 0, 0])
    for r in recs:
        g = groups[kind(r, by_pid)]
        g[0] += r["cpu"]
        g[1] += 1
        g[2] += r["vllm"]
    recorded = sum(r["cpu"] for r in recs)
    vllm_n = sum(r["vllm"] for r in recs)
    vllm_cpu = sum(r["cpu"] for r in recs if r["vllm"])
    print(f"{len(recs)} Python processes recorded, {recorded:.0f} CPU s"
          + (f" of the command's {total_cpu:.0f} CPU s (the rest: processes killed before they could record, "
             f"non-Python children)" if total_cpu is not None else "")
          + (f"; wall {wall:.0f} s" if wall is not None else ""))
    print(f"processes that imported vllm: {vllm_n}, {vllm_cpu:.0f} CPU s "
          f"({vllm_cpu / max(vllm_n, 1):.1f} s each on average)")
    print(f"\n| CPU s | share | processes | of them importing vllm | kind |\n|---:|---:|---:|---:|---|")
    for name, (cpu, n, nv) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"| {cpu:.0f} | {100 * cpu / max(recorded, 1e-9):.1f} % | {n} | {nv} | {name} |" if cpu >= 1 else
              f"| {cpu:.2f} | {100 * cpu / max(recorded, 1e-9):.1f} % | {n} | {nv} | {name} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="records file (default: a temporary file, printed)")
    ap.add_argument("--report", metavar="RECORDS", help="print the table of a saved records file and exit")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = ap.parse_args()
    if args.report:
        report(args.report)
        return
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command after --")
    site = tempfile.mkdtemp(prefix="suite_cpu_site_")
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    out = os.path.abspath(args.out or os.path.join(site, "records.jsonl"))
    open(out, "w").close()
    env = dict(os.environ, ALIGNED_SUITE_CPU_RECORDS=out,
               PYTHONPATH=os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p))
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env)
    _, status, _ = os.wait4(proc.pid, 0)
    wall = time.time() - t0
    # the command and every descendant that was waited for: RUSAGE_CHILDREN of this process, once wait4 reaped it
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = children.ru_utime + children.ru_stime
    print(f"\ncommand exit status {os.waitstatus_to_exitcode(status)}; records: {out}")
    report(out, total_cpu=total, wall=wall)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
