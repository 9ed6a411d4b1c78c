"""The suite's pytest-xdist support (tests/_xdist.py): each background job runs once per run however many workers ask
for it, tiny checkpoints are shared, scopes are whole modules (the ISA matrix one group), heaviest first.

Two workers are simulated in this process: two ``Background`` objects over one shared folder, as two xdist workers of
one run see it (each worker's basetemp is a folder in the controller's)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import _background
import _xdist

JOB = "import sys; open(sys.argv[1], 'a').write('ran\\n'); print('result', 42)"


class _Factory:
    def __init__(self, base: Path):
        self._base = base

    def getbasetemp(self) -> Path:
        return self._base


def _worker_background(run_root: Path, worker: str, counter: Path, monkeypatch, job: str = JOB,
                       thread: bool = False) -> _background.Background:
    """The Background of xdist worker ``worker`` of a run whose controller basetemp is ``run_root``."""
    module = types.ModuleType("fake_test_module")
    module.BACKGROUND_JOBS = lambda tiny_checkpoint: {
        "count_runs": dict(argv=[sys.executable, "-c", job, str(counter)], env=None, timeout=60)}
    module.test_it = lambda: None
    item = types.SimpleNamespace(module=module, fixturenames=("background",), name="test_it", originalname="test_it")
    session = types.SimpleNamespace(items=[item], shouldfail=False, shouldstop=False,
                                    config=types.SimpleNamespace(workerinput={"workerid": worker}))
    base = run_root / f"popen-{worker}"
    base.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    # no thread: result() claims and runs it, or reads it; a thread: it claims and runs the job at once
    monkeypatch.setenv("ALIGNED_TEST_BACKGROUND", "1" if thread else "0")
    return _background.Background(session, None, _Factory(base))


SLOW_JOB = "import sys, time; time.sleep(1.5); " + JOB


def _close_while_running(tmp_path, monkeypatch, shouldfail=False) -> _background.JobResult:
    """gw0's thread starts the job, gw0's tests end (close) while it runs, then gw1's test asks for it."""
    counter = tmp_path / "runs.txt"
    gw0 = _worker_background(tmp_path / "run", "gw0", counter, monkeypatch, job=SLOW_JOB, thread=True)
    gw0._session.shouldfail = shouldfail
    deadline = time.monotonic() + 30
    while not gw0._running and time.monotonic() < deadline:  # (the job's process started)
        time.sleep(0.02)
    assert gw0._running, "gw0's thread did not start the job"
    gw0.close()
    return _worker_background(tmp_path / "run", "gw1", counter, monkeypatch).result("count_runs")


def test_a_worker_whose_tests_end_first_lets_its_job_finish_for_the_other(tmp_path, monkeypatch):
    """A worker whose tests are done may still run a job another worker's test waits for: its close() lets it finish
    (found in a run: the other worker's test got the job's SIGKILL, status -9)."""
    res = _close_while_running(tmp_path, monkeypatch)
    assert (res.returncode, res.stdout) == (0, "result 42\n"), res
    assert (tmp_path / "runs.txt").read_text() == "ran\n"


def test_negative_control_an_interrupted_worker_kills_its_job(tmp_path, monkeypatch):
    """Control (Ctrl-C: close() kills what runs): the waiting worker sees the kill, so the check above can fail."""
    monkeypatch.setattr(_background, "_interrupted", [True])
    res = _close_while_running(tmp_path, monkeypatch)
    assert res.returncode == -9 and "[killed: the pytest process running it stopped" in res.stderr, res


def test_a_worker_stopped_by_its_failures_kills_its_job(tmp_path, monkeypatch):
    """-x / --maxfail reached in this worker (session.shouldfail): its running job is killed, not waited for."""
    res = _close_while_running(tmp_path, monkeypatch, shouldfail="stopping after 1 failures")
    assert res.returncode == -9, res


def test_a_job_asked_for_by_two_workers_runs_once(tmp_path, monkeypatch):
    counter = tmp_path / "runs.txt"
    gw0 = _worker_background(tmp_path / "run", "gw0", counter, monkeypatch)
    gw1 = _worker_background(tmp_path / "run", "gw1", counter, monkeypatch)
    first, second = gw0.result("count_runs"), gw1.result("count_runs")
    assert counter.read_text() == "ran\n"  # once: gw1 read gw0's result
    assert (first.returncode, first.stdout) == (0, "result 42\n")
    assert (second.returncode, second.stdout, second.stderr) == (first.returncode, first.stdout, first.stderr)


def test_negative_control_two_runs_run_it_twice(tmp_path, monkeypatch):
    """Control: two runs (two controller folders) share nothing, so each runs the job; the check above can fail."""
    counter = tmp_path / "runs.txt"
    _worker_background(tmp_path / "run_a", "gw0", counter, monkeypatch).result("count_runs")
    _worker_background(tmp_path / "run_b", "gw0", counter, monkeypatch).result("count_runs")
    assert counter.read_text() == "ran\nran\n"


def test_negative_control_without_claims_both_workers_run_it(tmp_path, monkeypatch):
    """Control: with a claim that always succeeds, both workers of one run run the job (the first check can fail)."""
    monkeypatch.setattr(_background, "claim", lambda path, owner=None: True)
    counter = tmp_path / "runs.txt"
    _worker_background(tmp_path / "run", "gw0", counter, monkeypatch).result("count_runs")
    _worker_background(tmp_path / "run", "gw1", counter, monkeypatch).result("count_runs")
    assert counter.read_text() == "ran\nran\n"


def test_a_crashed_claimer_fails_the_wait_at_once(tmp_path, monkeypatch):
    """A worker that claimed a job and died (its result never written) fails the other's wait at once, naming it,
    instead of the wait running out the job's timeout."""
    counter = tmp_path / "runs.txt"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])  # "gw0": exits and is not reaped (xdist reaps a crashed
    gw1 = _worker_background(tmp_path / "run", "gw1", counter, monkeypatch)  # worker only at the end: a zombie)
    assert _xdist.claim(gw1._claim_file(("count_runs",)), owner=dead.pid)  # "gw0" claimed it, then died
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=f"pid {dead.pid}.*ended without writing its result"):
        gw1.result("count_runs")
    assert time.monotonic() - t0 < 30 and not counter.exists()
    dead.wait()


def test_a_zombie_is_not_alive():
    """A crashed worker its parent has not reaped yet still answers os.kill(pid, 0): it counts as dead."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while _background._alive(proc.pid) and time.monotonic() < deadline:  # (exited, not waited for: a zombie)
        time.sleep(0.05)
    assert not _background._alive(proc.pid)
    os.kill(proc.pid, 0)  # control: the pid still exists (the zombie), so os.kill alone would call it alive
    proc.wait()
    assert _background._alive(os.getpid())


def test_claim_is_first_come_only(tmp_path):
    assert _xdist.claim(tmp_path / "x.claim") is True
    assert _xdist.claim(tmp_path / "x.claim") is False


def test_shared_root_is_the_controllers_folder_only_in_a_worker(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert _xdist.shared_root(_Factory(tmp_path / "popen-gw0")) == tmp_path / "popen-gw0"
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    assert _xdist.shared_root(_Factory(tmp_path / "popen-gw0")) == tmp_path
    # a pytest a worker's test started inherits PYTEST_XDIST_WORKER, not the basetemp: its own folder
    assert _xdist.shared_root(_Factory(tmp_path / "pytest-3")) == tmp_path / "pytest-3"


def test_scope_is_the_module_or_the_group():
    assert _xdist.scope_of("tests/ops/test_moe.py::test_a[bf16-2]") == "tests/ops/test_moe.py"
    assert _xdist.scope_of("tests/ops/test_moe.py::TestX::test_a") == "tests/ops/test_moe.py"
    assert _xdist.scope_of("tests/ops/test_linear.py::test_a[x]@isa_matrix") == "isa_matrix"


def test_isa_matrix_modules_form_one_group_in_a_worker(monkeypatch):
    """Every test of a module with a test using the ISA matrix (not only that test) joins the group; other modules do
    not; outside a worker nothing is renamed."""
    uses, other = types.ModuleType("uses"), types.ModuleType("other")

    class Item:
        def __init__(self, module, fixtures, nodeid):
            self.module, self.fixturenames, self._nodeid = module, fixtures, nodeid

        @property
        def nodeid(self):
            return self._nodeid

    items = [Item(uses, ("isa_matrix",), "a.py::t1"), Item(uses, (), "a.py::t2"), Item(other, (), "b.py::t3")]
    _xdist.group_items(types.SimpleNamespace(), items)  # a plain run's config
    assert [i.nodeid for i in items] == ["a.py::t1", "a.py::t2", "b.py::t3"]
    _xdist.group_items(types.SimpleNamespace(workerinput={"workerid": "gw1"}), items)
    assert [_xdist.scope_of(i.nodeid) for i in items] == ["isa_matrix", "isa_matrix", "b.py"]


def test_module_seconds_name_existing_modules():
    """The scheduling weights name test modules that exist (a renamed module would silently count as unmeasured)."""
    root = Path(__file__).resolve().parent.parent
    seconds = _xdist.module_seconds()
    assert seconds, f"{_xdist.MODULE_SECONDS} is missing or empty (python3 tests/_xdist.py RUN.xml writes it)"
    missing = [m for m in seconds if not (root / m).is_file()]
    assert not missing, f"{_xdist.MODULE_SECONDS} names modules that do not exist: {missing}"


def test_a_tiny_checkpoint_asked_for_by_two_workers_is_built_once(tmp_path, monkeypatch):
    """The same arguments give the same folder in both workers (a name from the arguments, not an order-dependent
    counter), built once; other arguments, another folder. Control: two runs build it twice."""
    import _tiny_checkpoints

    builds = []

    def build(path, dtype, seed=0, **overrides):
        builds.append(path)
        path.mkdir()
        (path / "config.json").write_text(f"{dtype} {seed} {sorted(overrides.items())}")
        return str(path)

    monkeypatch.setattr(_tiny_checkpoints, "_builders", lambda: {"qwen2": (build, {"num_hidden_layers": 2})})
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    gw0 = _tiny_checkpoints.checkpoint_getter(_Factory(_mkdir(tmp_path / "run" / "popen-gw0")))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    gw1 = _tiny_checkpoints.checkpoint_getter(_Factory(_mkdir(tmp_path / "run" / "popen-gw1")))
    other = gw0("qwen2", "bf16", seed=1)  # (first in gw0: no counter makes the next name differ between workers)
    a, b = gw0("qwen2", "bf16"), gw1("qwen2", "bf16")
    assert a == b and len(builds) == 2 and other != a
    assert gw1("qwen2", "bf16", num_hidden_layers=2) == a  # an override equal to the default: the same one
    again = _tiny_checkpoints.checkpoint_getter(_Factory(_mkdir(tmp_path / "run2" / "popen-gw1")))("qwen2", "bf16")
    assert again != a and len(builds) == 3


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


class _Node:
    def __init__(self, name):
        self.gateway, self.sent, self.shutting_down = types.SimpleNamespace(id=name), [], False

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def shutdown(self):
        self.shutting_down = True


def _schedule(collection, seconds, monkeypatch):
    monkeypatch.setattr(_xdist, "module_seconds", lambda: seconds)
    config = types.SimpleNamespace(getvalue=lambda name: ["2*popen"] if name == "tx" else None,
                                   option=types.SimpleNamespace(loadscopereorder=True))
    sched = _xdist.make_scheduler(config, None)
    nodes = [_Node("gw0"), _Node("gw1")]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, collection)
    sched.schedule()
    return [[collection[i] for i in node.sent] for node in nodes], list(sched.workqueue)


def test_scheduler_sends_whole_modules_heaviest_first(monkeypatch):
    """pytest-xdist's scheduler as the suite's conftest makes it: each worker gets whole scopes (a module, or the
    isa_matrix group of several), the heaviest first by tests/module_seconds.json; an unmeasured module counts as the
    heaviest. Control: other weights, another order."""
    collection = ["a.py::t1", "a.py::t2", "b.py::t1", "c.py::t1@isa_matrix", "d.py::t1@isa_matrix", "e.py::t1",
                  "f.py::t1", "f.py::t2"]
    seconds = {"a.py": 5.0, "b.py": 50.0, "c.py": 20.0, "d.py": 20.0, "e.py": 1.0}  # (f.py: not measured)
    sent, queued = _schedule(collection, seconds, monkeypatch)
    # f (unmeasured: 51), b (50), the isa_matrix group (40), a (5), e (1); two scopes per worker to start with
    assert sent == [["f.py::t1", "f.py::t2", "c.py::t1@isa_matrix", "d.py::t1@isa_matrix"],
                    ["b.py::t1", "a.py::t1", "a.py::t2"]], sent
    assert queued == ["e.py"]
    sent, _ = _schedule(collection, {**seconds, "e.py": 100.0}, monkeypatch)
    assert (sent[0][0], sent[1][0]) == ("f.py::t1", "e.py::t1"), sent  # f (101, unmeasured), then e (100)


def _readme_test_command(readme: str) -> str:
    block = readme.split("Set up and run the tests:", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return block.strip()


def test_ci_runs_the_readme_test_command():
    """.ci/run runs the README's test command (setup, then pytest with the same arguments: -n 2 included)."""
    root = Path(__file__).resolve().parent.parent
    setup, tests = _readme_test_command((root / "README.md").read_text()).split(" && ")
    assert setup == "bash scripts/setup.sh" and tests.startswith("python3 -m pytest"), (setup, tests)
    ci = (root / ".ci" / "run").read_text()
    assert 'cpu_time "setup" bash scripts/setup.sh\n' in ci
    ran = [line for line in ci.splitlines() if line.startswith('cpu_time "README tests')]
    assert len(ran) == 1 and ran[0].endswith('" ' + tests), (ran, tests)


def test_negative_control_readme_command_parser_sees_a_changed_command():
    readme = "Set up and run the tests:\n\n```bash\nbash scripts/setup.sh && python3 -m pytest -q\n```\n"
    assert _readme_test_command(readme).split(" && ")[1] == "python3 -m pytest -q"  # (not "... -n 2": would fail)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
