"""Weight sync learner -> rollout workers: one ``torch.distributed`` broadcast per version (gloo on CPU, NCCL on GPU).

The group is its own (a ``ProcessGroupGloo``/``ProcessGroupNCCL`` on a ``TCPStore`` the learner hosts), never the
default process group: an in-process vLLM engine initialises the default group for itself. Rank 0 is the learner,
ranks 1..W the rollout workers. A version travels as a header (int64 ``[version]``, -1 = stop) and one flat buffer
per dtype (:class:`WeightLayout`); each worker receives on a background thread into fresh buffers, so a broadcast
never waits for a generation to finish, and loads a version into vLLM (``rollout.refit``: vLLM's in-place reload)
only between two batches.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch

STOP = -1


class WeightLayout:
    """Names, shapes and dtypes of the synced weights in a fixed order, packed as one flat buffer per dtype.

    Tensors sharing storage (a tied LM head and its embedding) are sent once, under the first name in the state
    dict's own order (a Hugging Face model lists ``model.embed_tokens.weight`` before ``lm_head.weight``; vLLM skips
    ``lm_head.weight`` of a tied model on load and ties it to the embedding)."""

    def __init__(self, entries: list[tuple[str, tuple[int, ...], str]]):
        self.entries = [(n, tuple(s), str(d)) for n, s, d in entries]
        self.dtypes = sorted({d for _, _, d in self.entries})
        self.numel = {d: sum(_numel(s) for _, s, dd in self.entries if dd == d) for d in self.dtypes}

    @classmethod
    def of(cls, state: dict[str, torch.Tensor]) -> "WeightLayout":
        seen, entries = set(), []
        for name in state:
            t = state[name]
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key in seen:
                continue
            seen.add(key)
            entries.append((name, tuple(t.shape), str(t.dtype).replace("torch.", "")))
        return cls(entries)

    def to_list(self) -> list:
        return [list(e) for e in self.entries]

    @property
    def nbytes(self) -> int:
        return sum(n * getattr(torch, d).itemsize for d, n in self.numel.items())

    def pack(self, state: dict[str, torch.Tensor], device="cpu") -> list[torch.Tensor]:
        flats = []
        for d in self.dtypes:
            parts = [state[n].detach().reshape(-1) for n, _, dd in self.entries if dd == d]
            flats.append(torch.cat(parts).to(device=device, dtype=getattr(torch, d)))
        return flats

    def empty(self, device="cpu") -> list[torch.Tensor]:
        return [torch.empty(self.numel[d], dtype=getattr(torch, d), device=device) for d in self.dtypes]

    def unpack(self, flats: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        out, offsets = {}, dict.fromkeys(self.dtypes, 0)
        by_dtype = dict(zip(self.dtypes, flats))
        for name, shape, d in self.entries:
            n = _numel(shape)
            out[name] = by_dtype[d][offsets[d]: offsets[d] + n].view(shape)
            offsets[d] += n
        return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class SyncGroup:
    """The learner (rank 0) and its rollout workers in one broadcast group of their own."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: str = "cpu",
                 store=None, timeout_s: float = 1800.0):
        import torch.distributed as dist

        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        self.store = store
        if self.device.type == "cuda":
            self.backend = "nccl"
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size)
        else:
            self.backend = "gloo"
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    @staticmethod
    def host_store(host: str, world_size: int, timeout_s: float = 1800.0):
        """The learner's TCPStore on a free port; returns (store, port)."""
        import torch.distributed as dist

        store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        return store, store.port

    def _bcast(self, t: torch.Tensor) -> None:
        self.pg.broadcast(t, 0).wait()

    def send(self, version: int, flats: list[torch.Tensor]) -> None:
        """Learner: broadcast one version (returns when every worker has it)."""
        self._bcast(torch.tensor([version], dtype=torch.int64, device=self.device))
        for f in flats:
            self._bcast(f)

    def send_stop(self) -> None:
        self._bcast(torch.tensor([STOP], dtype=torch.int64, device=self.device))

    def receive(self, layout: WeightLayout):
        """Worker: the next (version, flats), or (None, None) on stop."""
        head = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._bcast(head)
        version = int(head.item())
        if version == STOP:
            return None, None
        flats = layout.empty(self.device)
        for f in flats:
            self._bcast(f)
        return version, flats


class WeightReceiver(threading.Thread):
    """Worker: receives versions in the background; :meth:`wait_for` hands out the one a batch needs."""

    def __init__(self, group: SyncGroup, layout: WeightLayout):
        super().__init__(daemon=True, name="weight-receiver")
        self.group, self.layout = group, layout
        self.versions: dict[int, list[torch.Tensor]] = {}
        self.stopped = False
        self.error: BaseException | None = None
        self._cond = threading.Condition()

    def run(self) -> None:
        try:
            while True:
                version, flats = self.group.receive(self.layout)
                with self._cond:
                    if version is None:
                        self.stopped = True
                    else:
                        self.versions[version] = flats
                    self._cond.notify_all()
                if version is None:
                    return
        except BaseException as e:  # the learner died: wake the worker, which reports it
            with self._cond:
                self.error = e
                self._cond.notify_all()

    def wait_for(self, version: int) -> list[torch.Tensor] | None:
        """Block until ``version`` has arrived and return its buffers; None if the learner stopped first."""
        with self._cond:
            while version not in self.versions and not self.stopped and self.error is None:
                self._cond.wait()
            if self.error is not None and version not in self.versions:
                raise RuntimeError(f"weight sync failed: {self.error}") from self.error
            return self.versions.get(version)

    def drop_below(self, version: int) -> None:
        with self._cond:
            for v in [v for v in self.versions if v < version]:
                del self.versions[v]
