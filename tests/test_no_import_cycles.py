"""No import circle in specforge_csbp: every module's imports, function-local ones included, form a DAG.

A circle hidden by a function-local import still ties two modules together (neither can be read or
tested alone); docs/architecture.md's map says each module imports only the ones above it. The graph is
read from the source (ast), so a lazy import counts as an edge like any other:

    from .step import load_context     (inside a function of prefetch.py)  -> edge prefetch -> step
    from . import groups               (plugin/__init__ siblings)          -> edge to plugin.groups
    from ..models.dflash import X      (X not a submodule)                 -> edge to models.dflash (__init__)
"""

from __future__ import annotations

import ast
from pathlib import Path

import specforge_csbp

PACKAGE = Path(specforge_csbp.__file__).parent


def _modules(root: Path, package: str) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (package, *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its source (top level or inside a function)."""
    modules = _modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    edges.add(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_specforge_csbp_has_no_import_cycle():
    graph = import_graph(PACKAGE, "specforge_csbp")
    assert len(graph) > 50  # the whole package was read
    assert cycles(graph) == []


def test_a_cycle_through_a_function_local_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import f\n")
    (pkg / "sub" / "a.py").write_text("from ..b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from .sub import a  # hidden circle\n    return a\n")
    (pkg / "c.py").write_text("from . import b\n")
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.c"] == {"pkg.b"}
    assert cycles(graph) == [["pkg.b", "pkg.sub.a"]]
