"""The public face, ``from lance_hpc import ...``: the names a user's task, training loop or job kind
needs, each typed and documented, listed on the docs page, loaded only when used; the examples and
the docs import nothing else of lance_hpc."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lance_hpc

ROOT = Path(__file__).resolve().parents[1]
# Code a user reads as an example: the examples, and the task the docs call a complete example.
EXAMPLES = [*sorted((ROOT / "examples").rglob("*.py")), ROOT / "tests" / "custom_task.py"]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^ *```python[^\n]*\n(.*?)^ *```", re.MULTILINE | re.DOTALL)
# Type aliases carry no docstring of their own: the face's module doc and the docs page say what they are.
ALIASES = {"Batch"}


def public_api_section() -> str:
    text = (ROOT / "docs" / "tasks.md").read_text()
    return text.split("## Public API", 1)[1].split("\n## ", 1)[0]


def test_the_face_is_small_and_every_name_resolves() -> None:
    assert 10 <= len(lance_hpc.__all__) <= 19, lance_hpc.__all__
    assert sorted(lance_hpc.__all__) == lance_hpc.__all__ and len(set(lance_hpc.__all__)) == len(lance_hpc.__all__)
    for name in lance_hpc.__all__:
        assert getattr(lance_hpc, name) is not None, name
        assert name in dir(lance_hpc)
    assert lance_hpc.Context.__module__ == "lance_hpc.runtime.context"


@pytest.mark.parametrize("name", ["run_entry", "preflight", "plan_data", "load_spec", "TASKS", "build_train_loader"])
def test_internals_are_not_on_the_face_but_stay_in_their_modules(name: str) -> None:
    with pytest.raises(AttributeError, match=f"has no attribute '{name}'"):
        getattr(lance_hpc, name)
    from lance_hpc import loading, spec, tasks
    from lance_hpc.runtime import entry

    assert any(hasattr(module, name) for module in (loading, spec, tasks, entry)), name


@pytest.mark.parametrize("name", sorted(set(lance_hpc.__all__) - ALIASES))
def test_every_public_name_is_documented_and_typed(name: str) -> None:
    value = getattr(lance_hpc, name)
    doc = value.__dict__.get("__doc__") if isinstance(value, type) else value.__doc__
    assert doc and doc.strip(), f"lance_hpc.{name} ({value.__module__}) has no docstring of its own"
    functions = [value] if inspect.isfunction(value) else []
    if isinstance(value, type):  # the methods a user calls or overrides, defined in lance_hpc
        functions = [
            member
            for member_name, member in vars(value).items()
            if inspect.isfunction(member) and not member_name.startswith("_") and member.__module__.startswith("lance_hpc")
        ]
    for function in functions:
        signature = inspect.signature(inspect.unwrap(function))
        unannotated = [p.name for p in signature.parameters.values() if p.name != "self" and p.annotation is p.empty]
        assert not unannotated, f"{name}.{function.__name__}: parameters without a type: {unannotated}"
        assert signature.return_annotation is not signature.empty, f"{name}.{function.__name__}: no return type"


def test_the_docs_page_lists_exactly_the_face() -> None:
    listed = re.findall(r"^\| `(\w+)`", public_api_section(), re.MULTILINE)
    assert sorted(listed) == lance_hpc.__all__, "docs/tasks.md, Public API, lists " + ", ".join(listed)


def imported_modules(source: str, where: str) -> list[str]:
    """The lance_hpc modules ``source`` imports, wherever in it."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lance_hpc"):
            found.append(node.module or "")
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("lance_hpc")]
    return found


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: str(path.relative_to(ROOT)))
def test_examples_import_only_the_face(path: Path) -> None:
    modules = imported_modules(path.read_text(), str(path))
    assert set(modules) <= {"lance_hpc"}, f"{path.relative_to(ROOT)} imports {sorted(set(modules) - {'lance_hpc'})}"


def test_the_docs_python_examples_import_only_the_face() -> None:
    wrong = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text()):
            wrong += [f"{page.relative_to(ROOT)}: {module}" for module in re.findall(r"from (lance_hpc\.[\w.]+) import", block)]
            wrong += [f"{page.relative_to(ROOT)}: {module}" for module in re.findall(r"import (lance_hpc\.[\w.]+)", block)]
    assert not wrong, "docs examples import past the face:\n" + "\n".join(wrong)


def test_importing_the_package_loads_neither_torch_nor_lance() -> None:
    probe = "import sys, lance_hpc; print('torch' in sys.modules, 'lance' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.split() == ["False", "False"], result.stdout + result.stderr


def test_a_rank_that_does_not_shard_never_imports_torch_distributed_checkpoint() -> None:
    """It takes about 0.6 s (DTensor, sympy): only a sharded save or resume imports it."""
    modules = "lance_hpc.kinds.rank, lance_hpc.kinds.train, lance_hpc.kinds.infer, lance_hpc.runtime.checkpoints"
    probe = f"import sys, {modules}; print([name for name in ('torch.distributed.checkpoint', 'sympy') if name in sys.modules])"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
