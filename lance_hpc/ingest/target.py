"""Where an ingest writes, and the write that never touches what it did not create.

A target is a dataset path (local or on an object store) with its storage options and its name in
messages. :func:`write_lance` writes where nothing is (or an empty directory, or on an object store
the files of a Lance create that never committed) or where a Lance dataset is; anything else is
refused before a row is read, naming what is there, and nothing is ever deleted. A new local dataset
is written to a hidden sibling directory and renamed into place; on an object store the first commit
has no retries, since a retried create would land on top of another writer's as its next version.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence
from urllib.parse import urlparse

import pyarrow as pa
from pyarrow import fs

from lance_hpc.errors import UserError
from lance_hpc.storage.datasets import dataset_exists, open_dataset
from lance_hpc.storage.options import filesystem_arguments, is_remote, redact

log = logging.getLogger("lance_hpc.data")

# What Lance writes under a new dataset's path before its first commit (folder: file suffix): on an
# object store an interrupted or lost create leaves these, and a later create may go on beside them.
UNCOMMITTED_LANCE_FILES = {"data": ".lance", "_transactions": ".txn"}
ENTRIES_SHOWN = 5
# A local dataset is written to the hidden sibling ".NAME" + PARTIAL_INFIX + 8 hex digits; one older
# than LEFTOVER_AGE_S when the same target is ingested again was left by a killed ingest.
PARTIAL_INFIX = ".partial-"
LEFTOVER_AGE_S = 3600


@dataclass(frozen=True)
class TargetNames:
    """How messages name the two datasets and the switch that lets ingest write over one."""

    train: str
    val: str
    overwrite: str


COMMAND_LINE_NAMES = TargetNames("URI", "--val-uri", "pass --overwrite")
SPEC_NAMES = TargetNames(
    "data.uri", "data.val_uri", "set data.ingest.overwrite: true or run lance-hpc ingest --spec JOB.yaml --overwrite"
)


@dataclass(frozen=True)
class Target:
    """A dataset ingest writes: where, with which storage options, and its name in messages."""

    uri: str
    options: dict[str, str]
    name: str


@dataclass(frozen=True)
class Ingested:
    """Rows written per split, and the URIs of datasets kept as they were: ingested before, or
    by another ingest that committed first."""

    train: int = 0
    val: int = 0
    kept: tuple[str, ...] = ()


def existing_dataset(target: Target) -> Any | None:
    """The Lance dataset at ``target``, or None where ingest may create one; a UserError that names
    what is there when it is anything else."""
    try:
        return open_dataset(target.uri, None, target.options)
    except UserError as error:
        if is_remote(target.uri) and "no Lance dataset there" not in str(error):
            raise  # credentials, bucket, endpoint: the message already says how to fix them
    found = _remote_contents(target) if is_remote(target.uri) else _local_contents(Path(target.uri))
    if found is None:
        return None
    raise UserError(
        f"{target.name} {target.uri} exists and is not a Lance dataset ({found}): ingest never writes into, "
        f"replaces or deletes what it did not create\n  fix: point {target.name} at a new path, "
        f"or move {target.uri} away yourself"
    )


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(sorted(names)[:ENTRIES_SHOWN])
    return f"it holds {shown}" + (f" and {len(names) - ENTRIES_SHOWN} more" if len(names) > ENTRIES_SHOWN else "")


def _local_contents(path: Path) -> str | None:
    """None for nothing, an empty directory, or only the files of a Lance write not committed yet at
    ``path``; else what is there, in a few words."""
    if not path.exists() and not path.is_symlink():
        return None
    if not path.is_dir():
        return "it is not a directory"
    with os.scandir(path) as entries:
        names = [entry.name + ("/" if entry.is_dir() else "") for entry in entries]
    local = fs.LocalFileSystem()
    infos = local.get_file_info(fs.FileSelector(str(path)))
    if all(_uncommitted_lance_folder(local, info) for info in infos):  # fragments of an ingest not committed yet
        return None
    return _listing(names)


def _remote_contents(target: Target) -> str | None:
    """None for nothing (or only the files of an uncommitted Lance create) under ``target.uri``;
    else what is there, in a few words."""
    try:
        store, path = filesystem(target.uri, target.options)
        info = store.get_file_info(path)
        if info.type == fs.FileType.NotFound:
            return None
        if info.type == fs.FileType.File:
            return "it is an object, not a prefix"
        entries = store.get_file_info(fs.FileSelector(path, allow_not_found=True))
        if all(_uncommitted_lance_folder(store, entry) for entry in entries):
            return None
    except OSError as error:
        text = redact(str(error), target.options).splitlines()
        raise UserError(
            f"{target.name} {target.uri}: cannot list what is there ({text[0] if text else type(error).__name__})\n"
            f"  fix: check the object store, the credentials and data.storage_options"
        ) from None
    return _listing([entry.base_name + ("/" if entry.type == fs.FileType.Directory else "") for entry in entries])


def _uncommitted_lance_folder(filesystem: Any, entry: Any) -> bool:
    """Whether ``entry`` is a folder holding only files that Lance writes before a first commit."""
    suffix = UNCOMMITTED_LANCE_FILES.get(entry.base_name)
    if entry.type != fs.FileType.Directory or suffix is None:
        return False
    inside = filesystem.get_file_info(fs.FileSelector(entry.path, allow_not_found=True))
    return all(item.type == fs.FileType.File and item.base_name.endswith(suffix) for item in inside)


def filesystem(uri: str, options: Mapping[str, str]) -> tuple[Any, str]:
    """A pyarrow filesystem for an object-store URI and the path of ``uri`` on it."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        return fs.S3FileSystem(**filesystem_arguments(options)), f"{parsed.netloc}{parsed.path}".rstrip("/")
    return fs.FileSystem.from_uri(uri.rstrip("/"))


def write_lance(reader: pa.RecordBatchReader, target: Target, *, rows_per_fragment: int, replace: bool = False) -> bool:
    """Write ``reader`` to ``target`` as one Lance commit: a new version of the dataset there with
    ``replace``, else a new dataset. Returns False when another writer created that dataset first
    (it is left as it is, for the caller to use)."""
    import lance

    options = target.options or None
    if replace:
        lance.write_dataset(reader, target.uri, mode="overwrite", max_rows_per_file=rows_per_fragment, storage_options=options)
        return True
    if is_remote(target.uri):
        fragments = lance.fragment.write_fragments(
            reader, target.uri, max_rows_per_file=rows_per_fragment, storage_options=options
        )
        try:
            # No retries: Lance retries a create that lost by committing it as the winner's next version.
            lance.LanceDataset.commit(
                target.uri, lance.LanceOperation.Overwrite(reader.schema, fragments), max_retries=0, storage_options=options
            )
        except OSError:
            if dataset_exists(target.uri, target.options):
                return False
            raise
        return True
    final = _local_path(target)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _write_failed(target, f"cannot create {final.parent}", error, None) from None
    _warn_of_leftovers(final)
    partial = final.parent / f".{final.name}{PARTIAL_INFIX}{uuid.uuid4().hex[:8]}"
    step = "create its temporary directory"
    try:
        # mkdir fails if the path exists, so what is removed below is ours alone (mkdtemp would do
        # the same, but its 0700 mode would stay on the dataset and hide it from the user's group).
        partial.mkdir()
        step = "write it"
        lance.write_dataset(reader, str(partial), mode="create", max_rows_per_file=rows_per_fragment)
        step = "move it into place"
        os.rename(partial, final)  # fails, replacing nothing, when final is a non-empty directory
        return True
    except OSError as error:
        if step == "move it into place" and existing_dataset(target) is not None:  # a UserError for anything else
            return False
        if error.errno is None:  # Lance's wrapping of an error the source raised, not the file system's
            raise
        raise _write_failed(target, f"cannot {step}", error, partial) from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # our own temporary directory, if the rename did not take it


def _local_path(target: Target) -> Path:
    """Where a local dataset is written: the directory a symlinked ``target`` points to, since the
    rename that puts the dataset in place would fail on the link (and must stay on its filesystem)."""
    path = Path(target.uri)
    return path.resolve() if path.is_symlink() else path


def _write_failed(target: Target, what: str, error: OSError, partial: Path | None) -> UserError:
    """The UserError for a local write that failed: the target, the cause, and what became of the
    hidden temporary directory (removed here, so the message can say whether that worked)."""
    cause = error.strerror or str(error) or type(error).__name__
    if error.filename is not None:
        cause += f": {error.filename}"
    leftover = ""
    if partial is not None:
        shutil.rmtree(partial, ignore_errors=True)
        leftover = (
            f"; its partial copy {partial} is left there: delete it"
            if os.path.lexists(partial)
            else f"; its partial copy {partial} was removed"
        )
    if error.errno in (errno.EBUSY, errno.ENOTDIR, errno.EXDEV):
        fix = (
            f"point {target.name} at a new path inside it (e.g. {target.uri.rstrip('/')}/dataset.lance): "
            "an empty mount point or a directory in use cannot be replaced"
        )
    elif error.errno == errno.ENOSPC:
        fix = f"free space on the filesystem of {target.uri}, or point {target.name} at another disk, then ingest again"
    else:
        fix = f"make {_local_path(target).parent} writable by you, or point {target.name} at a path you can write"
    return UserError(f"{target.name} {target.uri}: {what} ({cause}){leftover}\n  fix: {fix}")


def _warn_of_leftovers(final: Path) -> None:
    """Warn of the hidden directories that earlier ingests of ``final`` left when killed (SIGKILL,
    a node failure). They are named, not deleted: one may belong to an ingest still running on
    another node of a shared filesystem, which age alone cannot rule out, and a pid file that
    could would have to sit inside the directory and so end up in the dataset."""
    cutoff = time.time() - LEFTOVER_AGE_S
    try:
        with os.scandir(final.parent) as entries:
            old = sorted(
                entry.path
                for entry in entries
                if entry.name.startswith(f".{final.name}{PARTIAL_INFIX}")
                and entry.is_dir(follow_symlinks=False)
                and entry.stat(follow_symlinks=False).st_mtime < cutoff
            )
    except OSError:  # only a warning: the write itself reports a directory it cannot use
        return
    if old:
        log.warning(
            "%d partial dataset director%s left by earlier interrupted ingests of %s (older than %d minutes): "
            "%s; delete %s once no ingest of %s is running",
            len(old),
            "y" if len(old) == 1 else "ies",
            final,
            LEFTOVER_AGE_S // 60,
            ", ".join(old),
            "it" if len(old) == 1 else "them",
            final,
        )


def find_datasets(train: Target, val: Target | None) -> tuple[Any | None, Any | None]:
    """The Lance datasets already at the targets (None where there is none), checked before any
    row is read or written, so a target holding something else fails the ingest at once."""
    return existing_dataset(train), (existing_dataset(val) if val is not None else None)


def keeps(found: Any | None, target: Target, source: str, *, overwrite: bool, names: TargetNames) -> bool:
    """Whether the dataset ``found`` at ``target`` stays as it is instead of being written: yes for
    one ingested from ``source`` (by an interrupted or concurrent ingest), unless ``overwrite``;
    a UserError for one from another source."""
    if found is None or overwrite:
        return False
    recorded = (found.schema.metadata or {}).get(b"source", b"").decode()
    if recorded != source:
        origin = f"ingested from {recorded}" if recorded else "not written by lance-hpc ingest"
        raise UserError(
            f"{target.name} {target.uri} already holds a Lance dataset {origin}, not from {source}\n"
            f"  fix: to write {source} over it as a new version, {names.overwrite}; or point {target.name} at a new path"
        )
    return True


def targets(
    uri: str,
    val_uri: str | None,
    options: Mapping[str, str] | None,
    val_options: Mapping[str, str] | None,
    names: TargetNames,
) -> tuple[Target, Target | None]:
    """The training and validation targets; the validation set shares the training options unless given its own."""
    train = Target(uri, dict(options or {}), names.train)
    if not val_uri:
        return train, None
    return train, Target(val_uri, dict(val_options if val_options is not None else train.options), names.val)
