"""Shared test fixtures. Tests import the installed package (CI) or ``python/`` via PYTHONPATH (dev)."""

import os

import pytest
import torch

import aligned_ops  # noqa: F401  (registers torch.ops.aligned)


@pytest.fixture(autouse=True)
def _restore_threads():
    """Tests that change torch's thread count never leak it into other tests."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def pytest_report_header(config):
    from aligned_ops import _C  # noqa: F401

    return f"aligned_ops torch={torch.__version__} threads={torch.get_num_threads()} isa={os.environ.get('ALIGNED_CPU_ISA', 'auto')}"
