"""The vLLM attention backend's plan/run split, with vLLM's platform mocked as CUDA (no GPU here).

On a GPU vLLM hands the metadata builder device tensors (query_start_loc, seq_lens, block_table_tensor) plus
host copies (query_start_loc_cpu, seq_lens_cpu_upper_bound, and the block table's CPU mirror that the plugin's
BlockTable.get_device_tensor hook tags onto the device view). The device tensors here are 'meta' tensors: any
host read of them raises, so a builder that planned from them could not pass. Asserted: the backend plans once
per step from the host copies, every layer's forward runs that plan (no planning per layer) with the same bits
as the per-call op, and the in-kernel error words are read once per step, outside the forward, with a clear
error naming the op family. Negative controls: without the tag the builder must fall back to a copy (seen), and
a raised device error surfaces.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm")

import vllm.platforms  # noqa: E402

import aligned_ops  # noqa: E402
from aligned_ops.integrations.vllm import attention as va  # noqa: E402
from aligned_ops.testing import assert_bitwise_equal  # noqa: E402

from test_plugin_gpu_platform import MockCudaPlatform  # noqa: E402  (same folder: the mocked CUDA platform)

HQ, HKV, D, BS, NB = 4, 2, 8, 4, 9


@pytest.fixture
def cuda_platform(monkeypatch):
    monkeypatch.setattr(vllm.platforms, "_current_platform", MockCudaPlatform())


def _builder():
    spec = types.SimpleNamespace(num_kv_heads=HKV, head_size=D, block_size=BS)
    cfg = types.SimpleNamespace(model_config=types.SimpleNamespace(get_num_attention_heads=lambda pc: HQ),
                                parallel_config=None, cache_config=types.SimpleNamespace(num_gpu_blocks=NB))
    return va.AlignedAttentionMetadataBuilder(spec, ["l0", "l1"], cfg, torch.device("cpu"))


def _step(seed, tag=True):
    g = torch.Generator().manual_seed(seed)
    table_cpu = torch.stack([torch.randperm(NB, generator=g)[:4] for _ in range(2)]).to(torch.int32)
    seq_lens_cpu = torch.tensor([11, 3], dtype=torch.int32)
    qsl_cpu = torch.tensor([0, 5, 6], dtype=torch.int32)  # a 5-token chunk after 6 cached; one decode token
    device_table = table_cpu.to("meta")
    if tag:
        owner = types.SimpleNamespace(block_table=types.SimpleNamespace(cpu=table_cpu))
        va.tag_host_block_table(owner, device_table, 2)
    m = types.SimpleNamespace(
        causal=True, num_actual_tokens=6, max_query_len=5, max_seq_len=11,
        query_start_loc=qsl_cpu.to("meta"), query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_lens_cpu.to("meta"), seq_lens_cpu_upper_bound=seq_lens_cpu,
        block_table_tensor=device_table, slot_mapping=torch.zeros(6, dtype=torch.int64))
    return m, (table_cpu, seq_lens_cpu, qsl_cpu)


def _impl():
    return va.AlignedAttentionImpl(HQ, D, D ** -0.5, HKV, None, None, "auto")


def test_plans_once_per_step_from_host_copies_and_layers_run_the_plan(cuda_platform, monkeypatch):
    plans, checks = [], []
    real_plan = aligned_ops.AttentionPlan.plan_paged

    def spy_plan(self, qsl, seq_lens, table, *a, **k):
        plans.append(tuple(t.device.type for t in (qsl, seq_lens, table)))
        return real_plan(self, qsl, seq_lens, table, *a, **k)

    monkeypatch.setattr(aligned_ops.AttentionPlan, "plan_paged", spy_plan)
    monkeypatch.setattr(aligned_ops, "check_device_errors", lambda device="cuda": checks.append(str(device)))
    per_call = torch.ops.aligned.paged_attention.default
    monkeypatch.setattr(torch.ops.aligned, "paged_attention", None, raising=False)  # the per-call op: not used
    builder, impl = _builder(), _impl()
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        m, (table, seq_lens, qsl) = _step(step)
        meta = builder.build(0, m)
        assert meta.plan is not None and len(plans) == step + 1 and checks == ["cpu"] * (step + 1)
        for layer in range(2):  # every layer reuses the step's plan
            kv = torch.randn(2, NB, BS, HKV * D, generator=g).transpose(0, 1)  # LHBNC: K, V outermost
            q = torch.randn(6, HQ, D, generator=g)
            out = torch.empty(6, HQ * D)
            impl.forward(None, q, None, None, kv, meta, out)
            k_cache, v_cache = va.split_kv_cache(kv, HKV, D)
            ref = per_call(q, k_cache, v_cache, table, seq_lens, qsl, D ** -0.5)
            assert_bitwise_equal(out, ref.view(6, HQ * D))
        assert len(plans) == step + 1  # no planning in the forward
    assert plans == [("cpu", "cpu", "cpu")] * 2


def test_untagged_block_table_falls_back_to_a_copy(cuda_platform, monkeypatch):
    # Negative control: the tag is what keeps the builder off the device tensor.
    seen = []
    monkeypatch.setattr(va, "_host", lambda t, what: seen.append(what) or torch.zeros(t.shape, dtype=t.dtype))
    m, _ = _step(0, tag=False)
    va.host_metadata(m)
    assert seen == ["the block table"]
    m, _ = _step(0, tag=True)
    seen.clear()
    va.host_metadata(m)
    assert seen == []


def test_device_errors_are_reported_once_per_step(cuda_platform, monkeypatch):
    def bad(device="cuda"):
        raise RuntimeError("aligned::token_logprobs: token_ids must lie in [0, vocab) -- reported by the in-kernel "
                           "check")

    builder = _builder()
    monkeypatch.setattr(aligned_ops, "check_device_errors", bad)
    with pytest.raises(RuntimeError, match=r"aligned_ops vLLM plugin: a GPU op of the previous engine step met a bad "
                                           r"input: aligned::token_logprobs"):
        builder.build(0, _step(0)[0])


def test_cpu_platform_reads_no_device_errors(monkeypatch):
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(vllm.platforms, "_current_platform", CpuPlatform())
    monkeypatch.setattr(aligned_ops, "check_device_errors", lambda *a, **k: pytest.fail("read on the CPU platform"))
    m, _ = _step(0)
    assert _builder().build(0, m).plan is not None


def test_the_plugin_tags_the_block_table_device_view(monkeypatch):
    from vllm.v1.worker.block_table import BlockTable

    from aligned_ops.integrations import vllm as plugin
    from aligned_ops.integrations.vllm import patches

    plugin.install()
    assert BlockTable.get_device_tensor is va._block_table_get_device_tensor
    assert "BlockTable" in patches.patched_classes()
    monkeypatch.setitem(patches._originals, (BlockTable, "get_device_tensor"), (None, lambda self, n: self.dev[:n]))
    owner = types.SimpleNamespace(block_table=types.SimpleNamespace(cpu=torch.arange(12, dtype=torch.int32).view(3, 4)),
                                  dev=torch.zeros(3, 4, dtype=torch.int32, device="meta"))
    view = va._block_table_get_device_tensor(owner, 2)
    assert_bitwise_equal(getattr(view, va._HOST_TABLE_ATTR), owner.block_table.cpu[:2])


@pytest.mark.emulated
def test_the_backend_runs_the_engine_profiles_attention():
    """The engine's linear profile decides the attention profile (profiles.Profile.attention_profile), once per
    layer on its first forward: under the mma profile the layer runs paged_attention(profile="mma") where the mma
    kernel runs (here: the emulated GPU), bit for bit the op called directly and not the fma bits (negative
    control); on the plain CPU it runs fma attention (the CPU has no mma attention); the fma profile: fma."""
    from aligned_ops import profiles

    d = 16  # the mma kernel's k-blocks of 16
    g = torch.Generator().manual_seed(4)
    table = torch.stack([torch.randperm(NB, generator=g)[:4] for _ in range(2)]).to(torch.int32)
    seq_lens, qsl = torch.tensor([11, 3], dtype=torch.int32), torch.tensor([0, 5, 6], dtype=torch.int32)
    kv = torch.randn(2, NB, BS, HKV * d, generator=g).to(torch.bfloat16).transpose(0, 1)
    q = torch.randn(6, HQ, d, generator=g).to(torch.bfloat16)
    k_cache, v_cache = va.split_kv_cache(kv, HKV, d)

    def layer_out(profile):
        impl = va.AlignedAttentionImpl(HQ, d, d ** -0.5, HKV, None, None, "auto")
        impl._aligned_profile = profile  # what record_architecture binds from the engine config
        plan = aligned_ops.AttentionPlan().plan_paged(qsl, seq_lens, table, HQ, HKV, d, NB, BS)
        meta = va.AlignedAttentionMetadata(6, 5, qsl, 11, seq_lens, table, torch.zeros(6, dtype=torch.int64),
                                           plan=plan)
        out = torch.empty(6, HQ * d, dtype=torch.bfloat16)
        impl.forward(None, q, None, None, kv, meta, out)
        return out.view(6, HQ, d)

    def direct(profile):
        return aligned_ops.paged_attention(q, k_cache, v_cache, table, seq_lens, qsl, d ** -0.5, profile=profile)

    with aligned_ops.emulate("sm_90"):
        mma_layer, fma_layer = layer_out(profiles.MMA), layer_out(profiles.FMA)
        mma_ref, fma_ref = direct("mma"), direct("fma")
    assert_bitwise_equal(mma_layer, mma_ref)
    assert_bitwise_equal(fma_layer, fma_ref)
    assert not torch.equal(mma_ref.view(torch.int16), fma_ref.view(torch.int16))  # the profiles' bits differ
    assert_bitwise_equal(layer_out(profiles.MMA), direct("fma"))  # plain CPU: fma attention under mma
