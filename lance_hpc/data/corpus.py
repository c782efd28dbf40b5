"""Where a text corpus comes from: ``text:<glob>`` (each file one document; ``**`` recurses) and
``python-stdlib[:max_mb=N]`` (this interpreter's standard library: text on every machine, no
download), as document paths in a deterministic order."""

from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path

from lance_hpc.errors import UserError

STDLIB_MAX_MB = 8.0
# Tests and their data (some deliberately invalid Python), the IDE, the deprecated lib2to3, demos and
# installed packages: not the library's own code.
STDLIB_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
)


def is_text_source(source: str) -> bool:
    """True for the sources this module ingests: ``text:<glob>`` and ``python-stdlib[:...]``."""
    return source.startswith("text:") or source.partition(":")[0] == "python-stdlib"


def document_paths(source: str) -> list[Path]:
    """The files of a text source, one document each, in a deterministic (sorted) order."""
    kind, _, rest = source.partition(":")
    if kind == "text" and rest:
        paths = sorted(Path(match) for match in glob.glob(rest, recursive=True) if os.path.isfile(match))
        if not paths:
            raise UserError(f"text source: no files match the glob {rest!r}: fix the pattern (** matches any directories)")
        return paths
    if kind == "python-stdlib":
        return stdlib_paths(_max_mb(rest))
    raise UserError(f"unknown text source {source!r}: use text:<glob> or python-stdlib[:max_mb=N]")


def _max_mb(options: str) -> float:
    if not options:
        return STDLIB_MAX_MB
    key, _, value = options.partition("=")
    try:
        max_mb = float(value) if key.strip() == "max_mb" else 0.0
    except ValueError:
        max_mb = 0.0
    if not max_mb > 0:
        raise UserError(f"python-stdlib option {options!r}: the only option is max_mb=N (N > 0), e.g. python-stdlib:max_mb=8")
    return max_mb


def stdlib_paths(max_mb: float = STDLIB_MAX_MB) -> list[Path]:
    """The ``.py`` files of this interpreter's standard library, sorted, whole files while their
    total stays within ``max_mb`` megabytes (10**6 bytes)."""
    found: list[Path] = []
    for directory, subdirectories, files in os.walk(sysconfig.get_paths()["stdlib"]):
        subdirectories[:] = [name for name in subdirectories if name not in STDLIB_SKIPPED_DIRS]
        found += [Path(directory, name) for name in files if name.endswith(".py")]
    taken, total, limit = [], 0, int(max_mb * 1_000_000)
    for path in sorted(found):
        total += path.stat().st_size
        if total > limit:
            break
        taken.append(path)
    return taken
