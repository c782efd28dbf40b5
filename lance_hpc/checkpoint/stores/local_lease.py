"""A checkpoint directory's lease as a file on a local or shared file system, created with O_EXCL
(see :mod:`lance_hpc.checkpoint.lease` for why that is atomic)."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from pathlib import Path

from lance_hpc.checkpoint.lease.holders import LEASE_NAME, Holder, Snapshot

TAKEOVER_S = 60.0  # a takeover file older than this was left by a taker that died


class LeaseFile:
    """The lease as a file on a local or shared file system."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LEASE_NAME
        self.where = str(self.path)

    def read(self) -> Snapshot | None:
        try:
            with open(self.path, "rb") as file:
                return Snapshot(file.read(), os.fstat(file.fileno()).st_mtime)
        except FileNotFoundError:
            return None

    def claim(self, seen: Snapshot | None, record: bytes) -> bool:
        if seen is None:
            return self._create(record)
        # One taker per stale lease: the others find its takeover file, and look again shortly.
        takeover = self.path.with_name(f"{LEASE_NAME}.{hashlib.sha256(seen.payload).hexdigest()[:16]}.takeover")
        if not self._start_takeover(takeover):
            return False
        try:
            current = self.read()  # None: released meanwhile, and the O_EXCL create decides
            if current is not None and (current.payload != seen.payload or not self._move_aside(seen.payload)):
                return False
            return self._create(record)
        finally:
            takeover.unlink(missing_ok=True)

    def _create(self, record: bytes) -> bool:
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            with os.fdopen(descriptor, "wb") as file:
                file.write(record)
                file.flush()
                os.fsync(file.fileno())
        except BaseException:
            self.path.unlink(missing_ok=True)  # ours: created above, and nobody else's can be there
            raise
        return True

    @staticmethod
    def _start_takeover(takeover: Path) -> bool:
        """Create ``takeover`` (O_EXCL); False when another taker has it. One left by a taker that
        died mid-way (a takeover takes milliseconds) is cleared for the next look."""
        try:
            os.close(os.open(takeover, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            return True
        except FileExistsError:
            pass
        try:
            if time.time() - takeover.stat().st_mtime > TAKEOVER_S:
                takeover.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        return False

    def rewrite(self, token: str, record: bytes) -> bool:
        try:
            descriptor = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return False
        with os.fdopen(descriptor, "r+b") as file:
            current = Holder.decode(file.read())
            if current is None or current.token != token:
                return False
            file.seek(0)
            file.write(record)
            file.truncate()
            file.flush()
            os.fsync(file.fileno())  # NFS clients see the write once it reaches the server
        return True

    def remove(self, seen: Snapshot) -> None:
        self._move_aside(seen.payload)

    def _move_aside(self, expected: bytes) -> bool:
        """Take the lease out of the way if it still holds ``expected``. A rename is atomic where a
        read-then-unlink is not: what the rename moved is checked, and a newer lease (its holder
        renewed or released and another run took it) goes back where its holder looks for it."""
        aside = self.path.with_name(f"{LEASE_NAME}.{uuid.uuid4().hex}.old")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:  # released, or moved by another taker: the O_EXCL create decides
            return True
        moved = aside.read_bytes()
        if moved == expected:
            aside.unlink()
            return True
        try:
            os.link(aside, self.path)  # fails when another lease took the name meanwhile: that one wins
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: a copy, put back only where no newer lease is
            self._create(moved)  # O_EXCL, where a rename back would replace a lease taken meanwhile
        aside.unlink()
        return False
