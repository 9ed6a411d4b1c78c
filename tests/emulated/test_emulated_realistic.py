"""The realistic-shape cases of tests/cuda/realistic_cases.py (Qwen vocabulary, decode-size linears, sliced /
non-contiguous logits, activations and q) under the emulator: the GPU kernel source == the CPU backend, bit for bit,
at both warp widths. The vocabulary case runs at the full V = 151,936; the others at smaller sizes where the
full ones would cost minutes under the emulator (the GPU file runs them full)."""

from __future__ import annotations

import pathlib
import sys

import pytest

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "cuda"))
from realistic_cases import CASES  # noqa: E402

pytestmark = pytest.mark.emulated
FULL_UNDER_EMULATION = {"logits_full_vocab"}


def make_run(arch):
    def run(op, *args):
        ref = op(*args)
        with aligned_ops.emulate(arch) as emu:
            got = op(*args)
        assert emu.launches, f"{op}: no GPU kernel ran"
        for i, (r, g) in enumerate(zip(ref if isinstance(ref, (tuple, list)) else [ref],
                                       got if isinstance(got, (tuple, list)) else [got])):
            assert_bitwise_equal(g, r, f"{op} on {arch} [{i}]")
        return ref
    return run


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_realistic_shapes_emulated_equal_cpu(arch, case):
    CASES[case](make_run(arch), "full" if case in FULL_UNDER_EMULATION else "small")
