"""Files in directories other users may write (a group's shared log directory, a job's records
there): opened without following a link and without waiting on a FIFO, used only when they are
regular files the caller owns, and read only so far. Someone else's file, a link or a FIFO planted
in their place is refused with :class:`RefusedFile`, whose message says why.

Standard library only: the restart supervisor, which runs outside any container where lance_hpc
may not be installed, holds this module too (:mod:`lance_hpc.launch.restart_script`).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

OWN_FILE_MODE = 0o600  # what append_own creates: nobody else reads a job's records
OWN_DIR_MODE = 0o700
# O_NONBLOCK: opening a FIFO returns at once (fstat then refuses it) instead of waiting for a writer.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class RefusedFile(OSError):
    """A file lance_hpc does not use: a link, not a regular file, another user's, writable by
    others where that matters, or larger than its reader allows."""

    def __str__(self) -> str:
        return str(self.strerror)  # the message alone, as the caller prints it


def refusal(info: os.stat_result, private: bool = False) -> str:
    """Why the file ``info`` describes (an fstat of an open descriptor) is not to be used, or "".
    ``private``: nobody but its owner may write it either (a program to run)."""
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_uid != os.getuid():
        return f"belongs to uid {info.st_uid}, not to you (uid {os.getuid()})"
    if private and info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    return ""


def open_own(path: str | Path, private: bool = False) -> int:
    """A read-only descriptor of the regular file the caller owns at ``path``; raises RefusedFile
    for anything else (see :func:`refusal`), FileNotFoundError when there is nothing there."""
    return _checked(path, READ_FLAGS, 0, private)


def read_own(path: str | Path, limit: int) -> bytes:
    """The bytes of the regular file the caller owns at ``path``, at most ``limit`` of them (a
    larger file is refused, not cut short)."""
    with os.fdopen(open_own(path), "rb") as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise RefusedFile(errno.EFBIG, f"{path} is larger than the {limit} bytes lance_hpc reads of it")
    return data


def append_own(path: str | Path, text: str) -> None:
    """Append ``text`` in one write to the file the caller owns at ``path``, created 0600 when missing."""
    descriptor = _checked(path, APPEND_FLAGS, OWN_FILE_MODE, False)
    try:
        os.write(descriptor, text.encode())
    finally:
        os.close(descriptor)


def own_private_dir(directory: Path, levels: int) -> None:
    """Make ``directory`` and the ``levels - 1`` directories above it the caller's alone (0700):
    created so when missing, whatever the umask, and narrowed to it when they are the caller's.
    Raises RefusedFile when one is a link, not a directory, or another user's (who could plant
    anything in it)."""
    for level in reversed([directory, *directory.parents][:levels]):
        try:
            level.mkdir(mode=OWN_DIR_MODE)
        except FileExistsError:
            pass
        info = os.lstat(level)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            what = "is not a directory" if not stat.S_ISDIR(info.st_mode) else f"belongs to uid {info.st_uid}, not to you"
            raise RefusedFile(errno.EPERM, f"{level} {what}")
        if stat.S_IMODE(info.st_mode) != OWN_DIR_MODE:  # mkdir applies the umask, and an older one may be wider
            os.chmod(level, OWN_DIR_MODE)


def _checked(path: str | Path, flags: int, mode: int, private: bool) -> int:
    try:
        descriptor = os.open(path, flags, mode)
    except OSError as error:
        if error.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise RefusedFile(errno.ELOOP, f"{path} is a symbolic link") from None
        if error.errno == errno.ENXIO:  # a FIFO nobody reads, opened to write without waiting
            raise RefusedFile(errno.ENXIO, f"{path} is not a regular file") from None
        raise
    try:
        why = refusal(os.fstat(descriptor), private)  # of what was opened, not what the path names a moment later
        if why:
            raise RefusedFile(errno.EPERM, f"{path} {why}")
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor
