"""Fixtures shared by the integration tests (tiny checkpoints: tests/_tiny_checkpoints.py, via tests/conftest.py)."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _fast_worker_shutdown():
    """vLLM's mp executor waits VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5) for its workers to exit before it sends
    SIGTERM; on 2 loaded cores the TP workers never made it in time, so every TP engine's shutdown slept the full
    5 s. One second, then SIGTERM (what happened anyway). A value set by the caller is kept."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", os.environ.get("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1"))
        yield
