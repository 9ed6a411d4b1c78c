"""The GPU MoE (csrc/gpu/moe_kernels.cuh: routing, the grouped expert projections of both profiles, the combine) on
a real GPU — what the emulated suite (tests/emulated/test_emulated_moe.py) cannot prove:

* `fma`: the device equals the CPU backend bit for bit (routing and grouped routing with their backwards,
  experts, the experts' backward through autograd.grad);
* `mma`: the device equals the emulated kernel under this arch's MMA-Sim model (the record the emulated suite
  rests on; tests/cuda/test_cuda_linear_mma.py proves the instruction itself), forward and autograd.grad;
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


def experts_grads(case, go, profile):
    """moe_experts' output and autograd.grad of every differentiable input (x, weights, experts, shared)."""
    x, tw, ids, w13, w2, sw13, sw2, sg = case
    leaves = [t.clone().requires_grad_(True) for t in (x, tw, w13, w2, sw13, sw2, sg)]
    out = aligned_ops.moe_experts(leaves[0], leaves[1], ids, *leaves[2:], linear_profile=profile)
    return [out] + list(torch.autograd.grad(out, leaves, go))


@pytest.mark.parametrize("profile", ["fma", "mma"])
def test_backward_device_equals_cpu(profile):
    """The experts' backward on the device (ops/moe.py, composed of the GPU kernels) gives the bits of the same
    call on the CPU: the CPU backend (fma) or the emulated kernels under this arch's MMA-Sim model (mma)."""
    _, case = make_case(96, 4, seed=8)
    go = torch.randn(96, H, generator=torch.Generator().manual_seed(9)).bfloat16()
    dev = experts_grads(cuda(case), go.cuda(), profile)
    if profile == "fma":
        ref = experts_grads(case, go, profile)
    else:
        with aligned_ops.emulate(emulated_arch(), mma_model="mmasim"):
            ref = experts_grads(case, go, profile)
    for i, (a, b) in enumerate(zip(dev, ref)):
        assert_bitwise_equal(a.cpu(), b, f"output/gradient {i}")
    aligned_ops.check_device_errors("cuda")


@pytest.mark.parametrize("renorm", [True, False])
def test_grouped_routing_and_backwards_device_equal_cpu(renorm):
    """moe_grouped_routing (DeepSeek-V3 style: bias, groups) and both routings' backwards: the CPU's bits."""
    E64 = 64
    g = torch.Generator().manual_seed(11)
    z = torch.randn(300, E64, generator=g) * 3.0
    bias = torch.randn(E64, generator=g) * 0.1

    def grads(z, bias, grouped):
        zl = z.clone().requires_grad_(True)
        if grouped:
            w, ids, sc = aligned_ops.moe_grouped_routing(zl, bias, 8, 8, 4, renorm, 2.5)
        else:
            w, ids, sc = aligned_ops.moe_routing(zl, 8, "sigmoid", renorm)
        gg = torch.Generator().manual_seed(12)
        gw, gs = torch.randn(w.shape, generator=gg).to(w.device), torch.randn(sc.shape, generator=gg).to(sc.device)
        (dz,) = torch.autograd.grad((w * gw).sum() + (sc * gs).sum(), zl)
        return [w, ids, sc, dz]

    for grouped in (True, False):
        dev = grads(z.cuda(), bias.cuda(), grouped)
        cpu = grads(z, bias, grouped)
        for i, (a, b) in enumerate(zip(dev, cpu)):
            assert_bitwise_equal(a.cpu(), b, f"grouped={grouped} output {i}")
    aligned_ops.check_device_errors("cuda")
