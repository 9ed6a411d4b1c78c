"""The suite under pytest-xdist (``-n 2``, the README's test command): whole modules per worker, shared session state.

On 2 cores one pytest process leaves a core idle for much of the run (single-threaded Python, interpreter start-ups,
engine scheduling); two worker processes keep both busy. Three things make that safe and cheap here:

- **Scheduling by module** (``ModuleScheduling``): a module's tests all run in one worker, so a module-scoped engine
  or model starts once, as in a single process. Scopes are sent heaviest first (``tests/module_seconds.json``:
  seconds per module, measured; a module not listed counts as heavy, so a new module starts early), so the run
  ends on small modules and neither worker waits long for the other. A group (``@name`` appended to the node ids
  of its modules, below) is one scope.
- **The ISA matrix as one group** (``@isa_matrix``): its worker processes run the scripts of every module that uses
  it (tests/_isa_matrix.py); split over two workers, each would start its own processes for all of them.
- **Session state shared on disk** (``shared_root``): the tiny checkpoints are built once per run under a file lock
  (tests/_tiny_checkpoints.py), and each background job runs once, in the worker that claims it first, its result
  read from disk by the others (tests/_background.py).

Without xdist (``-n 0``, or a plain ``python3 -m pytest``) every function here does what one process needs: the shared
root is the session's own temp dir, and every claim succeeds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

GROUP_SEP = "@"  # pytest-xdist's own separator for a node id's group (its loadgroup scheduling)
MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")


def worker_id() -> str | None:
    """``gw0``, ``gw1``, ... in an xdist worker; None in a plain pytest process."""
    return os.environ.get("PYTEST_XDIST_WORKER")


def shared_root(tmp_path_factory) -> Path:
    """A folder every worker of this run sees: the controller's basetemp (each worker's basetemp is a folder in
    it, ``popen-gwN``); without xdist, the session's basetemp. (A pytest started by a test inherits
    PYTEST_XDIST_WORKER but has a basetemp of its own, not ``popen-gwN``: its own, as without xdist.)"""
    base = tmp_path_factory.getbasetemp()
    return base.parent if worker_id() is not None and base.name == f"popen-{worker_id()}" else base


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on ``path`` (created if missing) between the processes of this run."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def claim(path: Path, owner: int | None = None) -> bool:
    """True for the first process of the run that claims ``path`` (a file created exclusively; ``owner``, a pid,
    written in it), False after."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        if owner is not None:
            os.write(fd, str(owner).encode())
    finally:
        os.close(fd)
    return True


def claim_owner(path: Path) -> int | None:
    """The pid written in a claim (None: none, or not written yet)."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def group_items(config, items) -> None:
    """In an xdist worker: every module with a test that uses the ISA matrix joins the ``isa_matrix`` group (its
    node ids end in ``@isa_matrix``, as pytest-xdist's own ``xdist_group`` marks do under ``--dist loadgroup``)."""
    if not hasattr(config, "workerinput"):  # (not an xdist worker: a plain run, or a pytest a test started)
        return
    isa_modules = {item.module for item in items
                   if getattr(item, "module", None) is not None and "isa_matrix" in getattr(item, "fixturenames", ())}
    for item in items:
        if getattr(item, "module", None) in isa_modules and GROUP_SEP not in item.nodeid:
            item._nodeid = f"{item.nodeid}{GROUP_SEP}isa_matrix"


def scope_of(nodeid: str) -> str:
    """A node id's unit of scheduling: its group (after ``@``), else its module's path."""
    if GROUP_SEP in nodeid:
        return nodeid.rsplit(GROUP_SEP, 1)[1]
    return nodeid.split("::", 1)[0]


def module_seconds() -> dict[str, float]:
    try:
        return json.loads(MODULE_SECONDS.read_text())
    except (OSError, ValueError):
        return {}


def make_scheduler(config, log):
    """pytest-xdist's LoadScopeScheduling with ``scope_of`` as the scope and the heaviest scopes first."""
    from xdist.scheduler import LoadScopeScheduling

    seconds = module_seconds()
    unknown = max(seconds.values(), default=0.0) + 1.0  # a module not measured yet: sent first

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def schedule(self) -> None:
            # LoadScopeScheduling.schedule with one change: the work queue's order (heaviest scope first, by the
            # measured seconds of its modules) instead of collection order or test count.
            assert self.collection_is_completed
            if self.collection is not None:
                for node in self.nodes:
                    self._reschedule(node)
                return
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = list(next(iter(self.registered_collections.values())))
            if not self.collection:
                return
            units: dict[str, dict[str, bool]] = {}
            total: dict[str, float] = {}  # scope -> the seconds of its modules, each module counted once
            counted: set[tuple[str, str]] = set()
            for nodeid in self.collection:
                scope = self._split_scope(nodeid)
                units.setdefault(scope, {})[nodeid] = False
                module = nodeid.split("::", 1)[0]
                if (scope, module) not in counted:
                    counted.add((scope, module))
                    total[scope] = total.get(scope, 0.0) + seconds.get(module, unknown)
            for scope in sorted(units, key=lambda s: -total[s]):  # (stable: ties keep collection order)
                self.workqueue[scope] = units[scope]
            for _ in range(len(self.nodes) - len(self.workqueue)):  # more workers than scopes
                unused, _assigned = self.assigned_work.popitem()
                unused.shutdown()
            for node in self.nodes:
                self._assign_work_unit(node)
            for node in self.nodes:
                self._reschedule(node)
            if not self.workqueue:
                for node in self.nodes:
                    node.shutdown()

    return ModuleScheduling(config, log)


def write_module_seconds(junit_xml: str, out: Path = MODULE_SECONDS) -> dict[str, float]:
    """``tests/module_seconds.json`` from a run's ``--junitxml`` (seconds per module, setup and teardown included)."""
    import xml.etree.ElementTree as ET

    totals: dict[str, float] = {}
    for case in ET.parse(junit_xml).iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        if case.get("classname", "").split(".")[-1][:1].isupper():  # a test class: module is one level up
            module = case.get("classname").rsplit(".", 1)[0].replace(".", "/") + ".py"
        totals[module] = totals.get(module, 0.0) + float(case.get("time", 0.0))
    data = {m: round(s, 1) for m, s in sorted(totals.items(), key=lambda kv: -kv[1])}
    out.write_text(json.dumps(data, indent=0) + "\n")
    return data


if __name__ == "__main__":  # python3 tests/_xdist.py RUN.xml: rewrites tests/module_seconds.json
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python3 tests/_xdist.py JUNIT_XML   (from python3 -m pytest -q -n 2 --junitxml=JUNIT_XML)")
    print(f"{len(write_module_seconds(sys.argv[1]))} modules -> {MODULE_SECONDS}")
