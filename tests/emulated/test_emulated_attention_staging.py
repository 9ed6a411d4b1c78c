"""The attention split kernel's staging (csrc/gpu/attention_kernels.cuh): K and V tiles in shared memory with
16-byte loads, the keys' row offsets once per tile, the next tile's vectors prefetched in registers — or, where the
two tiles do not fit the device (fp32, D = 256 on gfx942's 64 KB LDS), K only with V read from global memory as
before. Every variant gives the CPU backend's bits; the launch records prove which one ran and that the 65 KB launch
above CUDA's 48 KB default went through the opt-in (the emulator refuses it otherwise, as a GPU would)."""

from __future__ import annotations

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal

ops = torch.ops.aligned
pytestmark = pytest.mark.emulated


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _inputs(dtype, hq, hkv, d, lens, seed=0, q_lens=None):
    g = torch.Generator().manual_seed(seed)
    q_lens = q_lens or lens
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    k, v = (torch.randn(sum(lens), hkv, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v, _cu(q_lens), _cu(lens)


# (arch, dtype, D) -> whether V is staged, and the dynamic shared bytes of the split kernel
CASES = [
    ("sm_90", torch.bfloat16, 128, True, 32 * 129 * 4 + 32 * 128 * 4),
    ("sm_90", torch.float32, 256, True, 32 * 257 * 4 + 32 * 256 * 4),  # 65.7 KB: needs the opt-in
    ("sm_120", torch.float32, 256, True, 32 * 257 * 4 + 32 * 256 * 4),
    ("gfx942", torch.float32, 256, False, 32 * 257 * 4),  # 64 KB LDS: K only
    ("gfx950", torch.float32, 256, True, 32 * 257 * 4 + 32 * 256 * 4),  # 160 KB LDS: K and V
    ("gfx942", torch.bfloat16, 80, True, 32 * 81 * 4 + 32 * 80 * 4),  # D % 8 == 0 but 80: vectors of 8 bf16
    ("sm_90", torch.float16, 36, True, 32 * 37 * 4 + 32 * 36 * 4),  # D not a multiple of 8: element staging
]


@pytest.mark.parametrize("arch,dtype,d,staged,smem", CASES)
def test_split_kernel_variants_equal_cpu(arch, dtype, d, staged, smem):
    # the last rows of sequences of 1, 70 and 530 keys (530: two splits, a partial last tile)
    q, k, v, cq, ck = _inputs(dtype, 4, 2, d, [1, 70, 530], q_lens=[1, 2, 3])
    ref = ops.attention_varlen(q, k, v, cq, ck, d**-0.5, True)
    with aligned_ops.emulate(arch) as emu:
        got = ops.attention_varlen(q, k, v, cq, ck, d**-0.5, True)
    assert_bitwise_equal(got[0], ref[0])
    assert_bitwise_equal(got[1], ref[1])
    split = [l for l in emu.launches if l.kernel_base == "attention_split_kernel"]
    assert split and all(l.shared_bytes == smem for l in split), [(l.kernel, l.shared_bytes) for l in split]
    assert all(l.kernel.endswith("true>" if staged else "false>") for l in split), split[0].kernel


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_paged_decode_staged_equals_training_rows(arch):
    """Decode over a shuffled paged cache (block size 16: a tile spans two pages) == the training path's rows."""
    q, k, v, cu, _ = _inputs(torch.bfloat16, 8, 2, 128, [600, 33], seed=3)
    train = ops.attention_varlen(q, k, v, cu, cu, 128**-0.5, True)[0]
    bs, lens = 16, [600, 33]
    need = [(n + bs - 1) // bs for n in lens]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(1)).to(torch.int32)
    table = torch.zeros(2, max(need), dtype=torch.int32)
    table[0, : need[0]], table[1, : need[1]] = perm[: need[0]], perm[need[0]:]
    kc = torch.zeros(sum(need), bs, 2, 128, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    for b, (s0, n) in enumerate(zip(cu.tolist(), lens)):
        pos = torch.arange(n)
        slot = table[b, pos // bs].long() * bs + pos % bs
        kc.view(-1, 2, 128)[slot], vc.view(-1, 2, 128)[slot] = k[s0: s0 + n], v[s0: s0 + n]
    last = torch.tensor([599, 632])
    with aligned_ops.emulate(arch):
        dec = ops.paged_attention(q[last], kc, vc, table, torch.tensor(lens, dtype=torch.int32),
                                  torch.tensor([0, 1, 2], dtype=torch.int32), 128**-0.5)
    assert_bitwise_equal(dec, train[last])
