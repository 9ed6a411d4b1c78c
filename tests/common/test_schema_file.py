"""Every op schema lives in one file, csrc/torch/bindings.cpp (issue 9): no other source under csrc declares a
library (TORCH_LIBRARY / TORCH_LIBRARY_FRAGMENT) or defines a schema (`.def(`); backends only register
implementations (TORCH_LIBRARY_IMPL, no-tensor ops under CatchAll). The scanner is checked against planted
sources (negative controls), and every `aligned::` schema the loaded library holds is declared in that file."""

import pathlib
import re

import torch

import aligned_ops  # noqa: F401

ROOT = pathlib.Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
BINDINGS = CSRC / "torch" / "bindings.cpp"
SOURCE_SUFFIXES = {".cpp", ".h", ".cc", ".hpp", ".cu", ".cuh", ".hip"}

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_STRING = re.compile(r'"(?:\\.|[^"\\])*"')
# A schema definition or a defining library: `m.def(`, `lib->def(`, `TORCH_LIBRARY(`, `TORCH_LIBRARY_FRAGMENT(`.
_SCHEMA_SITE = re.compile(r"(?:\.|->)\s*def\s*\(|\bTORCH_LIBRARY(?:_FRAGMENT)?\s*\(")


def schema_sites(text: str) -> list[str]:
    """The schema-defining constructs of a C++ source, comments and string literals ignored."""
    code = _STRING.sub('""', _COMMENT.sub(" ", text))
    return [m.group(0) for m in _SCHEMA_SITE.finditer(code)]


def offending_files(root: pathlib.Path, allowed: pathlib.Path) -> dict[str, list[str]]:
    out = {}
    for path in sorted(root.rglob("*")):
        if path.suffix not in SOURCE_SUFFIXES or path == allowed or not path.is_file():
            continue
        sites = schema_sites(path.read_text(errors="replace"))
        if sites:
            out[str(path.relative_to(root))] = sites
    return out


def test_no_schema_outside_bindings():
    assert offending_files(CSRC, BINDINGS) == {}


def test_bindings_is_the_library():
    sites = schema_sites(BINDINGS.read_text())
    assert sites.count("TORCH_LIBRARY(") == 1 and len(sites) > 30


def test_scanner_negative_control(tmp_path):
    # Planted sources: each defining form is caught; the same words in comments or strings, and impl-only
    # registrations, are not.
    (tmp_path / "csrc" / "cpu").mkdir(parents=True)
    allowed = tmp_path / "csrc" / "torch_bindings.cpp"
    allowed.write_text('TORCH_LIBRARY(aligned, m) { m.def("a() -> str"); }\n')
    (tmp_path / "csrc" / "cpu" / "frag.cpp").write_text(
        'TORCH_LIBRARY_FRAGMENT(aligned, m) { m.def("_x() -> str", &x); }\n')
    (tmp_path / "csrc" / "cpu" / "ptr.h").write_text('void f(torch::Library* lib) { lib->def("_y() -> str"); }\n')
    (tmp_path / "csrc" / "cpu" / "spaced.cu").write_text('void g(torch::Library& m) { m . def ("_z() -> str"); }\n')
    (tmp_path / "csrc" / "cpu" / "clean.cpp").write_text(
        '// m.def("_w() -> str") was here; TORCH_LIBRARY(aligned, m) moved out\n'
        '/* TORCH_LIBRARY_FRAGMENT(aligned, m) */\n'
        'const char* s = "m.def(";\n'
        'TORCH_LIBRARY_IMPL(aligned, CatchAll, m) { m.impl("_w", &w); }\n'
        'TORCH_LIBRARY_IMPL(aligned, CPU, m) { m.impl("op", &op); }\n')
    found = offending_files(tmp_path / "csrc", allowed)
    assert sorted(found) == ["cpu/frag.cpp", "cpu/ptr.h", "cpu/spaced.cu"]
    assert found["cpu/frag.cpp"] == ["TORCH_LIBRARY_FRAGMENT(", ".def("]


def test_every_loaded_schema_is_declared_in_bindings():
    text = _COMMENT.sub(" ", BINDINGS.read_text())
    declared = set(re.findall(r'm\.def\(\s*"(\w+)\(', text.replace('"\n      "', "")))
    loaded = {s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("aligned::")}
    assert loaded, "no aligned:: schema loaded"
    assert loaded == declared, (sorted(loaded - declared), sorted(declared - loaded))
