"""routing_capture.split_layer_records: the router calls of one prefill, split by layer — and a wrong layer count
refused (it used to be sliced into a plausible, wrong ``[T, L, k]``). The engine path is test_vllm_moe_e2e's."""

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.integrations.routing_capture import split_layer_records  # noqa: E402


def _records(chunks, layers, k=2):
    """What a prefill in ``chunks`` (rows per step) of a ``layers``-MoE-layer model records: per step, the layers in
    order; entry = 1000 * layer + absolute position, so the split can be checked exactly."""
    out, start = [], 0
    for c in chunks:
        for layer in range(layers):
            pos = torch.arange(start, start + c)
            out.append((1000 * layer + pos).unsqueeze(1).expand(c, k).clone())
        start += c
    return out


@pytest.mark.parametrize("chunks", [[7], [4, 4, 4], [5, 3, 1], [64, 64, 22]])
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_records_split_by_layer_in_position_order(chunks, layers):
    T = sum(chunks)
    got = split_layer_records(_records(chunks, layers), T, layers)
    want = torch.stack([(1000 * layer + torch.arange(T)).unsqueeze(1).expand(T, 2) for layer in range(layers)], 1)
    assert got.shape == (T, layers, 2) and torch.equal(got, want)


@pytest.mark.parametrize("chunks", [[7], [4, 4, 4], [5, 3, 1], [6, 6]])
@pytest.mark.parametrize("layers,claimed", [(2, 1), (3, 2), (2, 4), (1, 3), (3, 1)])
def test_a_wrong_layer_count_is_refused(chunks, layers, claimed):
    # equal chunks included: [4, 4, 4] of 3 layers claimed as 2 groups evenly and alike, and only the rows' total
    # (3 * 12 / 2 = 18 per claimed layer, not 12) tells
    with pytest.raises(ValueError, match=rf"not num_moe_layers={claimed} layers per step prefilling {sum(chunks)}"):
        split_layer_records(_records(chunks, layers), sum(chunks), claimed)


def test_a_partial_prefill_and_no_records_are_refused():
    # a prefix-cache hit recomputes only the tail: 8 of 12 positions
    with pytest.raises(ValueError, match="prefix-cache hit"):
        split_layer_records(_records([8], 2), 12, 2)
    with pytest.raises(ValueError, match="no MoE router call was recorded"):
        split_layer_records([], 12, 2)
