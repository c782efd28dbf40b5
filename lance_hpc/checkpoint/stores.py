"""Where checkpoints are kept: a local directory, or a prefix on S3-compatible object storage.

A store lists, writes, reads and deletes checkpoint files by name, and a reader never sees half a
checkpoint:

- a local directory writes a temporary file, fsyncs it, renames it into place and fsyncs the
  directory, so a crash at any moment leaves either the new file or none;
- an object store serializes the checkpoint in memory, then uploads it to its final key in one
  write call: a single PUT, or a multipart upload that the store only makes visible once it
  completes. An upload cut short (the writer killed, the network gone) never completes, so
  nothing is listed under the final name; its parts wait for the bucket's lifecycle rule.

Besides checkpoints, a store keeps small files by name (a checkpoint's JSON manifest), written the
same way, and read back only up to a size (anyone who may write to a shared checkpoint directory
may have put a FIFO, a device or a huge file there). A local write that fills the file system
raises :class:`NoSpace`, the partial file removed.

Object storage takes its endpoint, region and credentials from the same AWS_* environment
variables as s3:// datasets (:func:`lance_hpc.storage.options.storage_options`).
"""

from __future__ import annotations

import errno
import io
import os
import shutil
from functools import cached_property
from pathlib import Path
from typing import Any, BinaryIO, Callable, Protocol
from urllib.parse import urlparse

from pyarrow import fs

from lance_hpc.errors import UserError
from lance_hpc.spec.choices import check_registry
from lance_hpc.storage.files import read_regular, replaced_atomically, too_large
from lance_hpc.storage.options import (
    CHECKPOINT_SCHEMES,
    CREDENTIAL_FIX,
    filesystem_arguments,
    redact,
    storage_options,
    unsupported,
)

# Temporary files of a checkpoint being written: ``.step-XXXXXXXX.pt.<pid>.tmp``.
TEMP_SUFFIX = ".tmp"

CREDENTIAL_ERRORS = (
    "INVALID_ACCESS_KEY_ID",
    "SIGNATURE_DOES_NOT_MATCH",
    "EXPIRED_TOKEN",
    "INVALID_TOKEN",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
)
ENDPOINT_FIX = "check AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) and the network from this machine"
# What to do with a small file in a checkpoint directory that read_bytes refuses.
SMALL_FILE_FIX = (
    "remove it: lance_hpc keeps only small regular files beside its checkpoints, which are listed by name without them"
)

Location = Path | str  # a local checkpoint is a Path, one on object storage an s3:// URI


class NoSpace(Exception):
    """The file system filled up, or the user's quota ran out, while ``path`` was written. The
    partial file is gone and ``path`` is as it was; ``free`` is what the file system had left after
    that, ``written`` how far the write had got (0 when unknown)."""

    def __init__(self, path: Path, code: int, written: int, free: int) -> None:
        super().__init__(f"{path}: {os.strerror(code)}")
        self.path, self.quota, self.written, self.free = path, code == errno.EDQUOT, written, free


class Store(Protocol):
    """Checkpoint files, and small files beside them, by name in one directory or prefix."""

    def location(self, name: str) -> Location: ...

    def names(self) -> list[str]: ...

    def write(self, name: str, state: dict[str, Any]) -> None: ...

    def read(self, name: str) -> dict[str, Any]: ...

    def write_bytes(self, name: str, payload: bytes) -> None: ...

    def read_bytes(self, name: str, limit: int) -> bytes: ...

    def delete(self, name: str) -> None: ...


class LocalDirectory:
    """Checkpoint files in a directory of a local or shared file system."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def location(self, name: str) -> Path:
        return self.directory / name

    def names(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        return [path.name for path in self.directory.iterdir()]

    def write(self, name: str, state: dict[str, Any]) -> None:
        """torch.save to a temporary file, fsync, rename over ``name``, fsync the directory."""
        self._write(name, lambda file: _save(state, file))

    def read(self, name: str) -> dict[str, Any]:
        return _load(self.location(name))

    def write_bytes(self, name: str, payload: bytes) -> None:
        self._write(name, lambda file: file.write(payload))

    def read_bytes(self, name: str, limit: int) -> bytes:
        """The small file ``name``, at most ``limit`` bytes (a UserError past that, or for anything
        but a regular file); FileNotFoundError when it is gone."""
        found = read_regular(self.location(name), limit, fix=SMALL_FILE_FIX)
        if found is None:
            raise FileNotFoundError(self.location(name))
        return found

    def _write(self, name: str, dump: Callable[[BinaryIO], object]) -> None:
        """``dump`` into a temporary file that replaces ``name`` once complete; NoSpace when the
        file system fills up on the way (torch.save reports that as an obscure RuntimeError)."""
        path = self.location(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{os.getpid()}{TEMP_SUFFIX}")
        written = 0
        try:
            with replaced_atomically(path, temp) as file:
                try:
                    dump(file)
                except BaseException:
                    written = file.tell()
                    raise
        except Exception as error:
            code = out_of_space(error)
            if code is None:
                raise
            raise NoSpace(path, code, written, shutil.disk_usage(self.directory).free) from error

    def delete(self, name: str) -> None:
        self.location(name).unlink(missing_ok=True)


class ObjectStore:
    """Checkpoint objects under an ``s3://bucket/prefix`` URI."""

    def __init__(self, uri: str) -> None:
        parsed = urlparse(uri)
        self.uri = uri.rstrip("/")
        self.bucket = parsed.netloc
        self.prefix = f"{parsed.netloc}{parsed.path}".rstrip("/")  # pyarrow's path: bucket/key prefix
        self.options = storage_options(uri)  # endpoint, region and credentials from AWS_* variables

    @cached_property
    def filesystem(self) -> fs.S3FileSystem:
        return fs.S3FileSystem(**filesystem_arguments(self.options))

    def location(self, name: str) -> str:
        return f"{self.uri}/{name}"

    def names(self) -> list[str]:
        try:
            found = self.filesystem.get_file_info(fs.FileSelector(self.prefix, allow_not_found=True))
            # a missing bucket lists as empty: say so now, not at the first save hours later
            bucket_missing = not found and self.filesystem.get_file_info(self.bucket).type == fs.FileType.NotFound
        except OSError as error:
            raise self.error(str(error), "list checkpoints in", self.uri) from None
        if bucket_missing:
            raise self.error("NoSuchBucket", "list checkpoints in", self.uri)
        return [info.base_name for info in found if info.type == fs.FileType.File]

    def write(self, name: str, state: dict[str, Any]) -> None:
        """Serialize in memory, then upload in one write call: a signal or an error in
        torch.save cannot end the upload with half a checkpoint under ``name``."""
        payload = io.BytesIO()
        _save(state, payload)
        self.write_bytes(name, payload.getbuffer())

    def read(self, name: str) -> dict[str, Any]:
        return _load(io.BytesIO(self._fetch(name, None)))

    def write_bytes(self, name: str, payload: bytes | memoryview) -> None:
        try:
            with self.filesystem.open_output_stream(f"{self.prefix}/{name}") as stream:
                stream.write(payload)
        except OSError as error:
            untouched = "; earlier checkpoints are untouched"
            raise self.error(str(error), "write checkpoint", self.location(name), untouched) from None

    def read_bytes(self, name: str, limit: int) -> bytes:
        return self._fetch(name, limit)

    def _fetch(self, name: str, limit: int | None) -> bytes:
        """The object ``name``, refused when it is larger than ``limit`` bytes (a checkpoint has no limit)."""
        try:
            with self.filesystem.open_input_file(f"{self.prefix}/{name}") as file:
                if limit is not None and file.size() > limit:
                    raise too_large(self.location(name), limit, SMALL_FILE_FIX)
                return file.read()
        except OSError as error:
            raise self.error(str(error), "read checkpoint", self.location(name)) from None

    def delete(self, name: str) -> None:
        try:
            self.filesystem.delete_file(f"{self.prefix}/{name}")
        except FileNotFoundError:
            pass
        except OSError as error:
            raise self.error(str(error), "delete checkpoint", self.location(name)) from None

    def error(self, cause: str, operation: str, location: str, note: str = "") -> UserError:
        """A UserError naming the operation, the URI and the fix; credentials never appear in it."""
        text = redact(cause, self.options)
        endpoint = self.options.get("endpoint", "the default AWS endpoint")
        code = next((code for code in CREDENTIAL_ERRORS if code in text), None)
        if code:
            reason, fix = f"the object store at {endpoint} rejected the credentials ({code})", CREDENTIAL_FIX
        elif "ACCESS_DENIED" in text or "AccessDenied" in text:
            reason = f"access denied at {endpoint}"
            fix = (
                f"give these credentials s3:ListBucket, s3:GetObject, s3:PutObject and s3:DeleteObject "
                f"on bucket '{self.bucket}', or choose another checkpoint.dir"
            )
        elif "NO_SUCH_BUCKET" in text or "NoSuchBucket" in text:
            reason = f"bucket '{self.bucket}' does not exist at {endpoint}"
            fix = "create the bucket or fix checkpoint.dir; the endpoint comes from AWS_ENDPOINT_URL"
        elif "NETWORK_CONNECTION" in text or "Could not connect" in text or "Couldn't resolve" in text:
            reason, fix = f"cannot reach the object store at {endpoint}", ENDPOINT_FIX
        else:
            reason = text.splitlines()[0] if text else "the object store failed"
            fix = f"check checkpoint.dir and the object store at {endpoint}"
        return UserError(f"cannot {operation} {location}: {reason}{note}\n  fix: {fix}")


def _save(state: dict[str, Any], file: BinaryIO) -> None:
    # torch is imported where a checkpoint is written or read, not with this module: status and
    # cancel list checkpoint directories on login nodes, where importing torch costs seconds
    import torch

    torch.save(state, file)


def _load(source: str | Path | BinaryIO) -> dict[str, Any]:
    import torch

    return torch.load(source, map_location="cpu", weights_only=True)


def out_of_space(error: BaseException) -> int | None:
    """ENOSPC or EDQUOT when ``error``, or an error it was raised from or while handling, is one:
    torch.save turns a full disk into RuntimeError("... unexpected pos ...") raised while handling
    the OSError that says so."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return cause.errno
        cause = cause.__cause__ or cause.__context__
    return None


# URI scheme -> store; a directory without a scheme is a LocalDirectory.
STORES: dict[str, Callable[[str], Store]] = {"s3": ObjectStore}
check_registry(STORES, CHECKPOINT_SCHEMES, "checkpoint.dir scheme")


def open_store(directory: str | Path) -> Store:
    """The store for a checkpoint.dir: a local directory, or an object store for a URI."""
    problem = unsupported(directory)
    if problem:
        raise UserError(f"checkpoint.dir {directory}: {problem}")
    scheme, separator, _ = str(directory).partition("://")
    return STORES[scheme](str(directory)) if separator else LocalDirectory(directory)


def locate(location: Location) -> tuple[Store, str]:
    """The store that holds ``location`` (a checkpoint's path or URI) and the name in it."""
    if "://" in str(location):
        directory, _, name = str(location).rpartition("/")
        return open_store(directory), name
    path = Path(location)
    return LocalDirectory(path.parent), path.name
