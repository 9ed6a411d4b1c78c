"""The rollout engine's expert choices, token by token, recorded *while it generates* (MoE routing flips).

Every MoE layer call appends its top-k expert ids to ``integrations.routing_capture.capture_vllm_routing``'s list
(stock vLLM and the aligned plugin alike); this module wraps the in-process model runner's ``_model_forward`` to
know, for each forward step, which request and which position every flattened token row belongs to (vLLM 0.32
lays a step out request by request, ``query_start_loc`` marking each request's rows, ``positions`` each row's
position). So a rollout's routes cost no second forward pass: the positions a request prefills and decodes are
exactly the ones that score its completion tokens (position p-1 scores token p).

Needs the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as ``rollout.make_llm`` sets).
"""

from __future__ import annotations

import numpy as np
import torch


def _model_runner(llm):
    core = llm.llm_engine.engine_core
    engine = getattr(core, "engine_core", None)
    if engine is None:
        raise RuntimeError("EngineRouteRecorder needs the vLLM engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    worker = engine.model_executor.driver_worker
    return getattr(worker, "worker", worker).model_runner


class EngineRouteRecorder:
    """Records ``routes[request_id][position] = int16 [layers, k]`` for every request the engine runs while
    armed; :meth:`take` returns them as ``{request_id: int16 [positions, layers, k]}`` (-1 where a position was
    not run) and clears. Request ids are vLLM's external ids (the ``request_id`` of ``RequestOutput``)."""

    def __init__(self, llm, num_moe_layers: int):
        from ..integrations.routing_capture import capture_vllm_routing

        self.layers = num_moe_layers
        self._ctx = capture_vllm_routing()
        self._trace = self._ctx.__enter__()
        self._runner = _model_runner(llm)
        self._orig = self._runner._model_forward
        self._routes: dict[str, dict[int, np.ndarray]] = {}
        self.armed = False
        self._runner._model_forward = self._forward

    def _forward(self, *args, **kwargs):
        if not self.armed:
            return self._orig(*args, **kwargs)
        runner = self._runner
        n = runner.input_batch.num_reqs
        qsl = runner.query_start_loc.np[: n + 1].copy()
        req_ids = list(runner.input_batch.req_ids[:n])
        positions = kwargs.get("positions")
        del self._trace[:]
        out = self._orig(*args, **kwargs)
        rows = int(qsl[-1]) if n else 0
        if rows == 0:
            return out
        if len(self._trace) != self.layers:
            raise RuntimeError(f"EngineRouteRecorder: {len(self._trace)} MoE layer calls in one forward, expected "
                               f"{self.layers}")
        ids = torch.stack([t[:rows] for t in self._trace], dim=1).to(torch.int16).numpy()  # [rows, L, k]
        pos = positions[:rows].to(torch.int64).numpy()
        for r, rid in enumerate(req_ids):
            lo, hi = int(qsl[r]), int(qsl[r + 1])
            if hi <= lo:
                continue
            ext = rid.rsplit("-", 1)[0]  # vLLM appends "-<8 random chars>" to the external id
            per = self._routes.setdefault(ext, {})
            for row in range(lo, hi):
                per[int(pos[row])] = ids[row]  # a recomputed (preempted) position keeps its latest routes
        del self._trace[:]
        return out

    def take(self) -> dict[str, np.ndarray]:
        out = {}
        for rid, per in self._routes.items():
            length = max(per) + 1
            arr = np.full((length, self.layers, next(iter(per.values())).shape[-1]), -1, dtype=np.int16)
            for p, ids in per.items():
                arr[p] = ids
            out[rid] = arr
        self._routes = {}
        return out

    def close(self) -> None:
        self._runner._model_forward = self._orig
        self._ctx.__exit__(None, None, None)
