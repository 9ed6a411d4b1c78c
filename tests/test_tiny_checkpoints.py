"""The session's shared tiny checkpoints (tests/_tiny_checkpoints.py): an override is compared with the default the
builder really uses (after the variant it names), so an override equal to the base default is not dropped."""

import json
import os

import torch


def _config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def test_override_equal_to_the_base_default_survives_a_variant(tiny_checkpoint):
    variant = tiny_checkpoint("deepseek_v3", torch.bfloat16, seed=0, variant="dv-ne-dn")
    kept = tiny_checkpoint("deepseek_v3", torch.bfloat16, seed=0, variant="dv-ne-dn", qk_nope_head_dim=32)
    # negative control: the variant alone gives 24 (the base default is 32, which the override asks for)
    assert _config(variant)["qk_nope_head_dim"] == 24
    assert _config(kept)["qk_nope_head_dim"] == 32 and kept != variant
    # an override equal to the variant's own value is the variant's checkpoint; "default" is no variant
    assert tiny_checkpoint("deepseek_v3", torch.bfloat16, seed=0, variant="dv-ne-dn", qk_nope_head_dim=24) == variant
    base = tiny_checkpoint("deepseek_v3", torch.bfloat16, seed=0)
    assert tiny_checkpoint("deepseek_v3", torch.bfloat16, seed=0, variant="default", qk_nope_head_dim=32) == base
    assert _config(base)["qk_nope_head_dim"] == 32
