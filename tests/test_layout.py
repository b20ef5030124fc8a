"""The package layout is the architecture: each folder one layer, imports only downward, no circles, no library
module importing test plumbing, internal imports at the top of files (README's Layout section).

Read from the source text with ``ast`` (nothing is imported), so a violation names the file and line."""

from __future__ import annotations

import ast
import os
import re
from typing import Dict, List, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "python", "moe_graph")

# Lowest first. A module may import its own folder's modules and anything on a lower floor, never a higher one or
# a sibling on the same floor (distributed and moe do not know each other; train composes them).
FLOORS: Dict[str, int] = {
    "ops": 0,
    "parallel_state": 1,
    "cuda_graph": 1,
    "streams": 1,
    "fp8": 1,  # the public address of ops.fp8
    "grouped_linear": 2,
    "distributed": 3,
    "moe": 3,
    "train": 4,
    "integrations": 5,
    "testing": 5,  # float64 references: may import the machinery's public helpers below it
    "demo": 6,
    "selfcheck": 6,
}
# Only the shipped commands may use the references (selfcheck checks the kernels against them).
MAY_IMPORT_TESTING = {"demo", "selfcheck"}


def _modules() -> Dict[str, str]:
    mods = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
                mods[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return mods


def _imports(path: str, mods: Dict[str, str]) -> List[Tuple[int, str, bool]]:
    """(line, imported moe_graph module, inside a function) for every internal import of ``path``."""
    tree = ast.parse(open(path).read(), path)
    parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        assert not (isinstance(node, ast.ImportFrom) and node.level), f"{path}:{node.lineno}: relative import"
        if isinstance(node, ast.ImportFrom):
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                       for a in node.names]
        else:
            targets = [a.name for a in node.names]
        q, local = node, False
        while q in parents:
            q = parents[q]
            local |= isinstance(q, (ast.FunctionDef, ast.AsyncFunctionDef))
        out += [(node.lineno, t, local) for t in targets if t.split(".")[0] == "moe_graph" and t != "moe_graph._C"]
    return out


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _graph():
    mods = _modules()
    return mods, {m: _imports(p, mods) for m, p in mods.items()}


def test_every_top_level_module_has_a_floor():
    mods, _ = _graph()
    missing = sorted({_top(m) for m in mods} - set(FLOORS) - {""})
    assert not missing, f"add {missing} to FLOORS (and to README's Layout)"


def test_imports_point_down_and_never_into_test_plumbing():
    mods, graph = _graph()
    bad = []
    for m, imports in graph.items():
        src = _top(m)
        for line, target, _ in imports:
            dst = _top(target)
            if not src or not dst or src == dst:
                continue  # the package face re-exports; a folder imports itself
            if dst == "testing" and src not in MAY_IMPORT_TESTING:
                bad.append(f"{mods[m]}:{line}: {m} imports test references {target}")
            elif FLOORS[dst] >= FLOORS[src]:
                bad.append(f"{mods[m]}:{line}: {m} (floor {FLOORS[src]}) imports {target} (floor {FLOORS[dst]})")
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    mods, graph = _graph()
    edges: Dict[str, Set[str]] = {m: {t for _, t, _ in imps if t in mods and t != m and not m.startswith(t + ".")}
                                  for m, imps in graph.items()}
    # Tarjan's strongly connected components: any component with two modules is a circle.
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    circles = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_internal_imports_at_the_top_of_files():
    mods, graph = _graph()
    local = [f"{mods[m]}:{line}: {target}" for m, imps in graph.items() for line, target, inside in imps if inside]
    assert not local, "function-local internal imports:\n" + "\n".join(local)


def test_nothing_in_the_package_imports_tests_or_benchmarks():
    bad = []
    for m, path in _modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path}:{node.lineno}: {n}" for n in names if re.match(r"(tests|helpers|benchmarks|common)\b", n)]
    assert not bad, "\n".join(bad)


def test_the_layout_test_fails_on_a_violation(tmp_path, monkeypatch):
    # The checks above are only worth something if they can fail: plant an upward import, a circle and a local
    # import in a copy of the graph and see each check report it.
    mods, graph = _graph()
    planted = dict(graph)
    planted["moe_graph.ops.errors"] = graph["moe_graph.ops.errors"] + [(1, "moe_graph.moe.layer", True)]
    planted["moe_graph.moe.layer"] = graph["moe_graph.moe.layer"] + [(1, "moe_graph.ops.errors", False)]
    monkeypatch.setattr(__import__(__name__), "_graph", lambda: (mods, planted))
    for check in (test_imports_point_down_and_never_into_test_plumbing, test_internal_imports_at_the_top_of_files):
        try:
            check()
        except AssertionError:
            continue
        raise AssertionError(f"{check.__name__} missed a planted violation")
    # a circle: ops.errors -> moe.layer -> ops.errors
    try:
        test_no_import_circles()
    except AssertionError:
        return
    raise AssertionError("test_no_import_circles missed a planted circle")
