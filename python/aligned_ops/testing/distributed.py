"""Run a script on t local CPU processes joined by a gloo process group (tests and benches of the collective).

``launch(script, t, args)`` starts ``python script *args`` t times with ``RANK``, ``WORLD_SIZE``,
``ALIGNED_DIST_INIT`` (a ``file://`` rendezvous in a fresh temporary folder) and one intra-op thread each
(t processes share the machine's cores); it waits for all, kills the rest if one fails or the timeout
passes, and returns each rank's stdout. In the script, ``init_from_env()`` joins the group.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

__all__ = ["launch", "init_from_env"]


def init_from_env(backend: str = "gloo", timeout_s: float | None = None):
    """Join the group ``launch`` set up; returns ``(rank, world_size)``. ``timeout_s``: the process group's
    collective timeout (torch's default: 30 minutes), so a test whose ranks disagree fails instead of waiting."""
    import datetime

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kw = {} if timeout_s is None else dict(timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group(backend, init_method=os.environ["ALIGNED_DIST_INIT"], rank=rank, world_size=world, **kw)
    return rank, world


class _SignalDeath(RuntimeError):
    """A rank killed by a signal (negative exit code) — e.g. gloo's ``terminate called without an active exception``
    under heavy load, with no Python traceback."""


def launch(script: str, world_size: int, args=(), timeout: float = 300.0, env: dict | None = None,
           threads: int = 1) -> list[str]:
    """Run ``script`` on ``world_size`` processes; returns their stdouts (rank order). Raises on failure.

    A run in which a rank dies by a signal is started once more (and says so on stderr): a 2-core CI machine under
    load has shown gloo abort a rank (SIGABRT, "terminate called without an active exception", no traceback) in a
    test that passes alone. A failure that repeats — every deterministic one — and a Python exception, a non-zero
    exit or a timeout are raised as they are."""
    try:
        return _launch_once(script, world_size, args, timeout, env, threads)
    except _SignalDeath as first:
        print(f"aligned_ops.testing.launch: a rank died by a signal, starting the run once more:\n{first}",
              file=sys.stderr)
        return _launch_once(script, world_size, args, timeout, env, threads)


def _launch_once(script, world_size, args, timeout, env, threads) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="aligned_dist_") as tmp:
        base = dict(os.environ if env is None else env)
        base.update(WORLD_SIZE=str(world_size), ALIGNED_DIST_INIT="file://" + os.path.join(tmp, "rendezvous"),
                    OMP_NUM_THREADS=str(threads))
        procs, outs = [], []
        for rank in range(world_size):
            e = dict(base, RANK=str(rank))
            out = open(os.path.join(tmp, f"out{rank}"), "w+")
            err = open(os.path.join(tmp, f"err{rank}"), "w+")
            procs.append(subprocess.Popen([sys.executable, script, *map(str, args)], env=e, stdout=out, stderr=err))
            outs.append((out, err))
        deadline = time.monotonic() + timeout
        failed = None
        try:
            while True:
                codes = [p.poll() for p in procs]
                if any(c not in (None, 0) for c in codes):
                    failed = next(i for i, c in enumerate(codes) if c not in (None, 0))
                    break
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    failed = -1
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        texts = []
        for out, err in outs:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
            out.close()
            err.close()
        if failed is not None:
            who = "timed out" if failed < 0 else f"rank {failed} exited with {procs[failed].returncode}"
            i = max(failed, 0)
            kind = _SignalDeath if failed >= 0 and procs[failed].returncode < 0 else RuntimeError
            raise kind(f"launch({os.path.basename(script)}, {world_size}): {who}\n"
                               f"--- rank {i} stderr ---\n{texts[i][1][-4000:]}")
        return [t[0] for t in texts]
