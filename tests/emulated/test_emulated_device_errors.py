"""The GPU ops check data values in the kernel, not on the host (csrc/gpu/dense_api.h DeviceError).

Under emulation the GPU glue runs: a bad position / token id / temperature must NOT raise at the call (that
would need a host read of device data, i.e. a sync), must not read out of bounds (ASan stage), must give a
NaN row, and must be reported by ``aligned_ops.check_device_errors()`` with the CPU glue's words. The CPU
backend still raises at the call (its host check is free) — the negative control that the inputs are bad.
"""

from __future__ import annotations

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal

ops = torch.ops.aligned
pytestmark = pytest.mark.emulated
WIDTHS = ["sm_90", "gfx942"]


def _cases():
    cache = aligned_ops.rotary_cos_sin_cache(8, 64)
    x = torch.randn(3, 2, 8)
    logits = torch.randn(3, 37)
    return [
        ("rotary position", lambda pos: ops.rotary_embedding(pos, x, cache, 8, True),
         torch.tensor([0, 70, 5]), torch.tensor([0, 63, 5]), r"positions must lie in \[0, max_position\)", 1),
        ("rotary negative position", lambda pos: ops.rotary_embedding_backward(pos, x, cache, 8, False),
         torch.tensor([-1, 2, 5]), torch.tensor([1, 2, 5]), r"positions must lie in \[0, max_position\)", 0),
        ("token id", lambda ids: ops.token_logprobs(logits, ids, 1.0, None),
         torch.tensor([0, 37, 4]), torch.tensor([0, 36, 4]), r"token_ids must lie in \[0, vocab\)", 1),
        ("token id backward", lambda ids: ops.token_logprobs_backward(torch.ones(3), logits, ids, 1.0, None),
         torch.tensor([0, 1, -3]), torch.tensor([0, 1, 3]), r"token_ids must lie in \[0, vocab\)", 2),
        ("temperature", lambda t: ops.log_softmax(logits, 1.0, t),
         torch.tensor([1.0, 0.0, 0.7]), torch.tensor([1.0, 0.5, 0.7]), "every temperature must be finite and > 0", 1),
        ("temperature nan", lambda t: ops.logsumexp(logits, 1.0, t),
         torch.tensor([float("nan"), 1.0, 0.7]), torch.tensor([2.0, 1.0, 0.7]), "every temperature must be finite",
         0),
        ("temperature inf", lambda t: ops.token_logprobs(logits, torch.tensor([1, 2, 3]), 1.0, t),
         torch.tensor([1.0, 1.0, float("inf")]), torch.tensor([1.0, 1.0, 3.0]), "every temperature must be finite",
         2),
    ]


@pytest.mark.parametrize("arch", WIDTHS)
@pytest.mark.parametrize("case", range(7))
def test_bad_values_are_reported_by_the_kernel_not_the_host(arch, case):
    name, fn, bad, good, msg, bad_row = _cases()[case]
    with pytest.raises(RuntimeError):  # negative control: the CPU glue's host check rejects these values
        fn(bad)
    aligned_ops.check_device_errors("cpu")  # the CPU backend never defers an error
    with aligned_ops.emulate(arch) as emu:
        aligned_ops.check_device_errors("cpu")  # clean before
        out = fn(bad)  # no raise at the call: no host read of the values
        with pytest.raises(RuntimeError, match=msg):
            aligned_ops.check_device_errors("cpu")
        aligned_ops.check_device_errors("cpu")  # reading cleared the words
        rows = out.reshape(out.shape[0], -1)
        assert torch.isnan(rows[bad_row]).all(), name
        good_rows = [r for r in range(rows.shape[0]) if r != bad_row]
        ref = fn(good)  # emulated, valid values: the other rows are unaffected, bit for bit
        assert_bitwise_equal(rows[good_rows], ref.reshape(ref.shape[0], -1)[good_rows])
        aligned_ops.check_device_errors("cpu")  # valid values set nothing
    assert emu.launches, name  # the GPU kernels ran (recorded when the block exits)


def test_python_wrapper_keeps_a_device_scalar_temperature_on_device():
    # A 0-d temperature becomes per-row temperatures on the logits' device (float() would sync, and would not
    # compile); same bits as the scalar path. 'meta' stands in for a device here (no data): the fake impl sees a [T]
    # fp32 tensor.
    logits = torch.randn(4, 11)
    t = torch.tensor(0.7)
    a = aligned_ops.log_softmax(logits, 0.7)  # a Python float: the scalar path
    b = aligned_ops.log_softmax(logits, t.reshape(1).expand(4).contiguous())
    assert_bitwise_equal(a, b)
    assert_bitwise_equal(a, aligned_ops.log_softmax(logits, t))  # 0-d: the per-row path
    out = aligned_ops.log_softmax(logits.to("meta"), t.to("meta"))
    assert out.shape == (4, 11) and out.device.type == "meta"
