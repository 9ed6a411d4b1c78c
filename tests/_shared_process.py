"""Runs several background jobs' scripts one after the other in this one interpreter (tests/_background.py, jobs
declared with the same ``shared=``): each fresh interpreter that imports vLLM costs ~9-12 CPU s before it does
anything, and a stock-vLLM probe needs a process without the plugin, not a process of its own.

Usage: python _shared_process.py SPEC_JSON OUT_DIR
SPEC_JSON: a list of ``{"key": ..., "argv": [...], "timeout": seconds}``, each ``argv`` what followed
``sys.executable`` in the job's own command (``SCRIPT ARGS...`` or ``-c CODE ARGS...``). A job still running after
its own timeout ends the process (faulthandler: the job's threads' stacks on its stderr), as its own process
would have been killed; the parent (tests/_background.py) then names that job's timeout or crash at the end of its
stderr and runs the jobs after it in a fresh runner, so one job's hang or crash fails only its own tests. For each job, in order: file descriptors 1 and 2 are
pointed at ``OUT_DIR/KEY.out`` / ``KEY.err`` (what the script, vLLM's loggers and C code print), ``sys.argv`` and
``sys.path[0]`` are what ``python SCRIPT ARGS`` would have given it, the script runs as ``__main__`` (``os.environ``
is restored after it: what it set there was its own), and its exit
status (0, its SystemExit code, or 1 with the traceback on its stderr) goes to ``KEY.rc``. A job must leave no
torch.distributed default process group behind (an in-process engine it did not shut down): the next job's engine
would fail with "trying to initialize the default process group twice"; such a leak is that job's failure, and the
group is torn down before the next job.
"""

import faulthandler
import gc
import json
import os
import runpy
import sys
import traceback


def _leaked_group() -> bool:
    if "torch" not in sys.modules:
        return False
    import torch

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    if "vllm.distributed.parallel_state" in sys.modules:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return True


def _run_one(argv: list) -> int:
    if argv[0] == "-c":
        code, path0, name = argv[1], "", "<string>"
        sys.argv = ["-c", *argv[2:]]
    else:
        path0, name = os.path.dirname(os.path.abspath(argv[0])), argv[0]
        sys.argv = list(argv)
    saved_path, saved_env = list(sys.path), dict(os.environ)
    sys.path[0] = path0
    try:
        if argv[0] == "-c":
            exec(compile(code, name, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            runpy.run_path(argv[0], run_name="__main__")
        rc = 0
    except SystemExit as e:
        rc = int(e.code) if isinstance(e.code, int) else (0 if e.code is None else 1)  # (int(True) == 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the job's failure, reported as its own
        traceback.print_exc()
        rc = 1
    finally:
        sys.path[:] = saved_path
    gc.collect()
    os.environ.clear()  # what the job set in its environment was its own (as in its own process)
    os.environ.update(saved_env)
    if "vllm.envs" in sys.modules:  # (an engine's shutdown does this too) the next job reads its own os.environ
        sys.modules["vllm.envs"].disable_envs_cache()
    if _leaked_group():
        print("[_shared_process] the job left torch.distributed's default process group initialized (an in-process "
              "engine not shut down); torn down before the next job", file=sys.stderr)
        rc = rc or 1
    return rc


def main() -> None:
    spec_path, out_dir = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        jobs = json.load(f)
    own_out, own_err = os.dup(1), os.dup(2)
    for job in jobs:
        key = job["key"]
        # the parent names the job a dead process died in: the one started and without an exit status
        open(os.path.join(out_dir, key + ".started"), "w").close()
        with open(os.path.join(out_dir, key + ".out"), "wb") as out, open(os.path.join(out_dir, key + ".err"), "wb") as err:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            faulthandler.dump_traceback_later(job["timeout"], exit=True)  # (to fd 2: this job's stderr file)
            try:
                rc = _run_one(job["argv"])
            finally:
                faulthandler.cancel_dump_traceback_later()
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(own_out, 1)
                os.dup2(own_err, 2)
        with open(os.path.join(out_dir, key + ".rc.tmp"), "w") as f:  # (whole or absent: a kill mid-write)
            f.write(str(rc))
        os.replace(os.path.join(out_dir, key + ".rc.tmp"), os.path.join(out_dir, key + ".rc"))
        print(f"[_shared_process] {key}: exit status {rc}", flush=True)


if __name__ == "__main__":
    main()
