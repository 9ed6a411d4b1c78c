"""The emulated suite's schedules (tests/emulated/conftest.py): CI's second run (ALIGNED_EMU_SECOND_RUN=1, the ASan
run) gives every test a schedule other than the one the README run gave it, and between the two runs every test has
run under ``reverse`` and under a random order. Checked on the node ids of this folder's tests (collected by name)
and on synthetic ones."""

import importlib.util
import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent


def load_conftest(monkeypatch, **env):
    for k in ("ALIGNED_EMU_SECOND_RUN", "ALIGNED_EMU_SCHEDULE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    spec = importlib.util.spec_from_file_location("_emu_conftest_copy", HERE / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def node_ids():
    ids = [f"tests/emulated/test_x.py::test_{i}[case{i % 7}-sm_90]" for i in range(2000)]
    for f in sorted(HERE.glob("test_*.py")):  # the real files' test functions (parameters vary the hash the same way)
        ids += [f"tests/emulated/{f.name}::{line.split('(')[0][4:]}" for line in f.read_text().splitlines()
                if line.startswith("def test_")]
    return ids


def two_runs(first, second, ids):
    return [(first.schedule_for(n), second.schedule_for(n)) for n in ids]


def test_second_run_differs_from_the_first_and_covers_reverse(monkeypatch):
    first = load_conftest(monkeypatch)
    second = load_conftest(monkeypatch, ALIGNED_EMU_SECOND_RUN="1", ALIGNED_EMU_SCHEDULE="reverse")
    pairs = two_runs(first, second, node_ids())
    assert all(a != b for a, b in pairs)
    assert all("reverse" in (a, b) for a, b in pairs)
    assert all(any(x.startswith("random:") for x in (a, b)) for a, b in pairs)  # a shuffled order in one of them
    assert "forward" not in first.ROTATION
    assert {b for _, b in pairs} == {"reverse", "random:3"}  # both branches taken
    assert {a for a, _ in pairs} == set(first.ROTATION)


def test_negative_control_a_forced_reverse_repeats_the_rotation(monkeypatch):
    """The run CI made before (ALIGNED_EMU_SCHEDULE=reverse for every test) runs a quarter of the tests twice under
    reverse: the comparison above sees it."""
    first = load_conftest(monkeypatch)
    forced = load_conftest(monkeypatch, ALIGNED_EMU_SCHEDULE="reverse")
    pairs = two_runs(first, forced, node_ids())
    repeated = sum(a == b for a, b in pairs)
    assert 0.15 * len(pairs) < repeated < 0.35 * len(pairs)


def test_bad_second_run_value_is_a_usage_error(monkeypatch):
    with pytest.raises(pytest.UsageError, match="ALIGNED_EMU_SECOND_RUN='yes'"):
        load_conftest(monkeypatch, ALIGNED_EMU_SECOND_RUN="yes")
