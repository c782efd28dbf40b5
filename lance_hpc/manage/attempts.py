"""The attempts of a job inside its allocations, as ``lance-hpc status`` shows them beside SLURM's
requeues: when each started, on which nodes, how it ended and what came of it, from the records
the restart supervisor keeps (:mod:`lance_hpc.launch.restarts`)."""

from __future__ import annotations

import time

from lance_hpc.launch.paths import JobPaths
from lance_hpc.launch.restarts import ATTEMPTS_FILE, Attempt, read_attempts
from lance_hpc.slurm.records import JobRef
from lance_hpc.storage.shared_files import RefusedFile


def attempts_of(ref: JobRef) -> list[Attempt]:
    """What the supervisor recorded of ``ref``'s attempts (a sweep's run under the sweep's name).
    Raises RefusedFile for a record that is not the caller's own regular file."""
    owner = ref.log_owner
    if owner is None:
        return []
    return read_attempts(JobPaths.of(owner).attempts / ref.job_id / ATTEMPTS_FILE)


def attempt_lines(ref: JobRef) -> list[str]:
    """``attempts`` and one line per attempt, or nothing for a job that never restarted inside its
    allocation, or the one line that says which record was not read."""
    try:
        attempts = attempts_of(ref)
    except RefusedFile as error:
        return [f"attempts not shown: {error}"]
    if len(attempts) < 2 and not any(attempt.exit_code for attempt in attempts):
        return []
    runs = sorted({attempt.run for attempt in attempts})
    spec = ref.spec or ref.log_owner
    limit = f" (slurm.max_restarts: {spec.slurm.max_restarts} per allocation)" if spec else ""
    requeued = f", over {len(runs)} allocations (requeued {runs[-1]} time(s))" if runs[-1] else ""
    lines = [f"{len(attempts)} attempt(s){requeued}{limit}"]
    lines += [describe(attempt, show_run=bool(runs[-1])) for attempt in attempts]
    return lines


def describe(attempt: Attempt, show_run: bool = False) -> str:
    """``05:12:03 attempt 1 on node1,node2 (4 ranks): failed after 42 s: rank 1 on node2 was killed ... -> restarted (...)``."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(attempt.started))
    run = f"requeue {attempt.run}, " if show_run else ""
    where = f" on {','.join(attempt.nodes)} ({attempt.ranks} ranks)" if attempt.nodes else ""
    if attempt.ended is None:
        how = "running" if not attempt.outcome else attempt.outcome
    elif attempt.exit_code == 0:
        how = "finished"
    else:
        cause = attempt.cause.describe() if attempt.cause else f"exit code {attempt.exit_code}"
        how = f"failed after {attempt.ended - attempt.started:.0f} s: {cause}"
        if attempt.step is not None and (attempt.cause is None or attempt.cause.step is None):
            how += f" (ranks had reached step {attempt.step})"
    outcome = f" -> {attempt.outcome}" if attempt.outcome and attempt.ended is not None and attempt.exit_code else ""
    return f"{when} {run}attempt {attempt.number + 1}{where}: {how}{outcome}"
