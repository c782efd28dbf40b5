"""``python-stdlib[:max_mb=N]``: the ``.py`` files of this interpreter's standard library as a text
corpus, sorted, whole files while their total stays within ``max_mb`` (8 by default)."""

from __future__ import annotations

import sysconfig

import pyarrow.fs as pafs

from lance_hpc.errors import UserError
from lance_hpc.ingest.formats.text import Text

STDLIB = "python-stdlib"
STDLIB_MAX_MB = 8.0
# Tests and their data (some deliberately invalid Python), the IDE, the deprecated lib2to3, demos and
# installed packages: not the library's own code.
STDLIB_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
)


class PythonStdlib(Text):
    name = STDLIB

    @property
    def base(self) -> str:
        return self.pattern.rstrip("/")

    def shards(self, source: str) -> list[str]:
        max_bytes = int(max_mb(source) * 1_000_000)
        self.open(sysconfig.get_paths()["stdlib"])
        found = [
            info
            for info in self.filesystem.get_file_info(pafs.FileSelector(self.base, recursive=True))
            if info.type == pafs.FileType.File
            and info.path.endswith(".py")
            and not STDLIB_SKIPPED_DIRS & set(self.key(info.path).split("/")[:-1])
        ]
        taken, total = [], 0
        for info in sorted(found, key=lambda item: item.path):
            total += info.size or 0
            if total > max_bytes:
                break
            taken.append(info)
        return self.file_runs(taken)


def max_mb(options: str) -> float:
    """The ``max_mb=N`` of the source's options, or the default."""
    if not options:
        return STDLIB_MAX_MB
    key, _, value = options.partition("=")
    try:
        found = float(value) if key.strip() == "max_mb" else 0.0
    except ValueError:
        found = 0.0
    if not found > 0:
        raise UserError(f"{STDLIB} option {options!r}: the only option is max_mb=N (N > 0), e.g. {STDLIB}:max_mb=8")
    return found
