"""The vLLM plugin on CUDA / ROCm, with vLLM's platform mocked (no GPU here).

vLLM chooses every attention layer's backend through ``current_platform.get_attn_backend_cls`` (called by
``vllm.v1.attention.selector._cached_get_attn_backend``). The mocked platforms below answer like stock vLLM
does on a GPU: FlashAttention (CUDA) or ROCM_ATTN (ROCm). With the plugin installed the selection must give
the aligned backend, or raise a clear error at start-up: never the stock backend. The negative control is the
same selection without the plugin (it returns the stock backend, so these tests can fail).
"""

import warnings

import pytest
import torch

pytest.importorskip("vllm")

import vllm.platforms  # noqa: E402
from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig, _cached_get_attn_backend  # noqa: E402

from aligned_ops.integrations import vllm as vllm_plugin  # noqa: E402
from aligned_ops.integrations.vllm import gpu_platform as vgpu  # noqa: E402
from aligned_ops.integrations.vllm.attention import AlignedAttentionBackend  # noqa: E402

# Every vLLM module the plugin's install imports is imported now, on the real (CPU) platform: imported first under
# a mocked GPU platform, the hooked layer modules would initialise CUDA, and modules that bind
# `from vllm.platforms import current_platform` at import would keep the mock for the rest of the session (the
# module then depended on earlier tests having imported them, and broke later ones).
if not vllm_plugin.is_installed():
    vllm_plugin.install()
    vllm_plugin.uninstall()

FLASH_ATTN_PATH = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
ROCM_ATTN_PATH = "vllm.v1.attention.backends.rocm_attn.RocmAttentionBackend"


class _MockGpuPlatform(Platform):
    stock_path = ""
    stock_calls = 0

    @classmethod
    def get_device_capability(cls, device_id: int = 0):
        return cls.capability

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        cls.stock_calls += 1  # the stock selector: what vLLM would pick without the plugin
        return cls.stock_path


class MockCudaPlatform(_MockGpuPlatform):
    _enum = PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "cuda"
    dispatch_key = "CUDA"
    capability = DeviceCapability(9, 0)
    stock_path = FLASH_ATTN_PATH


class MockRocmPlatform(_MockGpuPlatform):
    _enum = PlatformEnum.ROCM
    device_name = "rocm"
    device_type = "cuda"
    dispatch_key = "CUDA"
    capability = DeviceCapability(9, 4)
    stock_path = ROCM_ATTN_PATH


def _layer(**kw):
    args = dict(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None)
    args.update(kw)
    return AttentionSelectorConfig(**args)


def _select(backend=None, **kw):
    """vLLM's own (cached) selection path, as an attention layer calls it."""
    _cached_get_attn_backend.cache_clear()
    return _cached_get_attn_backend(backend, _layer(**kw))


@pytest.fixture(params=[MockCudaPlatform, MockRocmPlatform], ids=["cuda", "rocm"])
def gpu_platform(request, monkeypatch):
    """The plugin installed on a mocked GPU platform; restored (CPU, installed or not) afterwards."""
    pcls = request.param
    was_installed = vllm_plugin.is_installed()
    vllm_plugin.uninstall()
    platform = pcls()
    pcls.stock_calls = 0
    monkeypatch.setattr(vllm.platforms, "_current_platform", platform)
    yield platform
    vllm_plugin.uninstall()
    monkeypatch.undo()
    _cached_get_attn_backend.cache_clear()
    if was_installed:
        vllm_plugin.install()


def _install_quiet():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vllm_plugin.install()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_negative_control_stock_selection_is_the_stock_backend(gpu_platform):
    assert vllm.platforms.current_platform is gpu_platform
    assert gpu_platform.get_attn_backend_cls(None, _layer()) == type(gpu_platform).stock_path
    assert type(gpu_platform).stock_calls == 1


def test_selects_the_aligned_backend_when_gpu_kernels_exist(gpu_platform, monkeypatch):
    monkeypatch.setattr(vgpu, "missing_gpu_kernels", lambda *a, **k: [])
    messages = _install_quiet()
    # The start-up warning names what was verified and how.
    assert any("NOT been verified on a real GPU" in m and "emulation" in m and "CPU backend end to end" in m
               and ".ci/gpu_check.sh" in m for m in messages), messages
    assert _select() is AlignedAttentionBackend
    assert _select(AttentionBackendEnum.CUSTOM) is AlignedAttentionBackend
    assert _select(dtype=torch.float32, head_size=128) is AlignedAttentionBackend
    assert AlignedAttentionBackend.get_name() == "CUSTOM"
    assert type(gpu_platform).stock_calls == 0  # the stock selector was never consulted
    # uninstall gives the stock selector back
    vllm_plugin.uninstall()
    assert gpu_platform.get_attn_backend_cls(None, _layer()) == type(gpu_platform).stock_path


@pytest.mark.parametrize("backend", [AttentionBackendEnum.FLASH_ATTN, AttentionBackendEnum.TRITON_ATTN,
                                     AttentionBackendEnum.FLASHINFER, AttentionBackendEnum.ROCM_ATTN])
def test_refuses_a_requested_stock_backend(gpu_platform, monkeypatch, backend):
    monkeypatch.setattr(vgpu, "missing_gpu_kernels", lambda *a, **k: [])
    _install_quiet()
    with pytest.raises(ValueError, match=f"refuses this attention layer.*attention_backend={backend.name} is not "
                                         "batch-invariant"):
        _select(backend)
    assert type(gpu_platform).stock_calls == 0


@pytest.mark.parametrize("layer_kw, reason", [(dict(use_mla=True), "MLA not supported"),
                                               (dict(has_sink=True), "attention sinks not supported"),
                                               (dict(attn_type="encoder_only"), "attention type encoder_only")])
def test_refuses_layers_the_aligned_backend_cannot_run(gpu_platform, monkeypatch, layer_kw, reason):
    monkeypatch.setattr(vgpu, "missing_gpu_kernels", lambda *a, **k: [])
    _install_quiet()
    with pytest.raises(ValueError, match=f"never falls back to a stock backend.*{reason}"):
        _select(**layer_kw)
    assert type(gpu_platform).stock_calls == 0


def test_refuses_when_this_build_has_no_gpu_kernels(gpu_platform):
    # This CPU build registers no CUDA kernels: the real check finds them missing and the selection refuses.
    missing = vllm_plugin.missing_gpu_kernels()
    assert "aligned::paged_attention" in missing and "aligned::rms_norm" in missing
    _install_quiet()
    with pytest.raises(ValueError, match=r"no (cuda|rocm) kernels for aligned::rms_norm.*aligned::paged_attention"):
        _select()
    assert type(gpu_platform).stock_calls == 0


def test_missing_gpu_kernels_sees_registered_kernels():
    # Positive control of the kernel probe: the CPU kernels exist under the CPU key.
    assert vllm_plugin.missing_gpu_kernels("CPU") == []
    assert vllm_plugin.missing_gpu_kernels("CUDA", ops=("rms_norm",)) == ["aligned::rms_norm"]


class _Cfg:
    class attention_config:
        backend = None
        backend_per_kind = {}


def test_start_up_reasons_on_gpu(monkeypatch):
    cuda = MockCudaPlatform()
    cfg = _Cfg()
    assert any("no cuda kernels for aligned::" in r for r in vllm_plugin.gpu_platform_reasons(cfg, cuda))
    monkeypatch.setattr(vgpu, "missing_gpu_kernels", lambda *a, **k: [])
    assert vllm_plugin.gpu_platform_reasons(cfg, cuda) == []
    monkeypatch.setattr(cfg.attention_config, "backend", AttentionBackendEnum.FLASH_ATTN)
    monkeypatch.setattr(cfg.attention_config, "backend_per_kind", {"sliding_window": AttentionBackendEnum.FLASHINFER})
    reasons = vllm_plugin.gpu_platform_reasons(cfg, cuda)
    assert any("attention_backend=FLASH_ATTN" in r for r in reasons)
    assert any("attention_backend=FLASHINFER" in r and "backend_per_kind['sliding_window']" in r for r in reasons)
    monkeypatch.setattr(cfg.attention_config, "backend", AttentionBackendEnum.CUSTOM)
    monkeypatch.setattr(cfg.attention_config, "backend_per_kind", {})
    assert vllm_plugin.gpu_platform_reasons(cfg, cuda) == []


def test_cpu_path_unchanged():
    from vllm.platforms import current_platform

    assert current_platform.is_cpu()
    assert vllm_plugin.gpu_platform_reasons(_Cfg(), current_platform) == []
    was = vllm_plugin.is_installed()
    vllm_plugin.install()
    try:
        assert not vgpu._platform_originals  # the CPU selector is not replaced
        assert AttentionBackendEnum.CPU_ATTN.get_path() == \
            "aligned_ops.integrations.vllm.attention.AlignedAttentionBackend"
    finally:
        if not was:
            vllm_plugin.uninstall()
