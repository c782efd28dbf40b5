"""What a shard directory's own files may name: a file of the checkpoint is a plain name inside its
directory, and anything else is refused with one message (a checkpoint may come from anyone)."""

from __future__ import annotations

from lance_hpc.errors import UserError


def plain_name(name: object, where: str) -> str:
    """``name``, read from a checkpoint's files, when it is a plain file name: no directory part,
    not ``.`` or ``..``; otherwise a UserError naming ``where`` it was read. A checkpoint from
    elsewhere must not make a reader open files outside its directory."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise refused(where, f"it names {name!r} as a file of the checkpoint, which is not a plain name inside its directory")
    return name


def refused(where: str, why: str) -> UserError:
    """The one message of a checkpoint file that asks for more than data: ``where`` it is, ``why``."""
    return UserError(
        f"refusing checkpoint file {where}: {why}\n  fix: export, resume and evaluate only checkpoints written by "
        "lance_hpc; a checkpoint from elsewhere is read as data, and this one asks to run code or to read outside "
        "its directory"
    )
