"""The `mma` profile on an AMX CPU: the unit is AMX-BF16 tdpbf16ps (csrc/cpu/gemm_amx_mma_kernels.cpp, mma.h).

The instruction's internal order over its 32 products has no model, so the kernel is held to the instruction
itself, used the plainest way: one element per instruction on 1 x 1 tiles, the activation row and the weight
column in the other operand roles, each block copied into zero-padded buffers (``_linear_mma_reference`` on this
unit). Bits compared through integer views, NaN positions only (the unit's NaN payloads are its own).

- kernel == that reference (test_linear_mma.py's kernel-vs-reference test, which takes AMX_SHAPES below): every
  tile path of the kernel (row tails 1..47 and several row groups, column tails,
  lanes that end in a partial block and lanes of whole blocks, K < 8, K = 1), lanes 1, 2, 4, 8, random and
  adversarial values (subnormals, overflow, inf, NaN, signed zeros), weights read in place with an odd row stride
  and a base that is not 4-byte aligned;
- a lane's partial last block is padded with +0 weights, not read on into the next lane (an inf there would make
  inf * 0 = NaN);
- the unit is not vdpbf16ps: its bits differ from mma.h's vdpbf16ps model (the control that the AMX unit runs);
- the vdpbf16ps model tests of test_linear_mma.py pass under ALIGNED_CPU_ISA=avx512 on this CPU (that level's
  unit), and that unit's bits differ from this one's; that unit refuses to pack weights by name;
- the packed weights (linear_mma_pack_weight / linear_mma_packed): the in-place bits on every shape above, a row
  alone == in batches, refusals by name, opcheck, compile; aligned_ops.linear_mma caches a registered weight's
  packing and drops it on an in-place write or clear_exact_weight_cache (a write through .data without the clear
  serves the stale packing: the control).
The invariance, TP, backward, MoE, compile and opcheck tests of test_linear_mma.py run on this unit as they are.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import aligned_ops
from aligned_ops.ops import linear_mma as mma_mod
from aligned_ops.testing import assert_bitwise_equal

sys.path.insert(0, os.path.dirname(__file__))
from test_linear_mma import TorchFunctionParameter, adversarial, numpy_model, rand, same_bits_nan_aware  # noqa: E402

ops = torch.ops.aligned
BF = torch.bfloat16
pytestmark = pytest.mark.skipif(aligned_ops.mma_unit() != "amx_bf16",
                                reason=f"the AMX unit; this process's mma unit is {aligned_ops.mma_unit()}")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_amx_level_runs_the_amx_unit():
    assert ops._cpu_isa() == "amx"
    assert aligned_ops.mma_unit() == "amx_bf16"


# Row counts: one row group (1, 15, 16), two blocks (17, 31, 32), a tail block past two (33, 47), several groups
# (100, 259). Columns: N % 16 and N % 32 tails, one block. K: lanes of whole 32-blocks (256: 32 each; 4864: 608 =
# 19 blocks), lanes ending in a partial block (896, 203, 77), K < 8 (empty lanes), K = 1.
# the AMX paths' shapes (test_linear_mma.py's kernel-vs-reference test runs them on either unit)
from test_linear_mma import AMX_SHAPES  # noqa: E402


def test_weight_read_in_place_with_odd_stride_and_misaligned_base():
    """The kernel loads weight tiles straight from the weight's rows (row stride K + 3 elements, the first
    element 2 bytes past a 4-byte boundary): the same bits as a contiguous copy and as the reference."""
    M, K, N = 37, 203, 45
    x = rand(M, K, seed=1)
    big = rand(N, K + 3, seed=2, scale=0.05)
    w = big[:, 1:K + 1]
    assert w.stride() == (K + 3, 1) and w.data_ptr() % 4 == 2
    got = ops.linear_mma(x, w)
    assert_bitwise_equal(got, ops.linear_mma(x, w.contiguous()))
    assert_bitwise_equal(got, ops._linear_mma_reference(x, w.contiguous(), 8).to(BF))


@pytest.mark.parametrize("K", [203, 896])
def test_a_partial_block_is_padded_with_zeros_not_the_next_lane(K):
    """Lane l's last block is partial; the next lane starts with an inf weight. The contract pads lane l with
    +0 weights: the row's result is +-inf (the inf times a nonzero x). A kernel that read on into the next lane
    would add inf * 0 = NaN to lane l."""
    x = torch.ones(3, K, dtype=BF)
    w = rand(16, K, seed=3, scale=0.05)
    starts = [l * K // 8 for l in range(8)]
    assert any((starts[l + 1] - starts[l]) % 32 for l in range(7))  # the shape has partial blocks
    for l in range(1, 8):
        w[l, starts[l]] = float("inf")
    out = ops.linear_mma_partial(x, w, 8)
    assert torch.isinf(out[:, 1:8]).all() and not torch.isnan(out).any(), out[:, :8]
    assert same_bits_nan_aware(out, ops._linear_mma_reference(x, w, 8))


def test_the_amx_bits_are_not_the_vdpbf16ps_model():
    """The control that the AMX unit runs (and that the reference comparisons above can fail): on adversarial
    inputs the kernel and its reference differ from mma.h's vdpbf16ps model."""
    x, w = adversarial(32, 64, 24, seed=5)
    kern = ops.linear_mma_partial(x, w, 8)
    assert same_bits_nan_aware(kern, ops._linear_mma_reference(x, w, 8))
    assert not same_bits_nan_aware(numpy_model(x, w, 8), kern)


_AVX512_UNIT = r"""
import sys, torch, aligned_ops
assert aligned_ops.mma_unit() == "avx512_bf16", aligned_ops.mma_unit()
x, w = torch.load(sys.argv[1])
torch.save(torch.ops.aligned.linear_mma_partial(x, w, 8), sys.argv[2])
try:
    torch.ops.aligned.linear_mma_pack_weight(w)
except RuntimeError as e:
    print(str(e).splitlines()[0])
else:
    raise SystemExit("packed without the amx unit")
"""


@pytest.mark.slow
def test_the_avx512_level_on_this_cpu_runs_vdpbf16ps(tmp_path):
    """ALIGNED_CPU_ISA=avx512 on an AMX CPU selects the vdpbf16ps unit (the bits every avx512_bf16 CPU shares):
    test_linear_mma.py's model tests pass there, and that unit's bits differ from this process's."""
    env = dict(os.environ, ALIGNED_CPU_ISA="avx512")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                          os.path.join(ROOT, "tests", "ops", "test_linear_mma.py"), "-k",
                          "numpy_model or other_order_and_no_flush"],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout, res.stdout[-1000:]
    x, w = adversarial(16, 96, 20, seed=6)
    torch.save((x, w), tmp_path / "in.pt")
    res = subprocess.run([sys.executable, "-c", _AVX512_UNIT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "linear_mma_pack_weight: packs weights for the amx_bf16 unit; this process's mma unit is avx512_bf16" \
        in res.stdout, res.stdout
    avx512 = torch.load(tmp_path / "out.pt")
    assert same_bits_nan_aware(avx512, numpy_model(x, w, 8))
    assert not same_bits_nan_aware(avx512, ops.linear_mma_partial(x, w, 8))


# ---- the packed weights (linear_mma_pack_weight / linear_mma_packed; the rollout engine's cached form) ----------

@pytest.mark.parametrize("M,K,N", AMX_SHAPES)
def test_packed_weight_gives_the_in_place_bits(M, K, N):
    """The packing is the same values in the instruction's tile layout, read with the roles of the reference:
    linear_mma_packed == linear_mma (weight rows read in place) == the reference, bias or none, random and
    adversarial values (inf, NaN: NaN positions)."""
    x, w, b = rand(M, K, seed=M + K), rand(N, K, seed=N, scale=0.05), rand(N, seed=9)
    xa, wa = adversarial(M, K, N, seed=M * 7 + N)
    for xx, ww in ((x, w), (xa, wa)):
        packed = ops.linear_mma_pack_weight(ww)
        assert packed.dtype == torch.int16 and packed.dim() == 1
        for bias in (None, b):
            got = ops.linear_mma_packed(xx, ww, packed, bias)
            want = ops.linear_mma(xx, ww, bias)
            assert same_bits_nan_aware(got.float(), want.float()) and bitwise_or_nan(got, want), (M, K, N)
    assert_bitwise_equal(ops.linear_mma_packed(x, w, ops.linear_mma_pack_weight(w), b),
                         (ops._linear_mma_reference(x, w, 8) + b.float()).to(BF))


def bitwise_or_nan(a, b):
    """bf16 bits equal wherever neither is NaN (the unit's NaN payloads are its own)."""
    nan = torch.isnan(a.float()) | torch.isnan(b.float())
    return torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])


def test_packed_row_alone_equals_row_in_batch():
    K, N = 896, 70
    w, b = rand(N, K, seed=30, scale=0.03), rand(N, seed=31)
    packed = ops.linear_mma_pack_weight(w)
    x = rand(300, K, seed=32)
    full = ops.linear_mma_packed(x, w, packed, b)
    for m in (0, 17, 150, 299):
        for lo, hi in ((m, m + 1), (max(0, m - 5), m + 1), (m, min(300, m + 40))):
            assert_bitwise_equal(ops.linear_mma_packed(x[lo:hi], w, packed, b)[m - lo], full[m])


def test_packed_bad_input_is_refused_by_name():
    w, x = rand(20, 64, seed=1), rand(3, 64, seed=2)
    packed = ops.linear_mma_pack_weight(w)
    with pytest.raises(RuntimeError, match=r"linear_mma_packed: packed must be linear_mma_pack_weight\(weight\)"):
        ops.linear_mma_packed(x, w, ops.linear_mma_pack_weight(rand(36, 64, seed=3)), None)  # another shape's
    with pytest.raises(RuntimeError, match=r"linear_mma_packed: packed must be"):
        ops.linear_mma_packed(x, w, packed.float(), None)
    with pytest.raises(RuntimeError, match=r"linear_mma_packed: x must be bfloat16"):
        ops.linear_mma_packed(x.float(), w, packed, None)
    with pytest.raises(RuntimeError, match=r"linear_mma_pack_weight: weight must be bfloat16"):
        ops.linear_mma_pack_weight(w.float())
    with pytest.raises(RuntimeError, match=r"linear_mma_pack_weight: weight must be 2-D"):
        ops.linear_mma_pack_weight(w[0])
    with pytest.raises(RuntimeError, match="no backward|has no backward|not differentiable"):
        xg = x.clone().requires_grad_()
        ops.linear_mma_packed(xg, w, packed, None).sum().backward()


def test_packed_opcheck_and_compile():
    w, x, b = rand(24, 40, seed=4), rand(5, 40, seed=5), rand(24, seed=6)
    torch.library.opcheck(ops.linear_mma_pack_weight, (w,))
    packed = ops.linear_mma_pack_weight(w)
    torch.library.opcheck(ops.linear_mma_packed, (x, w, packed, b))
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, p: ops.linear_mma_packed(a, w, p, b), fullgraph=True)
    assert_bitwise_equal(compiled(x, packed), ops.linear_mma(x, w, b))


def test_linear_mma_caches_the_packing_of_a_registered_weight_and_drops_it_on_a_write(monkeypatch):
    """aligned_ops.linear_mma packs a registered weight once (the cached derivation of the exact profile's
    registry), reads it on every later call with the in-place bits, and packs again after an in-place write (the
    version counter) or clear_exact_weight_cache (a write through .data). The control: a write through .data
    without the clear keeps serving the stale packing — the old weight's bits — so the checks below can fail."""
    from aligned_ops.ops import linear_mma as mma_mod

    packs = []
    real = ops.linear_mma_pack_weight

    def counting(w):
        packs.append(1)
        return real(w)

    monkeypatch.setattr(mma_mod.ops, "linear_mma_pack_weight", counting, raising=False)
    w = torch.nn.Parameter(rand(48, 203, seed=7, scale=0.05), requires_grad=False)
    x = rand(9, 203, seed=8)
    aligned_ops.cache_exact_weights(w)
    first = aligned_ops.linear_mma(x, w)
    assert_bitwise_equal(first, ops.linear_mma(x, w))
    aligned_ops.linear_mma(x, w)
    assert len(packs) == 1
    with torch.no_grad():
        w.mul_(2)  # in place: the version counter moves
    assert_bitwise_equal(aligned_ops.linear_mma(x, w), ops.linear_mma(x, w))
    assert len(packs) == 2
    w.data.copy_(rand(48, 203, seed=9, scale=0.05))  # behind the counter's back
    stale = aligned_ops.linear_mma(x, w)
    assert not torch.equal(stale.view(torch.int16), ops.linear_mma(x, w).view(torch.int16))  # the control
    aligned_ops.clear_exact_weight_cache()
    assert_bitwise_equal(aligned_ops.linear_mma(x, w), ops.linear_mma(x, w))
    assert len(packs) == 3
    # a weight autograd tracks reads its rows in place (no packing), and the gradient flows
    wg = rand(48, 203, seed=10).requires_grad_()
    aligned_ops.cache_exact_weights(wg)
    aligned_ops.linear_mma(x, wg).float().sum().backward()
    assert wg.grad is not None and len(packs) == 3


def test_a_vllm_style_parameter_takes_the_packed_path_without_its_torch_function(monkeypatch):
    """The rollout's weights are vLLM parameters with a __torch_function__ (~3 us per property read or op call;
    two dozen per linear measured 35 us a call, 0.92x -> 0.98x of stock end to end when removed): the packed path
    reads them as plain tensors — same bits, the packing cached, and the identity/storage/version key still sees a
    `.data =` swap and an in-place write. The control: the subclass's __torch_function__ does run outside the
    fast path (a plain op on it), so the count below can move."""
    packs = []
    real = ops.linear_mma_pack_weight
    monkeypatch.setattr(mma_mod.ops, "linear_mma_pack_weight", lambda w: packs.append(1) or real(w), raising=False)
    w = TorchFunctionParameter(rand(40, 160, seed=11, scale=0.05))
    x = rand(5, 160, seed=12)
    aligned_ops.cache_exact_weights(w)
    want = ops.linear_mma(x, w.detach().as_subclass(torch.Tensor))
    with torch.no_grad():
        assert_bitwise_equal(aligned_ops.linear_mma(x, w), want)  # packs
        TorchFunctionParameter.calls = 0
        for _ in range(3):
            assert_bitwise_equal(aligned_ops.linear_mma(x, w), want)
        assert TorchFunctionParameter.calls == 0 and len(packs) == 1
        w.sum()  # control, and the subclass's hook is back after the fast path: it runs for an ordinary op
        assert TorchFunctionParameter.calls > 0
        w.data = rand(40, 160, seed=13, scale=0.05)  # a new storage under the same parameter object
        assert_bitwise_equal(aligned_ops.linear_mma(x, w), ops.linear_mma(x, w.detach().as_subclass(torch.Tensor)))
        assert len(packs) == 2
        w.add_(1)  # in place: the version counter
        assert_bitwise_equal(aligned_ops.linear_mma(x, w), ops.linear_mma(x, w.detach().as_subclass(torch.Tensor)))
        assert len(packs) == 3


@pytest.mark.parametrize("threads", [1, 2])
def test_two_weight_groups_per_chunk_and_row_chunks(threads):
    """Prefill runs the lanes outermost over chunks of two 32-row weight groups (gemm_amx_mma_kernels.cpp) and
    passes of 256 activation rows; which chunks a thread gets depends on the thread count (run_gemm_tiles). Pinned
    to 1 and 2 threads: M > 32 with an m-tail, N > 64 with an n-tail, K with partial lane blocks, M > 256 (two row
    passes) — both paths equal the reference and each other."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for M, K, N in ((100, 320, 70), (77, 203, 150), (300, 77, 90)):
            x, w, b = rand(M, K, seed=M, scale=1.0), rand(N, K, seed=N, scale=0.05), rand(N, seed=K)
            xa, wa = adversarial(M, K, N, seed=M + N)
            for xx, ww in ((x, w), (xa, wa)):
                ref = ops._linear_mma_reference(xx, ww, 8)
                assert same_bits_nan_aware(ops.linear_mma_partial(xx, ww, 8), ref), (M, K, N, threads)
            got = ops.linear_mma(x, w, b)
            assert_bitwise_equal(got, (ops._linear_mma_reference(x, w, 8) + b.float()).to(BF))
            assert_bitwise_equal(ops.linear_mma_packed(x, w, ops.linear_mma_pack_weight(w), b), got)
    finally:
        torch.set_num_threads(prev)


def test_a_registered_weight_under_emulation_runs_the_emulated_gpu():
    """aligned_ops.linear_mma on a registered weight takes the packed CPU path only outside aligned_ops.emulate:
    under it the emulated GPU's kernel runs (its launches are recorded), and the packed ops refuse by name."""
    from aligned_ops.emulation import emulate

    w, x = rand(40, 96, seed=11, scale=0.05), rand(6, 96, seed=12)
    aligned_ops.cache_exact_weights(w)
    with emulate("sm_90") as emu:
        got = aligned_ops.linear_mma(x, w)
    assert emu.launches, "the registered weight's call launched no emulated kernel"
    with emulate("sm_90") as emu2:
        want = ops.linear_mma(x, w)
        with pytest.raises(RuntimeError, match="linear_mma_pack_weight: packs weights for the CPU amx_bf16 unit, "
                                               "not an emulated GPU's"):
            ops.linear_mma_pack_weight(w)
        with pytest.raises(RuntimeError, match="linear_mma_packed: packed weights are the CPU amx_bf16 unit's"):
            ops.linear_mma_packed(x, w, torch.zeros(mma_mod._packed_weight_elems(40, 96), dtype=torch.int16))
    assert emu2.launches
    assert_bitwise_equal(got, want)
