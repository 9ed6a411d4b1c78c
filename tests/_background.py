"""Subprocess work that needs nothing from the test process, started at the beginning of the run.

Some tests only start a fresh interpreter and check what it prints (the stock-vLLM negative controls must run
without the plugin, so never in this process; the CLI runs). The test process waits for them, and on 2 cores
much of a one-process run keeps one core busy: started from the first test of the run, one at a time per pytest
process (under pytest-xdist's ``-n 2``, up to two at once: one per worker), at a slightly lower priority (nice +5)
than the test process, they use the CPU the in-process tests leave idle. (Each job
starts a session of its own, so a timeout kills its whole process group. Where the kernel schedules sessions as
groups — sched_autogroup_enabled=1, as on the 2-core CI VMs seen so far — a job competes with the test process as
a group of its own and its nice value orders only its own processes: it then gets an equal share, not a smaller
one. The CPU the suite uses is the same either way.) A module
declares its jobs with a function of the session's tiny checkpoints (tests/_tiny_checkpoints.py)::

    def BACKGROUND_JOBS(tiny_checkpoint):
        return {"stock_dense_probe": dict(argv=[sys.executable, PROBE, tiny_checkpoint("qwen2", torch.bfloat16)],
                                          env={...}, timeout=300)}

(a job may name the tests that wait for it, ``for_test="test_name"`` or a list of names, each a test function
or one parametrization of it, ``"test_name[op]"``: it is started only when one of them is selected; a name that is
no test function of the module is a usage error at collection) and its test asks for the result::

    res = background.result("stock_dense_probe")   # returncode, stdout, stderr (waits; runs it now if queued)

Jobs of one module or several that are declared with the same ``shared="name"`` (each ``argv`` a Python script
or ``-c`` code run by ``sys.executable``, the same ``env`` for all) run one after the other in one interpreter
(tests/_shared_process.py: each job's own argv, stdout, stderr and exit status; ~9-12 CPU s saved per vLLM import
avoided), in the order of the run's tests (a job declared with ``shared_order=1`` after those without); its timeout is the sum of theirs. ``result(key)`` still gives each
job's own result (a job the shared process never reached: the process's exit status and its stderr).

A job that writes files puts ``OUT_DIR`` among its argv: it is replaced by the job's own folder under pytest's
basetemp (``<basetemp>/background/<key>``, the run's shared one under xdist; ``background.out_dir(key)``, kept after the run as tmp_path is, failed runs included, and never left in
$TMPDIR when the run is interrupted).

Only the jobs of modules with a selected test that uses the ``background`` fixture are started. The command,
its environment (a job declared without ``env``: the clean environment of the run's first test, taken before any
test can change os.environ) and its timeout are the test's own, so it computes exactly what it computed when the test
started it; only the moment differs. ALIGNED_TEST_BACKGROUND=0 runs each job when its test asks for it (a shared
process's jobs all at once, when the first of their tests asks).

Under pytest-xdist (the README's ``-n 2``) every worker declares the same jobs over folders all of them see (the tiny
checkpoints and OUT_DIR folders under the run's shared tmp dir, tests/_xdist.py); each worker's thread goes through
the queue, and a job (or a shared process's jobs) runs in the worker that claims it first (a ``.claim`` file with
its pid). That worker writes each job's result to disk; ``result(key)`` in another worker reads it, waiting while
it runs (a claimer that died without writing it fails the wait at once). A worker whose tests are done lets the job
it runs finish before it exits (another worker's test may wait for it), unless it stops: Ctrl-C, or ``-x`` /
``--maxfail`` reached in that worker (the other worker of an ``-x`` run only gets xdist's shutdown: it finishes its
job, bounded by the job's own timeout).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys as _sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from _xdist import claim, claim_owner, shared_root

OUT_DIR = "{background job's out dir}"  # in a job's argv: the job's own folder under pytest's basetemp


@dataclass
class JobResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


class Background:
    def __init__(self, session, tiny_checkpoint, tmp_path_factory):
        self._session = session
        self._in_worker = hasattr(getattr(session, "config", None), "workerinput")  # an xdist worker (not a pytest
        # a test started: it inherits PYTEST_XDIST_WORKER, not workerinput)
        self._jobs: dict[str, dict] = {}
        self._out_dirs: dict[str, Path] = {}
        # Under pytest-xdist every worker declares the same jobs (the same session.items, the same shared tiny
        # checkpoints, the same folders here) and each job runs once: in the worker that claims its unit first
        # (a ``.claim`` file), which writes each job's result next to it for the others (tests/_xdist.py).
        self._dir = shared_root(tmp_path_factory) / "background"
        self._dir.mkdir(exist_ok=True)
        # A job declared without ``env`` gets this environment, not the one live when the thread starts it (an
        # in-process test may have monkeypatched ALIGNED_OPS_LINEAR by then). Taken here, at the session's first
        # test before any function fixture of it, it is the clean environment every test starts from (conftest
        # restores os.environ after each module): what the test's own subprocess inherited when it ran it.
        session_env = dict(os.environ)
        seen = set()
        for item in session.items:
            mod = getattr(item, "module", None)
            if mod is None or mod in seen or "background" not in getattr(item, "fixturenames", ()):
                continue
            seen.add(mod)
            declare = getattr(mod, "BACKGROUND_JOBS", None)
            if declare is None:
                continue
            mine = [i for i in session.items if getattr(i, "module", None) is mod]
            selected = {i.name for i in mine} | {getattr(i, "originalname", i.name) for i in mine}
            for key, job in declare(tiny_checkpoint).items():
                if key in self._jobs:
                    raise pytest.UsageError(f"background job {key!r} declared twice")
                wanted = job.get("for_test")
                if wanted is not None:
                    wanted = [wanted] if isinstance(wanted, str) else list(wanted)
                    for name in wanted:
                        if not callable(getattr(mod, name.split("[", 1)[0], None)):
                            raise pytest.UsageError(f"background job {key!r} of {mod.__name__}: for_test names "
                                                    f"{name!r}, which is no test function of that module")
                    if not selected.intersection(wanted):
                        continue  # no test that waits for it is selected: not started
                job = dict(job, env=dict(session_env) if job.get("env") is None else job["env"])
                if OUT_DIR in job["argv"]:
                    self._out_dirs[key] = self._dir / key
                    self._out_dirs[key].mkdir(exist_ok=True)
                    job["argv"] = [str(self._out_dirs[key]) if a == OUT_DIR else a for a in job["argv"]]
                self._jobs[key] = job
        # units of work: one job, or the jobs declared with the same ``shared`` name (one process, tests/_shared_process.py)
        self._unit_of: dict[str, tuple] = {}
        shared: dict[str, list] = {}
        for key, job in self._jobs.items():
            if job.get("shared") is None:
                self._unit_of[key] = (key,)
                continue
            argv = job["argv"]
            if len(argv) < 2 or argv[0] != _sys.executable or (argv[1].startswith("-") and argv[1] != "-c"):
                raise pytest.UsageError(f"background job {key!r}: a shared job runs `sys.executable SCRIPT ...` or "
                                        f"`sys.executable -c CODE ...`, not {argv[:2]!r}")
            members = shared.setdefault(job["shared"], [])
            if members and self._jobs[members[0]]["env"] != job["env"]:
                diff = sorted(k for k in set(job["env"]) | set(self._jobs[members[0]]["env"])
                              if job["env"].get(k) != self._jobs[members[0]]["env"].get(k))
                raise pytest.UsageError(f"background jobs {members[0]!r} and {key!r} share a process "
                                        f"({job['shared']!r}) but not their environment (differs in {diff})")
            members.append(key)
        self._shared_dirs: dict[tuple, Path] = {}
        for name, members in shared.items():
            members.sort(key=lambda k: self._jobs[k].get("shared_order", 0))  # (stable: else the run's order)
            for key in members:
                self._unit_of[key] = tuple(members)
            self._shared_dirs[tuple(members)] = self._dir / ("shared_" + name)
            self._shared_dirs[tuple(members)].mkdir(exist_ok=True)
        self._queue = list(dict.fromkeys(self._unit_of.values()))
        self._results: dict[str, JobResult] = {}
        self._claimed: set[tuple] = set()  # units this process claimed (runs or ran)
        self._running: dict[str, subprocess.Popen] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._stopping = False  # close() kills the running jobs (a plain run's end, Ctrl-C, -x)
        self._thread = None
        if self._queue and os.environ.get("ALIGNED_TEST_BACKGROUND", "1") != "0":
            self._thread = threading.Thread(target=self._worker, name="aligned-test-background", daemon=True)
            self._thread.start()

    def _claim_file(self, unit: tuple) -> Path:
        """The unit's claim: the job's key, or the shared process's name (a short file name however many jobs)."""
        shared = self._jobs[unit[0]].get("shared")
        return self._dir / (f"shared_{shared}.claim" if shared is not None else f"{unit[0]}.claim")

    def _claim(self, unit: tuple) -> bool:
        """True if this process is the run's first to claim ``unit`` (it then runs it; its pid is in the claim)."""
        if claim(self._claim_file(unit), owner=os.getpid()):
            with self._cv:
                self._claimed.add(unit)
            return True
        return False

    def _run(self, unit: tuple, nice: int) -> None:
        """Runs a unit this process claimed; each job's result is also written for the run's other workers."""
        try:
            if len(unit) == 1 and self._jobs[unit[0]].get("shared") is None:
                self._run_one(unit[0], nice)
            else:
                self._run_shared(unit, nice)
        finally:
            with self._cv:  # (a job that raised: its failure, for this worker's waiting test too; first, for all)
                for key in unit:
                    self._results.setdefault(key, JobResult(-1, "", f"[background job {key!r}: no result recorded "
                                                                    "(killed, or an error running it)]", 0.0))
                self._cv.notify_all()
            for key in unit:
                res = self._results[key]
                tmp = self._dir / f"{key}.result.tmp"
                tmp.write_text(json.dumps(dataclasses.asdict(res)))
                os.replace(tmp, self._dir / f"{key}.result.json")  # (atomic: a reader never sees half of it)

    def _result_from_disk(self, key: str, timeout: float) -> JobResult:
        """The result another worker of the run wrote for ``key`` (it claimed the unit); waits for it. A claimer
        that died first (a crashed worker: its ``finally`` never ran) fails the wait at once."""
        path = self._dir / f"{key}.result.json"
        claim_file = self._claim_file(self._unit_of[key])
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"background job {key!r} (run by another pytest-xdist worker) gave no result "
                                   "within its timeout")
            owner = claim_owner(claim_file)  # (None for the moment between the claim and its pid)
            if owner is not None and not _alive(owner) and not path.exists():
                raise RuntimeError(f"background job {key!r}: the pytest-xdist worker that ran it (pid {owner}) "
                                   "ended without writing its result (it crashed, or stopped: -x / Ctrl-C?)")
            time.sleep(0.2)
        res = JobResult(**json.loads(path.read_text()))
        with self._cv:
            self._results[key] = res
        return res

    def _run_shared(self, unit: tuple, nice: int) -> None:
        """The jobs of ``unit`` in one interpreter (tests/_shared_process.py), each its own result. A job whose
        timeout or crash ends the interpreter fails alone, named at the end of its stderr; the jobs after it run
        in a fresh interpreter. Any error here becomes every unrecorded job's failure (a waiting test never hangs)."""
        work = self._shared_dirs[unit]
        runner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shared_process.py")
        results: dict[str, JobResult] = {}
        try:
            remaining, attempt = list(unit), 0
            while remaining:
                if attempt and self._stopping:  # (close() killed the process: no fresh one after it)
                    break
                jobs = [self._jobs[k] for k in remaining]
                spec = work / f"spec{attempt}.json"
                spec.write_text(json.dumps([{"key": k, "argv": j["argv"][1:], "timeout": j.get("timeout", 600)}
                                            for k, j in zip(remaining, jobs)]))
                name = "+".join(remaining)
                whole = self._run_one(name, nice, job=dict(
                    argv=[_sys.executable, runner, str(spec), str(work)], env=jobs[0]["env"],
                    timeout=sum(j.get("timeout", 600) for j in jobs) + 60))
                died_in = None
                for k, j in zip(remaining, jobs):
                    rc_file, out_file, err_file, started = (work / f"{k}.{ext}" for ext in ("rc", "out", "err",
                                                                                             "started"))
                    out = out_file.read_text(errors="replace") if out_file.exists() else ""
                    err = err_file.read_text(errors="replace") if err_file.exists() else ""
                    if rc_file.exists():
                        results[k] = JobResult(int(rc_file.read_text()), out, err, whole.seconds)
                    elif started.exists() and died_in is None:
                        died_in = k
                        results[k] = JobResult(whole.returncode or -1, out, err + "\n" + whole.stderr[-3000:] + (
                            f"\n[{k}: the shared process {name!r} ended (status {whole.returncode}) while running "
                            f"this job: its own timeout of {j.get('timeout', 600)} s (faulthandler's 'Timeout' "
                            f"stacks above) or a crash; the jobs after it ran in a fresh process]\n"), whole.seconds)
                done = set(results)
                left = [k for k in remaining if k not in done]
                if died_in is None and left:  # the runner died before starting any of them: no retry loop
                    for k in left:
                        results[k] = JobResult(whole.returncode or -1, "", f"[shared process {name!r} ended (status "
                                               f"{whole.returncode}) before this job started]\n" + whole.stderr[-3000:],
                                               whole.seconds)
                    left = []
                remaining, attempt = left, attempt + 1
        except Exception as e:  # noqa: BLE001 - recorded as the failure of every job not yet recorded
            for k in unit:
                results.setdefault(k, JobResult(-1, "", f"[shared process of {unit!r}: {type(e).__name__}: {e}]", 0.0))
        with self._cv:
            self._results.update(results)
            self._cv.notify_all()

    def _run_one(self, key: str, nice: int, job: dict | None = None) -> JobResult:
        """Runs one process: the job ``key``, or (``job`` given: a shared process, whose jobs' results the caller
        records) ``job`` under the name ``key``."""
        record = job is None
        job = self._jobs[key] if job is None else job
        t0 = time.monotonic()
        argv = (["nice", "-n", str(nice)] if nice else []) + list(job["argv"])  # (no preexec_fn: threads here)
        if self._stopping:  # close() killed what ran: nothing starts after it
            return self._record(key, record, JobResult(-1, "", "[not started: the session was closing]", 0.0))
        try:
            # its own process group: a timeout or close() kills the job's children too (a CLI job's engine and
            # train processes hold its pipes; killing the job alone left communicate() waiting on them)
            proc = subprocess.Popen(argv, env=job.get("env"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True)
        except OSError as e:  # recorded as the job's failure: a waiting test fails, never waits forever
            return self._record(key, record, JobResult(-1, "", f"[could not start {argv!r}: {e}]",
                                                       time.monotonic() - t0))
        with self._cv:  # (under the lock _kill_running sets the flag in: one of the two sees the other)
            self._running[key] = proc
            stopping = self._stopping
        if stopping:
            _kill_group(proc)
        try:
            out, err = proc.communicate(timeout=job.get("timeout", 600))
            res = JobResult(proc.returncode, out, err, time.monotonic() - t0)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            res = JobResult(-9, out, err + f"\n[timed out after {job.get('timeout', 600)} s]", time.monotonic() - t0)
        if self._stopping and proc.returncode == -signal.SIGKILL:
            res.stderr += "\n[killed: the pytest process running it stopped (end of its tests, -x or Ctrl-C)]"
        with self._cv:
            self._running.pop(key, None)
            if record:
                self._results[key] = res
            self._cv.notify_all()
        return res

    def _record(self, key: str, record: bool, res: JobResult) -> JobResult:
        if record:
            with self._cv:
                self._results[key] = res
                self._cv.notify_all()
        return res

    def _worker(self):
        while True:
            with self._cv:
                if self._closed or not self._queue:
                    return
                unit = self._queue.pop(0)
            if self._claim(unit):  # (else another worker of the run has it)
                self._run(unit, nice=5)

    def out_dir(self, key: str) -> Path:
        """The folder that replaced OUT_DIR in the job's argv."""
        return self._out_dirs[key]

    def result(self, key: str) -> JobResult:
        """The job's result; waits for it if it is running, runs it now (in the foreground) if it is queued."""
        if key not in self._jobs:
            raise KeyError(f"background job {key!r} is not declared by this test's module (BACKGROUND_JOBS)")
        unit = self._unit_of[key]
        with self._cv:
            if key in self._results:
                return self._results[key]
            if unit in self._queue:
                self._queue.remove(unit)
            mine = unit in self._claimed
        # the job's own timeout (a shared process's: the sum of its jobs') + grace
        timeout = sum(self._jobs[k].get("timeout", 600) for k in unit)
        if not mine:
            if self._claim(unit):  # nobody started it yet: run it now, in the foreground
                self._run(unit, nice=0)
                return self._results[key]
            return self._result_from_disk(key, timeout + 60)  # another pytest-xdist worker runs it
        with self._cv:
            deadline = time.monotonic() + timeout + 60
            while key not in self._results:
                if not self._cv.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"background job {key!r} gave no result within its timeout")
            return self._results[key]

    def close(self):
        with self._cv:
            self._closed = True
            self._queue.clear()
        stopping = _interrupted[0] or self._session.shouldfail or self._session.shouldstop
        if self._in_worker and not stopping and self._thread is not None:
            # Under pytest-xdist a job this worker runs may be one another worker's test waits for (this worker's
            # tests are done, the run is not): it finishes (its own timeout bounds it) and its result is written.
            # (Jobs not started yet: the worker whose test asks for one runs it then.)
            try:
                self._thread.join()
                return
            except BaseException:  # Ctrl-C or xdist stopping the worker meanwhile: the job must not outlive it
                self._kill_running()
                raise
        self._kill_running()  # a job no selected test still waits for (the run was interrupted or stops: -x)

    def _kill_running(self):
        with self._cv:
            self._stopping = True
            running = list(self._running.values())
        for p in running:
            _kill_group(p)


_interrupted = [False]  # set on Ctrl-C (conftest's pytest_keyboard_interrupt): close() kills the running jobs


def interrupted() -> None:
    _interrupted[0] = True


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, a dead process its parent has not reaped yet, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True  # (no /proc: as far as os.kill can tell)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the job's process group (start_new_session: the job and every process it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


@pytest.fixture(scope="session")
def background(request, tiny_checkpoint, tmp_path_factory):
    """Jobs of the collected modules' BACKGROUND_JOBS, started at the first test of the run (see above)."""
    bg = Background(request.session, tiny_checkpoint, tmp_path_factory)
    yield bg
    bg.close()


@pytest.fixture(scope="session", autouse=True)
def _start_background_jobs(request):
    """Starts the background jobs at the first test of the run, if any selected test uses them."""
    if any("background" in getattr(item, "fixturenames", ()) for item in request.session.items):
        request.getfixturevalue("background")
    yield
