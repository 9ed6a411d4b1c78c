"""Weight sync learner -> rollout workers (runner/sync.py): the layout packs and unpacks every weight bit for bit,
sends a tied weight once, and a real gloo broadcast between two processes delivers each version's bits in order to
the worker's background receiver, then stops it. Negative controls: a changed weight changes the packed bits; a
worker that waits for a version never sent is woken by the stop and gets None."""

import multiprocessing as mp

import pytest
import torch

from aligned_ops.runner.sync import SyncGroup, WeightLayout, WeightReceiver
from aligned_ops.testing import assert_bitwise_equal, bits


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(16, 8, generator=g).to(torch.bfloat16)
    return {
        "model.embed_tokens.weight": emb,
        "lm_head.weight": emb,  # tied: same storage
        "model.norm.weight": torch.randn(8, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 6, 8, generator=g).to(torch.bfloat16),
        "buffer.fp32": torch.randn(5, generator=g),
    }


def test_layout_roundtrip_is_bitwise_and_sends_a_tied_weight_once():
    state = _state(0)
    layout = WeightLayout.of(state)
    names = [n for n, _, _ in layout.entries]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert layout.dtypes == ["bfloat16", "float32"]
    assert layout.nbytes == (16 * 8 + 8 + 4 * 6 * 8) * 2 + 5 * 4
    flats = layout.pack(state)
    back = layout.unpack(flats)
    for name in names:
        assert_bitwise_equal(back[name], state[name], name)
    # the layout survives the trip to a worker (plain lists)
    assert WeightLayout(layout.to_list()).entries == layout.entries
    # negative control: one changed element changes the packed bits
    state["model.norm.weight"][3] += 1
    assert not torch.equal(bits(layout.pack(state)[0]), bits(flats[0]))


def _worker(port: int, q) -> None:
    layout = WeightLayout.of(_state(0))
    group = SyncGroup("127.0.0.1", port, 1, 2)
    rx = WeightReceiver(group, layout)
    rx.start()
    got = {}
    for v in (0, 1, 2):
        flats = rx.wait_for(v)
        got[v] = [bits(f).clone() for f in flats]
        rx.drop_below(v)
    assert rx.wait_for(3) is None  # the learner stopped before sending version 3
    rx.join(timeout=30)
    q.put({v: [t.tolist() for t in fl] for v, fl in got.items()})


def test_gloo_broadcast_delivers_each_version_bitwise_then_stops():
    store, port = SyncGroup.host_store("127.0.0.1", 2)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_worker, args=(port, q))
    p.start()
    try:
        group = SyncGroup("127.0.0.1", port, 0, 2, store=store)
        assert group.backend == "gloo"
        layout = WeightLayout.of(_state(0))
        sent = {v: layout.pack(_state(v)) for v in (0, 1, 2)}
        for v in (0, 1, 2):
            group.send(v, sent[v])
        group.send_stop()
        got = q.get(timeout=60)
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0
    for v in (0, 1, 2):
        for a, b in zip(got[v], sent[v]):
            assert a == bits(b).tolist(), f"version {v} arrived with other bits"
    assert got[1] != got[2]  # the versions are distinct (the comparison above could not pass by accident)


def test_receiver_reports_a_dead_learner():
    class Broken:
        def receive(self, layout):
            raise ConnectionError("learner gone")

    rx = WeightReceiver(Broken(), WeightLayout.of(_state(0)))
    rx.start()
    with pytest.raises(RuntimeError, match="weight sync failed: learner gone"):
        rx.wait_for(0)
    rx.join(timeout=5)
    assert not rx.is_alive()
