"""The package has no import cycle: a static graph of every ``import`` in python/aligned_ops (module-level AND
function-level — a lazy import still ties two modules together), checked for cycles, with negative controls
(a synthetic package with a cycle, the cli <-> verify edge the package used to have, and the edge that closes a
cycle in the vLLM plugin package when its patch registry imports a concern module: all found).
The shipped CLI (aligned_ops.apps) and the RL runner (aligned_ops.runner) reach no test fixture (aligned_ops.testing), with a negative control.
A fresh interpreter then imports the apps in the order that used to need the cycle (verify before cli)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import aligned_ops

PKG_DIR = os.path.dirname(os.path.abspath(aligned_ops.__file__))


def _modules(root: str, package: str) -> dict[str, tuple[str, bool]]:
    """``{dotted name: (path, is_package)}`` of every .py file under ``root``."""
    mods = {}
    for dirpath, _, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        prefix = package if rel == "." else package + "." + rel.replace(os.sep, ".")
        for f in files:
            if f.endswith(".py"):
                is_pkg = f == "__init__.py"
                mods[prefix if is_pkg else f"{prefix}.{f[:-3]}"] = (os.path.join(dirpath, f), is_pkg)
    return mods


def import_graph(root: str, package: str) -> dict[str, set[str]]:
    """Edges module -> module for every import of a module of ``package`` (parents implied by Python's import
    of a submodule are not edges: they are not a choice of the importing module)."""
    mods = _modules(root, package)
    graph = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        here = mod if is_pkg else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # `from X import Y`: Y is a submodule (an edge to it) or a name of X (an edge to X)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import aligned_ops.ops.collective` names a module; trim attributes
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None (iterative DFS, three colours)."""
    colour = dict.fromkeys(graph, 0)
    for start in sorted(graph):
        if colour[start]:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        colour[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour[nxt] == 1:
                return path[path.index(nxt):] + [nxt]
            elif colour[nxt] == 0:
                colour[nxt] = 1
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return None


def test_package_has_no_import_cycle():
    graph = import_graph(PKG_DIR, "aligned_ops")
    # the graph really is the package's: the edges the layout is built on are present
    assert "aligned_ops.apps.common" in graph["aligned_ops.apps.verify"]
    assert "aligned_ops.apps.verify" in graph["aligned_ops.apps.cli"]  # lazy import counted
    assert "aligned_ops.ops.linear" in graph["aligned_ops.ops.collective"]
    # the vLLM plugin package, one module per concern, all in the graph; the patch registry imports none of them
    plugin = {m for m in graph if m.startswith("aligned_ops.integrations.vllm.")}
    assert {f"aligned_ops.integrations.vllm.{m}" for m in ("plugin", "patches", "bind", "config", "decoders", "layers",
                                                          "tp", "moe", "sampler", "attention", "gpu_platform")} <= plugin
    assert "aligned_ops.integrations.vllm.patches" in graph["aligned_ops.integrations.vllm.layers"]
    assert not graph["aligned_ops.integrations.vllm.patches"] & plugin
    assert "aligned_ops.integrations.vllm" in graph["aligned_ops.integrations.vllm_plugin"]
    assert "aligned_ops.models.tiny" in graph["aligned_ops.runner.models"]  # the runner's tiny-model builders
    assert "aligned_ops.runner.models" in graph["aligned_ops.apps.demo"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for n in graph.get(m, ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def fixtures_reached_by_the_cli(graph) -> dict[str, set[str]]:
    """{shipped app or runner module: the aligned_ops.testing modules it imports, directly or not}."""
    out = {}
    for m in graph:
        if m.startswith(("aligned_ops.apps", "aligned_ops.runner")):
            hit = {n for n in reachable(graph, m) if n == "aligned_ops.testing" or n.startswith("aligned_ops.testing.")}
            if hit:
                out[m] = hit
    return out


def test_the_shipped_cli_imports_no_test_fixture():
    graph = import_graph(PKG_DIR, "aligned_ops")
    assert "aligned_ops.models.tiny" in reachable(graph, "aligned_ops.apps.cli")  # the CLI's model builders
    assert fixtures_reached_by_the_cli(graph) == {}
    # negative control: the import the demo used to have is found
    graph["aligned_ops.apps.demo"].add("aligned_ops.testing.tiny_model")
    assert "aligned_ops.testing.tiny_model" in fixtures_reached_by_the_cli(graph)["aligned_ops.apps.cli"]
    # ... and the one the runner's model builder used to have (reached by `aligned-ops train` and the demo)
    graph = import_graph(PKG_DIR, "aligned_ops")
    graph["aligned_ops.runner.models"].add("aligned_ops.testing.tiny_model")
    hit = fixtures_reached_by_the_cli(graph)
    assert {"aligned_ops.runner.models", "aligned_ops.apps.train", "aligned_ops.apps.demo"} <= set(hit)


def test_negative_control_cycles_are_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a  # lazy, still a cycle\n")
    cycle = find_cycle(import_graph(str(pkg), "pkg"))
    assert cycle is not None and set(cycle) == {"pkg.a", "pkg.sub.b"}
    # ... and the real package with the edge it used to have (verify took helpers from cli) has one too
    graph = import_graph(PKG_DIR, "aligned_ops")
    graph["aligned_ops.apps.verify"].add("aligned_ops.apps.cli")
    cycle = find_cycle(graph)
    assert cycle is not None and {"aligned_ops.apps.cli", "aligned_ops.apps.verify"} <= set(cycle)
    # ... and the plugin package's registry importing a concern module (the naive split's cycle) is found
    graph = import_graph(PKG_DIR, "aligned_ops")
    graph["aligned_ops.integrations.vllm.patches"].add("aligned_ops.integrations.vllm.plugin")
    cycle = find_cycle(graph)
    assert cycle is not None and {"aligned_ops.integrations.vllm.patches", "aligned_ops.integrations.vllm.plugin"} \
        <= set(cycle)


def test_apps_import_in_any_order_in_a_fresh_interpreter():
    code = ("import aligned_ops.apps.verify, aligned_ops.apps.demo, aligned_ops.apps.trainer, aligned_ops.apps.train, "
            "aligned_ops.runner, aligned_ops.runner.worker, aligned_ops.runner.ray_backend, "
            "aligned_ops.apps.cli, aligned_ops.testing.tiny_model, aligned_ops.integrations.hf, "
            "aligned_ops.integrations.vllm_plugin, aligned_ops.integrations.vllm.moe, aligned_ops.model_spec, "
            "aligned_ops.models.registry, aligned_ops.profiles; import sys; "
            "assert 'vllm' not in sys.modules, 'importing the plugin package (or the runner) imported vLLM'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
