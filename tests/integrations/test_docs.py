"""The copy-pasteable snippets of the README (use with vLLM / refit / use in your trainer) run as written, in
order, in one namespace."""

import os
import re

import pytest
import torch

pytest.importorskip("vllm")

from aligned_ops.testing.tiny_model import build_tiny_qwen2  # noqa: E402
from aligned_ops.testing import bitwise_equal

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_doc_snippets_run(tmp_path):
    with open(DOC) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) == 3, "expected the vLLM, refit and trainer snippets"
    ns = {"MODEL_DIR": build_tiny_qwen2(tmp_path / "doc_model", torch.bfloat16, seed=5)}
    for code in blocks:
        exec(compile(code, DOC, "exec"), ns)  # noqa: S102
    assert bitwise_equal(ns["trainer_lp"], torch.tensor(ns["again"].logprobs))
