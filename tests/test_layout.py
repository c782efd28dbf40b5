"""The package's shape: no module imports itself back through others, at the top of a file or
inside a function (an import moved into a function to dodge a cycle is still a cycle) or for type
hints only; the packages stand in layers, each importing only those below it (type hints
included); no module is over 400 lines; and the top level names the steps of the flow."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import lance_hpc

PACKAGE = Path(lance_hpc.__file__).parent


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


# The packages (and the modules at the top level) from the lowest to the highest: each imports only
# those before it. docs/architecture.md draws the same order.
LAYERS = (
    "errors",  # UserError and exit codes
    "imports",  # import paths, child processes
    "quiet",  # the dependencies' warnings that do not apply
    "output",  # what a process prints: whole lines, progress for a terminal or a log file
    "limits",  # the bounds ingest, decode and the spec agree on
    "lineage",  # provenance of columns, lineage of checkpoints: plain documents, read and written above
    "storage",
    "signals",  # the signals a rank's processes take
    "tasks",
    "spec",
    "slurm",
    "parallel",
    "checkpoint",
    "ingest",
    "loading",
    "runtime",
    "backfill",  # the rows derived columns lack as a table grows, the indices on them
    "writeback",
    "kinds",
    "launch",
    "manage",
    "lance_hpc",  # the public face, lance_hpc/__init__.py
    "bench",
    "cli",  # the command line: a parser per command over the subsystems' functions
    "run",  # python -m shims over cli/
    "submit",
    "__main__",  # python -m lance_hpc: a shim over cli/ (python -m lance_hpc.ingest and .bench run it by name)
)


def _runtime_imports(tree: ast.AST, type_checking: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, wherever it is; those under ``if TYPE_CHECKING:`` only with ``type_checking``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """module -> the package's modules it imports (a ``from package import name`` counts as an import
    of ``package.name`` when that is a module, else of ``package``), and the packages whose
    ``__init__`` that runs, from outside them; the imports for type checkers only with ``type_checking``."""
    modules = module_names()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text(), str(path)), type_checking):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
                # importing a.b.c runs a/b/__init__.py first: an edge to each package it enters
                parent = target.rpartition(".")[0]
                while "." in parent and not name.startswith(f"{parent}."):
                    graph[name].add(parent)
                    parent = parent.rpartition(".")[0]
    return graph


def layer_of(module: str) -> str:
    """The package a module belongs to (``lance_hpc.loading.mix`` -> ``loading``), or the module
    itself at the top level (``lance_hpc.errors`` -> ``errors``; the package's own face is ``lance_hpc``).
    A package's ``__main__`` is of that package: it imports nothing above it."""
    return module.split(".")[1] if "." in module else module


def package_graph() -> dict[str, dict[str, set[str]]]:
    """package -> the other packages it imports, each with the imports that tie them
    ("module -> module"), type hints included: a type names what a module is made of."""
    graph: dict[str, dict[str, set[str]]] = {}
    for module, targets in import_graph(type_checking=True).items():
        ties = graph.setdefault(layer_of(module), {})
        for target in targets:
            if layer_of(target) != layer_of(module):
                ties.setdefault(layer_of(target), set()).add(f"{module} -> {target}")
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_the_graph_sees_imports_inside_functions_and_skips_type_checking_blocks(tmp_path: Path) -> None:
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lance_hpc import spec\n"
        "def later():\n    from lance_hpc.runtime import checkpoint\n"
    )
    imports = _runtime_imports(ast.parse(source))
    assert [node.module for node in imports if isinstance(node, ast.ImportFrom)] == ["typing", "lance_hpc.runtime"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert shortest_cycle({"a": {"b", "d"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, "a") == ["a", "d", "a"]


def test_no_import_cycles() -> None:
    """Between files, type hints included: a module that names another's type for a checker is made
    of it as much as one that calls it (a Protocol of the few methods it needs breaks such a loop)."""
    graph = import_graph(type_checking=True)
    assert len(graph) > 50 and graph["lance_hpc.kinds.rank"]  # the walk found the package
    found = cycles(graph)
    described = [
        "; ".join(f"{module} -> {', '.join(sorted(graph[module] & set(component)))}" for module in component)
        for component in found
    ]
    assert not found, "import cycles:\n" + "\n".join(described)


def shortest_cycle(graph: dict[str, set[str]], start: str) -> list[str]:
    """The shortest path of imports from ``start`` back to it (breadth first), or [] if none."""
    paths = {start: [start]}
    queue = [start]
    for node in queue:
        for other in sorted(graph[node]):
            if other == start:
                return paths[node] + [start]
            if other not in paths:
                paths[other] = paths[node] + [other]
                queue.append(other)
    return []


def test_the_packages_import_each_other_without_a_cycle() -> None:
    graph = package_graph()
    found = cycles({package: set(ties) for package, ties in graph.items()})
    described = []
    for component in found:
        loop = shortest_cycle({package: set(graph[package]) & set(component) for package in component}, component[0])
        steps = [f"  {a} -> {b}: {', '.join(sorted(graph[a][b]))}" for a, b in zip(loop, loop[1:])]
        described.append(f"{' -> '.join(loop)} (of {', '.join(component)})\n" + "\n".join(steps))
    assert not found, "packages that import each other, with the imports that close a loop:\n" + "\n".join(described)


def test_every_package_imports_only_the_layers_below_it() -> None:
    graph = package_graph()
    assert set(graph) == set(LAYERS), (
        f"packages missing from LAYERS: {sorted(set(graph) - set(LAYERS))}, gone: {sorted(set(LAYERS) - set(graph))}"
    )
    upward = [
        tie
        for package, ties in graph.items()
        for other, found in ties.items()
        if LAYERS.index(other) > LAYERS.index(package)
        for tie in sorted(found)
    ]
    assert not upward, (
        "imports that run up the layers (tests/test_layout.py LAYERS, lowest first): move the piece both need to the "
        "lower package, or into a small one of its own below both\n  " + "\n  ".join(upward)
    )


MODULE_LINES = 400  # house style: a module that would pass this becomes a package


def test_every_module_is_at_most_400_lines() -> None:
    lengths = {path: len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert len(lengths) > 50  # the walk found the package
    longer = sorted(f"{path.relative_to(PACKAGE.parent)}: {lines}" for path, lines in lengths.items() if lines > MODULE_LINES)
    assert not longer, f"modules over {MODULE_LINES} lines: split each into a package of smaller ones\n  " + "\n  ".join(longer)


def test_the_top_level_names_the_steps_of_the_flow() -> None:
    packages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    assert {"cli", "spec", "launch", "runtime", "loading", "ingest", "writeback", "storage", "tasks", "manage"} <= packages
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    # the public face, the python -m shims over cli/ (submit, run), and what every step shares
    # (errors, imports, limits, signals, output: how lines are printed, and quiet: the dependencies'
    # warnings that do not apply)
    shared = {"errors", "imports", "limits", "quiet", "signals", "output"}
    assert modules <= {"__init__", "__main__", "submit", "run", *shared}


# An import path to lance_hpc's own code written in a string, as load_callable takes it.
IMPORT_PATH_TEXT = re.compile(r"lance_hpc(?:\.\w+)+:\w+(?:\.\w+)*")


def upward_import_paths() -> list[str]:
    """Import paths in strings (``lance_hpc.kinds.train:Train``) that name a module of a higher layer."""
    modules, found = module_names(), []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and IMPORT_PATH_TEXT.fullmatch(node.value):
                target = node.value.partition(":")[0]
                if target in modules and LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(name)):
                    found.append(f"{name}: {node.value!r}")
    return found


def test_no_package_names_code_above_it_by_import_path() -> None:
    """A string loaded on use is an import all the same: the spec once named the kinds it validates
    this way. A lower package asks for what it needs through a registry that it owns instead."""
    assert IMPORT_PATH_TEXT.fullmatch("lance_hpc.kinds.train:Train") and not IMPORT_PATH_TEXT.fullmatch("lance_hpc.run")
    found = upward_import_paths()
    assert not found, "import paths in strings that run up the layers:\n  " + "\n  ".join(found)
