"""The GPU MoE (csrc/gpu/moe_kernels.cuh: routing, the grouped expert projections of both profiles, the combine) on
a real GPU — what the emulated suite (tests/emulated/test_emulated_moe.py) cannot prove:

* `fma`: the device equals the CPU backend bit for bit (routing, experts, the backward);
* `mma`: the device equals the emulated kernel under this arch's MMA-Sim model (the record the emulated suite
  rests on; tests/cuda/test_cuda_linear_mma.py proves the instruction itself);
* on the hardware: a token alone == inside batches up to 4096 tokens, run to run, both profiles;
* a captured CUDA graph replays the experts for other ids and weights of the same shapes (no host read).

Skipped without a GPU (CI has none).
"""

from __future__ import annotations

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal

ops = torch.ops.aligned
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) GPU")

H, I, E, IS = 256, 96, 16, 64


def emulated_arch() -> str:
    if torch.version.hip:
        name = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
        return name if name in ("gfx942", "gfx950") else pytest.skip(f"no emulated model for {name}")
    major, minor = torch.cuda.get_device_capability()
    arch = {8: "sm_80", 9: "sm_90", 10: "sm_100", 12: "sm_120"}.get(major)
    return arch or pytest.skip(f"no emulated model for sm_{major}{minor}")


def make_case(T, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    logits = torch.randn(T, E, generator=g) * 2.0
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).bfloat16()
    sw13 = (torch.randn(2 * IS, H, generator=g) * 0.1).bfloat16()
    sw2 = (torch.randn(H, IS, generator=g) * 0.1).bfloat16()
    sg = (torch.randn(1, H, generator=g) * 0.1).bfloat16()
    tw, ids, _ = ops.moe_routing(logits, k, "softmax", True)
    return logits, (x, tw, ids, w13, w2, sw13, sw2, sg)


def cuda(t):
    return tuple(v.cuda() if v is not None else None for v in t)


@pytest.mark.parametrize("k", [1, 8])
def test_fma_device_equals_cpu(k):
    logits, case = make_case(300, k, seed=k)
    cpu = ops.moe_experts(*case)
    dev = ops.moe_experts(*cuda(case))
    assert_bitwise_equal(dev.cpu(), cpu)
    for scoring, renorm in (("softmax", True), ("sigmoid", False)):
        for a, b in zip(ops.moe_routing(logits.cuda(), k, scoring, renorm), ops.moe_routing(logits, k, scoring, renorm)):
            assert_bitwise_equal(a.cpu(), b)
    aligned_ops.check_device_errors("cuda")


def test_mma_device_equals_emulated_kernel():
    arch = emulated_arch()
    _, case = make_case(200, 4, seed=3)
    dev = ops.moe_experts(*cuda(case), "mma").cpu()
    with aligned_ops.emulate(arch, mma_model="mmasim"):
        emu = ops.moe_experts(*case, "mma")
    assert_bitwise_equal(dev, emu)


@pytest.mark.parametrize("profile", ["fma", "mma"])
def test_token_alone_equals_in_big_batches(profile):
    _, case = make_case(4096, 8, seed=5)
    dcase = cuda(case)
    x, tw, ids, *w = dcase
    full = ops.moe_experts(*dcase, profile)
    assert_bitwise_equal(ops.moe_experts(*dcase, profile), full)  # run to run
    for t in (0, 77, 4095):
        assert_bitwise_equal(ops.moe_experts(x[t:t + 1], tw[t:t + 1], ids[t:t + 1], *w, profile)[0], full[t])
    for n in (5, 64, 1000):
        assert_bitwise_equal(ops.moe_experts(x[:n], tw[:n], ids[:n], *w, profile), full[:n])


def test_cuda_graph_replays_other_ids():
    _, a = make_case(64, 4, seed=6)
    _, b = make_case(64, 4, seed=7)
    static = [t.clone() for t in cuda(a)]
    out = ops.moe_experts(*static)  # warm-up (allocator)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.moe_experts(*static)
    for dst, src in zip(static, cuda(b)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out.cpu(), ops.moe_experts(*b))
