"""The background jobs that need a process WITHOUT the aligned_ops plugin (stock vLLM-CPU probes, the plugin's
inert-without-opt-in check) share one interpreter: tests/_background.py runs the jobs declared with the same
``shared`` name one after the other in one process (tests/_shared_process.py), so vLLM, torch and transformers are
imported once for all of them instead of once each (~12 CPU s per vLLM import on 2 cores). Each probe shuts its
engine down before it returns; each job still gets its own argv, stdout, stderr and exit status.

One environment for all of them (a shared process has one): no plugin (ALIGNED_OPS_VLLM unset, VLLM_PLUGINS empty:
vLLM loads no plugin even if aligned_ops is pip-installed), none of the aligned side's MLA-form variables, the
non-MLA attention for stock MLA models (VLLM_MLA_DISABLE=1: the expanded form the aligned side runs; only
DeepSeek-V3 has MLA; the stock MLA probe of test_vllm_deepseek_v3_mla_e2e.py asks for vLLM's own MLA path by an
argument, --stock-mla, and the probe sets VLLM_MLA_DISABLE=0 for its own engine), offline, 2 OpenMP threads, and
this checkout's python/ first on the path.
"""

from __future__ import annotations

import os
import sys

SHARED = "stock_vllm"  # the shared process's name (tests/_background.py)


def stock_env() -> dict:
    env = dict(os.environ, VLLM_PLUGINS="", VLLM_MLA_DISABLE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="2")
    # the TP probe's mp workers: one second before SIGTERM at shutdown, as for the engines of the tests
    # (integrations/conftest.py); in-process engines have no workers
    env.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1")
    for name in ("ALIGNED_OPS_VLLM", "ALIGNED_OPS_MLA_FORM", "VLLM_ALIGNED_OPS_MLA_FORM"):
        env.pop(name, None)
    src = os.path.dirname(os.path.dirname(os.path.abspath(__import__("aligned_ops").__file__)))
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def stock_job(script_or_code: str, *args: str, timeout: float, **kw) -> dict:
    """A background job run by ``sys.executable`` in the shared stock process: ``script_or_code`` is a script's
    file name in this folder, or (``code=True``) Python source run as ``-c``."""
    if kw.pop("code", False):
        argv = [sys.executable, "-c", script_or_code, *args]
    else:
        argv = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), script_or_code), *args]
    return dict(argv=argv, env=stock_env(), timeout=timeout, shared=SHARED, **kw)
