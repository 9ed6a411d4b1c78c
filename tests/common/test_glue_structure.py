"""The torch glue's structure (issue 20, "one glue body per op"), checked on the sources and on the loaded library:

* every op schema (csrc/torch/bindings.cpp) is in exactly one family's op list (csrc/torch/glue/<family>.h), or is
  a no-tensor control op (catch-all kernel) or an op composed in Python; each list entry names one glue body,
  defined once, as a template over the backend (and, for the linear profiles, the profile);
* a numerics profile is a template argument, not a copy: a profile's families (LinearMma, LinearMmaReference) list,
  op by op, the bodies of the `fma` families (Linear, LinearReference) instantiated for their profile; and no two
  glue bodies are near copies of each other (token similarity, PROFILE_FAMILIES / NEAR_COPY below);
* operators are registered only by the per-key registration files (one line per family: register_cpu.cpp,
  register_cuda.cpp) through registration_impl.h — no backend file registers an op of its own — and each line has
  its explicit instantiation beside the backend's run functions (and no instantiation lacks its line);
* the emulator is the GPU backend's third instantiation: the families the CPU key lets the emulated GPUs run are
  exactly the families the CUDA key registers;
* no `.cpp` is `#include`d anywhere, and no `#define gpu` (or any macro renaming the `gpu` namespace) exists;
* every op of every family the CPU key registers has a CPU kernel in the loaded library.
Each rule is checked against planted sources (negative controls)."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import aligned_ops  # noqa: F401

ROOT = pathlib.Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
SOURCE_SUFFIXES = {".cpp", ".h", ".cc", ".hpp", ".cu", ".cuh", ".hip"}
# Schemas without a family: control ops with no tensor argument (catch-all kernels next to their backend) and
# ops composed of other aligned ops in Python (torch.library.register_kernel).
CATCH_ALL = {"_cpu_isa", "_exact_unit", "_cpu_mma_unit", "_emulate_enter", "_emulate_exit", "_emulated_archs", "_emulate_selftest",
             "attention_plan_layout"}
PYTHON_COMPOSED = {"fused_token_logprobs", "fused_token_logprobs_backward", "moe_experts_backward"}

# A profile's families and the families whose bodies they instantiate (glue/linear_mma.h, glue/linear.h).
PROFILE_FAMILIES = {"LinearMma": "Linear", "LinearMmaReference": "LinearReference"}
# Two glue bodies of at least NEAR_COPY_TOKENS tokens whose token sequences match to NEAR_COPY_RATIO or more
# (difflib) are a copy with names changed. It catches near-verbatim copies only: before the profile became a
# template argument the linear forward bodies matched their mma copies 0.95-0.98, but linear_backward's copy 0.88 and
# the two routing backwards 0.93 (restructured copies) — PROFILE_FAMILIES (a profile family must run its base
# family's bodies) and test_params_single_source guard those; the closest distinct ops today, linear and
# linear_partial, 0.91.
NEAR_COPY_RATIO = 0.94
NEAR_COPY_TOKENS = 100

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_STRING = re.compile(r'"(?:\\.|[^"\\])*"')


def code_of(text: str, keep_strings: bool = False) -> str:
    text = _COMMENT.sub(" ", text)
    return text if keep_strings else _STRING.sub('""', text)


def sources(root: pathlib.Path):
    return [p for p in sorted(root.rglob("*")) if p.is_file() and p.suffix in SOURCE_SUFFIXES]


def source_codes(root: pathlib.Path) -> dict[pathlib.Path, str]:
    """{source file: its code without comments and strings}, read once (the body check looks at every file for
    every op: reading and stripping them per op made one `problems` call ~50x slower)."""
    return {p: code_of(p.read_text()) for p in sources(root)}


def schemas(root: pathlib.Path) -> set[str]:
    text = code_of((root / "torch" / "bindings.cpp").read_text(), keep_strings=True)
    return set(re.findall(r'm\.def\(\s*"(\w+)\(', text.replace('"\n      "', "")))


def families(root: pathlib.Path) -> dict[str, dict[str, str]]:
    """{family: {schema name: glue body}} from every `struct F { ... ops{ Op{"name", &body<B>}, ... } }` (or
    `&body<Profile, B>`)."""
    out: dict[str, dict[str, str]] = {}
    for path in sorted((root / "torch" / "glue").glob("*.h")):
        text = code_of(path.read_text(), keep_strings=True)
        for m in re.finditer(r"struct\s+(\w+)\s*\{\s*template\s*<class B>\s*static constexpr std::tuple ops\{(.*?)\};",
                             text, re.S):
            ops = re.findall(r'Op\{\s*"(\w+)"\s*,\s*&(\w+)<(?:\w+\s*,\s*)?B>\s*\}', m.group(2))
            assert m.group(1) not in out, f"family {m.group(1)} defined twice"
            out[m.group(1)] = {}
            for name, body in ops:
                assert name not in out[m.group(1)], f"{m.group(1)} lists {name} twice"
                out[m.group(1)][name] = body
    return out


# `template <class B>` or `template <class P, class B>` (a profile's bodies), then the signature up to the `{`.
_BODY_HEAD = r"template\s*<(?:class\s+\w+\s*,\s*)?class B>\s*\n?[^;{{}}]*?\b{name}\s*\([^;{{]*\)\s*\{{"
_TOKEN = re.compile(r"[A-Za-z_]\w*|\d\w*|::|->|[^\s\w]")


def body_definitions(root: pathlib.Path, body: str, codes: dict[pathlib.Path, str] | None = None) -> list[str]:
    """Files (and count) where a glue body template `body` is defined (a definition, not a declaration).
    ``codes``: source_codes(root), when the caller has it already."""
    found = []
    for path, code in (source_codes(root) if codes is None else codes).items():
        for _ in re.finditer(_BODY_HEAD.format(name=re.escape(body)), code):
            found.append(str(path.relative_to(root)))
    return found


def glue_bodies(root: pathlib.Path) -> dict[str, list[str]]:
    """{"file:body": its tokens} of every glue body template in csrc/torch/glue (comments and strings blanked)."""
    out = {}
    for path in sorted((root / "torch" / "glue").glob("*.h")):
        code = code_of(path.read_text())
        for m in re.finditer(_BODY_HEAD.format(name=r"(\w+)"), code):
            i, depth = m.end(), 1
            while depth:
                depth += {"{": 1, "}": -1}.get(code[i], 0)
                i += 1
            out[f"{path.name}:{m.group(1)}"] = _TOKEN.findall(code[m.end() : i - 1])
    return out


def near_copies(root: pathlib.Path) -> list[str]:
    import difflib
    import itertools

    big = tuple(sorted((k, tuple(v)) for k, v in glue_bodies(root).items() if len(v) >= NEAR_COPY_TOKENS))
    if big not in _near_copy_memo:  # the same sources are scanned by several tests (real and planted trees)
        out = []
        for (a, ta), (b, tb) in itertools.combinations(big, 2):
            m = difflib.SequenceMatcher(None, ta, tb, autojunk=False)
            # quick_ratio bounds ratio from above: most pairs are ruled out without the quadratic match
            if m.real_quick_ratio() < NEAR_COPY_RATIO or m.quick_ratio() < NEAR_COPY_RATIO:
                continue
            ratio = m.ratio()
            if ratio >= NEAR_COPY_RATIO:
                out.append(f"glue bodies {a} and {b} are near copies ({ratio:.2f}): template the one body on what "
                           "differs")
        _near_copy_memo[big] = out
    return list(_near_copy_memo[big])


_near_copy_memo: dict = {}


def profile_copies(root: pathlib.Path, fams: dict[str, dict[str, str]]) -> list[str]:
    """A profile family whose op list does not instantiate its base family's bodies, op by op."""
    out = []
    for fam, base in PROFILE_FAMILIES.items():
        if fam not in fams or base not in fams:
            out.append(f"profile family {fam} or its base {base} is missing")
            continue
        mine, theirs = list(fams[fam].items()), list(fams[base].values())
        if [body for _, body in mine] != theirs:
            out.append(f"profile family {fam} runs bodies {[b for _, b in mine]}, not {base}'s {theirs}")
    return out


def registrations(root: pathlib.Path, key: str) -> list[tuple[str, ...]]:
    """The `register_family<Family, Backend...>` lines of register_<key>.cpp."""
    text = code_of((root / "torch" / f"register_{key}.cpp").read_text())
    lines = re.finditer(r"register_family<([^>]*)>\(m\)", text)
    return [tuple(a.strip() for a in m.group(1).split(",")) for m in lines]


def instantiations(root: pathlib.Path) -> list[tuple[str, ...]]:
    out = []
    for path in sorted((root / "torch" / "backends").glob("*.cpp")):
        text = code_of(path.read_text())
        out += [tuple(a.strip() for a in m.group(1).split(","))
                for m in re.finditer(r"template\s+void\s+register_family<([^>]*)>\(torch::Library&\)", text)]
    return out


# register_autograd.cpp registers the backend-independent autograd keys (and only those) of the ops whose schemas
# write into an argument (Tensor(a!)): its op list must be exactly those schemas.
AUTOGRAD_KEYS = {"ADInplaceOrView", "Autograd"}


def writing_schemas(root: pathlib.Path) -> set[str]:
    """The ops whose schema writes into an argument (a `Tensor(x!)`)."""
    text = code_of((root / "torch" / "bindings.cpp").read_text(), keep_strings=True).replace('"\n      "', "")
    return {m.group(1) for m in re.finditer(r'm\.def\(\s*"(\w+)\(([^"]*)"', text) if "!)" in m.group(2)}


def autograd_registrations(root: pathlib.Path) -> list[str]:
    """register_autograd.cpp: only the autograd keys, for exactly the writing ops."""
    path = root / "torch" / "register_autograd.cpp"
    if not path.exists():
        return [f"{path.relative_to(root)} is missing (the writing ops' autograd keys)"]
    code = code_of(path.read_text(), keep_strings=True)
    found = [f"{path.relative_to(root)}: TORCH_LIBRARY_IMPL({k}) (only {sorted(AUTOGRAD_KEYS)} belong there)"
             for k in re.findall(r"TORCH_LIBRARY_IMPL\s*\(\s*aligned\s*,\s*(\w+)", code) if k not in AUTOGRAD_KEYS]
    listed = re.search(r"kWritingOps\[\]\s*=\s*\{([^}]*)\}", code)
    ops = set(re.findall(r'"(\w+)"', listed.group(1))) if listed else set()
    want = writing_schemas(root)
    found += [f"writing op {op} has no autograd kernels in register_autograd.cpp" for op in sorted(want - ops)]
    found += [f"register_autograd.cpp lists {op}, which writes into no argument" for op in sorted(ops - want)]
    return found


def stray_registrations(root: pathlib.Path) -> list[str]:
    """Operator registrations outside the registration files: a TORCH_LIBRARY_IMPL for a dispatch key other than
    CatchAll, or an `.impl("op"` of a schema that is not a catch-all control op. (register_autograd.cpp: checked by
    autograd_registrations.)"""
    allowed = {root / "torch" / "register_cpu.cpp", root / "torch" / "register_cuda.cpp",
               root / "torch" / "registration_impl.h", root / "torch" / "register_autograd.cpp"}
    found = []
    for path in sources(root):
        if path in allowed:
            continue
        code = code_of(path.read_text(), keep_strings=True)
        for m in re.finditer(r"TORCH_LIBRARY_IMPL\s*\(\s*aligned\s*,\s*(\w+)", code):
            if m.group(1) != "CatchAll":
                found.append(f"{path.relative_to(root)}: TORCH_LIBRARY_IMPL({m.group(1)})")
        for m in re.finditer(r'\.impl\(\s*"(\w+)"', code):
            if m.group(1) not in CATCH_ALL:
                found.append(f"{path.relative_to(root)}: impl({m.group(1)})")
    return found


def included_cpp(root: pathlib.Path) -> list[str]:
    """Every `#include` of a .cpp / .cc file (a translation unit compiled inside another)."""
    found = []
    for path in sources(root):
        for m in re.finditer(r'^\s*#\s*include\s*[<"]([^>"]+\.(?:cpp|cc|cxx))[>"]', path.read_text(), re.M):
            found.append(f"{path.relative_to(root)}: {m.group(1)}")
    return found


def gpu_renames(root: pathlib.Path) -> list[str]:
    """Macros that rename the `gpu` namespace (the old emulation trick): `#define gpu ...`."""
    found = []
    for path in sources(root):
        for m in re.finditer(r"^\s*#\s*define\s+gpu\b.*$", path.read_text(), re.M):
            found.append(f"{path.relative_to(root)}: {m.group(0).strip()}")
    return found


def problems(root: pathlib.Path) -> list[str]:
    out = []
    fams = families(root)
    codes = source_codes(root)
    owner: dict[str, list[str]] = {}
    for fam, ops in fams.items():
        for name in ops:
            owner.setdefault(name, []).append(fam)
    for name, fs in owner.items():
        if len(fs) > 1:
            out.append(f"{name} is in several families: {fs}")
    for name in sorted(schemas(root) - CATCH_ALL - PYTHON_COMPOSED):
        if name not in owner:
            out.append(f"schema {name} is in no family")
    for fam, ops in fams.items():
        for name, body in ops.items():
            defs = body_definitions(root, body, codes)
            if len(defs) != 1:
                out.append(f"{name}: glue body {body} is defined {len(defs)} times {defs}")
    out += stray_registrations(root)
    out += autograd_registrations(root)
    cpu, cuda = registrations(root, "cpu"), registrations(root, "cuda")
    lines = set(cpu) | set(cuda)
    inst = instantiations(root)
    out += [f"registration {l} has no instantiation" for l in sorted(lines - set(inst))]
    out += [f"instantiation {i} has no registration line" for i in sorted(set(inst) - lines)]
    for l in cpu + cuda:
        if l[0] not in fams:
            out.append(f"registration of unknown family {l[0]}")
    out += [f"family {f} is not registered on the CPU key" for f in sorted(set(fams) - {l[0] for l in cpu})]
    emulated = {l[0] for l in cpu if "EmulatedCuda" in l[1:] and "EmulatedHip" in l[1:]}
    on_gpu = {l[0] for l in cuda}
    out += [f"family {f} runs emulated GPU glue but has no CUDA registration" for f in sorted(emulated - on_gpu)]
    out += [f"family {f} has GPU glue but is not emulated" for f in sorted(on_gpu - emulated)]
    out += profile_copies(root, fams)
    out += near_copies(root)
    out += [f"#include of a .cpp: {x}" for x in included_cpp(root)]
    out += [f"namespace rename: {x}" for x in gpu_renames(root)]
    return out


def test_glue_structure():
    assert problems(CSRC) == []
    # not vacuous: the families cover the schemas, several backends claim them
    assert len(families(CSRC)) >= 10 and len(registrations(CSRC, "cpu")) >= 10 and registrations(CSRC, "cuda")
    # the body scan sees the glue (every listed body, the linear profiles' among them)
    bodies = {k.split(":")[1] for k in glue_bodies(CSRC)}
    assert {b for ops in families(CSRC).values() for b in ops.values()} <= bodies
    assert {"linear", "linear_partial", "linear_backward", "linear_reference"} <= bodies


def test_every_cpu_registered_op_has_a_cpu_kernel():
    fams = families(CSRC)
    names = [name for line in registrations(CSRC, "cpu") for name in fams[line[0]]]
    assert len(names) > 40
    missing = [n for n in names if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aligned::{n}", "CPU")]
    assert missing == []
    # the control ops are catch-all kernels; the Python-composed ops have their CPU kernels from Python
    for n in CATCH_ALL:  # a catch-all kernel shows as the CompositeImplicitAutograd alias
        assert "CompositeImplicitAutograd[alias]: registered at" in torch._C._dispatch_dump(f"aligned::{n}"), n
    for n in PYTHON_COMPOSED:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"aligned::{n}", "CPU"), n


def test_no_generated_tu_includes_a_cpp():
    # The emulation target's generated TUs (CMakeLists.txt) compile the vendor kernel files (.cu / .hip), as nvcc
    # and hip-clang do; never a .cpp.
    cmake = (ROOT / "CMakeLists.txt").read_text()
    generated = re.findall(r'#include \\"\$\{(\w+)\}\\"', cmake)
    assert generated and all(g in ("_src", "CMAKE_CURRENT_SOURCE_DIR") for g in generated), generated
    assert re.search(r"file\(GLOB _emu_cuda_files CONFIGURE_DEPENDS csrc/cuda/\*\.cu\)", cmake)
    assert re.search(r"file\(GLOB _emu_hip_files CONFIGURE_DEPENDS csrc/hip/\*\.hip\)", cmake)


# ---- negative controls: each rule on a planted copy of csrc ---------------------------------------------------
@pytest.fixture()
def planted_root(tmp_path):
    import shutil

    root = tmp_path / "csrc"
    shutil.copytree(CSRC, root)
    assert problems(root) == []
    return root


def _edit(path: pathlib.Path, old: str, new: str):
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


def test_planted_second_body_is_caught(planted_root):
    # a backend file defining its own rms_norm glue body beside the family's
    (planted_root / "torch" / "backends" / "cpu_special.cpp").write_text(
        "template <class B>\nat::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {\n"
        "  return x;\n}\n")
    assert any("glue body rms_norm is defined 2 times" in p for p in problems(planted_root))


def test_planted_duplicate_op_entry_is_caught(planted_root):
    _edit(planted_root / "torch" / "glue" / "linear.h", 'Op{"linear_partial", &linear_partial<FmaLinear, B>},',
          'Op{"linear_partial", &linear_partial<FmaLinear, B>},\n      Op{"rms_norm", &linear<FmaLinear, B>},')
    found = problems(planted_root)
    assert any("rms_norm is in several families" in p for p in found), found


def test_planted_backend_registration_is_caught(planted_root):
    (planted_root / "torch" / "backends" / "cpu_extra.cpp").write_text(
        'TORCH_LIBRARY_IMPL(aligned, CPU, m) { m.impl("rms_norm", &my_rms_norm); }\n'
        'TORCH_LIBRARY_IMPL(aligned, CatchAll, m) { m.impl("_cpu_isa", &isa); }\n')
    found = problems(planted_root)
    assert "torch/backends/cpu_extra.cpp: TORCH_LIBRARY_IMPL(CPU)" in found
    assert "torch/backends/cpu_extra.cpp: impl(rms_norm)" in found
    assert not any("impl(_cpu_isa)" in p for p in found)


def test_writing_ops_have_their_autograd_keys():
    """Every op that writes into an argument has the autograd kernels (version bump, grad refusal): the current
    list, and controls: a new writing schema without them, a listed op that writes nothing, another key there."""
    assert writing_schemas(CSRC) == {"reshape_and_cache", "mla_reshape_and_cache", "attention_plan"}
    assert autograd_registrations(CSRC) == []


def test_planted_writing_op_without_autograd_keys_is_caught(planted_root):
    _edit(planted_root / "torch" / "bindings.cpp", 'm.def("silu_and_mul(Tensor x) -> Tensor");',
          'm.def("silu_and_mul(Tensor x) -> Tensor");\n  m.def("fill_cache(Tensor(a!) cache) -> ()");')
    assert "writing op fill_cache has no autograd kernels in register_autograd.cpp" in problems(planted_root)
    _edit(planted_root / "torch" / "register_autograd.cpp", '"attention_plan"}', '"attention_plan", "rms_norm"}')
    assert "register_autograd.cpp lists rms_norm, which writes into no argument" in problems(planted_root)
    _edit(planted_root / "torch" / "register_autograd.cpp", "TORCH_LIBRARY_IMPL(aligned, Autograd, m)",
          "TORCH_LIBRARY_IMPL(aligned, CPU, m)")
    assert any("TORCH_LIBRARY_IMPL(CPU) (only" in p for p in problems(planted_root))


def test_planted_included_cpp_is_caught(planted_root):
    _edit(planted_root / "torch" / "backends" / "emulated.cpp", '#include "emulated.h"',
          '#include "emulated.h"\n#include "../../cuda/ops_cuda.cpp"')
    assert any("#include of a .cpp" in p and "ops_cuda.cpp" in p for p in problems(planted_root))


def test_planted_gpu_rename_is_caught(planted_root):
    _edit(planted_root / "emu" / "model_cuda.h", '#include "model_common.h"',
          '#include "model_common.h"\n#define gpu gpu_emu_cuda')
    assert any("namespace rename" in p for p in problems(planted_root))


def test_planted_missing_backend_line_is_caught(planted_root):
    # a family whose GPU registration is dropped while the CPU key still emulates it; and an instantiation left
    # without its registration line
    _edit(planted_root / "torch" / "register_cuda.cpp", "  register_family<Linear, Cuda>(m);\n", "")
    found = problems(planted_root)
    assert "family Linear runs emulated GPU glue but has no CUDA registration" in found
    assert "instantiation ('Linear', 'Cuda') has no registration line" in found


def test_planted_schema_without_family_is_caught(planted_root):
    _edit(planted_root / "torch" / "bindings.cpp", 'm.def("silu_and_mul(Tensor x) -> Tensor");',
          'm.def("silu_and_mul(Tensor x) -> Tensor");\n  m.def("gelu(Tensor x) -> Tensor");')
    assert "schema gelu is in no family" in problems(planted_root)


def _linear_body(root: pathlib.Path, name: str) -> str:
    text = code_of((root / "torch" / "glue" / "linear.h").read_text(), keep_strings=True)
    return re.search(rf"template <class P, class B>\n[^\n]*? {name}\(.*?\n\}}\n", text, re.S).group(0)


def test_planted_profile_copy_is_caught(planted_root):
    # the mma family given its own linear body again, the profile's pieces written in (what glue/linear_mma.h held
    # before the profile was a template argument): the profile family no longer runs its base family's bodies
    body = _linear_body(planted_root, "linear")
    copy = body.replace("template <class P, class B>", "template <class B>").replace(" linear(", " linear_mma(")
    copy = copy.replace("P::kOps.linear", '"linear_mma"').replace("P::kDtypes", "LinearDtypes::kBf16Only")
    copy = copy.replace("P::weight_operand(weight)", "weight.contiguous()").replace("P::template gemm<B>", "B::mma_gemm")
    glue = planted_root / "torch" / "glue"
    _edit(glue / "linear_mma.h", "struct MmaLinear {", copy + "\nstruct MmaLinear {")
    _edit(glue / "linear_mma.h", 'Op{"linear_mma", &linear<MmaLinear, B>}', 'Op{"linear_mma", &linear_mma<B>}')
    assert problems(planted_root) == [
        "profile family LinearMma runs bodies ['linear_mma', 'linear_partial', 'linear_backward'], not Linear's "
        "['linear', 'linear_partial', 'linear_backward']"]


def test_planted_near_copy_is_caught(planted_root):
    # a new op whose body is an existing one with its names changed (as _linear_mma_reference's was of
    # _linear_partial_reference's, 0.98), in a family of its own
    body = _linear_body(planted_root, "linear_reference").replace(" linear_reference(", " linear_tf32_reference(")
    body = body.replace("P::kOps.reference", '"_linear_tf32_reference"')
    _edit(planted_root / "torch" / "glue" / "linear.h", "struct Linear {",
          body + "\nstruct LinearTf32Reference {\n  template <class B>\n  static constexpr std::tuple ops{"
          'Op{"_linear_tf32_reference", &linear_tf32_reference<FmaLinear, B>}};\n};\n\nstruct Linear {')
    found = problems(planted_root)
    assert any(p.startswith("glue bodies linear.h:linear_reference and linear.h:linear_tf32_reference are near copies")
               for p in found), found
