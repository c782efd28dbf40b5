"""One writer per checkpoint directory: rank 0 holds a lease file there while its run may write.

Two runs on one checkpoint.dir (a job submitted twice, a local run started twice) would prune and
resume from each other's checkpoints and both end "successfully". So before anything is written,
rank 0 takes the lease ``writer.lease.json`` in checkpoint.dir, renews it, and gives it back when the
run ends for good; a second run refuses to start and names the holder.

Taking it is atomic without flock, which NFS and Lustre mounts often lack or fake:

- on a file system the lease is created with O_CREAT|O_EXCL (atomic on NFSv3 and later). Of several
  runs taking over a stale lease, the one that creates its takeover file (O_EXCL again, named after
  that lease's contents) renames the stale lease to a name of its own, checks that the rename moved
  exactly that lease, and creates the new one; the others look again and find it alive.
- on object storage a conditional PUT (If-None-Match) would do, but pyarrow's S3 client sends no such
  header (boto3 is not a dependency). So a taker writes its lease, waits SETTLE_S and reads it back:
  with S3's read-after-write consistency every racer reads the last write, and only its writer goes
  on. That holds while a racer's check and its write are less than SETTLE_S apart.

A lease is alive while its pid runs on this machine (same host name and boot id, same process start
time), or, from another machine, while its heartbeat is younger than STALE_AFTER_S. The same SLURM job
started again (requeued, or restarted by SLURM) takes its own lease back at once. A requeued job's
lease, marked so, holds while SLURM shows the job waiting to run again, though its pid is gone and
its heartbeat stopped; it is free once SLURM says the job ended, or once SLURM no longer knows it and
its last heartbeat is STALE_AFTER_S old.

The heartbeat comes from a thread rather than from step boundaries: a step, an evaluation or a
multi-GB checkpoint upload can outlast any timeout worth waiting for, and a thread beats through them.
It dies with its process, so a killed run's lease goes stale on schedule. Rank 0 also checks that it
still holds the lease before each checkpoint it writes (:func:`held`).
"""

from __future__ import annotations

import functools
import getpass
import hashlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Protocol, TypeVar

from lance_hpc.checkpoint.stores import ObjectStore, open_store
from lance_hpc.errors import UserError
from lance_hpc.slurm import queue

LEASE_NAME = "writer.lease.json"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # ten missed heartbeats: longer than an NFS server takes to come back
SETTLE_S = 2.0  # object storage: how long a taker waits for a racer's write before it reads back
CLAIM_ATTEMPTS = 20  # looks at a lease others are changing, CLAIM_WAIT_S apart
CLAIM_WAIT_S = 0.2
TAKEOVER_S = 60.0  # a takeover file older than this was left by a taker that died
END_WAIT_S = 30.0  # how long a run's exit waits on the store to release or mark its lease
RECORD_BYTES = 1024  # renewals rewrite the record in place at one size, so no reader sees it shrink
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
T = TypeVar("T")


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
            f"last heartbeat {_duration(now - self.heartbeat)} ago"
        )

    def stop_hint(self) -> str:
        if self.job:
            return f"`lance-hpc cancel {self.job}` saves and stops it"
        return f"`kill -TERM {self.pid}` on {self.host} saves and stops it"


def this_process(job: str | None, restart: int) -> Holder:
    """A lease record for this process, as rank 0 of SLURM job ``job`` (None: a local run)."""
    now = _whole_seconds()
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
    )


@dataclass(frozen=True)
class Snapshot:
    """A lease file as read: its bytes, and when it was last modified (seconds since the epoch)."""

    payload: bytes
    modified: float

    @property
    def holder(self) -> Holder | None:
        return Holder.decode(self.payload)


class LeaseStore(Protocol):
    """Where a directory's lease lives, with the atomic steps taking it needs."""

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


def lease_store(directory: str | Path) -> LeaseStore:
    store = open_store(directory)
    return LeaseObject(store) if isinstance(store, ObjectStore) else LeaseFile(Path(directory))


class Lease:
    """The lease this process holds on ``directory``, renewed from a daemon thread until it is
    released (the run ended) or kept (the job was requeued and takes it back when it runs again)."""

    def __init__(self, directory: str | Path, store: LeaseStore, holder: Holder) -> None:
        self.directory, self.store, self.holder = str(directory), store, holder
        self.lost: str | None = None  # set when another run took the lease over
        self._lock = threading.Lock()  # renewals from the thread against keep/release from the run
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="lance_hpc-lease", daemon=True)

    def start(self) -> None:
        """Start renewing; from now on checkpoint.save confirms the lease before each write."""
        _HELD[self.directory] = self
        self._thread.start()

    def _beat(self) -> None:
        failing = False
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.renew()
                failing = False
            except Exception as error:  # a file system or store hiccup: the next beat tries again
                if not failing:
                    print(
                        f"lance_hpc: cannot renew the lease {self.store.where} ({error}); retrying every {HEARTBEAT_S:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                failing = True
            if self.lost:
                return

    def renew(self, requeued: bool = False) -> None:
        with self._lock:
            if self.lost:
                return
            renewed = replace(self.holder, heartbeat=_whole_seconds(), requeued=requeued)
            if self.store.rewrite(self.holder.token, renewed.encode()):
                self.holder = renewed
            else:
                self.lost = self._now_held_by()

    def confirm(self) -> None:
        """Raise UserError unless this process still holds the lease (rank 0 asks before each write)."""
        snapshot = self.store.read()
        holder = snapshot.holder if snapshot else None
        if holder is not None and holder.token == self.holder.token and not self.lost:
            return
        self.lost = self.lost or self._now_held_by()
        raise UserError(
            f"checkpoint.dir {self.directory}: this run no longer holds its lease ({self.lost}), so it stops "
            f"without writing: two writers would prune each other's checkpoints\n"
            "  fix: run one job per checkpoint.dir; the run that took over continues from this run's checkpoints. "
            f"A lease goes stale after {STALE_AFTER_S / 60:.0f} min without a heartbeat, so a run paused (SIGSTOP) "
            "or cut off from its file system that long loses it"
        )

    def _now_held_by(self) -> str:
        snapshot = self.store.read()
        holder = snapshot.holder if snapshot else None
        if holder is None:
            return f"{self.store.where} is gone" if snapshot is None else f"{self.store.where} was overwritten"
        return f"another run took it over: {holder.describe(time.time())}"

    def keep(self) -> None:
        """Stop renewing but keep the lease: the job was requeued, and its next run (same job, next
        restart count) takes it back at once. The mark tells other runs why the heartbeat stopped,
        and that SLURM decides when the lease is free."""
        if not self._end():
            return
        try:
            marked = _within(END_WAIT_S, lambda: self.renew(requeued=True))
        except Exception as error:  # the lease stays as it was; the restart count still identifies the job
            print(f"lance_hpc: cannot mark the lease {self.store.where} as requeued ({error})", file=sys.stderr, flush=True)
            return
        if not marked:
            print(
                f"lance_hpc: the lease {self.store.where} could not be marked as requeued within "
                f"{END_WAIT_S:.0f} s (its file system or store does not answer); it goes stale unmarked",
                file=sys.stderr,
                flush=True,
            )

    def release(self) -> None:
        """Stop renewing and delete the lease, if it is still this process's. Waits at most about
        HEARTBEAT_S + END_WAIT_S on a store that stopped answering: a lease left behind goes stale
        (or its pid is seen gone), where a job stuck in its exit would hold its nodes."""
        if not self._end():
            return

        def remove() -> None:
            snapshot = self.store.read()
            holder = snapshot.holder if snapshot else None
            if snapshot is not None and holder is not None and holder.token == self.holder.token:
                self.store.remove(snapshot)

        if not _within(END_WAIT_S, remove):
            print(
                f"lance_hpc: the lease {self.store.where} could not be released within {END_WAIT_S:.0f} s (its "
                "file system or store does not answer); it is left to go stale",
                file=sys.stderr,
                flush=True,
            )

    def _end(self) -> bool:
        """Stop the heartbeat and forget the lease; False when that was done already."""
        if _HELD.get(self.directory) is not self:
            return False
        del _HELD[self.directory]
        self._stop.set()
        self._thread.join(timeout=HEARTBEAT_S)  # a renewal stuck on a dead store is left to die with the process
        return True


def _within(seconds: float, action: Callable[[], None]) -> bool:
    """Run ``action`` and wait for it at most ``seconds``; False when it has not returned by then. It
    runs on a daemon thread, so a read stuck on a hard-mounted NFS server that went away (or behind a
    renewal stuck there, holding the lease's lock) is left to die with the process. Its exception is
    raised here."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            action()
        except BaseException as error:  # handed to the caller, which decides what to report
            errors.append(error)

    thread = threading.Thread(target=run, name="lance_hpc-lease-end", daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    if errors:
        raise errors[0]
    return not thread.is_alive()


# The lease this process holds on each checkpoint directory, which checkpoint.save confirms.
_HELD: dict[str, Lease] = {}


def held(directory: str | Path) -> Lease | None:
    """The lease this process holds on ``directory``, if any."""
    return _HELD.get(str(directory))


def acquire(directory: str | Path, me: Holder) -> tuple[Lease, str | None]:
    """Take the lease of ``directory`` for ``me`` and start renewing it: the lease, and what was
    taken over (a run that is gone), if anything worth saying. UserError when a live run holds it."""
    store = lease_store(directory)
    for attempt in range(CLAIM_ATTEMPTS):
        if attempt:
            time.sleep(CLAIM_WAIT_S)
        seen = _read(store)
        note = None if seen is None else verdict(seen, me, str(directory), store.where)
        if _file_errors(store, functools.partial(store.claim, seen, me.encode())):
            lease = Lease(directory, store, me)
            lease.start()
            return lease, note
    raise UserError(
        f"checkpoint.dir {directory}: could not take its lease {store.where} in {CLAIM_ATTEMPTS} tries: "
        "other runs kept changing it, so several are starting on this directory at once\n"
        "  fix: start one run per checkpoint.dir"
    )


def refuse_if_held(directory: str | Path, job: str | None, restart: int) -> None:
    """UserError when a live run holds the lease of ``directory``: a quick look before starting
    ranks, which take the lease themselves (and may find it taken meanwhile)."""
    store = lease_store(directory)
    seen = _read(store)
    if seen is not None:
        verdict(seen, this_process(job, restart), str(directory), store.where)


def verdict(seen: Snapshot, me: Holder, directory: str, where: str) -> str | None:
    """Whether ``me`` may take over the lease ``seen``: raises UserError while its holder may still
    write; otherwise returns what to tell the user (None for a job taking back its own lease)."""
    now = time.time()
    holder = seen.holder
    if holder is None:
        age = now - seen.modified
        if age < STALE_AFTER_S:
            raise UserError(
                f"checkpoint.dir {directory} has a lease {where} that cannot be read, last written "
                f"{_duration(age)} ago: another run may be taking it right now\n"
                f"  fix: start this run again in a minute; if no other run uses this directory, delete {where}"
            )
        return f"taking over the unreadable lease {where}, untouched for {_duration(age)}"
    if holder.job is not None and holder.job == me.job and (holder.requeued or holder.restart != me.restart):
        return None  # SLURM ends a job's previous run before it starts the next one
    gone = _why_gone(holder, me, now)
    if gone is None and holder.requeued and holder.job:
        raise UserError(
            f"checkpoint.dir {directory} is kept by a requeued job: {holder.describe(now)}\n"
            "  its next run takes the lease back and continues from its checkpoints; two runs on one checkpoint.dir "
            "would prune and resume from each other's checkpoints\n"
            f"  fix: let that job run again, or stop it for good with `lance-hpc cancel {holder.job}` (or "
            f"`scancel {holder.job}`) and start this run once SLURM shows it ended; or give this run its own "
            "checkpoint.dir (--set checkpoint.dir=...)"
        )
    if gone is None:
        raise UserError(
            f"checkpoint.dir {directory} is in use by another run: {holder.describe(now)}\n"
            "  two runs on one checkpoint.dir would prune and resume from each other's checkpoints\n"
            f"  fix: wait for that run to end ({holder.stop_hint()}), or give this run its own checkpoint.dir "
            "(--set checkpoint.dir=...). The lease is free once that run ends, or "
            f"{STALE_AFTER_S / 60:.0f} min after its last heartbeat if it died on another machine"
        )
    return (
        f"checkpoint.dir {directory}: taking over the lease of a run that is gone ({gone}); it was held by {holder.describe(now)}"
    )


def _why_gone(holder: Holder, me: Holder, now: float) -> str | None:
    """None while ``holder`` may still write; else why it cannot."""
    if holder.requeued and holder.job:
        return _why_requeued_gone(holder.job, now - holder.heartbeat)
    if holder.host == me.host and holder.boot_id == me.boot_id:
        if _running(holder.pid, holder.pid_start):
            return None
        return f"pid {holder.pid} is no longer running on {holder.host}"
    ended = _slurm_job_ended(holder.job) if holder.job else None
    if ended:
        return ended
    age = now - holder.heartbeat
    if age < STALE_AFTER_S:
        return None
    return f"no heartbeat for {_duration(age)} (a lease goes stale after {STALE_AFTER_S / 60:.0f} min without one)"


def _why_requeued_gone(job: str, heartbeat_age: float) -> str | None:
    """None while a requeued job may run again and take its lease back. Its pid is gone and its
    heartbeat stopped on purpose, so neither says anything: a job SLURM shows and has not ended keeps
    the lease however long it waits in the queue. One SLURM does not know (forgotten after it ended,
    or no SLURM on this machine) is gone once its heartbeat is stale; while the controller does not
    answer, nothing is decided."""
    shown, answered = _slurm_job(job)
    if shown is not None:
        return f"SLURM job {job} ended {shown.state}" if shown.ended else None
    if not answered or heartbeat_age < STALE_AFTER_S:
        return None
    return (
        f"SLURM job {job} was requeued {_duration(heartbeat_age)} ago and SLURM no longer knows it "
        f"(a requeued job's lease is free then, {STALE_AFTER_S / 60:.0f} min after its last heartbeat)"
    )


def _slurm_job_ended(job: str) -> str | None:
    """Why the holder's SLURM job can no longer write (it ended: cancelled with --now, killed, timed
    out), when this machine's SLURM knows; None otherwise. Without it a job resubmitted right after
    such an end would wait out the heartbeat."""
    shown, _ = _slurm_job(job)
    if shown is None or not shown.ended:
        return None
    return f"SLURM job {job} ended {shown.state}"


def _slurm_job(job: str) -> tuple[queue.SlurmJob | None, bool]:
    """The job as this machine's SLURM shows it (None: unknown to it, or no SLURM here), and False
    when the controller did not answer."""
    try:
        return (queue.show_job(job) if queue.have_slurm() else None), True
    except UserError:
        return None, False


def _read(store: LeaseStore) -> Snapshot | None:
    """The lease, read again when it does not parse: a renewal may have been mid-write."""
    snapshot = _file_errors(store, store.read)
    for _ in range(3):
        if snapshot is None or snapshot.holder is not None:
            break
        time.sleep(0.1)
        snapshot = _file_errors(store, store.read)
    return snapshot


def _file_errors(store: LeaseStore, action: Callable[[], T]) -> T:
    """``action()``, a file system's refusal turned into a UserError (object stores raise their own)."""
    try:
        return action()
    except OSError as error:
        raise UserError(
            f"cannot take the lease {store.where}: {error.strerror or error}\n"
            "  fix: checkpoint.dir must be a directory this user can create files in"
        ) from None


def _running(pid: int, start_ticks: int) -> bool:
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


def _whole_seconds() -> float:
    """Now, as the lease file records it (ISO 8601 to the second)."""
    return float(int(time.time()))


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")


def _seconds(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
