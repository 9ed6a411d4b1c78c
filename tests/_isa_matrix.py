"""The CPU ISA-level matrix, one worker process per level for the whole test run.

The kernel level is chosen once per process (ALIGNED_CPU_ISA, csrc/cpu/cpu_backend.h), so a test that proves
"every level computes the same bits" must run each level in its own process. Each such test module declares its
work as a script in a module-level dict::

    ISA_FAMILIES = {"linear": SCRIPT}   # SCRIPT: python source; sys.argv[1] is a file path it may write

and asks the session fixture for the result on one level::

    res = isa_matrix.run("avx2", "linear")   # res.path: what the script wrote there; res.stdout: what it printed
    by_level = isa_matrix.run_levels(isa_matrix.levels_to_compare(), "linear")   # the CPU's levels, side by side

The first request for a level starts ONE process for that level which runs the scripts of every module with a
selected test that uses the ``isa_matrix`` fixture (directly or through a fixture of its own), in turn (instead
of one process per test per level: 3 levels x 7 families, each paying for ``import torch, aligned_ops``). Each script runs as if it were its own ``python -c`` process as far as it can
tell: ``__name__ == "__main__"``, its own ``sys.argv``, the worker's original environment and torch thread
count restored before it (a script that sets ALIGNED_EXACT_F64 cannot change the next one's results), stdout
captured per script. A script that raises fails its own tests only (the traceback is in the failure); a worker
that dies fails every test of that level with its stderr (which names the family it was running, and has the
Python stack of a crash). The families share one process and only the environment and thread count are restored
between them, but the kernel level is fixed at import: a script's leftover state (imported modules, torch globals)
cannot make a worker run another level's kernels (the false pass this matrix guards against); a leak that changes a
later family's numbers shows as that family's false failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# Per script, what a test allowed its own subprocess before (300-600 s); the worker runs them all.
SCRIPT_TIMEOUT_S = 600

_WORKER = r'''
import contextlib, faulthandler, io, json, os, sys, traceback
faulthandler.enable()  # a crash (SIGSEGV, abort) prints the Python stack to stderr, below the family's line
import torch
import aligned_ops  # noqa: F401  (the level is chosen here, once for this process)

spec = json.load(open(sys.argv[1]))
env, threads, report = dict(os.environ), torch.get_num_threads(), {}
for name, fam in spec["families"].items():
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(threads)
    sys.argv = ["-c", fam["out"]]
    print("running ISA family " + name, file=sys.stderr, flush=True)  # a worker that dies names the family it ran
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(fam["script"], "<ISA family " + name + ">", "exec"), {"__name__": "__main__"})
        report[name] = {"ok": True, "stdout": out.getvalue()}
    except BaseException:  # noqa: BLE001  (SystemExit and assertions included: reported to that family's tests)
        report[name] = {"ok": False, "stdout": out.getvalue(), "error": traceback.format_exc()}
with open(spec["report"], "w") as f:
    json.dump(report, f)
'''


def supported_levels(*, amx: bool = False) -> list[str]:
    """The kernel levels this CPU runs of generic, avx2 and avx512 — and with ``amx=True`` the amx level too (the
    exact profile's AMX-INT8 kernels; the fma kernels there are avx512's) — by csrc/cpu/cpu_dispatch.cpp's rule (avx2:
    AVX2 + FMA; avx512: F/BW/VL/DQ; amx: avx512 and amx_int8 — the Linux kernel's grant of the AMX tiles, which the
    dispatcher also needs, is not checked here: where it is refused the amx worker's import fails by name, as with
    the cpuinfo copies this replaced); forcing another level makes ``import aligned_ops`` refuse by name. Machines of
    this project's kind include AVX2-only CPUs (AMD Zen 3), so a cross-level test compares the levels there are, and
    none is assumed."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # pragma: no cover (not Linux)
        return ["generic"]
    levels = ["generic"]
    if {"avx2", "fma"} <= flags:
        levels.append("avx2")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        levels.append("avx512")
        if amx and "amx_int8" in flags:
            levels.append("amx")
    return levels


@dataclass
class IsaResult:
    level: str
    family: str
    path: Path  # the file the script got as sys.argv[1]
    stdout: str


class IsaMatrix:
    def __init__(self, session, root: Path):
        self._root = root
        self._families: dict[str, str] = {}
        self._runs: dict[str, dict] = {}  # level -> report
        for item in session.items:
            # Only a selected test that reads the matrix (the fixture, directly or through one of its own, e.g. the
            # golden corpus's ``recomputed``) brings its module's families in: a module's other tests (a quick run's
            # `-m "not slow"` selection of the golden module's planted-bit tests) start no level's work for them.
            if "isa_matrix" not in getattr(item, "fixturenames", ()):
                continue
            for name, script in (getattr(getattr(item, "module", None), "ISA_FAMILIES", None) or {}).items():
                if self._families.setdefault(name, script) != script:
                    raise pytest.UsageError(f"two test modules declare ISA family {name!r} with different scripts")

    @staticmethod
    def levels_to_compare() -> list[str]:
        """Every level this CPU runs, for a test that proves they give the same bits; skips where only one runs."""
        levels = supported_levels()
        if len(levels) < 2:
            pytest.skip("only the generic kernel level runs on this CPU: no second level to compare")
        return levels

    def run(self, level: str, family: str) -> IsaResult:
        return self.run_levels([level], family)[level]

    def run_levels(self, levels: list[str], family: str) -> dict[str, IsaResult]:
        """``family``'s result on each of ``levels``; the levels that have not run it yet start their workers side
        by side (one process per level, each running every family it has not run) and are waited for together."""
        if family not in self._families:
            raise KeyError(f"ISA family {family!r} is not declared by the module of a selected test that uses the "
                           "isa_matrix fixture (ISA_FAMILIES)")
        started = []
        try:
            for level in levels:
                if "crash" not in self._runs.get(level, {}) and \
                        family not in self._runs.get(level, {}).get("families", {}):
                    # First request for this level (or a family that was not collected when the level ran): one
                    # worker for every family not yet run on this level.
                    todo = {n: s for n, s in self._families.items()
                            if n not in self._runs.get(level, {}).get("families", {})}
                    started.append(self._start(level, todo))
            for level, proc, report, timeout in started:
                self._finish(level, proc, report, timeout)
        finally:
            # a later _start that raised, or Ctrl-C / an error in one worker's wait: no worker outlives the request
            for _, proc, _, _ in started:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        return {level: self._result(level, family) for level in levels}

    def _result(self, level: str, family: str) -> IsaResult:
        rep = self._runs[level]
        if "crash" in rep:
            pytest.fail(f"the ISA worker for level {level!r} failed: {rep['crash']}", pytrace=False)
        res = rep["families"][family]
        if not res["ok"]:
            pytest.fail(f"ISA family {family!r} on level {level!r} raised:\n{res['error']}", pytrace=False)
        return IsaResult(level, family, self._root / level / f"{family}.out", res["stdout"])

    def _start(self, level: str, families: dict[str, str]):
        d = self._root / level
        d.mkdir(exist_ok=True)
        spec = {"report": str(d / f"report{len(self._runs.get(level, {}).get('runs', []))}.json"),
                "families": {n: {"script": s, "out": str(d / f"{n}.out")} for n, s in families.items()}}
        spec_path = Path(spec["report"]).with_suffix(".spec.json")
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, ALIGNED_CPU_ISA=level)
        rep = self._runs.setdefault(level, {"families": {}, "runs": []})
        rep["runs"].append(spec_path)
        proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(spec_path)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        return level, proc, Path(spec["report"]), SCRIPT_TIMEOUT_S * max(1, len(families))

    def _finish(self, level: str, proc: subprocess.Popen, report: Path, timeout: float) -> None:
        rep = self._runs[level]
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            proc.kill()
            proc.communicate()
            rep["crash"] = f"timed out after {e.timeout} s"
            return
        if proc.returncode != 0 or not report.exists():
            rep["crash"] = f"exit code {proc.returncode}\n{stderr[-3000:]}"
            return
        rep["families"].update(json.loads(report.read_text()))


@pytest.fixture(scope="session")
def isa_matrix(request, tmp_path_factory) -> IsaMatrix:
    """One worker process per CPU ISA level, shared by every test module that declares ISA_FAMILIES."""
    return IsaMatrix(request.session, tmp_path_factory.mktemp("isa_matrix"))
