"""Emulator schedules for the emulated suite (csrc/emu/runtime.cpp "Schedules").

A correct kernel gives the same bits whatever order the runtime runs a block's threads, warps and a grid's
blocks in, so every test here must pass under every schedule. Running the whole suite once per schedule would
multiply its time by four; instead:

* ``ALIGNED_EMU_SCHEDULE`` set (``forward``, ``reverse``, ``random:SEED``): every test runs under that schedule
  (``ALIGNED_EMU_SCHEDULE=reverse python3 -m pytest -m emulated`` — what .ci/run's schedule step does on a
  subset, and how the whole suite is checked under each schedule);
* unset (the README's test command): each test gets one of ``forward``, ``reverse``, ``random:1``, ``random:2``,
  picked from a hash of its node id — the same for every run, so a failure reproduces — and the suite as a
  whole covers all four at no extra cost.

The schedule a test ran under is in its report (section "emu-schedule") and in ``-v`` output's header. Tests
that need a particular schedule (the planted races) pass ``schedule=`` to ``aligned_ops.emulate``, which wins
inside its scope.
"""

from __future__ import annotations

import os
import zlib

import pytest

from aligned_ops.emulation import SCHEDULE_ENV, check_schedule

ROTATION = ("forward", "reverse", "random:1", "random:2")
_FORCED = os.environ.get(SCHEDULE_ENV)
if _FORCED:
    check_schedule(_FORCED)  # a typo fails the collection, not every launch


def schedule_for(nodeid: str) -> str:
    """The schedule of a test when none is forced: a stable hash of its node id picks one of ROTATION."""
    return _FORCED or ROTATION[zlib.crc32(nodeid.encode()) % len(ROTATION)]


def pytest_report_header(config):
    how = f"forced by {SCHEDULE_ENV}={_FORCED}" if _FORCED else f"rotated per test over {', '.join(ROTATION)}"
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
