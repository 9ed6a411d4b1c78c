"""Trainer side, GLM-4.5: HF ``Glm4MoeForCausalLM`` patched through aligned_ops computes HF's function (accuracy:
fp32 against stock HF, a tolerance — the bits are the aligned ops', compared with vLLM in the e2e test) on configs
the e2e test does not build: without q/k norms (GLM-4.5 itself), one expert group (n_group = 1), no q/k/v bias.
The correction bias stays fp32 in a bf16 model. Refusals name the field."""

import pytest
import torch

from aligned_ops.integrations.hf import patch_model
from aligned_ops.testing.tiny_model import build_tiny_glm4_moe


@pytest.mark.parametrize("overrides", [dict(), dict(use_qk_norm=False, attention_bias=False),
                                       dict(n_group=1, topk_group=1, num_experts_per_tok=3)])
def test_patched_matches_stock_hf_in_fp32(tmp_path, overrides):
    from transformers import AutoModelForCausalLM

    path = build_tiny_glm4_moe(tmp_path / "m", torch.float32, seed=1, num_hidden_layers=2, **overrides)
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = stock(ids).logits
        out = patch_model(stock)(ids).logits
    err = (out - ref).abs().max().item()
    assert err < 1e-4, err  # fp32 rounding only: the same function (measured 4e-6)


def test_bias_fp32_in_bf16_model_and_bad_groups_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_glm4_moe(tmp_path / "m", torch.bfloat16, seed=0, num_hidden_layers=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    model.config.n_group = 3  # 8 experts do not split into 3 groups
    with pytest.raises(ValueError, match="Glm4MoeForCausalLM routing needs n_group \\| n_routed_experts"):
        patch_model(model)
