"""Who holds a checkpoint directory's lease (:mod:`lance_hpc.checkpoint.lease`): the record a lease
file holds, this process's own, and whether a recorded process still runs on this machine."""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

LEASE_NAME = "writer.lease.json"  # in checkpoint.dir
RECORD_BYTES = 1024  # renewals rewrite the record in place at one size, so no reader sees it shrink
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, as its file says; times are seconds since the epoch."""

    token: str  # unique to one taking of the lease
    host: str
    boot_id: str
    pid: int
    pid_start: int  # the process's start, in clock ticks after boot: a reused pid has another
    user: str
    job: str | None  # the SLURM job (ARRAYID_TASKID for a run of an array); None for a local run
    restart: int  # SLURM_RESTART_COUNT of the run that took the lease
    started: float
    heartbeat: float
    requeued: bool = False  # the job was requeued and keeps its lease until it runs again
    attempt: int = 0  # the attempt inside the allocation (LANCE_HPC_ATTEMPT: the restart supervisor's)

    def encode(self) -> bytes:
        fields = {**asdict(self), "started": _iso(self.started), "heartbeat": _iso(self.heartbeat)}
        return json.dumps(fields, indent=1).encode().ljust(RECORD_BYTES - 1) + b"\n"

    @classmethod
    def decode(cls, payload: bytes) -> Holder | None:
        """The holder a lease file names; None for anything else (a lease being written, a damaged one)."""
        try:
            raw = json.loads(payload)
            return cls(
                str(raw["token"]),
                str(raw["host"]),
                str(raw["boot_id"]),
                int(raw["pid"]),
                int(raw["pid_start"]),
                str(raw["user"]),
                None if raw["job"] is None else str(raw["job"]),
                int(raw["restart"]),
                _seconds(raw["started"]),
                _seconds(raw["heartbeat"]),
                bool(raw.get("requeued", False)),
                int(raw.get("attempt", 0)),
            )
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self, now: float) -> str:
        """``pid 4242 on node7, SLURM job 1234, user ada, since ..., last heartbeat 8 s ago``."""
        job = "a local run"
        if self.job:
            job = f"SLURM job {self.job}" + (f" (restart {self.restart})" if self.restart else "")
        requeued = " requeued and waiting to run again" if self.requeued else ""
        return (
            f"pid {self.pid} on {self.host}, {job}{requeued}, user {self.user}, since {_when(self.started)}, "
            f"last heartbeat {duration(now - self.heartbeat)} ago"
        )

    def stop_hint(self) -> str:
        if self.job:
            return f"`lance-hpc cancel {self.job}` saves and stops it"
        return f"`kill -TERM {self.pid}` on {self.host} saves and stops it"


def this_process(job: str | None, restart: int, attempt: int = 0) -> Holder:
    """A lease record for this process, as rank 0 of SLURM job ``job`` (None: a local run) in its
    run ``restart`` (SLURM_RESTART_COUNT) and the ``attempt`` inside that run's allocation."""
    now = whole_seconds()
    return Holder(
        uuid.uuid4().hex,
        socket.gethostname(),
        _boot_id(),
        os.getpid(),
        _start_ticks(os.getpid()) or 0,
        _user(),
        job,
        restart,
        now,
        now,
        attempt=attempt,
    )


@dataclass(frozen=True)
class Snapshot:
    """A lease file as read: its bytes, and when it was last modified (seconds since the epoch)."""

    payload: bytes
    modified: float

    @property
    def holder(self) -> Holder | None:
        return Holder.decode(self.payload)


def running(pid: int, start_ticks: int) -> bool:
    """Whether ``pid`` is a live process that started at ``start_ticks`` (0: unknown, any start)."""
    ticks = _start_ticks(pid)
    if ticks is None:
        return False
    return 0 in (ticks, start_ticks) or ticks == start_ticks


def _start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks after boot; None when no such process runs (a zombie
    is not running: it has exited and waits for its parent)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    except OSError:  # /proc hidden from this user: fall back on whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _boot_id() -> str:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for this uid (some containers)
        return str(os.getuid())


def whole_seconds() -> float:
    """Now, as the lease file records it (ISO 8601 to the second)."""
    return float(int(time.time()))


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")


def _seconds(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class LeaseStore(Protocol):
    """Where a directory's lease lives, with the atomic steps taking it needs
    (:mod:`lance_hpc.checkpoint.lease` says why each store's are atomic)."""

    where: str

    def read(self) -> Snapshot | None: ...

    def claim(self, seen: Snapshot | None, record: bytes) -> bool:
        """Replace ``seen`` (None: no lease) by ``record``; False when another taker changed it first."""
        ...

    def rewrite(self, token: str, record: bytes) -> bool:
        """Replace the lease by ``record`` if ``token`` holds it; False when it does not."""
        ...

    def remove(self, seen: Snapshot) -> None:
        """Delete the lease if it is still ``seen``."""
        ...


class Leased(Protocol):
    """What taking a lease asks of a checkpoint store (:class:`lance_hpc.checkpoint.stores.Store`):
    where it is, and the lease beside it."""

    where: str

    def lease(self) -> LeaseStore: ...
