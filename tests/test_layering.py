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


# The functions that sequence a build: called by the one chain (pipeline/chain.py) alone, so optimize-model,
# bench-model, tune-kernels MODEL and the bench scripts cannot drift apart (issue 42).
SEQUENCING = {"graph_stage", "stages.lower", "build_untuned", "pick_build"}


def _calls(src: str) -> set[str]:
    """The functions ``src`` calls: ``f`` for ``f(...)`` and ``x.f(...)``, and ``module.f`` for the latter."""
    out = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name):
                out.add(f.id)
            elif isinstance(f, ast.Attribute):
                out.add(f.attr)
                if isinstance(f.value, ast.Name):
                    out.add(f"{f.value.id}.{f.attr}")
    return out


def test_the_commands_build_through_the_one_chain():
    callers = {m: src for m, src in project_sources().items() if m.startswith("pipeline.")}
    callers.update({f"bench.{p.stem}": p.read_text() for p in sorted((ROOT / "bench").glob("*.py"))})
    own = {"pipeline.chain", "pipeline.stages", "pipeline.tuning"}  # the chain and the stages themselves
    strays = {m: sorted(_calls(src) & SEQUENCING) for m, src in callers.items() if m not in own}
    assert {m: c for m, c in strays.items() if c} == {}
    for command in ("pipeline.optimize_model", "pipeline.benchmark", "pipeline.model_mode"):
        assert "run_chain" in _calls(callers[command]), command


# ---- what owns what ----------------------------------------------------------------------------------------
MAX_PARAMETERS = 8  # below the API, a function taking more wants an options object (a frozen dataclass)
WIDE_ALLOWED = {"pipeline.api.optimize"}  # the Python API: one keyword per command-line option, documented there


def parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> int:
    """Named parameters, ``self``/``cls`` left out (``*args``/``**kwargs`` are no named parameters)."""
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    return len(names) - (1 if names and names[0] in ("self", "cls") else 0)


def wide_functions(sources: dict[str, str]) -> list[str]:
    """``module.function:line (n)`` for every function with more than MAX_PARAMETERS parameters."""
    out = []
    for mod, src in sources.items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and parameter_count(node) > MAX_PARAMETERS:
                if f"{mod}.{node.name}" not in WIDE_ALLOWED:
                    out.append(f"{mod}.{node.name}:{node.lineno} ({parameter_count(node)})")
    return sorted(out)


def thread_count_readers(sources: dict[str, str]) -> list[str]:
    """``module:line`` of every ``"num-cores"`` string outside kerneltune.targets: a target's thread count is
    read there alone (``host.num_cores``, ``TargetSpec.threads``), so its default and meaning are one."""
    out = []
    for mod, src in sources.items():
        if mod == "kerneltune.targets" or mod.startswith("kerneltune.targets."):
            continue
        out += [f"{mod}:{node.lineno}" for node in ast.walk(ast.parse(src))
                if isinstance(node, ast.Constant) and node.value == "num-cores"]
    return sorted(out)


def bench_sources(root: Path = ROOT) -> dict[str, str]:
    return {module_name(path, root): path.read_text() for path in sorted((root / "bench").rglob("*.py"))}


def test_no_function_below_the_api_takes_more_than_eight_parameters():
    assert wide_functions(project_sources()) == []


def test_only_the_target_package_reads_the_thread_count():
    """The project's packages and bench/ (tests build targets of a given thread count, and may)."""
    assert thread_count_readers({**project_sources(), **bench_sources()}) == []


def test_the_ownership_checks_catch_a_wide_function_and_a_stray_thread_count():
    sources = {
        "graphopt.a": "class C:\n    def m(self, a, b, c, d, e, f, g, h, *args, **kw):\n        pass\n"
                      "def wide(a, b, c, d, e, f, g, h, *, i=0):\n    pass\n",
        "pipeline.api": "def optimize(a, b, c, d, e, f, g, h, i, j):\n    pass\n",
        "pipeline.x": "def f(target):\n    '''its ``num-cores``'''\n    return target.attrs['num-cores']\n",
        "kerneltune.targets.host": "def num_cores(t):\n    return t.attrs.get(\"num-cores\", 1)\n",
    }
    assert wide_functions(sources) == ["graphopt.a.wide:4 (9)"]
    assert thread_count_readers(sources) == ["pipeline.x:3"]


def test_no_script_shadows_a_standard_module():
    """A script's folder is first on ``sys.path`` when it runs, so ``bench/profile.py`` was what torch's
    ``import cProfile`` got for ``profile``: every bench script that loaded torchvision failed.  Top-level
    scripts and test modules must not take a standard library module's name."""
    import sys

    for folder in ("bench", "tests", ".ci"):
        names = {p.stem for p in (ROOT / folder).glob("*.py")}
        assert not names & set(sys.stdlib_module_names), (folder, sorted(names & set(sys.stdlib_module_names)))
