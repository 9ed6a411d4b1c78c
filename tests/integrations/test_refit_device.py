"""refit keeps the weights on the engine's device and dtype (never a detour through the CPU in-process).

A fake engine stands in for vLLM (``collective_rpc`` runs the function on a fake worker in this process);
its model's parameters live on the 'meta' device, a non-CPU device without data, so any ``.cpu()`` of a
trainer tensor or any placement of a weight on the CPU is visible (meta -> cpu raises; the received
tensors' device is checked). The real-engine refit is covered end to end in test_vllm_rl_features.py.
"""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.integrations import rollout  # noqa: E402
from aligned_ops.testing import assert_bitwise_equal  # noqa: E402


class InprocClient:  # the name vLLM's in-process engine core client has
    pass


class MPClient:
    pass


def _fake_llm(engine_dtype, param_device, core):
    received = []
    model = torch.nn.Linear(4, 3, device=param_device, dtype=engine_dtype)
    runner = SimpleNamespace(model=model, model_config=SimpleNamespace(dtype=engine_dtype))
    runner.get_model = lambda: model
    worker = SimpleNamespace(model_runner=runner,
                             reload_weights=lambda weights_iterator: received.extend(weights_iterator))
    transported = []

    def collective_rpc(fn, args=(), kwargs=None):
        transported.extend(args[0])
        return [fn(worker, *args, **(kwargs or {}))]

    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(model_config=SimpleNamespace(dtype=engine_dtype), engine_core=core,
                                   vllm_config=SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=False))),
        collective_rpc=collective_rpc)
    return llm, received, transported


def test_in_process_refit_never_touches_the_cpu(monkeypatch):
    monkeypatch.setattr(rollout.plugin, "is_installed", lambda: True)
    llm, received, transported = _fake_llm(torch.bfloat16, "meta", InprocClient())
    sd = {"weight": torch.empty(3, 4, device="meta", dtype=torch.float32),
          "bias": torch.empty(3, device="meta", dtype=torch.float32)}
    rollout.refit(llm, sd)  # a .cpu() of a meta tensor would raise here
    assert [k for k, _ in received] == ["weight", "bias"]
    assert all(v.device.type == "meta" and v.dtype == torch.bfloat16 for _, v in received)
    assert all(v.device.type == "meta" for _, v in transported)  # not even the transport went through the CPU


def test_refit_places_weights_on_the_engine_device_across_processes(monkeypatch):
    # An engine in other processes gets host bytes (collective_rpc serialises); its worker moves them to its
    # own device and dtype.
    monkeypatch.setattr(rollout.plugin, "is_installed", lambda: True)
    llm, received, transported = _fake_llm(torch.float16, "meta", MPClient())
    rollout.refit(llm, {"weight": torch.randn(3, 4), "bias": torch.randn(3)})
    assert all(v.device.type == "cpu" and v.dtype == torch.float16 for _, v in transported)
    assert all(v.device.type == "meta" and v.dtype == torch.float16 for _, v in received)


def test_cpu_engine_values_are_the_cast_weights(monkeypatch):
    monkeypatch.setattr(rollout.plugin, "is_installed", lambda: True)
    llm, received, _ = _fake_llm(torch.bfloat16, "cpu", InprocClient())
    w = torch.randn(3, 4)
    rollout.refit(llm, {"weight": w})
    assert_bitwise_equal(received[0][1], w.to(torch.bfloat16))


@pytest.mark.parametrize("bad", [torch.ones(3, 4, dtype=torch.int64), torch.ones(3, 4, dtype=torch.bool), [1.0]])
def test_non_float_weight_is_refused_before_anything_is_sent(monkeypatch, bad):
    # (it was cast to the engine dtype: an integer tensor became weights of 1.0 in the engine without a word)
    monkeypatch.setattr(rollout.plugin, "is_installed", lambda: True)
    llm, received, transported = _fake_llm(torch.bfloat16, "cpu", InprocClient())
    with pytest.raises(ValueError, match=r"refit: state_dict\['weight'\] is a .*floating-point.*nothing was sent"):
        rollout.refit(llm, {"bias": torch.randn(3), "weight": bad})
    assert received == [] and transported == []
    rollout.refit(llm, {"bias": torch.randn(3), "weight": torch.randn(3, 4, dtype=torch.float16)})  # control
    assert [k for k, _ in received] == ["bias", "weight"]


def test_dtensor_weight_is_refused_with_full_tensor_advice(monkeypatch):
    # An FSDP2 trainer's state_dict() holds DTensors: vLLM's loaders raised "got mixed torch.Tensor and DTensor"
    # half-way through a real engine's reload. Refused up front, naming the weight.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    monkeypatch.setattr(rollout.plugin, "is_installed", lambda: True)
    llm, received, transported = _fake_llm(torch.bfloat16, "cpu", InprocClient())
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        w = torch.randn(3, 4)
        dw = distribute_tensor(w, init_device_mesh("cpu", (1,)), [Shard(0)])
        with pytest.raises(ValueError, match=r"refit: state_dict\['weight'\] is a DTensor.*full_tensor\(\)"):
            rollout.refit(llm, {"weight": dw})
        assert received == [] and transported == []
        rollout.refit(llm, {"weight": dw.full_tensor()})  # control: the gathered tensor is refitted as it is
        assert_bitwise_equal(received[0][1], w.to(torch.bfloat16))
    finally:
        if own:
            dist.destroy_process_group()
