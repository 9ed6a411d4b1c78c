"""Shared test fixtures. Tests import the installed package (CI) or ``python/`` via PYTHONPATH (dev)."""

import os

import pytest
import torch

import aligned_ops  # noqa: F401  (registers torch.ops.aligned)


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


def pytest_report_header(config):
    from aligned_ops import _C  # noqa: F401

    return f"aligned_ops torch={torch.__version__} threads={torch.get_num_threads()} isa={os.environ.get('ALIGNED_CPU_ISA', 'auto')}"
