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
import sys
import threading
import time
from dataclasses import replace
from typing import Callable, TypeVar

from lance_hpc.checkpoint.lease.holders import LEASE_NAME, Holder, Leased, LeaseStore, Snapshot, this_process, whole_seconds
from lance_hpc.checkpoint.lease.verdict import STALE_AFTER_S, verdict
from lance_hpc.errors import UserError

# What other modules take from here; the record and the verdict have modules of their own, and each
# store its lease (:meth:`lance_hpc.checkpoint.stores.Store.lease`).
__all__ = [
    "LEASE_NAME",
    "STALE_AFTER_S",
    "Holder",
    "Lease",
    "acquire",
    "held",
    "refuse_if_held",
    "this_process",
    "verdict",
]

HEARTBEAT_S = 30.0
CLAIM_ATTEMPTS = 20  # looks at a lease others are changing, CLAIM_WAIT_S apart
CLAIM_WAIT_S = 0.2
END_WAIT_S = 30.0  # how long a run's exit waits on the store to release or mark its lease
T = TypeVar("T")


class Lease:
    """The lease this process holds on checkpoint.dir ``directory``, renewed from a daemon thread
    until it is released (the run ended) or kept (the job was requeued and takes it back when it
    runs again)."""

    def __init__(self, directory: str, store: LeaseStore, holder: Holder) -> None:
        self.directory, self.store, self.holder = directory, store, holder
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
            renewed = replace(self.holder, heartbeat=whole_seconds(), requeued=requeued)
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


def held(checkpoints: Leased) -> Lease | None:
    """The lease this process holds on the store ``checkpoints``, if any."""
    return _HELD.get(checkpoints.where)


def acquire(checkpoints: Leased, me: Holder) -> tuple[Lease, str | None]:
    """Take the lease of the store ``checkpoints`` for ``me`` and start renewing it: the lease, and
    what was taken over (a run that is gone), if anything worth saying. UserError when a live run
    holds it."""
    directory, store = checkpoints.where, checkpoints.lease()
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


def refuse_if_held(checkpoints: Leased, job: str | None, restart: int) -> None:
    """UserError when a live run holds the lease of the store ``checkpoints``: a quick look before
    starting ranks, which take the lease themselves (and may find it taken meanwhile)."""
    store = checkpoints.lease()
    seen = _read(store)
    if seen is not None:
        verdict(seen, this_process(job, restart), checkpoints.where, store.where)


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
