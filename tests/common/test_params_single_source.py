"""One params struct per op family, shared by every backend (issue 9 item 1): the dense, logits, linear (`fma`)
and moe families' params structs are each defined exactly once, in csrc/common/params_*.h (torch-free), and an
extension of a shared base (the routing ops' MoeTopkParams) repeats none of its fields; no
backend header or glue file defines its own copy; no glue body or backend run file (csrc/torch/glue/,
csrc/torch/backends/) fills one field by field (they call csrc/torch/make_params.h's make_*_params); and every CPU
kernel-table entry of these families takes the struct, not a positional argument list. A source scan, checked
against planted sources (negative controls)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
SOURCE_SUFFIXES = {".cpp", ".h", ".cc", ".hpp", ".cu", ".cuh", ".hip"}

# The families this rule covers (attention and the exact linear have their own params headers and owners).
FAMILY_PARAMS = {
    "RmsNormParams", "RmsNormBackwardParams", "SiluMulParams", "RotaryParams", "ElementwiseParams",
    "LogitsParams", "GemmParams", "ColumnSumParams", "MoeRoutingParams", "MoeCombineParams", "MoeExpertsParams",
    "MoeGroupedRoutingParams", "MoeTopkParams",
    "ExactGemmParams",
}
# The CPU kernel tables of these families (csrc/cpu): every function-pointer entry takes a params struct.
TABLE_HEADERS = ("cpu/cpu_kernels.h", "cpu/dense_split_kernels.h", "cpu/moe_kernels.h")
TABLE_STRUCTS = ("KernelTable", "DenseSplitKernels", "MoeKernels")
# DenseSplitKernels' fold steps take the parts' partial results, not an op's tensors.
TABLE_EXEMPT = {"merge_max", "lane_exp_sums", "pair_of_lanes"}

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_STRING = re.compile(r'"(?:\\.|[^"\\])*"')
_STRUCT_DEF = re.compile(r"\bstruct\s+(\w+Params)\s*(?::[^{;]*)?\{")
# A glue file building a family struct itself: `RmsNormParams p{}` / `gpu::GemmParams p;` / `GemmParams p = {`.
_LOCAL_STRUCT = re.compile(r"\b(?:\w+::)*(\w+Params)\s+\w+\s*(?:\{|;|=\s*\{)")
_ENTRY = re.compile(r"\(\s*\*\s*(\w+)\s*\)\s*\(([^)]*)\)")


def code_of(path: pathlib.Path) -> str:
    return _STRING.sub('""', _COMMENT.sub(" ", path.read_text(errors="replace")))


def sources(root: pathlib.Path):
    return [p for p in sorted(root.rglob("*")) if p.is_file() and p.suffix in SOURCE_SUFFIXES]


def struct_definitions(root: pathlib.Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in sources(root):
        for m in _STRUCT_DEF.finditer(code_of(path)):
            if m.group(1) in FAMILY_PARAMS:
                out.setdefault(m.group(1), []).append(str(path.relative_to(root)))
    return out


def glue_files(root: pathlib.Path):
    """The glue bodies and the backends' run files (csrc/torch/glue, csrc/torch/backends)."""
    return [p for p in sources(root) if p.parent.name in ("glue", "backends") and p.parent.parent.name == "torch"]


def glue_fillings(root: pathlib.Path) -> dict[str, list[str]]:
    out = {}
    for path in glue_files(root):
        hits = [m.group(1) for m in _LOCAL_STRUCT.finditer(code_of(path)) if m.group(1) in FAMILY_PARAMS]
        if hits:
            out[str(path.relative_to(root))] = hits
    return out


def positional_entries(root: pathlib.Path) -> dict[str, list[str]]:
    out = {}
    for rel, struct in zip(TABLE_HEADERS, TABLE_STRUCTS):
        code = code_of(root / rel)
        body = re.search(r"\bstruct\s+" + struct + r"\s*\{(.*?)\};", code, re.S)
        assert body, f"{rel}: struct {struct} not found"
        bad = []
        for name, args in _ENTRY.findall(body.group(1)):
            if name in TABLE_EXEMPT:
                continue
            first = args.split(",")[0].strip()
            if not re.fullmatch(r"const\s+(\w+Params)\s*&\s*\w*", first) or \
                    re.fullmatch(r"const\s+(\w+)\s*&\s*\w*", first).group(1) not in FAMILY_PARAMS:
                bad.append(name)
        if bad:
            out[rel] = bad
    return out


# Params structs that extend a shared base (flash-attention's params inheritance) and must not repeat its fields:
# the top-k routing ops share the logits, outputs and gradients (MoeTopkParams) and differ in their scoring rule.
EXTENDS = {"MoeRoutingParams": "MoeTopkParams", "MoeGroupedRoutingParams": "MoeTopkParams"}


def _struct_fields(code: str, name: str):
    """(base or None, [field names]) of `struct name [: base] { ... };` in code, or None when absent."""
    m = re.search(rf"\bstruct\s+{name}\s*(?::\s*(?:public\s+)?(\w+)\s*)?\{{(.*?)\}};", code, re.S)
    if not m:
        return None
    fields = []
    for decl in m.group(2).split(";"):
        decl = decl.strip()
        if decl:  # `const float* gw` / `int64_t T, E, k` -> gw / T, E, k
            head, *rest = decl.split(",")
            fields += [re.findall(r"\w+", head)[-1]] + [r.strip() for r in rest]
    return m.group(1), fields


def inheritance_problems(root: pathlib.Path) -> list[str]:
    code = "".join(code_of(p) for p in sorted((root / "common").glob("params_*.h")))
    out = []
    for name, base in EXTENDS.items():
        mine, theirs = _struct_fields(code, name), _struct_fields(code, base)
        if mine is None or theirs is None:
            out.append(f"{name} or {base} not found")
        elif mine[0] != base:
            out.append(f"{name} does not extend {base}")
        else:
            out += [f"{name} repeats {base}.{f}" for f in mine[1] if f in theirs[1]]
    return out


def test_routing_params_share_their_base():
    assert inheritance_problems(CSRC) == []
    # not vacuous: the base holds the shared fields, the extensions their own
    assert {"z", "ids", "dz", "renormalize"} <= set(_struct_fields(code_of(CSRC / "common" / "params_moe.h"),
                                                                   "MoeTopkParams")[1])


def test_inheritance_negative_control(tmp_path):
    # the grouped routing's params written out in full again (as before the base existed) are caught
    import shutil

    root = tmp_path / "csrc"
    shutil.copytree(CSRC / "common", root / "common")
    path = root / "common" / "params_moe.h"
    text = path.read_text()
    assert "struct MoeGroupedRoutingParams : MoeTopkParams {" in text
    path.write_text(text.replace("struct MoeGroupedRoutingParams : MoeTopkParams {",
                                 "struct MoeGroupedRoutingParams {\n  DType dt;\n  const void* z;\n  int64_t T, E, k;"))
    assert inheritance_problems(root) == ["MoeGroupedRoutingParams does not extend MoeTopkParams"]
    path.write_text(text.replace("struct MoeGroupedRoutingParams : MoeTopkParams {",
                                 "struct MoeGroupedRoutingParams : MoeTopkParams {\n  int64_t T, E, k;"))
    assert inheritance_problems(root) == [f"MoeGroupedRoutingParams repeats MoeTopkParams.{f}" for f in "TEk"]


def test_each_family_params_struct_defined_once_in_common():
    defs = struct_definitions(CSRC)
    assert set(defs) == FAMILY_PARAMS, sorted(FAMILY_PARAMS - set(defs))
    for name, files in defs.items():
        assert len(files) == 1 and re.fullmatch(r"common/params_\w+\.h", files[0]), (name, files)


def test_params_headers_are_torch_free():
    for path in sorted((CSRC / "common").glob("params_*.h")):
        includes = re.findall(r'#include\s+[<"]([^>"]+)[>"]', path.read_text())
        assert all(not i.startswith(("ATen", "torch", "c10", "cuda", "hip")) for i in includes), (path, includes)


def test_no_glue_file_fills_a_params_struct():
    assert glue_files(CSRC), "no glue files found"
    assert glue_fillings(CSRC) == {}
    # ... and the families' glue bodies really take their params from make_params.h (the scan is not vacuous).
    calls = 0
    for rel in ("torch/glue/dense.h", "torch/glue/logits.h", "torch/glue/linear.h", "torch/glue/moe.h"):
        code = code_of(CSRC / rel)
        assert '#include "../make_params.h"' in (CSRC / rel).read_text(), rel
        n = len(re.findall(r"\bmake_\w+_params\s*\(", code))
        assert n >= 1, rel
        calls += n
    assert calls >= 15


def test_cpu_kernel_tables_take_params_structs():
    assert positional_entries(CSRC) == {}


def test_scanner_negative_controls(tmp_path):
    root = tmp_path / "csrc"
    for d in ("common", "cpu", "torch/glue", "torch/backends", "gpu"):
        (root / d).mkdir(parents=True)
    body = "".join(f"struct {n} {{ int x; }};\n" for n in sorted(FAMILY_PARAMS))
    (root / "common" / "params_all.h").write_text(body)
    # A backend header redefining one struct: two definitions, one outside common.
    (root / "gpu" / "dense_api.h").write_text("namespace g {\nstruct RmsNormParams {\n  int dt;\n};\n}\n")
    defs = struct_definitions(root)
    assert defs["RmsNormParams"] == ["common/params_all.h", "gpu/dense_api.h"]
    assert defs["GemmParams"] == ["common/params_all.h"]
    # Glue filling a struct itself is caught; the same words in a comment or a call to make_*_params are not.
    (root / "torch" / "backends" / "gpu.h").write_text(
        "void f() {\n  gpu::GemmParams p{};\n  p.M = 1;\n}\n// SiluMulParams q{};\n"
        "void g() { const auto p = make_rms_norm_params(a); launch(p); }\n")
    (root / "torch" / "glue" / "logits.h").write_text("void h() { LogitsParams lp;\n lp.T = 2; }\n")
    # a kernel file is not glue: its own structs are its business (cpu/ is not scanned)
    (root / "cpu" / "ops_old.cpp").write_text("void k() { GemmParams p{}; }\n")
    assert glue_fillings(root) == {"torch/backends/gpu.h": ["GemmParams"], "torch/glue/logits.h": ["LogitsParams"]}
    # A kernel table entry with a positional list is caught; a params entry is not.
    (root / "cpu" / "cpu_kernels.h").write_text(
        "struct KernelTable {\n  const char* isa;\n  void (*rms_norm)(const RmsNormParams& p, int64_t r0, int64_t r1);\n"
        "  void (*silu_and_mul)(DType dt, const void* x, void* out, int64_t d, int64_t r0, int64_t r1);\n"
        "  void (*rotary)(const OtherThing& p, int64_t r0, int64_t r1);\n};\n")
    (root / "cpu" / "dense_split_kernels.h").write_text(
        "struct DenseSplitKernels {\n  void (*merge_max)(const float* m, int64_t n);\n};\n")
    (root / "cpu" / "moe_kernels.h").write_text(
        "struct MoeKernels {\n  void (*routing)(const MoeRoutingParams& p, int64_t r0, int64_t r1);\n};\n")
    assert positional_entries(root) == {"cpu/cpu_kernels.h": ["silu_and_mul", "rotary"]}
