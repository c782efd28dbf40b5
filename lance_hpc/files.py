"""Durable local files: written under a temporary name, then renamed into place, so a crash at
any moment leaves either the whole new file or none under its final name."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator


@contextmanager
def replaced_atomically(final: Path, temp: Path) -> Iterator[BinaryIO]:
    """An open ``temp`` to write; on a clean exit it is fsynced, renamed over ``final`` and the
    directory fsynced (which makes the rename itself durable). On an error, raised by the body
    too (a size check, say), ``temp`` is deleted and ``final`` left as it was."""
    try:
        with open(temp, "wb") as file:
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
