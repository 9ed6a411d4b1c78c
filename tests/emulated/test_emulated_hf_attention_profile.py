"""The trainer patch's attention under the ``mma`` linear profile (profiles.Profile.attention_profile): a patched
bf16 model's layers call ``attention_varlen(profile="mma")`` where the mma attention kernel runs (here: the
emulated GPU, CPU tensors inside ``aligned_ops.emulate``), and ``profile="fma"`` on the plain CPU.

Proved by bits, not by a mock: every attention call of the forward is recorded (the real op runs), and its output
is compared on integer views with ``attention_varlen`` called directly on the same q/k/v under each profile — equal
to ``profile="mma"``'s, different from ``profile="fma"``'s (the negative control: the two profiles' bits differ,
so the comparison can fail). Also: ``torch.compile(fullgraph=True)`` of ``attention_varlen(profile="mma")`` under
emulation gives the eager bits."""

from __future__ import annotations

import pytest
import torch

import aligned_ops
from aligned_ops import profiles
from aligned_ops.integrations.hf import patch_model
from aligned_ops.testing import bitwise_equal
from aligned_ops.testing.tiny_model import build_tiny_qwen2

pytestmark = pytest.mark.emulated
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = build_tiny_qwen2(tmp_path_factory.mktemp("hfattnmma") / "m", BF16, seed=3, num_hidden_layers=1)
    # patched under emulation: the emulated GPU's unit serves mma on a CPU without one (AVX2-only, e.g. Zen 3)
    with aligned_ops.emulate("sm_90"):
        return patch_model(AutoModelForCausalLM.from_pretrained(d, dtype=BF16), profile="mma")


def _recorded_forward(model, monkeypatch, ids, cu):
    calls, real = [], aligned_ops.attention_varlen

    def record(q, k, v, cu_q, cu_k, scale=None, causal=True, plan=None, profile="fma"):
        out = real(q, k, v, cu_q, cu_k, scale, causal, plan=plan, profile=profile)
        calls.append((q, k, v, cu_q, cu_k, scale, causal, profile, out[0]))
        return out

    monkeypatch.setattr(aligned_ops, "attention_varlen", record)
    with torch.no_grad():
        logits = model(input_ids=ids, cu_seqlens=cu).logits
    monkeypatch.setattr(aligned_ops, "attention_varlen", real)
    return logits, calls


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_patched_model_attention_runs_mma_under_emulation(model, monkeypatch, arch):
    assert profiles.profile_of(model) is profiles.MMA
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (1, 21), generator=g)
    cu = torch.tensor([0, 13, 21], dtype=torch.int32)
    with aligned_ops.emulate(arch):
        _, calls = _recorded_forward(model, monkeypatch, ids, cu)
        assert len(calls) == len(model.model.layers) and all(c[7] == "mma" for c in calls), [c[7] for c in calls]
        for q, k, v, cq, ck, scale, causal, _, out in calls:
            mma = aligned_ops.attention_varlen(q, k, v, cq, ck, scale, causal, profile="mma")[0]
            fma = aligned_ops.attention_varlen(q, k, v, cq, ck, scale, causal, profile="fma")[0]
            assert bitwise_equal(out, mma), "the layer's attention is not attention_varlen(profile='mma')"
            assert not bitwise_equal(out, fma), "negative control: fma and mma attention bits must differ"


def test_patched_model_attention_is_fma_on_the_plain_cpu(model, monkeypatch):
    """The same model (same linear profile) outside emulation runs fma attention: the CPU has no mma attention."""
    if aligned_ops.mma_unit() is None:
        pytest.skip("this CPU has no bf16 unit: the mma linears of the plain-CPU forward cannot run here")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (1, 21), generator=g)
    cu = torch.tensor([0, 13, 21], dtype=torch.int32)
    _, calls = _recorded_forward(model, monkeypatch, ids, cu)
    assert len(calls) == len(model.model.layers) and all(c[7] == "fma" for c in calls), [c[7] for c in calls]
    for q, k, v, cq, ck, scale, causal, _, out in calls:
        assert bitwise_equal(out, aligned_ops.attention_varlen(q, k, v, cq, ck, scale, causal, profile="fma")[0])


def test_compiled_mma_attention_under_emulation_equals_eager():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(20, h, 32, generator=g).to(BF16) for h in (4, 2, 2))
    cu = torch.tensor([0, 9, 20], dtype=torch.int32)

    def f(q, k, v):
        out, lse = aligned_ops.attention_varlen(q, k, v, cu, cu, profile="mma")
        return out * 2, lse

    with aligned_ops.emulate("sm_90"):
        eager = f(q, k, v)
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True)(q, k, v)
        fma = aligned_ops.attention_varlen(q, k, v, cu, cu, profile="fma")[0] * 2
    assert bitwise_equal(eager[0], compiled[0]) and bitwise_equal(eager[1], compiled[1])
    assert not bitwise_equal(eager[0], fma)  # negative control: the compiled graph ran the mma profile


def test_mma_start_up_check_under_emulation_needs_no_cpu_unit():
    """Inside ``emulate`` the CPU tensors run the emulated GPU's unit: the start-up check asks only for bf16 there;
    outside it, the CPU's own unit decides (refused by name on a CPU without one)."""
    from aligned_ops.ops.linear_mma import MMA_REFUSAL, mma_model_reasons

    with aligned_ops.emulate("gfx942"):
        assert profiles.MMA.model_refusals(BF16) == []
        assert profiles.MMA.model_refusals(torch.float32) == [
            "the mma profile takes bfloat16 models (its matrix units multiply bf16), got float32; "
            "use ALIGNED_OPS_LINEAR=fma"]
    assert mma_model_reasons(BF16) == ([] if aligned_ops.mma_unit() is not None else [MMA_REFUSAL])
