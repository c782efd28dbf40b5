"""Checkpoints under an ``s3://bucket/prefix`` URI on S3-compatible object storage (:class:`ObjectStore`).

A checkpoint is serialized in memory, then uploaded to its final key in one write call: a single
PUT, or a multipart upload that the store only makes visible once it completes. An upload cut short
(the writer killed, the network gone) never completes, so nothing is listed under the final name;
its parts wait for the bucket's lifecycle rule. Shards go through DCP's file-system interface over
the same client (:mod:`.object_files`). The directory's lease is an object beside them, written
and read back (:class:`LeaseObject`; :mod:`lance_hpc.checkpoint.lease` says why that is atomic).

The endpoint, region and credentials come from the same AWS_* environment variables as s3://
datasets (:func:`lance_hpc.storage.options.storage_options`); they never appear in a message.
"""

from __future__ import annotations

import io
import time
from functools import cached_property
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from pyarrow import fs

from lance_hpc.checkpoint.lease.holders import LEASE_NAME, Holder, Snapshot
from lance_hpc.checkpoint.stores.base import SMALL_FILE_FIX, Store, load_state, save_state
from lance_hpc.errors import UserError
from lance_hpc.storage.files import too_large
from lance_hpc.storage.options import CREDENTIAL_FIX, filesystem_arguments, redact, storage_options

if TYPE_CHECKING:
    import torch.distributed.checkpoint as dcp

    from lance_hpc.checkpoint.shards.reading import DataOnlyReader

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


class ObjectStore(Store):
    """Checkpoint objects under an ``s3://bucket/prefix`` URI."""

    needs_flush = False  # an object's data is there once its stream is closed

    def __init__(self, uri: str) -> None:
        parsed = urlparse(uri)
        self.where = uri  # as checkpoint.dir gives it
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
        save_state(state, payload)
        self.write_bytes(name, payload.getbuffer())

    def read(self, name: str) -> dict[str, Any]:
        return load_state(io.BytesIO(self._fetch(name, None)))

    def write_bytes(self, name: str, payload: bytes | memoryview) -> None:
        try:
            with self.filesystem.open_output_stream(f"{self.prefix}/{name}") as stream:
                stream.write(payload)
        except OSError as error:
            untouched = "; earlier checkpoints are untouched"
            raise self.error(str(error), "write checkpoint", self.location(name), untouched) from None

    def read_bytes(self, name: str, limit: int, fix: str = SMALL_FILE_FIX) -> bytes:
        return self._fetch(name, (limit, fix))

    def _fetch(self, name: str, bound: tuple[int, str] | None) -> bytes:
        """The object ``name``, refused when it is larger than ``bound``'s limit in bytes, with its
        fix (a checkpoint has no bound); never more than one byte past the bound is read."""
        try:
            with self.filesystem.open_input_file(f"{self.prefix}/{name}") as file:
                if bound is None:
                    return file.read()
                limit, fix = bound
                found = file.read(limit + 1) if file.size() <= limit else None
                if found is None or len(found) > limit:
                    raise too_large(self.location(name), limit, fix)
                return found
        except OSError as error:
            if bound is not None and isinstance(error, FileNotFoundError):
                raise  # read_bytes says a small file is gone as a directory's store does
            raise self.error(str(error), "read checkpoint", self.location(name)) from None

    def delete(self, name: str) -> None:
        try:
            self.filesystem.delete_file(f"{self.prefix}/{name}")
        except FileNotFoundError:
            pass
        except OSError as error:
            raise self.error(str(error), "delete checkpoint", self.location(name)) from None

    def shard_directories(self) -> list[str]:
        try:
            found = self.filesystem.get_file_info(fs.FileSelector(self.prefix, allow_not_found=True))
        except OSError as error:
            raise self.error(str(error), "list checkpoint shards in", self.uri) from None
        return [info.base_name for info in found if info.type == fs.FileType.Directory]

    def delete_shards(self, name: str) -> None:
        try:
            self.filesystem.delete_dir(f"{self.prefix}/{name}")
        except FileNotFoundError:
            pass
        except OSError as error:
            raise self.error(str(error), "delete checkpoint shards", self.location(name)) from None

    def flush_shards(self, name: str) -> None:
        """Nothing to do: a stream's data is there once the stream is closed."""

    def shard_writer(self, name: str, reuse: dcp.FileSystemWriter | None = None, synced: bool = True) -> dcp.FileSystemWriter:
        """Each rank uploads its own files in one stream each; rank 0 writes ``.metadata`` once all
        are complete. Object storage has no fsync, so ``synced`` changes nothing."""
        import torch
        import torch.distributed.checkpoint as dcp

        from lance_hpc.checkpoint.stores.object_files import ObjectFiles

        path = f"{self.prefix}/{name}"
        if reuse is not None:
            reuse.reset(path)
            return reuse
        # Staging buffers are kept (in pinned memory, which needs CUDA) only on a machine with a GPU.
        writing = dcp.FileSystemWriter(path, sync_files=False, cache_staged_state_dict=torch.cuda.is_available())
        writing.fs = ObjectFiles(self.filesystem)  # type: ignore[assignment]
        writing.path = path
        return writing

    def shard_reader(self, name: str) -> DataOnlyReader:
        from lance_hpc.checkpoint.shards.reading import DataOnlyReader
        from lance_hpc.checkpoint.stores.object_files import ObjectFiles

        return DataOnlyReader(f"{self.prefix}/{name}", self, name, ObjectFiles(self.filesystem))

    def lease(self) -> LeaseObject:
        return LeaseObject(self)

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


SETTLE_S = 2.0  # how long a taker waits for a racer's write before it reads back


class LeaseObject:
    """The lease as an object under an ``s3://bucket/prefix`` checkpoint.dir."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.key = f"{store.prefix}/{LEASE_NAME}"
        self.where = store.location(LEASE_NAME)

    def read(self) -> Snapshot | None:
        # A listing first: S3 answers a HEAD or GET with wrong credentials by a bare 403, where a
        # listing says why (and that the bucket is missing), in the words checkpoints use.
        if LEASE_NAME not in self.store.names():
            return None
        try:
            with self.store.filesystem.open_input_file(self.key) as file:
                payload = file.read()
            # only an unreadable lease is judged by its age: ask for it then, not on every read
            modified = None if Holder.decode(payload) else self.store.filesystem.get_file_info(self.key).mtime
        except FileNotFoundError:
            return None
        except OSError as error:
            raise self.store.error(str(error), "read the lease", self.where) from None
        return Snapshot(payload, modified.timestamp() if modified else time.time())

    def claim(self, seen: Snapshot | None, record: bytes) -> bool:
        current = self.read()
        if (current and current.payload) != (seen and seen.payload):
            return False
        self._put(record)
        time.sleep(SETTLE_S)  # a racer that read the same lease writes within this; the last write wins
        after = self.read()
        return after is not None and after.payload == record

    def rewrite(self, token: str, record: bytes) -> bool:
        current = self.read()
        holder = current.holder if current else None
        if holder is None or holder.token != token:
            return False
        self._put(record)
        return True

    def remove(self, seen: Snapshot) -> None:
        current = self.read()
        if current is not None and current.payload == seen.payload:
            try:
                self.store.filesystem.delete_file(self.key)
            except OSError as error:
                raise self.store.error(str(error), "delete the lease", self.where) from None

    def _put(self, record: bytes) -> None:
        try:
            with self.store.filesystem.open_output_stream(self.key) as stream:
                stream.write(record)
        except OSError as error:
            raise self.store.error(str(error), "write the lease", self.where) from None
