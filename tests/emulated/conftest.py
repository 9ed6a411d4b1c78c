"""Emulator schedules for the emulated suite (csrc/emu/runtime.cpp "Schedules").

A correct kernel gives the same bits whatever order the runtime runs a block's threads, warps and a grid's
blocks in, so every test here must pass under every schedule. Running the whole suite once per schedule would
multiply its time by four; instead:

* ``ALIGNED_EMU_SCHEDULE`` set (``forward``, ``reverse``, ``random:SEED``): every test runs under that schedule
  (``ALIGNED_EMU_SCHEDULE=forward python3 -m pytest -m emulated``: how the whole suite is checked under one
  schedule by hand);
* unset (the README's test command): each test gets one of ``reverse``, ``random:1``, ``random:2``, ``random:4``,
  picked from a hash of its node id — the same for every run, so a failure reproduces. Never ``forward``: index
  order is the order a race hides behind (the plain order runs in the explicit schedule tests and in the emulated
  calls of tests/ops);
* ``ALIGNED_EMU_SECOND_RUN=1`` (CI's ASan run, after the README's): each test runs under ``reverse``, or under
  ``random:3`` where the rotation gave it ``reverse`` — so every test has run under ``reverse`` and under a
  random order (threads shuffled within a warp, warps and blocks out of index order: only a random schedule
  does that), never twice under one. It wins over ``ALIGNED_EMU_SCHEDULE`` here, which is then not read (CI sets
  that to ``reverse`` for the emulated calls of the other test folders). The ASan run skips the torch.compile
  tests (``-k "not compile"``, scripts/asan_tests.sh): those run once, under their rotation's schedule.

The schedule a test ran under is in its report (section "emu-schedule") and in ``-v`` output's header. Tests
that need a particular schedule (the planted races) pass ``schedule=`` to ``aligned_ops.emulate``, which wins
inside its scope.
"""

from __future__ import annotations

import os
import zlib

import pytest

from aligned_ops.emulation import SCHEDULE_ENV, check_schedule

ROTATION = ("reverse", "random:1", "random:2", "random:4")
SECOND_RUN_ENV = "ALIGNED_EMU_SECOND_RUN"
SECOND_RUN_OTHER = "random:3"  # a seed the rotation does not use
_SECOND_RUN = os.environ.get(SECOND_RUN_ENV, "0")
if _SECOND_RUN not in ("0", "1"):
    raise pytest.UsageError(f"{SECOND_RUN_ENV}={_SECOND_RUN!r}: expected 0 or 1")
_FORCED = None if _SECOND_RUN == "1" else os.environ.get(SCHEDULE_ENV)
if _FORCED:
    check_schedule(_FORCED)  # a typo fails the collection, not every launch


def rotation_for(nodeid: str) -> str:
    """The README run's schedule of a test: a stable hash of its node id picks one of ROTATION."""
    return ROTATION[zlib.crc32(nodeid.encode()) % len(ROTATION)]


def schedule_for(nodeid: str) -> str:
    """The schedule of a test in this run (forced, second run, or the rotation)."""
    if _SECOND_RUN == "1":
        return SECOND_RUN_OTHER if rotation_for(nodeid) == "reverse" else "reverse"
    return _FORCED or rotation_for(nodeid)


def pytest_report_header(config):
    if _SECOND_RUN == "1":
        how = f"second run ({SECOND_RUN_ENV}=1): reverse, or {SECOND_RUN_OTHER} where the rotation gave reverse"
    elif _FORCED:
        how = f"forced by {SCHEDULE_ENV}={_FORCED}"
    else:
        how = f"rotated per test over {', '.join(ROTATION)}"
    return f"emulator schedule: {how}"


@pytest.fixture(autouse=True)
def _emulator_schedule(request, monkeypatch):
    sched = schedule_for(request.node.nodeid)
    monkeypatch.setenv(SCHEDULE_ENV, sched)
    request.node.user_properties.append(("emu_schedule", sched))
    yield sched


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        report.sections.append(("emu-schedule", f"this test ran under {SCHEDULE_ENV}={schedule_for(item.nodeid)}"))
