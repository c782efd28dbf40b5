"""A checkpoint directory's lease as an object under an ``s3://bucket/prefix`` checkpoint.dir, written
and read back (see :mod:`lance_hpc.checkpoint.lease` for why that is atomic)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from lance_hpc.checkpoint.lease.holders import LEASE_NAME, Holder, Snapshot

if TYPE_CHECKING:
    from lance_hpc.checkpoint.stores.objects import ObjectStore

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
