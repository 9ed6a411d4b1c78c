"""Shared test fixtures. Tests import the installed package (CI) or ``python/`` via PYTHONPATH (dev).

Also the suite's hygiene rules, checked on every run:
- a test module leaves the process as it found it: ``os.environ`` is restored after each module, and a module
  that leaves torch.distributed's default process group behind (an in-process vLLM engine that was never shut
  down) errors, after the group is torn down so that later modules are unaffected;
- a test that starts a vLLM engine in this process must be marked ``slow`` (it fails otherwise); tests that
  are not marked ``slow`` and took more than ``SLOW_SECONDS`` (times the xdist workers sharing the cores) are listed
  at the end of the run;
- the end of the run prints how many ``slow`` and ``emulated`` tests ran (CI reports the emulated count).

Shared machinery (one module each): ``isa_matrix`` (tests/_isa_matrix.py: one worker process per CPU ISA level
for the whole run), ``tiny_checkpoint`` (tests/_tiny_checkpoints.py: tiny checkpoints built once per run),
``background`` (tests/_background.py: subprocess-only jobs started at the beginning of the run); under
pytest-xdist (the README's ``-n 2``), tests/_xdist.py: whole modules per worker, the session state shared.
"""

import importlib.abc
import importlib.machinery
import os
import sys

# OpenMP threads that wait (a barrier, a lock) sleep instead of spinning (set before torch loads libgomp; every
# process the suite starts inherits it; a value the user set is kept). The suite's processes share the cores: two
# xdist workers, background jobs, engines and their workers, each with its own OpenMP pool. By default libgomp spins
# 300,000 rounds (milliseconds) before it sleeps whenever the process has no more OpenMP threads than CPUs it may run
# on (the CPUs counted at start), each process on its own: a spinning thread burns the CPU the thread it waits for
# needs. Measured on 2 cores: the README's `-n 2` run 1,466-1,501 -> 1,297 CPU s, 766-788 -> 682 s wall. Changes
# no arithmetic (each thread's share of a parallel_for is fixed), only when a waiting thread yields the core. (The
# benchmarks in bench/ keep the default; a pytest started inside a process that already loaded torch gets it only
# in its subprocesses.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

import aligned_ops  # noqa: F401  (registers torch.ops.aligned)

import _background
from _background import _start_background_jobs, background  # noqa: F401  (fixtures: subprocess jobs, see there)
from _isa_matrix import isa_matrix  # noqa: F401  (fixture: one worker process per CPU ISA level, see there)
from _tiny_checkpoints import tiny_checkpoint  # noqa: F401  (fixture: tiny checkpoints built once per run)
import _xdist

# A test that is not marked slow should finish well within this on 2 cores (it is listed at the end otherwise).
SLOW_SECONDS = 20.0

# vLLM's CPU worker replaces torch.set_num_threads with a no-op for the rest of the process once an in-process
# engine starts (vllm/v1/worker/cpu_worker.py). Tests that compare 1 vs 2 threads must keep the real one.
_TORCH_SET_NUM_THREADS = torch.set_num_threads


@pytest.fixture(autouse=True)
def _restore_threads():
    """Tests that change torch's thread count never leak it into other tests, and always get the real
    torch.set_num_threads (see above)."""
    torch.set_num_threads = _TORCH_SET_NUM_THREADS
    n = torch.get_num_threads()
    yield
    torch.set_num_threads = _TORCH_SET_NUM_THREADS
    torch.set_num_threads(n)


def _default_group_exists() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def _tear_down_default_group() -> None:
    """What an in-process engine's shutdown does (vLLM's EngineCore.shutdown -> cleanup_dist_env_and_memory):
    vLLM's model-parallel groups and world group, then torch.distributed's default group."""
    if "vllm.distributed.parallel_state" in sys.modules:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    if _default_group_exists():
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module", autouse=True)
def _module_leaves_no_process_state(request):
    """A test module may change process-wide state only for its own duration (so that the suite passes in any
    order and any selection). Seen before this check: tests/integrations/test_docs.py ran the README's snippets,
    whose in-process engine was never shut down. The engine outlived the test: the first vLLM import that
    make_llm triggers leaves its importer frames referenced (importlib -> vllm_plugin.install -> make_llm -> the
    snippet's module frame, whose globals hold ``llm``; gc.collect() frees nothing), so its default process
    group (gloo, world 1) stayed until some later engine's shutdown
    (EngineCore.shutdown -> cleanup_dist_env_and_memory) happened to tear it down. A module run right after it
    that creates its own group (tests/integrations/test_plugin_exact_tp.py) failed with "trying to initialize the
    default process group twice"; one that checks the group is absent (tests/collective) silently skipped."""
    env = dict(os.environ)
    group_before = _default_group_exists()
    yield
    leaked = _default_group_exists() and not group_before
    if leaked:
        _tear_down_default_group()
    if dict(os.environ) != env:
        os.environ.clear()
        os.environ.update(env)
    if leaked:
        pytest.fail(f"{request.node.nodeid} left torch.distributed's default process group initialized: an in-process "
                    "vLLM engine was not shut down (aligned_ops.integrations.rollout.shutdown(llm)), or a test did not "
                    "destroy its group. Torn down now so that later modules are unaffected.", pytrace=False)


# ---- pytest-xdist (the README's `-n 2`): whole modules per worker, the ISA matrix as one group (tests/_xdist.py) --


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    _xdist.group_items(config, items)  # (trylast: after -m / -k deselection, on the items that run)


def pytest_keyboard_interrupt(excinfo):
    _background.interrupted()  # (a worker's background jobs are killed, not waited for)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") in ("each", "worksteal"):
        return None  # asked for by name: xdist's own (-n alone means "load": whole modules, below)
    return _xdist.make_scheduler(config, log)


# ---- slow marker: engines are slow by definition; long tests are listed ---------------------------------------

_ENGINE_CLASSES = {"vllm.v1.engine.llm_engine": "LLMEngine", "vllm.v1.engine.async_llm": "AsyncLLM"}
_engines_started = [0]


def _count_starts(module) -> None:
    cls = getattr(module, _ENGINE_CLASSES[module.__name__], None)
    if cls is None or getattr(cls.__init__, "_aligned_counted", False):
        return
    init = cls.__init__

    def counted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _engines_started[0] += 1

    counted._aligned_counted = True
    cls.__init__ = counted


class _EngineImportHook(importlib.abc.MetaPathFinder):
    """Counts every vLLM engine constructed in this process, whenever vLLM's engine modules get imported."""

    def find_spec(self, name, path, target=None):
        if name not in _ENGINE_CLASSES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_count(module):
            exec_module(module)
            _count_starts(module)

        spec.loader.exec_module = exec_and_count
        return spec


for _name in _ENGINE_CLASSES:
    if _name in sys.modules:
        _count_starts(sys.modules[_name])
sys.meta_path.insert(0, _EngineImportHook())


def _fail_if_unmarked_engine(item, before, where):
    started = _engines_started[0] - before
    if started and item.get_closest_marker("slow") is None:
        pytest.fail(f"{item.nodeid} started {started} vLLM engine(s) in this process ({where}) but is not marked slow "
                    "(@pytest.mark.slow or pytestmark = pytest.mark.slow)", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    before = _engines_started[0]  # a module-scoped engine fixture starts in its first test's setup
    result = yield
    _fail_if_unmarked_engine(item, before, "in a fixture")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    before = _engines_started[0]
    result = yield
    _fail_if_unmarked_engine(item, before, "in the test")
    return result


_seconds: dict = {}  # nodeid -> setup + call + teardown seconds
_marks: dict = {}  # nodeid -> set of the markers counted below


def pytest_runtest_logreport(report):
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration
    _marks.setdefault(report.nodeid, {m for m in ("slow", "emulated") if m in report.keywords})


def pytest_terminal_summary(terminalreporter):
    parts = []
    for m in ("slow", "emulated"):
        ids = [n for n, ms in _marks.items() if m in ms]
        if ids:
            parts.append(f"{m} {len(ids)} tests, {sum(_seconds[n] for n in ids):.0f} s")
    if parts:
        terminalreporter.write_line(f"aligned_ops markers: {'; '.join(parts)} (of {sum(_seconds.values()):.0f} s in tests)")
    # Under pytest-xdist the workers share the cores: a test's wall time grows with them (2 workers on 2 cores: ~2x)
    workers = getattr(terminalreporter.config.option, "numprocesses", None)
    limit = SLOW_SECONDS * max(1, min(workers if isinstance(workers, int) else 1, os.cpu_count() or 1))
    long = sorted(((s, n) for n, s in _seconds.items() if s > limit and "slow" not in _marks.get(n, ())),
                  reverse=True)
    if long:
        terminalreporter.write_line(f"not marked slow but over {limit:.0f} s here (mark them slow, or make them "
                                    "faster):")
        for s, n in long:
            terminalreporter.write_line(f"  {s:7.1f} s  {n}")


def pytest_report_header(config):
    from aligned_ops import _C  # noqa: F401

    return f"aligned_ops torch={torch.__version__} threads={torch.get_num_threads()} isa={os.environ.get('ALIGNED_CPU_ISA', 'auto')}"
