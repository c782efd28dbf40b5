"""Import paths in a spec: ``pkg.module:Name`` or ``path/to/file.py:Name``.

A file path is loaded as a module named after the file, with the file's directory added at the
end of ``sys.path``, where it stays: the file's own imports of its siblings (at its top, or later
inside a function) find them there, and so do the DataLoader workers, which unpickle the task's
decoder by its module's name (the rank resolves every import path before their server starts, and
each worker gets the rank's ``sys.path``). At the end, never first: a module planted beside the
file under the name of one already importable (``lance.py``, ``json.py``) never shadows it, in the
file's imports or in anything the rank imports later. A file named like an importable module is
refused (rename it).

Importing runs the module's code. So ``validate``, ``submit`` (``--dry-run`` too) and the job's
ranks import these paths; ``status``, ``logs`` and ``cancel`` never do (they validate with
``imports=False``, see :func:`lance_hpc.spec.load.validate_spec`).

Nothing else is imported from where a process happens to run: every Python process lance_hpc
starts (:func:`python_command`, :func:`child_environment`) leaves the working directory off
``sys.path``, which ``python -m`` would put first. Run from a directory others can write to, a
child would otherwise import their ``typing_extensions.py`` in place of the real one.
"""

from __future__ import annotations

import importlib
import os
import site
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from lance_hpc.errors import UserError, listing

PYTHONPATH_ADVICE = (
    "check the spelling, and that the package is importable where the job runs: installed in its "
    "environment, or its directory on PYTHONPATH (export PYTHONPATH=/path/to/project in slurm.setup); "
    "or name a file: path/to/file.py:Name"
)


# Python 3.11+: -P starts the process itself without the working directory on sys.path, and the
# variable does the same for every Python it starts in turn (multiprocessing's forkserver, say).
SAFE_PATH_FLAG = "-P"
SAFE_PATH_VARIABLE = "PYTHONSAFEPATH"


def python_command(*arguments: str) -> list[str]:
    """This interpreter with ``arguments`` (``-m module ...``), without the working directory on sys.path."""
    return [sys.executable, SAFE_PATH_FLAG, *arguments]


def child_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a Python process lance_hpc starts: ``PYTHONSAFEPATH=1``, and this
    lance_hpc's directory first on PYTHONPATH when it is a checkout rather than an installed
    package, which the working directory no longer provides: a child imports the same lance_hpc
    as its parent. (An installed one is found as it is: site-packages put on PYTHONPATH would come
    before the standard library.)"""
    result = dict(os.environ if environ is None else environ)
    package_root = str(Path(__file__).resolve().parents[1])
    installed = {*site.getsitepackages(), site.getusersitepackages()}
    paths = [path for path in result.get("PYTHONPATH", "").split(os.pathsep) if path]
    if package_root not in installed and package_root not in paths[:1]:
        result["PYTHONPATH"] = os.pathsep.join([package_root, *paths])
    result[SAFE_PATH_VARIABLE] = "1"
    return result


def is_import_path(text: str) -> bool:
    """True for ``module:Name`` and ``file.py:Name`` (a registered name has no colon)."""
    module, sep, name = text.rpartition(":")
    return bool(sep and module and name)


def load_object(path: str, what: str) -> Any:
    """The object ``path`` names; a UserError naming ``what`` (e.g. ``task.name``), the path, the
    exception and how to fix it, when it does not import or does not exist."""
    module_name, sep, attribute = path.rpartition(":")
    if not (sep and module_name and attribute):
        raise UserError(f"{what}: {path!r} is not an import path\n  fix: write package.module:Name or path/to/file.py:Name")
    try:
        module = _import(module_name)
    except UserError:
        raise
    except Exception as error:  # an import runs arbitrary code: any exception means "does not import"
        raise UserError(
            f"{what}: cannot import {module_name!r} from {path!r}: {type(error).__name__}: {error}\n  fix: {PYTHONPATH_ADVICE}"
        ) from None
    found: Any = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            public = sorted(name for name in vars(module) if not name.startswith("_"))
            raise UserError(
                f"{what}: {module_name!r} has no {attribute!r} (from {path!r}); it defines:{listing(public, '    ', most=20)}\n"
                "  fix: name one of those after the colon"
            )
        found = getattr(found, part)
    return found


def load_callable(path: str, what: str) -> Any:
    """Like :func:`load_object`, and the object must be callable (a class or a function)."""
    found = load_object(path, what)
    if not callable(found):
        raise UserError(
            f"{what}: {path!r} names a {type(found).__name__}, not something callable\n  fix: name a class or a function"
        )
    return found


def _import(module_name: str) -> Any:
    if not module_name.endswith(".py"):
        return importlib.import_module(module_name)
    file = Path(module_name).resolve()
    if not file.is_file():
        raise UserError(
            f"{module_name}: no such file\n  fix: give the file's path, absolute or relative to the directory you run lance-hpc from"
        )
    if not file.stem.isidentifier():
        raise UserError(f"{file}: {file.stem!r} is not a valid module name\n  fix: rename the file, e.g. my_task.py")
    directory = str(file.parent)
    if directory not in sys.path:
        sys.path.append(directory)  # last: it adds the file's siblings, and shadows nothing (module doc)
    module = importlib.import_module(file.stem)
    if Path(getattr(module, "__file__", "") or "").resolve() != file:
        raise UserError(f"{file}: the module name {file.stem!r} is already taken by {module.__file__}\n  fix: rename the file")
    return module


def lazy_exports(package: str, module_of: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's ``__getattr__`` that loads each public name from its module when first used
    (and keeps it), so importing the package costs nothing its caller does not use."""

    def attribute(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return attribute
