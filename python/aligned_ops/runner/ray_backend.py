"""The same runner on Ray: the learner and each rollout worker are actors (one CPU each, or one GPU each where
the cluster has them), the rollouts travel through a ``ray.util.queue.Queue``, the weights through the learner's
own broadcast group (``sync.SyncGroup``: gloo/NCCL between the actors, rendezvous on the learner's TCPStore).

The plugin switch reaches each rollout actor through its ``runtime_env`` (``ALIGNED_OPS_VLLM``; vLLM's own Ray
executor forwards only ``VLLM_*`` variables), with the driver's ``PYTHONPATH`` so a development checkout is found.
Without ``--ray-address`` a local head is started on loopback and shut down at the end.
"""

from __future__ import annotations

import os

from .config import RunConfig


def _actor_env(kernels: str | None, linear: str | None = None) -> dict:
    from .worker import worker_env

    env = worker_env(kernels, linear) if kernels else {}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    for key in ("ATEN_CPU_CAPABILITY",):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


class RayLauncher:
    """Starts the rollout workers as Ray actors from inside the learner actor."""

    cores = None  # Ray places the actors; no pinning

    def __init__(self, num_cpus_per_worker: float = 1.0):
        import ray
        from ray.util.queue import Queue

        self.inbox = Queue()
        self.num_cpus = num_cpus_per_worker
        self.actors, self.runs = [], []
        self._ray = ray

    def start(self, cfg: RunConfig, model_dir: str, start: int, sync_info: dict, moe_layers: int) -> None:
        ray = self._ray

        @ray.remote
        class RolloutWorker:
            def run(self, spec, outbox):
                from aligned_ops.runner.worker import rollout_worker_main

                rollout_worker_main(spec, outbox)
                return spec["worker"]

        for w in range(cfg.rollout_workers):
            spec = dict(cfg=cfg.to_dict(), model_dir=model_dir, worker=w, workers=cfg.rollout_workers, start=start,
                        steps=cfg.steps, sync=sync_info, moe_layers=moe_layers, cores=None, parent_death=False)
            actor = RolloutWorker.options(num_cpus=self.num_cpus, runtime_env={"env_vars": _actor_env(cfg.kernels, cfg.linear)},
                                          name=None).remote()
            self.actors.append(actor)
            self.runs.append(actor.run.remote(spec, self.inbox))

    def poll(self) -> None:
        ray = self._ray
        done, _ = ray.wait(self.runs, timeout=0, num_returns=len(self.runs))
        for ref in done:
            ray.get(ref)  # raises the worker's exception
        if done:
            raise RuntimeError(f"{len(done)} rollout worker actor(s) returned before the run ended")

    def close(self, abort: bool = False) -> None:
        ray = self._ray
        try:
            if not abort:
                ray.get(self.runs, timeout=120)
        finally:
            for a in self.actors:
                ray.kill(a)


def run_with_ray(cfg: RunConfig, model_dir: str) -> dict:
    """Start (or join) Ray, run the learner as an actor, return its summary."""
    import ray

    started = False
    if not ray.is_initialized():
        if cfg.ray_address:
            ray.init(address=cfg.ray_address, runtime_env={"env_vars": _actor_env(None)})
        else:  # a local head on loopback, one CPU per actor
            ray.init(num_cpus=max(os.cpu_count() or 1, cfg.rollout_workers + 1), include_dashboard=False,
                     _node_ip_address="127.0.0.1", runtime_env={"env_vars": _actor_env(None)},
                     configure_logging=False, log_to_driver=True)
        started = True
    try:
        @ray.remote
        class Learner:
            def run(self, cfg_dict, model_dir):
                from aligned_ops.runner.config import RunConfig
                from aligned_ops.runner.loop import learner_main
                from aligned_ops.runner.ray_backend import RayLauncher

                c = RunConfig.from_dict(cfg_dict)
                host = ray.util.get_node_ip_address()
                return learner_main(c, model_dir, RayLauncher(), host=host)

        learner = Learner.options(num_cpus=1, runtime_env={"env_vars": _actor_env(None)}).remote()
        return ray.get(learner.run.remote(cfg.to_dict(), os.path.abspath(model_dir)))
    finally:
        if started:
            ray.shutdown()
