"""Source structure of the Python package (issue 20), each rule with a negative control (a synthetic violation
the checker finds):

- no profile-name string comparison outside ``aligned_ops/profiles.py``: code asks the profile object, reads a
  capability or compares objects (``profile is FMA``);
- the supported-architecture list is defined once: an architecture name appears as a string only in its own
  ``aligned_ops/models/<arch>.py`` (the registry list in ``models/__init__.py`` holds objects), and what those
  files define is exactly what the trainer patch, the plugin and ``model_spec`` support;
- the CPU glue forks only through ``ieee_parallel_for`` (csrc/cpu/ieee_env.h): no bare ``at::parallel_for`` (nor
  ``parallel_reduce``, ``at::launch``, an OpenMP pragma) in csrc/torch/backends or csrc/cpu outside that header,
  since a worker thread keeps its own MXCSR and a caller's FTZ / DAZ would reach only some rows;
- (no import cycle: tests/test_import_graph.py.)
"""

from __future__ import annotations

import ast
import os
import re

import aligned_ops
from aligned_ops import profiles
from aligned_ops.models import ARCHITECTURES

PKG_DIR = os.path.dirname(os.path.abspath(aligned_ops.__file__))
ARCH_NAME = re.compile(r"^[A-Z][A-Za-z0-9]*ForCausalLM$")


def _sources(root=PKG_DIR):
    for dirpath, _, files in os.walk(root):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path) as fh:
                    yield os.path.relpath(path, root), fh.read()


def _docstrings(tree) -> set[int]:
    """ids of the string constants that are docstrings (module, class, function)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def _str_constants(node) -> list[str]:
    """The string constants an operand is or holds (a literal tuple / list / set / dict's keys)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for e in node.elts for v in _str_constants(e)]
    if isinstance(node, ast.Dict):
        return [v for k in node.keys if k is not None for v in _str_constants(k)]
    return []


def profile_name_comparisons(source: str, names) -> list[str]:
    """``lineno: text`` of every comparison (==, !=, in, not in, is, is not) with a string literal that is a
    profile name, or a literal collection holding one; also ``match`` cases on such literals."""
    tree = ast.parse(source)
    lines = source.splitlines()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(v in names for o in operands for v in _str_constants(o)):
                found.append(f"{node.lineno}: {lines[node.lineno - 1].strip()}")
        elif isinstance(node, ast.MatchValue) and any(v in names for v in _str_constants(node.value)):
            found.append(f"{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def architecture_literals(source: str) -> list[str]:
    """Every non-docstring string constant that is an architecture name (``...ForCausalLM``)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs and ARCH_NAME.match(n.value)]


# ---- profiles --------------------------------------------------------------------------------------------------


def test_no_profile_name_comparison_outside_the_profiles_module():
    names = set(profiles.REGISTRY)
    assert names >= {"fma", "exact"}
    offenders = {rel: hits for rel, src in _sources() if rel != "profiles.py"
                 for hits in [profile_name_comparisons(src, names)] if hits}
    assert offenders == {}
    # the profiles module itself is where names live (it is scanned by the same checker: it compares none either —
    # names are dictionary keys there)
    with open(os.path.join(PKG_DIR, "profiles.py")) as f:
        assert profile_name_comparisons(f.read(), names) == []


def test_profile_comparison_checker_negative_control():
    names = set(profiles.REGISTRY)
    planted = (
        "def f(p, q, r):\n"
        "    if p == 'exact':\n"              # the comparison this rule removed (7 files had one)
        "        return 1\n"
        "    if q in ('fma', 'exact'):\n"     # membership in a literal tuple of names
        "        return 2\n"
        "    if 'fma' != r.name:\n"           # the literal on the left
        "        return 3\n"
        "    match r:\n"
        "        case 'exact':\n"
        "            return 4\n"
        "    return p == 'tree'\n"            # not a profile name: fine
    )
    hits = profile_name_comparisons(planted, names)
    assert [h.split(":")[0] for h in hits] == ["2", "4", "6", "9"], hits
    # what the package does instead passes: object identity, a capability, the registry
    clean = ("def f(p, profiles):\n    return p is profiles.FMA or p.capabilities.fused_lm_head or "
             "p.name in profiles.REGISTRY\n")
    assert profile_name_comparisons(clean, names) == []


# ---- architectures ---------------------------------------------------------------------------------------------


def test_the_architecture_list_is_defined_once():
    by_file = {rel: lits for rel, src in _sources() for lits in [architecture_literals(src)] if lits}
    arch_files = {f"models/{m}.py" for m in ("qwen2", "qwen3", "llama", "qwen2_moe", "qwen3_moe", "deepseek_v3",
                                                   "glm4_moe")}
    # every architecture name is written in exactly one place: its own module, once
    assert set(by_file) == arch_files, by_file
    assert all(len(v) == 1 for v in by_file.values()), by_file
    assert {v[0] for v in by_file.values()} == set(ARCHITECTURES)
    # ... and everything that decides "supported" reads that registry
    from aligned_ops import model_spec
    from aligned_ops.integrations import MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES

    assert set(model_spec.RULES) == set(ARCHITECTURES) == set(SUPPORTED_ARCHITECTURES + MOE_ARCHITECTURES)
    assert set(MOE_ARCHITECTURES) == {n for n, a in ARCHITECTURES.items() if a.moe}


def test_architecture_literal_checker_negative_control():
    planted = ('"""Supports Qwen2ForCausalLM (a docstring mention is fine)."""\n'
               'SUPPORTED = ("Qwen2ForCausalLM", "LlamaForCausalLM")\n'
               'def ok(a):\n    return a == "Qwen3MoeForCausalLM"\n'
               'SUFFIX = "ForCausalLM"\n')
    assert architecture_literals(planted) == ["Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM"]
    # a second module naming an architecture would make the scan above find two files
    by_file = {rel: architecture_literals(src) for rel, src in [("integrations/extra.py", planted),
                                                                *_sources()]}
    assert {rel for rel, v in by_file.items() if "Qwen2ForCausalLM" in v} == {"integrations/extra.py",
                                                                             "models/qwen2.py"}


# ---- threads of the CPU ops ------------------------------------------------------------------------------------

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORK_HELPER = "csrc/cpu/ieee_env.h"
_CPP_COMMENT_OR_STRING = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"', re.S)
_BARE_FORK = re.compile(r"\b(?:parallel_for|parallel_reduce|invoke_parallel)\b|\bat::launch\b|#\s*pragma\s+omp\b")


def bare_forks(source: str) -> list[str]:
    """'line: text' of every fork in C++ source that is not ieee_parallel_for (comments and strings ignored)."""
    code = _CPP_COMMENT_OR_STRING.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), source)
    return [f"{code.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in _BARE_FORK.finditer(code)]


def test_cpu_glue_forks_only_through_ieee_parallel_for():
    offenders, seen = {}, 0
    for sub in ("csrc/torch/backends", "csrc/cpu"):
        for dirpath, _, files in os.walk(os.path.join(REPO_DIR, sub)):
            for f in sorted(files):
                if f.endswith((".h", ".cpp", ".cc", ".hpp", ".inc")):
                    rel = os.path.relpath(os.path.join(dirpath, f), REPO_DIR)
                    with open(os.path.join(REPO_DIR, rel)) as fh:
                        src = fh.read()
                    seen += "ieee_parallel_for(" in src
                    if rel != FORK_HELPER and (hits := bare_forks(src)):
                        offenders[rel] = hits
    assert offenders == {}
    assert seen >= 6  # the scan reached the backends (dense, attention, moe, mma, exact) and gemm_tiles.h
    with open(os.path.join(REPO_DIR, FORK_HELPER)) as fh:  # the helper is the one bare at::parallel_for
        assert len(bare_forks(fh.read())) == 1


def test_bare_fork_checker_negative_control():
    planted = (
        "void Cpu::rms_norm(const Call&, const RmsNormParams& p) {\n"
        "  at::parallel_for(0, p.rows, 1, [&](int64_t b, int64_t e) { k.rms_norm(p, b, e); });\n"  # the old form
        "  cpu::ieee_parallel_for(0, p.rows, 1, f);  // at::parallel_for in a comment: fine\n"
        "  using at::parallel_for;\n"
        "  const char* s = \"at::parallel_for\";\n"  # in a string: fine
        "  /* at::parallel_for(0, 1, 1, f); */\n"
        "#pragma omp parallel for\n"
        "  at::parallel_reduce(0, n, 1, 0.f, f, g);\n"
        "  ieee_parallel_for(0, n, 1, f);\n"
        "}\n"
    )
    assert bare_forks(planted) == ["2: parallel_for", "4: parallel_for", "7: #pragma omp", "8: parallel_reduce"]
