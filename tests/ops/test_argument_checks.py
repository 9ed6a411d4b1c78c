"""Issue 8's missing checks (each ended in a silent NaN, a raw Python error or silently ignored input):
eps of fused_add_rms_norm / rms_norm_backward, scalars that fp32 cannot represent (attention scale),
head_dim 0, overlapping k/v caches, an unknown ALIGNED_CPU_ISA. Each test asserts the message (op and
argument named)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import aligned_ops
from aligned_ops.testing import bitwise_equal

ops = torch.ops.aligned
NAN = float("nan")


@pytest.mark.parametrize("eps", [-1e-6, NAN, 1e39])
def test_eps_checked_by_every_norm_op(eps):
    x, r, w = torch.randn(4, 16), torch.randn(4, 16), torch.rand(16) + 0.5
    with pytest.raises(RuntimeError, match=r"aligned::rms_norm: eps must be >= 0 and finite in float32"):
        ops.rms_norm(x, w, eps)
    with pytest.raises(RuntimeError, match=r"aligned::fused_add_rms_norm: eps must be >= 0 and finite in float32"):
        ops.fused_add_rms_norm(x, r, w, eps)  # was accepted: rows of NaN (negative/NaN) or zeros (1e39)
    with pytest.raises(RuntimeError, match=r"aligned::rms_norm_backward: eps must be >= 0 and finite in float32"):
        ops.rms_norm_backward(x, x, w, eps)


def _varlen(D=8, scale=0.25):
    q, k, v = torch.randn(5, 2, D), torch.randn(5, 1, D), torch.randn(5, 1, D)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    return q, k, v, cu


def test_attention_scale_must_be_finite_in_fp32():
    q, k, v, cu = _varlen()
    out, _ = ops.attention_varlen(q, k, v, cu, cu, 3e38, True)  # large but representable: runs
    assert out.shape == q.shape
    for bad in (1e39, -1e39, float("inf"), NAN):  # 1e39 used to become inf in fp32: every output NaN
        with pytest.raises(RuntimeError, match=r"aligned::attention_varlen: scale must be finite in float32"):
            ops.attention_varlen(q, k, v, cu, cu, bad, True)
        with pytest.raises(RuntimeError, match=r"aligned::paged_attention: scale must be finite in float32"):
            ops.paged_attention(q, torch.randn(1, 8, 1, 8), torch.randn(1, 8, 1, 8),
                                torch.zeros(1, 1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32), cu, bad)


def test_head_dim_zero_is_a_clear_error():
    q, k, v, cu = _varlen(D=0)
    # the wrapper used to raise ZeroDivisionError computing the default scale 0 ** -0.5
    with pytest.raises(ValueError, match=r"aligned_ops.attention_varlen: q must be \[tokens, heads, head_dim\] "
                                         r"with head_dim >= 1"):
        aligned_ops.attention_varlen(q, k, v, cu, cu)
    with pytest.raises(ValueError, match="aligned_ops.paged_attention: .*head_dim >= 1"):
        aligned_ops.paged_attention(q, torch.randn(1, 8, 1, 0), torch.randn(1, 8, 1, 0),
                                    torch.zeros(1, 1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32), cu)
    with pytest.raises(RuntimeError, match="aligned::attention_varlen: head_dim must be >= 1, got 0"):
        ops.attention_varlen(q, k, v, cu, cu, 1.0, True)
    with pytest.raises(RuntimeError, match="aligned::paged_attention: head_dim must be >= 1, got 0"):
        ops.paged_attention(q, torch.randn(1, 8, 1, 0), torch.randn(1, 8, 1, 0), torch.zeros(1, 1, dtype=torch.int32),
                            torch.tensor([5], dtype=torch.int32), cu, 1.0)


def test_overlapping_k_and_v_caches_are_refused():
    k = v = torch.randn(3, 1, 8)
    slots = torch.tensor([0, 1, 2])
    buf = torch.zeros(3, 4, 1, 8)
    # two views of one buffer (v's blocks start one block into k's): the writes of k and v would clobber
    with pytest.raises(RuntimeError, match="aligned::reshape_and_cache: k_cache and v_cache must not overlap"):
        ops.reshape_and_cache(k, v, buf[0:2], buf[1:3], slots)
    with pytest.raises(RuntimeError, match="must not overlap"):
        ops.reshape_and_cache(k, v, buf[:2], buf[:2], slots)
    # disjoint views of one buffer (vLLM's kv_cache[0] / kv_cache[1]) are fine
    kv = torch.zeros(2, 2, 4, 1, 8)
    ops.reshape_and_cache(k, v * 2, kv[0], kv[1], slots)
    assert bitwise_equal(kv[0].reshape(-1, 1, 8)[:3], k) and bitwise_equal(kv[1].reshape(-1, 1, 8)[:3], 2 * v)


@pytest.mark.parametrize("value", ["avx1024", "AVX2", "neon"])
def test_unknown_cpu_isa_fails_loudly(value):
    # Was ignored silently (the best level ran). Now the import fails and names the variable and the choices.
    env = dict(os.environ, ALIGNED_CPU_ISA=value)
    code = "import aligned_ops, torch; print(torch.ops.aligned._cpu_isa())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"ALIGNED_CPU_ISA={value!r} is not a kernel level" in proc.stderr
    assert "generic, avx2, avx512 or amx" in proc.stderr


ISA_FAMILIES = {"cpu_isa": "import aligned_ops, torch; print(torch.ops.aligned._cpu_isa())"}  # tests/_isa_matrix.py


def test_known_cpu_isa_still_selects_that_level(isa_matrix):
    # Positive control for the test above: a valid value runs and reports the level it forced (the shared
    # generic-level worker process: ALIGNED_CPU_ISA=generic in its environment, read once at its import).
    assert isa_matrix.run("generic", "cpu_isa").stdout.strip() == "generic"
