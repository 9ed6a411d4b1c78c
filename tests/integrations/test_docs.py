"""The copy-pasteable snippets of the README (use with vLLM / refit / use in your trainer) run as written, in
order, in one namespace. The README leaves its in-process engine running (as a user's script would); the test
shuts it down, so its process group does not outlive the test (tests/conftest.py checks that)."""

import os
import re

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.testing.tiny_model import build_tiny_qwen2  # noqa: E402
from aligned_ops.testing import bitwise_equal

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


pytestmark = pytest.mark.slow  # a real vLLM engine


def test_doc_snippets_run(tmp_path):
    with open(DOC) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) == 3, "expected the vLLM, refit and trainer snippets"
    ns = {"MODEL_DIR": build_tiny_qwen2(tmp_path / "doc_model", torch.bfloat16, seed=5)}
    try:
        for code in blocks:
            exec(compile(code, DOC, "exec"), ns)  # noqa: S102
        assert bitwise_equal(ns["trainer_lp"], torch.tensor(ns["again"].logprobs))
    finally:
        if "llm" in ns:
            from aligned_ops.integrations.rollout import shutdown

            shutdown(ns["llm"])
