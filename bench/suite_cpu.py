"""Where the CPU seconds of a command go, process by process — for CI time work (issue 20: the README's test command
on 2 cores is bound by CPU, not by waiting, so the number to cut is CPU seconds, and a test's wall time under
`-n 2` says little: it grows with whatever the other worker runs, and the background jobs' CPU shows up in the test
that happens to reap them).

A ``sitecustomize`` put first on PYTHONPATH makes each Python process the command starts append one record when it
exits (atexit, or SIGTERM): its interpreter command line (``sys.orig_argv``: ``sys.argv`` is rewritten by spawned
children and by tests/_shared_process.py), its multiprocessing name (vLLM's TP workers are ``VllmWorker-N``), its own
user + system CPU, its wall time, and whether it imported vllm / torch / transformers. The table sums the records by
kind, and compares them with the command's total: the CPU of the command and every descendant that was waited for
(``RUSAGE_CHILDREN`` once the command is reaped).

Not recorded (their CPU is in the total when a parent reaped them, never in a row): processes killed by SIGKILL,
ended by ``os._exit`` (fork children, some workers), or whose SIGTERM handler was replaced before the signal
(vLLM's engine core); children started with an environment without this PYTHONPATH or without
ALIGNED_SUITE_CPU_RECORDS, or with ``-I`` / ``-E`` / ``-S``; and non-Python processes (compilers, Ray's C++
daemons). What the tool changes: a process that has not installed a SIGTERM handler of its own
gets one that records and then dies of SIGTERM as before (exit status -15). Such a process's
``signal.getsignal(SIGTERM)`` returns that handler, not SIG_DFL, and a SIGTERM that arrives while its main thread
runs native code takes effect only when the code returns to Python.

    python3 bench/suite_cpu.py [--out records.jsonl] -- python3 -m pytest -q -n 2
    python3 bench/suite_cpu.py --report records.jsonl        # the table again, from saved records

(Any other sitecustomize — on PYTHONPATH, in site-packages or the standard library's directory — is shadowed for
the run.)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

SITECUSTOMIZE = r'''
import atexit, json, os, resource, signal, sys, time
_t0 = time.time()
_path = os.environ.get("ALIGNED_SUITE_CPU_RECORDS")
_done = []
def _record(*_):
    if not _path or _done:  # once: SIGTERM during the atexit write must not write a second record
        return
    _done.append(1)
    r = resource.getrusage(resource.RUSAGE_SELF)
    mods = sys.modules
    mp = mods.get("multiprocessing")
    rec = dict(pid=os.getpid(), ppid=os.getppid(),
               # the interpreter's own command line (sys.argv may be rewritten: a spawned child gets its parent's,
               # tests/_shared_process.py sets each job's); the multiprocessing name tells spawned children apart
               orig_argv=" ".join(getattr(sys, "orig_argv", []))[:400], argv=" ".join(getattr(sys, "argv", []))[:400],
               mp_name=mp.current_process().name if mp is not None else "MainProcess",
               cpu=r.ru_utime + r.ru_stime, wall=time.time() - _t0,
               vllm="vllm" in mods, torch="torch" in mods, transformers="transformers" in mods)
    # one short write per process (appends from many processes do not interleave), SIGTERM held off meanwhile: a
    # record is written whole or not at all, and a SIGTERM that arrives during it is taken right after
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        with open(_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
    except OSError:
        pass
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
atexit.register(_record)
def _on_term(signum, frame):  # record, then die of SIGTERM as before (a handler installed later replaces this one)
    _record()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
    signal.signal(signal.SIGTERM, _on_term)
'''


_INTERPRETER_FLAGS_WITH_VALUE = {"-X", "-W", "--check-hash-based-pycs"}


def _command(argv: str) -> tuple[str, str, list[str]]:
    """``(how, what, rest)`` of an interpreter command line: ``("-m", module, args)``, ``("-c", code, args)`` or
    ``("script", path, args)``."""
    words = argv.split(" ")[1:]  # after the interpreter
    i = 0
    while i < len(words) and words[i].startswith("-") and words[i] != "-" and words[i][:2] not in ("-m", "-c"):
        i += 2 if words[i] in _INTERPRETER_FLAGS_WITH_VALUE else 1
    if i >= len(words):
        return "script", "", []
    if words[i][:2] in ("-m", "-c"):  # `-m mod` or `-mmod`
        if len(words[i]) > 2:
            return words[i][:2], words[i][2:], words[i + 1:]
        return words[i], (words[i + 1] if i + 1 < len(words) else ""), words[i + 2:]
    return "script", words[i], words[i + 1:]  # (a script "-" reads stdin)


def kind(rec: dict) -> str:
    """A short name for what a process was, from the interpreter's own command line (``sys.orig_argv``) and its
    multiprocessing name."""
    argv = rec.get("orig_argv") or "python " + rec["argv"]  # records without orig_argv: sys.argv has no interpreter
    how, what, rest = _command(argv)
    engine = " (imports vllm)" if rec["vllm"] else ""
    name = rec.get("mp_name", "MainProcess")
    if "--multiprocessing-fork" in argv or name != "MainProcess":
        if name.startswith("VllmWorker"):
            return "vLLM TP worker (spawned by an engine)"
        return f"multiprocessing child {re.sub(r'[-_]?[0-9]+$', '', name)}{engine}"
    if how == "-m" and what == "pytest":
        return "pytest (main process)"
    if how == "-c" and "sys.stdin.readline" in argv:
        return "pytest-xdist worker (in-process tests)"  # execnet starts each worker as `python -c` reading stdin
    if how == "-m" and what == "aligned_ops.apps.cli" or how == "script" and (what.endswith("apps/cli.py")
                                                                              or os.path.basename(what) == "aligned-ops"):
        return f"aligned-ops {rest[0] if rest else '?'}" + (" (engine)" if rec["vllm"] else "")
    if how == "-c":
        m = re.search(r"isa_matrix\d*/(\w+)/", rec["argv"])  # the spec path (orig_argv is cut inside the code)
        return f"ISA-level worker ({m.group(1)})" if m else f"other `python -c`{engine}"
    if how == "-m":
        return f"-m {what}{engine}"
    return ("`python` (code on stdin)" if what in ("", "-") else os.path.basename(what)) + engine


def report(path: str, total_cpu: float | None = None, wall: float | None = None) -> None:
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    groups = collections.defaultdict(lambda: [0.0, 0, 0])
    for r in recs:
        g = groups[kind(r)]
        g[0] += r["cpu"]
        g[1] += 1
        g[2] += r["vllm"]
    recorded = sum(r["cpu"] for r in recs)
    vllm_n = sum(r["vllm"] for r in recs)
    vllm_cpu = sum(r["cpu"] for r in recs if r["vllm"])
    print(f"{len(recs)} Python processes recorded, {recorded:.0f} CPU s"
          + (f" of the command's {total_cpu:.0f} CPU s (the rest: processes that could not record, see the "
             f"docstring)" if total_cpu is not None else "")
          + (f"; wall {wall:.0f} s" if wall is not None else ""))
    print(f"processes that imported vllm: {vllm_n}, {vllm_cpu:.0f} CPU s "
          f"({vllm_cpu / max(vllm_n, 1):.1f} s each on average)")
    print(f"\n| CPU s | share | processes | of them importing vllm | kind |\n|---:|---:|---:|---:|---|")
    for name, (cpu, n, nv) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        cpu_s = f"{cpu:.0f}" if cpu >= 1 else f"{cpu:.2f}"
        print(f"| {cpu_s} | {100 * cpu / max(recorded, 1e-9):.1f} % | {n} | {nv} | {name} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="records file (default: a temporary file, printed)")
    ap.add_argument("--report", metavar="RECORDS", help="print the table of a saved records file and exit")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = ap.parse_args()
    if args.report:
        if args.command:
            ap.error("--report prints saved records: give no command")
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
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = children.ru_utime + children.ru_stime
    code = os.waitstatus_to_exitcode(status)
    print(f"\ncommand exit status {code}; records: {out}")
    report(out, total_cpu=total, wall=wall)
    sys.exit(code if code >= 0 else 128 - code)  # killed by a signal: the shell's convention


if __name__ == "__main__":
    main()
