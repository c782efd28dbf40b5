"""The names the node cache writes, and where: only names Lance itself gives its files, each
inside the cache's dataset root.

Whoever writes a dataset writes its manifest, and the manifest names the data files. Lance escapes
such a name when it reads (``../../x`` is read as ``data/..%2F..%2Fx``), but a local path joined
from it leads anywhere the reading user may write: a manifest naming
``../../../../.bashrc`` would have the cache rename the author's bytes over the reader's file.
So the cache mirrors a file only under a name Lance writes (:func:`is_cached_name`: one plain file
name in ``data/``, ``_deletions/`` or ``_versions/``), and every path it writes into a root
(mirrored file, partial file, lock file) comes from :func:`inside`, which refuses one that resolves
outside the root. A fragment with any other name is read from the store, uncached.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

MANIFEST_DIR = "_versions"


CACHED_DIRS = ("data", "_deletions", MANIFEST_DIR)


# The names the cache writes under each of CACHED_DIRS (Lance's names): eviction deletes nothing
# else, and a file the manifest names otherwise is never mirrored. ASCII only: Lance writes no other.
CACHED_NAMES = {
    "data": re.compile(r"[\w-]+\.lance", re.ASCII),
    "_deletions": re.compile(r"\d+-\d+-\d+\.(?:arrow|bin)", re.ASCII),
    MANIFEST_DIR: re.compile(r"\d+\.manifest", re.ASCII),
}


PARTIAL = ".partial"


PARTIAL_NAME = re.compile(rf"(?P<final>.+)\.\d+-\d+{re.escape(PARTIAL)}")  # <name>.<pid>-<thread>.partial


class Uncacheable(OSError):
    """A file the cache cannot keep: it is left uncached, and its rows are read from the store."""


class OutsideRoot(Uncacheable):
    """A path the cache was asked to write that is not a plain file name inside its dataset root."""


def is_cached_name(path: str) -> bool:
    """Whether ``path`` (relative to a dataset root) is a name the cache mirrors: ``<dir>/<name>``
    with ``dir`` one of :data:`CACHED_DIRS` and ``name`` as Lance writes files there."""
    directory, separator, name = path.partition("/")
    pattern = CACHED_NAMES.get(directory)
    return bool(separator) and pattern is not None and pattern.fullmatch(name) is not None


def inside(root: Path, relative: str) -> Path:
    """``root / relative``, for a file the cache writes; raises :class:`OutsideRoot` unless
    ``relative`` is relative, has no ``..`` or empty component, and the file's directory resolved
    (symlinks followed) is the root or under it. The file itself is not resolved: a symlink planted
    there is replaced by the rename, never followed (files are opened with ``O_NOFOLLOW``)."""
    parts = relative.split("/")
    path = root / relative
    if os.path.isabs(relative) or any(part in ("", ".", "..") for part in parts):
        raise OutsideRoot(errno.EINVAL, "not a plain file name under the cache root", str(path))
    if not path.parent.resolve().is_relative_to(root.resolve()):
        raise OutsideRoot(errno.EXDEV, f"resolves outside the cache root {root}", str(path))
    return path


def lock_path(root: Path, path: str, kind: str) -> Path:
    """The lock file of ``kind`` guarding ``path``: one file in the root's ``.locks/``."""
    return inside(root, f".locks/{path.replace('/', '%')}.{kind}")
