"""The docs' op tables name real ops with their real arguments (the README snippets run in test_docs.py, which
needs vLLM; this needs only the extension)."""

import os
import re

import torch

# the op tables: every `aligned.OP(arg, ...)` the docs write is a registered op whose schema takes those arguments,
# in that order, with those defaults (probe s47: README wrote token_logprobs(logits, ids, ...) and
# moe_experts(x, w, ids, ...) — keyword calls with the documented names failed — and aligned.moe_layer, no op)
OP_DOCS = ("README.md", "DESIGN.md", "docs/exact_linear.md", "docs/integrations.md", "docs/parallelism.md")
OP_CALL = re.compile(r"`aligned\.([a-z_0-9]+)\(([^`]*)\)`")


def documented_op_calls(text: str):
    for name, args in OP_CALL.findall(text):
        parts = [a.strip() for a in args.split(",") if a.strip() and a.strip() != "..."]
        yield name, [(p.split("=")[0].strip(), p.split("=", 1)[1].strip() if "=" in p else None) for p in parts]


def schema_mismatches(name: str, doc_args) -> list[str]:
    import aligned_ops

    aligned_ops.load()
    op = getattr(torch.ops.aligned, name, None)
    if op is None:
        return [f"aligned.{name}: no such op"]
    schema = {a.name: a for a in op.default._schema.arguments}
    names = [a.name for a in op.default._schema.arguments]
    out = []
    if [n for n, _ in doc_args] != names[:len(doc_args)]:
        out.append(f"aligned.{name}: documented arguments {[n for n, _ in doc_args]}, schema {names}")
    for arg, default in doc_args:
        if default is not None and arg in schema and str(schema[arg].default_value) != default.strip('"'):
            out.append(f"aligned.{name}: {arg}={default} documented, schema default {schema[arg].default_value}")
    return out


def test_documented_op_signatures_are_the_schemas():
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    calls = []
    for doc in OP_DOCS:
        with open(os.path.join(root, doc)) as f:
            calls += list(documented_op_calls(f.read()))
    assert len(calls) >= 15, calls  # the README's two op tables
    bad = [m for name, args in calls for m in schema_mismatches(name, args)]
    assert bad == []


def test_documented_op_signature_check_can_fail():
    # negative controls: the old README rows
    assert schema_mismatches("token_logprobs", [("logits", None), ("ids", None), ("temperature", None)])
    assert schema_mismatches("moe_layer", [("x", None)])
    assert schema_mismatches("moe_routing", [("router_logits", None), ("top_k", None), ("scoring", '"sigmoid"')])
    assert not schema_mismatches("token_logprobs", [("logits", None), ("token_ids", None), ("temperature", None)])
