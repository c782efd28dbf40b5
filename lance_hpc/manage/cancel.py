"""``lance-hpc cancel``: stop a job after it saved a checkpoint (or at once with ``--now``).

lance_hpc's ranks take SIGTERM as "save and stop": each notes it, at the next step they agree,
rank 0 writes a checkpoint and every rank exits 3. Plain ``scancel`` sends SIGTERM too, but kills
the job ``KillWait`` seconds later (30 s by default), which a large model's checkpoint may not
survive; so cancel signals the job's steps only and waits for them to end on their own. submitit
jobs keep submitit's protocol (SIGTERM is ignored there): USR2 saves and requeues, and the
requeued job is then cancelled before it starts again. ``--now`` kills the tasks before it
cancels the job, as plain ``scancel`` would give them SIGTERM and time to save.
"""

from __future__ import annotations

import sys
import time

from lance_hpc.checkpoint import manifests
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.errors import ExitCode, UserError
from lance_hpc.manage import logs
from lance_hpc.output import printable
from lance_hpc.slurm import queue, records
from lance_hpc.slurm.records import JobRef

PROG = "lance-hpc cancel"
POLL_S, PROGRESS_EVERY_S = 1.0, 10.0


def stop_signal(job: queue.SlurmJob) -> str:
    return "USR2" if job.via_submitit else "TERM"


def cancel(ref: JobRef, now: bool, timeout_s: float) -> int:
    job = queue.show_job(ref.job_id)
    if job is None:
        raise UserError(
            f"SLURM does not know job {ref.job_id}, so there is nothing to cancel\n"
            f"  fix: see how it ended with: lance-hpc status {ref.spec_source or ref.job_id}"
        )
    if job.ended:
        print(f"job {ref.job_id} already ended: {job.state}; nothing to cancel")
        return 0
    if not job.started:
        queue.scancel(ref.job_id)
        print(f"cancelled job {ref.job_id} (it was {job.state}, so there was nothing to save)")
        return 0
    if now:
        queue.kill_now(ref.job_id)
        print(f"cancelled job {ref.job_id}")
        return 0
    signal_name = stop_signal(job)
    print(
        f"asking job {ref.job_id} to save a checkpoint and stop (SIG{signal_name} to its tasks; "
        "the ranks stop together at the next step)",
        flush=True,
    )
    if not queue.signal_steps(ref.job_id, signal_name):  # its batch script has not started srun yet
        queue.scancel(ref.job_id, signal_name)
    job = wait_until_stopped(ref, signal_name, timeout_s)
    if job is not None and not job.ended:
        print(
            f"{PROG}: job {ref.job_id} is still {job.state} after {timeout_s:.0f} s; it may still be writing "
            f"its checkpoint\n  fix: wait and check with `lance-hpc status {ref.spec_source or ref.job_id}`, "
            f"or stop it at once with `lance-hpc cancel {ref.job_id} --now`",
            file=sys.stderr,
        )
        return ExitCode.FAILED
    report_stopped(ref, job)
    return 0


def wait_until_stopped(ref: JobRef, signal_name: str, timeout_s: float) -> queue.SlurmJob | None:
    """Poll until the job ended (or SLURM forgot it); a submitit job that requeued itself after
    saving is cancelled before it can start again. Returns the last view of the job."""
    started = time.monotonic()
    shown_at = started
    while True:
        job = queue.show_job(ref.job_id)
        if job is None or job.ended:
            return job
        if signal_name == "USR2" and not job.started:
            queue.scancel(ref.job_id)
        elapsed = time.monotonic() - started
        if elapsed >= timeout_s:
            return job
        if time.monotonic() - shown_at >= PROGRESS_EVERY_S:
            print(
                f"  waiting for job {ref.job_id} to save and stop: {job.state}, {elapsed:.0f} s "
                f"(giving up after {timeout_s:.0f} s)",
                flush=True,
            )
            shown_at = time.monotonic()
        time.sleep(POLL_S)


def report_stopped(ref: JobRef, job: queue.SlurmJob | None) -> None:
    state = f"{job.state}, {job.describe_exit()}" if job else "gone from SLURM"
    if job is not None and ref.spec is not None:
        records.record_state(ref.spec, job)
    print(f"job {ref.job_id} stopped ({state})")
    if ref.spec is None:
        print(f"  ({ref.spec_note}: see its last lines with `lance-hpc logs {ref.job_id}`)")
        return
    outcome = logs.log_outcome(logs.job_logs(ref, job).files)
    saved = manifests.latest(open_store(ref.spec.checkpoint.dir))  # names and manifests only: nothing is loaded
    print(f"  its log: {printable(outcome or 'no stop message (it may have stopped before its first step)')}")
    if saved:
        print(f"  checkpoint step {saved.step}: {saved.location}")
        print(f"  continue with: lance-hpc submit {ref.spec_source}")
    else:
        print(f"  no checkpoint in {ref.spec.checkpoint.dir}: a new submission starts from step 0")


def cancel_jobs(target: str, overrides: list[str], job_id: str | None, now: bool, timeout_s: float) -> int:
    """Cancel the job ``target`` (a spec or a job id) names, each run of it for a sweep; without
    ``now``, wait up to ``timeout_s`` for each to save and stop. The worst exit code of them."""
    queue.require("scancel")
    refs = records.resolve(target, overrides, job_id)  # a sweep: each run of its latest array
    return max(cancel(ref, now, timeout_s) for ref in refs)
