"""Durable local files: written under a temporary name, then renamed into place, so a crash at
any moment leaves either the whole new file or none under its final name."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator


@contextmanager
def replaced_atomically(final: Path, temp: Path, *, mode: int = 0o666, exclusive: bool = False) -> Iterator[BinaryIO]:
    """An open ``temp`` to write; on a clean exit it is fsynced, renamed over ``final`` and the
    directory fsynced (which makes the rename itself durable). On an error, raised by the body
    too (a size check, say), ``temp`` is deleted and ``final`` left as it was.

    ``temp`` is created with ``mode`` (less the umask) and never through a symlink; ``exclusive``
    refuses a ``temp`` that is already there instead of truncating it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_EXCL if exclusive else os.O_TRUNC)
    handle = os.open(temp, flags, mode)  # before the try: what is at ``temp`` when this fails is not ours to delete
    try:
        with open(handle, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    directory = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
