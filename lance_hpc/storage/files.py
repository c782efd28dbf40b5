"""Durable local files, and files read back from directories others may write to.

Written under a temporary name in the same directory, fsynced, then renamed into place, so a crash
or a full disk at any moment leaves either the whole new file or the old one under its final name,
never a truncated mix. Every file lance_hpc writes or rewrites for the user (a tuned spec, the
resolved spec and script, records, checkpoints and their manifests, metrics) goes through
:func:`replaced_atomically` or :func:`write_file`.

Read back through :func:`open_regular` or :func:`read_regular`: in a shared directory anyone may
have put a FIFO (which blocks a reader forever), a link to a device such as /dev/zero (which never
ends) or a file of any size where lance_hpc's own small file belongs.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from lance_hpc.errors import UserError

# A new file's mode before the umask, as open() gives it.
NEW_FILE_MODE = 0o666
PRIVATE_MODE = 0o600
# Ends the name of the temporary file beside a final one that write_file and replaced_atomically make.
TEMP_SUFFIX = ".tmp"


@contextmanager
def replaced_atomically(
    final: Path, temp: Path | None = None, *, mode: int | None = None, exclusive: bool = False
) -> Iterator[BinaryIO]:
    """An open temporary file to write; on a clean exit it is fsynced, renamed over ``final`` and
    the directory fsynced (which makes the rename itself durable). On an error, raised by the
    body too (a size check, a full disk), the temporary file is deleted and ``final`` left as it was.

    ``temp`` names the temporary file (callers that clean up after a crash know their own names);
    without it a fresh, unguessable name beside ``final`` is used, created exclusively. ``mode``
    is the new file's mode (less the umask); without it the file keeps the mode of the one it
    replaces exactly (a spec its owner made 0600 stays 0600), and a new file gets 0666 less the
    umask, as open() would. The temporary file is never opened through a symlink, and with
    ``exclusive`` one already there is refused instead of truncated."""
    if temp is None:
        temp, exclusive = final.with_name(f".{final.name}.{os.getpid()}-{secrets.token_hex(4)}{TEMP_SUFFIX}"), True
    kept = _mode_of(final) if mode is None else None
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_EXCL if exclusive else os.O_TRUNC)
    # Owner-only until the kept mode is set: nobody else may open it in between and read it later.
    created = PRIVATE_MODE if kept is not None else NEW_FILE_MODE if mode is None else mode
    handle = os.open(temp, flags, created)  # before the try: what is at ``temp`` when this fails is not ours to delete
    try:
        if kept is not None:
            os.fchmod(handle, kept)  # exactly the owner's choice: the umask neither narrows nor widens it
        with open(handle, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    sync_to_disk(final.parent)


def sync_to_disk(path: Path) -> None:
    """``path`` (a file, or a directory: its entries) on disk: fsync through a read-only descriptor."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_file(path: Path, content: str | bytes, *, mode: int | None = None) -> None:
    """Replace (or create) ``path`` with ``content`` as :func:`replaced_atomically` does: all of it
    or, after any failure, the file as it was and no temporary file beside it. ``mode`` as there:
    without it an existing file keeps its mode."""
    with replaced_atomically(path, mode=mode) as file:
        file.write(content.encode() if isinstance(content, str) else content)


def _mode_of(path: Path) -> int | None:
    """The permission bits of the file at ``path`` (of a link's target), or None when there is none."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return None


def open_regular(path: Path, *, fix: str, follow_links: bool = False) -> int | None:
    """A read-only descriptor of the regular file at ``path``, or None when nothing is there.
    Anything else is refused with a UserError ending in ``fix``: a FIFO or a device, opened without
    blocking so a FIFO cannot hang the caller, and, unless ``follow_links``, a symbolic link
    (lance_hpc never writes one where it reads its own files back)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        descriptor = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as error:
        reason = "it is a symbolic link, which is not followed" if error.errno == errno.ELOOP else error.strerror
        raise UserError(f"cannot read {path}: {reason}\n  fix: {fix}") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise UserError(
            f"{path} is not a regular file, so it is not read (a device or a pipe may never end or may block)\n  fix: {fix}"
        )
    return descriptor


def read_regular(path: Path, limit: int, *, fix: str) -> bytes | None:
    """The whole of the regular file at ``path`` (None when nothing is there), as :func:`open_regular`
    opens it, never more than ``limit`` bytes: a larger file is refused with a UserError naming it."""
    descriptor = open_regular(path, fix=fix)
    if descriptor is None:
        return None
    with os.fdopen(descriptor, "rb") as file:  # read as shared_files.read_own reads: one byte past the bound at most
        data = file.read(limit + 1)
    if len(data) > limit:
        raise too_large(path, limit, fix)
    return data


class Refused(UserError):
    """A file (or object) not read because of what it is: not a regular file, or larger than lance_hpc
    ever writes there."""


def too_large(where: Path | str, limit: int, fix: str) -> Refused:
    """The refusal of a file (or object) at ``where`` larger than ``limit`` bytes."""
    return Refused(
        f"{where} is larger than {limit:,} bytes, more than lance_hpc ever writes there, so it is not read\n  fix: {fix}"
    )
