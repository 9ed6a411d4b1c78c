"""The plugin's router hook (vLLM's ``GateLinear``) against the trainer's router: a router whose weight vLLM keeps
in fp32 (GLM-4.5) while HF holds it in the model dtype must give the trainer's logits whatever dtype the checkpoint
stored it in."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.integrations.vllm.moe import _gate_linear_forward  # noqa: E402
from aligned_ops.models import rules_for  # noqa: E402
from aligned_ops.testing import bits  # noqa: E402

ARCH = "Glm4MoeForCausalLM"


def _gate(weight: torch.Tensor) -> torch.nn.Module:
    gate = torch.nn.Module()
    gate.weight = torch.nn.Parameter(weight, requires_grad=False)
    gate.bias = None
    gate.return_bias = False
    gate._aligned_arch = ARCH
    return gate


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_checkpoint_router_rounds_like_the_trainer(dtype):
    torch.manual_seed(0)
    w_checkpoint = torch.randn(16, 96)  # an fp32 checkpoint: most values not representable in the model dtype
    x = torch.randn(7, 96).to(dtype)
    rules = rules_for(ARCH)
    # the trainer (models/moe.py): HF loaded the weight in the model dtype, the router widens both to fp32
    trainer = rules.router_linear(x.float(), w_checkpoint.to(dtype).float())
    got = _gate_linear_forward(_gate(w_checkpoint.clone()), x)
    assert got.dtype == torch.float32
    assert torch.equal(bits(got), bits(trainer))
    # negative control: vLLM's own fp32 copy of the checkpoint, used whole, routes by other logits
    whole = rules.router_linear(x.float(), w_checkpoint)
    assert not torch.equal(bits(whole), bits(trainer))


def test_model_dtype_checkpoint_router_unchanged():
    """A checkpoint in the model dtype (vLLM's fp32 copy is its exact widening): the same bits as before the
    rounding step (the widened weight used directly)."""
    torch.manual_seed(1)
    w = torch.randn(16, 96).to(torch.bfloat16).float()
    x = torch.randn(5, 96).to(torch.bfloat16)
    got = _gate_linear_forward(_gate(w.clone()), x)
    assert torch.equal(bits(got), bits(rules_for(ARCH).router_linear(x.float(), w)))
