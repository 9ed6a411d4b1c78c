"""Seeing that the vLLM plugin is on: the VLLM_-prefixed alias of its switch (vLLM's Ray executor forwards only
VLLM_* variables), and the one line an engine logs at configuration (versions, profile, what was replaced).
``vllm_status(llm)`` on a real engine: test_trl.py (aligned engine) and test_vllm_e2e.py (stock engine)."""

import logging

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.integrations.vllm import plugin  # noqa: E402


@pytest.mark.parametrize("name", ["ALIGNED_OPS_VLLM", "VLLM_ALIGNED_OPS"])
def test_switch_and_its_vllm_alias(monkeypatch, name):
    for var in (plugin.ENV_VAR, *plugin.ENV_ALIASES):
        monkeypatch.delenv(var, raising=False)
    assert not plugin.enabled_by_env()  # control: nothing set, off
    monkeypatch.setenv(name, "1")
    assert plugin.enabled_by_env()
    monkeypatch.setenv(name, "0")
    assert not plugin.enabled_by_env()
    assert name == plugin.ENV_VAR or name.startswith("VLLM_")


@pytest.mark.slow  # vLLM's engine configuration, twice
def test_engine_config_logs_one_line_saying_what_is_active(tiny_checkpoint, monkeypatch):
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    import aligned_ops

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    plugin.install()
    path = tiny_checkpoint("qwen2", torch.bfloat16, seed=0)
    lines = []

    class Catch(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    def configure():
        return EngineArgs(model=path, dtype="bfloat16", max_model_len=256,
                          additional_config={"aligned_ops_linear": "exact"}).create_engine_config()

    configure()  # vLLM configures its logging (dictConfig resets the handlers of the "vllm" loggers) on first use
    logger = logging.getLogger("vllm.aligned_ops")
    # what earlier tests of the same process may have done to the logging tree (a level on "vllm", a disabled
    # logger) is not this test's subject: the line is emitted at INFO on this logger
    # (through setLevel / logging.disable: they also clear the loggers' isEnabledFor cache, which a plain
    # attribute write leaves stale; restored after)
    old = logger.level, logger.disabled, logging.root.manager.disable
    logger.disabled = False
    logger.setLevel(logging.INFO)
    logging.disable(logging.NOTSET)
    handler = Catch()
    logger.addHandler(handler)
    try:
        configure()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old[0])
        logger.disabled = old[1]
        logging.disable(old[2])
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("aligned_ops vLLM plugin active: aligned_ops " + aligned_ops.__version__)
    assert f"vLLM {vllm.__version__}" in line and f"built for torch {aligned_ops.BUILT_WITH_TORCH}" in line
    assert "linear profile 'exact'" in line
    for replaced in ("Qwen2DecoderLayer", "RMSNorm", "UnquantizedLinearMethod", "AutoWeightsLoader"):
        assert replaced in line, (replaced, line)
    assert "\n" not in line
    # the line reaches vLLM's own handler (vLLM configures one on "vllm" only)
    assert logger.parent is logging.getLogger("vllm") and logger.propagate
