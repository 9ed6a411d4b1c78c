"""One RoPE table builder (aligned_ops.rope) for both sides: HF config and vLLM rotary module give the same bits.

No engine: vLLM's ``get_rope`` builds the rotary module the model would use; the plugin describes it
(``rope_spec_from_vllm``), the trainer describes the HF config (``rope_spec_from_hf_config``), and the two
tables must be bitwise equal. Semantics are checked against HF's inverse frequencies and attention factor
(float64 reference, tolerance) and against vLLM's own fp32 table.
"""

import math

import pytest
import torch

from aligned_ops.rope import RopeSpec, cos_sin_cache, inv_freq, rope_spec_from_hf_config
from aligned_ops.testing import assert_bitwise_equal, bitwise_equal

CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 1e6},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                              "rope_theta": 1e6, "attention_factor": 1.3, "beta_fast": 16, "beta_slow": 2},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
                    "rope_theta": 1e5, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
}


def _llama_config(rope_parameters, head_dim=32, max_pos=1024):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                       max_position_embeddings=max_pos, rope_parameters=dict(rope_parameters),
                       architectures=["LlamaForCausalLM"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_semantics_match_hf(name):
    """Inverse frequencies and the cos/sin factor are HF's (float64 vs HF's fp32: relative 1e-6)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _llama_config(CASES[name])
    spec = rope_spec_from_hf_config(cfg)
    rt = CASES[name]["rope_type"]
    if rt == "default":
        ref, af = 1.0 / (CASES[name]["rope_theta"] ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)), 1.0
    else:
        ref, af = ROPE_INIT_FUNCTIONS[rt](cfg, "cpu")
    ours = torch.tensor(inv_freq(spec), dtype=torch.float64)
    torch.testing.assert_close(ours, ref.to(torch.float64), rtol=1e-6, atol=0)
    assert spec.attention_factor == pytest.approx(af, rel=1e-12)
    table = cos_sin_cache(spec, 64)
    pos = torch.arange(64, dtype=torch.float64)[:, None] * ours[None, :]
    expect = torch.cat([pos.cos(), pos.sin()], -1) * af
    torch.testing.assert_close(table.double(), expect, rtol=0, atol=1e-7)


@pytest.fixture(scope="module")
def vllm_rope():
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from aligned_ops.integrations import vllm_plugin

    vllm_plugin.install()
    with set_current_vllm_config(VllmConfig()):
        yield get_rope


@pytest.mark.parametrize("name", sorted(CASES))
def test_plugin_and_trainer_tables_bitwise_equal(vllm_rope, name):
    """The table the plugin builds for vLLM's module == the table the trainer builds from the HF config."""
    from aligned_ops.integrations import vllm_plugin

    cfg = _llama_config(CASES[name])
    rot = vllm_rope(32, cfg.max_position_embeddings, True, dict(cfg.rope_parameters), torch.float32)
    hf_spec, vllm_spec = rope_spec_from_hf_config(cfg), vllm_plugin.rope_spec_from_vllm(rot)
    n = 1536
    assert_bitwise_equal(cos_sin_cache(vllm_spec, n), cos_sin_cache(hf_spec, n))
    # The buffer the plugin registered at construction is that table (its own length).
    buf = rot._aligned_cos_sin_cache
    assert_bitwise_equal(buf, cos_sin_cache(hf_spec, buf.shape[0]))
    # Same angles as vLLM's own fp32 table (which computes cos/sin in fp32: close, not equal).
    own = rot.cos_sin_cache.float()
    m = min(own.shape[0], buf.shape[0])
    torch.testing.assert_close(buf[:m], own[:m], rtol=0, atol=2e-4)
    # Negative control: a different variant gives a different table. (Dynamic NTK within
    # max_position_embeddings IS plain RoPE, in HF and in vLLM: base' = base * 1^(R/(R-2)).)
    default = cos_sin_cache(rope_spec_from_hf_config(_llama_config(CASES["default"])), n)
    if name == "dynamic":
        assert bitwise_equal(cos_sin_cache(hf_spec, n), default)
        from dataclasses import replace

        assert not bitwise_equal(cos_sin_cache(replace(hf_spec, max_trained_positions=256), n), default)
    elif name != "default":
        assert not bitwise_equal(cos_sin_cache(hf_spec, n), default)


def test_table_does_not_depend_on_length_or_threads():
    spec = RopeSpec(rotary_dim=128, base=500000.0, max_position=8192, rope_type="llama3", factor=8.0,
                    low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=1024)
    threads = torch.get_num_threads()
    try:
        a = cos_sin_cache(spec)
        torch.set_num_threads(1)
        b = cos_sin_cache(spec, 8192 - 5)
    finally:
        torch.set_num_threads(threads)
    assert_bitwise_equal(a[: 8192 - 5], b)


def test_unsupported_variants_refused():
    from aligned_ops.integrations import check_hf_config

    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported"):
        check_hf_config(_llama_config({"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 16,
                                       "long_factor": [1.0] * 16, "original_max_position_embeddings": 256}) , "t")
    with pytest.raises(ValueError, match="dynamic NTK-alpha"):
        from types import SimpleNamespace

        rope_spec_from_hf_config(SimpleNamespace(rope_parameters={"rope_type": "dynamic", "alpha": 2.0, "rope_theta": 1e4},
                                                 head_dim=32, max_position_embeddings=64))
    with pytest.raises(ValueError, match="llama3 needs"):
        RopeSpec(rotary_dim=32, base=1e4, max_position=64, rope_type="llama3", factor=8.0)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        RopeSpec(rotary_dim=31, base=1e4, max_position=64)


def test_old_plain_rope_entry_point_is_the_default_spec():
    import aligned_ops

    assert_bitwise_equal(aligned_ops.rotary_cos_sin_cache(64, 300, 1e6),
                         cos_sin_cache(RopeSpec(rotary_dim=64, base=1e6, max_position=300)))
    assert math.isclose(float(aligned_ops.rotary_cos_sin_cache(64, 300, 1e6)[299, 0]), math.cos(299.0), rel_tol=1e-6)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 5e5},
])
@pytest.mark.parametrize("top_level", [None, 256])
def test_raw_config_without_original_max_position_reads_as_transformers(rope, top_level):
    """A raw config.json (``--model``: a SimpleNamespace of its fields) without original_max_position_embeddings in
    its RoPE parameters: transformers fills it (a top-level field, Phi-3's layout, else max_position_embeddings), so
    the engine and the trainer run with it; the raw reader takes the same value (it refused the config before).
    Control: the config object with the value written explicitly gives the same table, another value does not."""
    from types import SimpleNamespace

    fields = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=1024, rope_scaling=dict(rope))
    if top_level is not None:
        fields["original_max_position_embeddings"] = top_level
    raw = rope_spec_from_hf_config(SimpleNamespace(**fields))
    filled = rope_spec_from_hf_config(_llama_config(rope))  # transformers' own standardisation
    if top_level is not None:
        from transformers import LlamaConfig

        filled = rope_spec_from_hf_config(LlamaConfig(
            hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
            rope_parameters=dict(rope), original_max_position_embeddings=top_level))
    assert raw.original_max_position == filled.original_max_position == (top_level or 1024)
    assert_bitwise_equal(cos_sin_cache(raw, 1536), cos_sin_cache(filled, 1536))
    other = rope_spec_from_hf_config(_llama_config({**rope, "original_max_position_embeddings": 128}))
    assert not bitwise_equal(cos_sin_cache(raw, 1536), cos_sin_cache(other, 1536))
