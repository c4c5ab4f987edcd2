"""The package layering, checked on every import the code makes (module level, in functions, under
TYPE_CHECKING): ``graphopt`` -> ``kerneltune`` -> ``pipeline`` -> ``bench``/``tests``, each importing only
below itself; ``models`` standalone (it may use ``graphopt.errors`` and ``graphopt.fileio``); and no import cycle between the
project's modules.  See docs/architecture.md.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("graphopt", "kerneltune", "pipeline", "models")
# What each package may import from the project (besides itself).
ALLOWED = {
    "graphopt": set(),
    "kerneltune": {"graphopt"},
    "pipeline": {"graphopt", "kerneltune"},
    "models": {"graphopt.errors", "graphopt.fileio"},
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_sources(root: Path = ROOT) -> dict[str, str]:
    """Module name -> source of every module of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            out[module_name(path, root)] = path.read_text()
    return out


def imports(sources: dict[str, str]) -> list[tuple[str, str, int]]:
    """(importer, imported project module, line) for every import statement anywhere in each module."""
    edges = []
    for mod, src in sources.items():
        is_pkg = any(m.startswith(mod + ".") for m in sources)
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                # "from pkg import mod" imports the submodule; "from mod import name" the module
                names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in sources else origin for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in sources:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    edges.append((mod, name, node.lineno))
    return edges


def upward(edges: list[tuple[str, str, int]]) -> list[str]:
    bad = []
    for src, dst, line in edges:
        top, dst_top = src.split(".")[0], dst.split(".")[0]
        if top == dst_top:
            continue
        if not any(dst == a or dst.startswith(a + ".") for a in ALLOWED[top]):
            bad.append(f"{src}:{line} imports {dst}")
    return sorted(set(bad))


def cycles(edges: list[tuple[str, str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for src, dst, _ in edges:
        graph.setdefault(src, set()).add(dst)
        graph.setdefault(dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_upward_import():
    edges = imports(project_sources())
    assert len(edges) > 100  # the walk really sees the project's imports
    assert upward(edges) == []


def test_no_import_cycle():
    assert cycles(imports(project_sources())) == []


def test_the_checks_catch_an_upward_import_and_a_cycle():
    """The walk on a made-up tree: in-function and relative imports count, and both faults are found."""
    sources = {
        "graphopt": "",
        "graphopt.a": "def f():\n    from pipeline.x import y\n",
        "graphopt.b": "from . import c\n",
        "graphopt.c": "def g():\n    import graphopt.b\n",
        "kerneltune": "",
        "kerneltune.t": "from graphopt.a import f\n",
        "pipeline": "",
        "pipeline.x": "from kerneltune.t import f\ny = 1\n",
        "models": "",
        "models.m": "from graphopt.errors import UserError\nfrom graphopt import a\n",
        "graphopt.errors": "",
    }
    edges = imports(sources)
    assert upward(edges) == ["graphopt.a:2 imports pipeline.x", "models.m:2 imports graphopt.a"]
    assert cycles(edges) == [["graphopt.a", "kerneltune.t", "pipeline.x"], ["graphopt.b", "graphopt.c"]]


def test_the_rewrite_knows_no_cost():
    """Rewriting matches and applies; what a candidate costs is the cost side's (graphopt.cost), which the
    search asks (as egg keeps cost in extract.rs, out of rewrite.rs)."""
    edges = imports(project_sources())
    assert [f"{a}:{line} imports {b}" for a, b, line in edges if a in ("graphopt.rewrite", "graphopt.match")
            and b.startswith("graphopt.cost")] == []


def test_the_single_operator_tuner_loads_no_onnx():
    """kerneltune's command line checks its threads and memory with graphopt.limits: the ONNX importer (and
    graphopt.validate, the model checks) stays out of its imports."""
    import os
    import subprocess
    import sys

    code = "import sys, kerneltune.cli; print(sorted(m for m in ('onnx', 'graphopt.validate', 'graphopt.onnx_io') " \
           "if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
