"""Every import inside specforge_csbp points DOWN the architecture map (docs/architecture.md).

The map is one ordered list, lowest first: a module may import a module of its own entry (the cycle test,
tests/test_no_import_cycles.py, keeps those a DAG) or of an entry before its own, never one after it. An
entry is a folder or a module; a module belongs to the longest entry that prefixes its dotted name, so
`models.bdlm.recipe` sits above `training` while the rest of `models` sits below it:

    layout < preflight < errors < ... < models < ... < training < models.bdlm.recipe < ... < cli < studies
    training/checkpointing.py: from ..planner.memory import ...    planner < training: down, allowed
    planner/pairs.py: from ..training import ...                    training > planner: up, "planner.pairs -> training..."

Function-local imports count like top-level ones: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_no_import_cycles import PACKAGE, import_graph

# The architecture map, lowest first (docs/architecture.md draws the same order top to bottom).
ORDER = [
    "",  # the package root: __version__ only
    "stack",  # the supported releases, checked at start-up (metadata only)
    "layout",
    "values",  # the one parser per kind of value (sizes, override values)
    "preflight",
    "errors",  # reads a user's files through preflight.check_input_file
    "outputs",
    "progress",  # tqdm bars that print plain lines off a terminal
    "devices",
    "masks",
    "attention",
    "distributed",
    "parallel",
    "objectives",  # the losses need only layout; the models call them
    "models",
    "data",
    "assets",  # the tiny target is written through data.capture
    "compat",  # the one pair check of two artifacts a command combines (reads data.manifest's config hash)
    "bench",  # records, plots, runners: below the planner, whose calibration reads records
    "planner",  # cost / memory model over the models' plans and the objectives' chunking
    "training",  # activation_checkpointing: auto asks the planner's memory model
    "models.bdlm.recipe",  # the train-bdlm recipe: a BDLM's sections on top of training's generic ones
    "export",
    "eval",  # loads exported drafters
    "plugin",  # the SpecForge plugin warm-starts from exported checkpoints
    "cli",
    "studies",  # a study drives `specforge-csbp` commands (cli.main in process)
    "__main__",
]


def rank(module: str, package: str, order: list[str]) -> int:
    """The index in `order` of the longest entry that prefixes `module` (a ValueError names an unplaced one)."""
    rel = module[len(package) + 1 :] if module != package else ""
    matches = [i for i, e in enumerate(order) if e == rel or (e and rel.startswith(e + "."))]
    if not matches:
        raise ValueError(f"{module} has no entry in the architecture order; add its folder to ORDER")
    best = max(matches, key=lambda i: len(order[i]))
    return best


def upward_imports(graph: dict[str, set[str]], package: str, order: list[str]) -> list[str]:
    """'importer -> imported (entry < entry)' for every import that points up the order."""
    bad = []
    for importer in sorted(graph):
        here = rank(importer, package, order)
        for imported in sorted(graph[importer]):
            there = rank(imported, package, order)
            if there > here:
                bad.append(
                    f"{importer} -> {imported} (up the map: {order[here] or package} -> {order[there]})"
                )
    return bad


def test_every_import_points_down_the_architecture_map():
    graph = import_graph(PACKAGE, "specforge_csbp")
    assert len(graph) > 50  # the whole package was read
    assert upward_imports(graph, "specforge_csbp", ORDER) == []


def test_every_folder_of_the_package_has_a_place_in_the_order():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    leaves = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert folders | leaves <= set(ORDER)


def test_the_map_in_docs_lists_the_folders_in_the_same_order():
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = doc.split("```")[1]  # the map is the first code block
    heads = [
        line.split()[0].rstrip("/").removesuffix(".py") for line in block.splitlines() if line[:1].isalpha()
    ]
    folders = [e for e in ORDER if e and "." not in e and e != "__main__"]
    assert heads == folders


def test_an_upward_import_is_named_with_its_module_pair(tmp_path: Path):
    pkg = tmp_path / "pkg"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "high" / "user.py").write_text("from ..low import base\n")
    (pkg / "low" / "base.py").write_text(
        "def f():\n    from ..high.user import g  # lazy, still up\n    return g\n"
    )
    graph = import_graph(pkg, "pkg")
    assert upward_imports(graph, "pkg", ["", "low", "high"]) == [
        "pkg.low.base -> pkg.high.user (up the map: low -> high)"
    ]
    assert upward_imports(graph, "pkg", ["", "high", "low"]) == [
        "pkg.high.user -> pkg.low.base (up the map: high -> low)"
    ]


def test_a_module_belongs_to_the_longest_entry_that_prefixes_it():
    order = ["", "models", "training", "models.bdlm.recipe"]
    assert rank("p", "p", order) == 0
    assert rank("p.models.bdlm.adapter", "p", order) == 1
    assert rank("p.models.bdlm.recipe", "p", order) == 3
    assert rank("p.modelsx", "p", order + ["modelsx"]) == 4  # a prefix ends at a dot
    with pytest.raises(ValueError, match="p.cli has no entry"):
        rank("p.cli", "p", order)


# Function-local imports of the package still without a `# lazy:` reason: each is to be hoisted or given
# one at the next edit of its file, and then leaves this set. Each entry is (file, imported module).
_REASON_PENDING: set[tuple[str, str]] = set()


def unexplained_local_imports(root: Path) -> list[str]:
    """'file:line module' for each function-local import of the package (relative, or by its name) that has
    no `# lazy: why` comment on its line or directly above its group of imports."""
    out = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").split("\n")
        tree = ast.parse("\n".join(lines), str(path))
        group_start = {}  # end line of an import -> start line of its import group
        imports = sorted(
            (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))), key=lambda n: n.lineno
        )
        for n in imports:
            group_start[n.end_lineno] = group_start.get(n.lineno - 1, n.lineno)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for n in ast.walk(fn):
                if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith(root.name)):
                    name = "." * n.level + (n.module or "")
                elif isinstance(n, ast.Import) and any(a.name.startswith(root.name) for a in n.names):
                    name = n.names[0].name
                else:
                    continue
                start = group_start.get(n.lineno - 1, n.lineno)
                said = "# lazy:" in " ".join(lines[n.lineno - 1 : n.end_lineno]) or (
                    start >= 2 and lines[start - 2].strip().startswith("# lazy:")
                )
                rel = path.relative_to(root).as_posix()
                if not said and (rel, name) not in _REASON_PENDING:
                    out.append(f"{rel}:{n.lineno} {name}")
    return sorted(set(out))


def test_every_function_local_import_of_the_package_says_why_it_is_lazy():
    assert unexplained_local_imports(PACKAGE) == []


def test_a_lazy_import_without_a_reason_is_named(tmp_path: Path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "def f():\n"
        "    # lazy: optional dependency\n"
        "    import json\n"
        "    from . import b\n"
        "\n"
        "    from .b import g\n"
        "    return b, g, json\n"
        "\n"
        "def h():\n"
        "    from .b import g  # lazy: CLI start-up\n"
        "    import pkg.b\n"
        "    return g\n"
    )
    (pkg / "b.py").write_text("g = 1\n")
    assert unexplained_local_imports(pkg) == ["a.py:11 pkg.b", "a.py:6 .b"]
