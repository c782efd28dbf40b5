"""The package's shape: no module imports itself back through others, at the top of a file or
inside a function (an import moved into a function to dodge a cycle is still a cycle), and the
top level names the steps of the flow."""

from __future__ import annotations

import ast
from pathlib import Path

import lance_hpc

PACKAGE = Path(lance_hpc.__file__).parent


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, wherever it is, except those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (a ``from package import name`` counts as an import
    of ``package.name`` when that is a module, else of ``package``), and the packages whose
    ``__init__`` that runs, from outside them."""
    modules = module_names()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
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


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 50 and graph["lance_hpc.runtime.rank"]  # the walk found the package
    found = cycles(graph)
    described = [
        "; ".join(f"{module} -> {', '.join(sorted(graph[module] & set(component)))}" for module in component)
        for component in found
    ]
    assert not found, "import cycles:\n" + "\n".join(described)


def test_the_top_level_names_the_steps_of_the_flow() -> None:
    packages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    assert {"cli", "spec", "launch", "runtime", "data", "storage", "tasks", "manage"} <= packages
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    # the public face, the python -m shims over cli/ (submit, run, ingest), and what every step
    # shares (errors, imports, and quiet: the dependencies' warnings that do not apply)
    assert modules <= {"__init__", "__main__", "submit", "run", "ingest", "errors", "imports", "quiet"}
