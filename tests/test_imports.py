"""The import graph of attnbench has no cycles: every module can be understood from the ones it imports."""

from __future__ import annotations

import ast
from pathlib import Path

import attnbench

PACKAGE = Path(attnbench.__file__).resolve().parent
IMPLEMENTATIONS = PACKAGE.parent / "implementations"


def _modules(package: Path = PACKAGE, implementations: Path = IMPLEMENTATIONS) -> dict[str, Path]:
    mods = {}
    for root, prefix in ((package, ("attnbench",)), (implementations, ("attnbench", "implementations"))):
        for f in root.rglob("*.py"):
            parts = (*prefix, *f.relative_to(root).with_suffix("").parts)
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def import_graph(root: Path | None = None, strict: bool = False) -> dict[str, set[str]]:
    """Module -> the attnbench modules it imports anywhere in its code (function-level imports included). A package's
    own ``__init__`` imported implicitly with a submodule is not an edge; ``from pkg import name`` is an edge to the
    submodule ``pkg.name`` when there is one, else to ``pkg``.

    ``strict`` (issue 40's count): also the packages a dotted import runs on the way (``attnbench.report`` for
    ``attnbench.report.figures``; not the root ``attnbench``, which every import runs) and name-level ties:
    ``importlib.import_module("attnbench.x")``. ``root``: a checkout other than this one (the tests of the count)."""
    mods = _modules(root / "attnbench", root / "implementations") if root else _modules()

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(known(a.name) for a in node.names if a.name.startswith("attnbench"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if base.startswith("attnbench"):
                    deps.update(known(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else known(base) for a in node.names)
            elif (strict and isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", ""))
                  == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
                  and str(node.args[0].value).startswith("attnbench")):
                deps.add(known(node.args[0].value))
        if strict:  # the packages on the way to each import run their __init__ too
            for dep in [d for d in deps if d]:
                parts = dep.split(".")
                deps.update(".".join(parts[:k]) for k in range(2, len(parts)) if ".".join(parts[:k]) in mods
                            and not name.startswith(".".join(parts[:k]) + "."))
        graph[name] = {d for d in deps if d and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycles():
    graph = import_graph()
    assert "attnbench.runner.engine" in graph and "attnbench.registry" in graph["attnbench.runner.engine"]
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{a} imports {sorted(graph[a] & set(c))}" for a in c) + ")" for c in found)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_package_code_never_imports_the_tests():
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in imported if m == "tests" or m.startswith(("tests.", "conftest"))], name
