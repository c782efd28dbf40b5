"""Whether a run may take over a lease it found: its holder may still write (a live pid on this
machine, a fresh heartbeat from another, a requeued SLURM job waiting to run again), or is gone."""

from __future__ import annotations

import time

from lance_hpc.checkpoint.lease.holders import Holder, Snapshot, duration, running
from lance_hpc.errors import UserError
from lance_hpc.slurm import queue

STALE_AFTER_S = 300.0  # ten missed heartbeats: longer than an NFS server takes to come back


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
                f"{duration(age)} ago: another run may be taking it right now\n"
                f"  fix: start this run again in a minute; if no other run uses this directory, delete {where}"
            )
        return f"taking over the unreadable lease {where}, untouched for {duration(age)}"
    if (
        holder.job is not None
        and holder.job == me.job
        and (holder.requeued or holder.restart != me.restart or holder.attempt < me.attempt)
    ):
        # SLURM ends a job's previous run before it starts the next one, and the restart supervisor
        # an attempt before the next, wherever that one's rank 0 runs
        return None
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
        if running(holder.pid, holder.pid_start):
            return None
        return f"pid {holder.pid} is no longer running on {holder.host}"
    ended = _slurm_job_ended(holder.job) if holder.job else None
    if ended:
        return ended
    age = now - holder.heartbeat
    if age < STALE_AFTER_S:
        return None
    return f"no heartbeat for {duration(age)} (a lease goes stale after {STALE_AFTER_S / 60:.0f} min without one)"


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
        f"SLURM job {job} was requeued {duration(heartbeat_age)} ago and SLURM no longer knows it "
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
