"""The bits corpus (tests/golden/op_bits.json, written by make_op_bits.py): every aligned op's outputs and
gradients on fixed inputs, under every CPU ISA level of this machine and the emulated sm_90 and gfx942, hashed
and compared with the recorded sha256, entry by entry (each level's entries computed by that level's shared
worker process, tests/_isa_matrix.py). A refactor that is meant to change nothing (the C++ glue
of issue 20) must pass this unchanged; an intended change of bits regenerates the corpus
(`python tests/golden/make_op_bits.py --write`) and says why in its commit message.

Negative controls: a planted flipped bit in one output is reported, by name, and nothing else; the corpus is
not vacuous (it reaches every op schema but a listed few, and the emulated runs really launch GPU kernels)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import pytest
import torch

import aligned_ops  # noqa: F401

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("make_op_bits", HERE / "make_op_bits.py")
make_op_bits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_op_bits)

# Schemas the corpus does not hash, and why.
NOT_HASHED = {
    "attention_plan": "writes the plan's internal format, not an op result (its runs are hashed)",
    "attention_plan_size": "the plan's sizes, not an op result",
    "_cpu_isa": "control op", "_exact_unit": "control op", "_cpu_mma_unit": "control op", "_emulate_enter": "control op",
    # the CPU amx_bf16 unit's packed form of linear_mma (same bits as linear_mma in place: tests/ops/
    # test_linear_mma_amx.py). The corpus has no amx configuration: its levels are those every x86 machine of this
    # kind runs (generic, avx2, avx512), and the AMX unit's bits are those of one AMX CPU model
    "linear_mma_pack_weight": "the amx unit's packing (no amx configuration in the corpus)",
    "linear_mma_packed": "the amx unit's packed linear_mma (no amx configuration in the corpus)",
    "_emulate_exit": "control op", "_emulated_archs": "control op", "_emulate_selftest": "runtime self-test",
    # the mma attention's scalar references (test hooks, emulation only): tests/emulated/test_emulated_attention_mma.py
    # holds the kernels to them bit for bit; the corpus does not record mma attention bits yet
    "_attention_mma_reference": "test hook (emulated mma attention reference)",
    "_attention_mma_backward_reference": "test hook (emulated mma attention backward reference)",
}


@pytest.fixture(scope="module")
def corpus():
    return json.loads(make_op_bits.CORPUS.read_text())


# Each CPU level's entries are computed by that level's shared worker process (tests/_isa_matrix.py: one
# process per level for the whole run, which also runs the other modules' ISA families) instead of three more
# processes of our own; the emulated archs run in the generic level's worker, as in make_op_bits.compute_all. The
# script is make_op_bits' own ``--run`` (the same pipeline as ``--check``), its JSON written to the worker's file.
_ISA_SCRIPT = f"""
import contextlib, importlib.util, sys
spec = importlib.util.spec_from_file_location("make_op_bits", {str(HERE / "make_op_bits.py")!r})
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
with open(sys.argv[1], "w") as f, contextlib.redirect_stdout(f):
    rc = m.main(["--run", ",".join(m.configs_of(m._level_of_this_process()))])
assert rc == 0, rc
"""
ISA_FAMILIES = {"golden_op_bits": _ISA_SCRIPT}


@pytest.fixture(scope="module")
def recomputed(isa_matrix):
    """(records per configuration, the aligned ops called), as make_op_bits.compute_all() returns them."""
    result, called = {}, set()
    for level, res in isa_matrix.run_levels(make_op_bits.available_levels(), "golden_op_bits").items():
        got = json.loads(res.path.read_text())
        assert set(got["records"]) == set(make_op_bits.configs_of(level)), (
            f"the {level} worker computed configurations {sorted(got['records'])}, "
            f"not {make_op_bits.configs_of(level)}")
        result.update(got["records"])
        called.update(got["called"])
    return result, sorted(called)


@pytest.mark.slow
def test_every_entry_has_its_recorded_bits(corpus, recomputed):
    result, _ = recomputed
    assert set(make_op_bits.available_levels()) <= set(corpus["configs"])
    assert set(result) == set(make_op_bits.available_levels()) | set(make_op_bits.EMULATED)
    report = {c: make_op_bits.differences(corpus, c, recs) for c, recs in sorted(result.items())}
    assert all(not v for v in report.values()), "entries whose bits changed: " + json.dumps(
        {c: v for c, v in report.items() if v}, indent=1)


@pytest.mark.slow
def test_corpus_reaches_every_op(corpus, recomputed):
    _, called = recomputed
    schemas = {s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("aligned::")}
    missing = schemas - set(called) - set(NOT_HASHED)
    assert not missing, f"ops the corpus never calls: {sorted(missing)}"
    # every family is in it, every dtype, and both emulated archs launched GPU kernels for most entries
    families = {e.split("/", 1)[0] for e in corpus["entries"]}
    for fam in ("rms_norm", "log_softmax", "fused_token_logprobs", "linear", "linear_exact_tp", "attention_varlen",
                "paged_attention_planned", "moe_experts", "exp_f32"):
        assert fam in families, fam
    for tag in ("f32", "bf16", "f16"):
        assert sum(f"/{tag}/" in e for e in corpus["entries"]) > 100, tag
    launched = corpus["gpu_launched"]
    assert len(launched) > len(corpus["entries"]) // 2
    assert all(set(v) == set(make_op_bits.EMULATED) for v in launched.values())


def _clean_reference(corpus):
    """{entry: sha256} of entries every configuration agrees on (the in-process control's level may be any)."""
    return {e: h for e, h in corpus["entries"].items() if isinstance(h, str)}


@pytest.mark.parametrize("config", ["cpu", "sm_90"])
def test_planted_flipped_bit_is_caught(corpus, monkeypatch, config):
    # The same pipeline as the corpus (cases -> hash -> differences), on a few cases, in this process.
    only = "rms_norm/bf16/5x64"
    agreed = _clean_reference(corpus)
    level = torch.ops.aligned._cpu_isa()
    cfg = config if config != "cpu" else (level if level in corpus["configs"] else "generic")
    clean = make_op_bits.run_config(config if config != "cpu" else level, only)
    assert clean and all(e in agreed for e in clean)
    fake_corpus = {"configs": corpus["configs"], "entries": agreed, "gpu_launched": corpus["gpu_launched"]}
    assert make_op_bits.differences(fake_corpus, cfg, clean, only) == []
    target = sorted(clean)[1]
    monkeypatch.setenv(make_op_bits.PLANT_ENV, target)
    planted = make_op_bits.run_config(config if config != "cpu" else level, only)
    assert make_op_bits.differences(fake_corpus, cfg, planted, only) == [target]


def test_flip_changes_exactly_one_bit():
    for t in (torch.tensor([1.5, -2.0], dtype=torch.bfloat16), torch.tensor([3, 4]), torch.tensor([True, False])):
        f = make_op_bits._flip_one_bit(t)
        assert make_op_bits.digest(f) != make_op_bits.digest(t)
        from aligned_ops.testing import bits
        x = bits(f).view(-1)[1:] == bits(t).view(-1)[1:]
        assert bool(x.all())
