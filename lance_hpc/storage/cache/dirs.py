"""The node cache's directories: ``<dir>``, shared by the node's users; ``lance_hpc-<uid>`` in it,
this user's own; and a dataset root in that, which exists only with the marker the cache wrote.

``<dir>`` may be shared by every user of the node (``/local/nvme/...``), so each user gets a
directory of their own in it, ``lance_hpc-<uid>``, mode 0700; the cache refuses one that is a
symlink, another user's, or open to others. Inside, a dataset root exists only with the marker file
the cache wrote into it (the root is renamed into place with it), so eviction
(:mod:`lance_hpc.storage.cache.eviction`) never deletes from a directory the cache did not make.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from lance_hpc.errors import UserError
from lance_hpc.storage.cache.files import FILE_MODE, is_whole

ROOT_MARKER = ".lance_hpc-cache-root"
SHARED_MODE = 0o1777  # like /tmp: everyone adds their own directory, no one removes or renames another's


def shared_directory(directory: Path) -> None:
    """Make sure ``directory``, which the node's users share, lets each of them add a directory
    that no one else can swap: made mode 1777 where missing, refused where others may write to it
    without the sticky bit (they could rename this user's directory and put their own in its place)."""
    try:
        os.stat(directory)
    except FileNotFoundError:
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(directory)
            # mkdir's mode is masked by the umask, which would leave the directory to its first user alone.
            os.chmod(directory, SHARED_MODE)
        except FileExistsError:  # another process (or user) made it meanwhile: checked below like any other
            pass
        except OSError as error:
            raise UserError(
                f"data.cache.dir: cannot create {directory}: {error.strerror or error}\n"
                "  fix: create it once with mode 1777 (mkdir -m 1777 DIR), or choose a data.cache.dir "
                "you can write on a node-local disk"
            ) from None
    info = os.stat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise UserError(f"data.cache.dir: {directory} is not a directory\n  fix: choose another data.cache.dir")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise UserError(
            f"data.cache.dir: {directory} is writable by other users without the sticky bit (mode "
            f"{stat.filemode(info.st_mode)}), so they could replace your cache directory in it with "
            f"their own\n  fix: have its owner run chmod +t {directory}, or choose another data.cache.dir"
        )


def user_directory(directory: Path) -> Path:
    """This user's directory in ``directory`` (which other users of the node may share), created
    0700 on first use; refused where it is a symlink, another user's, or open to other users."""
    shared_directory(directory)
    mine = directory / f"lance_hpc-{os.geteuid()}"
    try:
        os.mkdir(mine, 0o700)
    except FileExistsError:
        pass
    except PermissionError:
        if not os.path.lexists(mine):
            raise UserError(
                f"data.cache.dir: you cannot create your cache directory {mine}: {directory} is not "
                f"writable by you (mode {stat.filemode(os.stat(directory).st_mode)})\n"
                f"  fix: have its owner run chmod 1777 {directory}, or choose another data.cache.dir"
            ) from None
    info = os.lstat(mine)
    fix = "remove it (or have its owner or an administrator remove it), or choose another data.cache.dir"
    if not stat.S_ISDIR(info.st_mode):
        raise UserError(
            f"data.cache.dir: {mine} is not a directory (a symlink or a file) where the cache keeps your files: {fix}"
        )
    if info.st_uid != os.geteuid():
        raise UserError(
            f"data.cache.dir: {mine} belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}), "
            f"and the cache would keep your files there: {fix}"
        )
    if info.st_mode & 0o077:
        raise UserError(
            f"data.cache.dir: {mine} is open to other users (mode {stat.filemode(info.st_mode)}) and holds "
            f"your cached data: run chmod 700 {mine}"
        )
    return mine


def cache_root(directory: Path, key: str, uri: str) -> Path:
    """The dataset root ``directory/key``, made on first use with its marker already inside (a
    directory renamed into place), so that eviction never meets a root of its own unmarked."""
    root = directory / key
    if _is_marked(root):
        return root
    made = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=directory))
    marker = os.open(made / ROOT_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    with open(marker, "w") as file:
        file.write(f"lance_hpc node-local cache of {uri}: its files are deleted by lance_hpc's eviction\n")
    try:
        os.rename(made, root)
    except OSError:  # another process made it first (or something else is there: refused below)
        (made / ROOT_MARKER).unlink()
        made.rmdir()
    if not _is_marked(root):
        raise UserError(
            f"data.cache.dir: {root} is not a cache directory lance_hpc made (no {ROOT_MARKER} in it): "
            "remove it, or choose another data.cache.dir"
        )
    return root


def _is_marked(root: Path) -> bool:
    """Whether ``root`` is a directory (not a symlink) that the cache made: its marker is in it."""
    try:
        return stat.S_ISDIR(os.lstat(root).st_mode) and is_whole(root / ROOT_MARKER, None)
    except FileNotFoundError:
        return False
