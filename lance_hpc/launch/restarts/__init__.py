"""Restarts inside one allocation: a failed job step starts again from what the job saved (its
latest checkpoint, if any), on the nodes that are left, without a place in the queue.

The batch script runs srun through the supervisor (``python3 -I <log_dir>/<name>.restarts.pyz ...
-- srun ...``; submitit's script through a shell function ``srun`` that does the same). Each
attempt is one job step. When it fails (a rank died, raised, hung past the watchdog's limit, or
a node failed), the allocation stays (``#SBATCH --no-kill``), and the next attempt runs:

- on the allocation's nodes that SLURM still gives the job and does not mark down, drained or not
  responding, and that srun did not report failed; the first ``--nodes`` of them (later ones are
  spares), or as few as ``--min-nodes`` (fewer ranks: the checkpoint resumes on any world size);
- on a port held for its rank 0 from before it starts, as the batch step holds one for the first
  attempt (:mod:`~lance_hpc.launch.restarts.port_holder`);
- unless the attempt ended with the same error at the same step as an earlier one (a bug, not a
  fault: the job stops at once with that error and the rank that raised it), or with a problem in
  the spec or data (exit 2), or stopped by a signal (exit 3), or no restarts are left (the job
  ends with the first attempt's error and exit code).

Once an attempt is past its start, a standby step runs beside it (``srun --overlap``): the next
attempt's ranks, started ahead, their imports done, waiting for a go file
(:func:`lance_hpc.kinds.standby.wait_if_standby`). A restart on the same nodes releases them, so
it skips Python's start-up; a restart on other nodes, or the job's end, cancels them.

Every attempt is one line in ``<record>/attempts.jsonl`` when it starts and one when it ends (its
nodes, ranks, exit code and cause), which ``lance-hpc status`` shows; the ranks note their own
errors in ``<record>/run<R>-attempt<N>/rank-<r>.json`` (:func:`lance_hpc.runtime.failures.note_failure`).
The local launcher (``--local``) uses the same policy (:func:`decide`) for its ranks.

The modules: ``policy`` (attempts, causes, what restarts and on which nodes), ``causes`` (what srun
and the ranks' notes say of a failure), ``nodes`` (what SLURM says of the allocation's nodes),
``port_holder``, ``step`` (one srun) and ``supervisor`` (the loop); the command line the batch
script runs is :mod:`lance_hpc.cli.restarts`.

The batch step runs the supervisor with the node's own ``python3 -I``, outside any container, where
lance_hpc may not be installed: these modules and its command line import the standard library,
each other, :mod:`lance_hpc.runtime.ports`, :mod:`lance_hpc.runtime.restart_variables` (the
variables it sets for the ranks, named there once for both sides) and
:mod:`lance_hpc.storage.shared_files` only (a test holds them to that), and the renderer
writes them beside the job's script as one zip application (:mod:`lance_hpc.launch.restart_script`).
"""

from lance_hpc.launch.restarts.causes import StepReport, attempt_cause, cause_from_note, first_note, notes
from lance_hpc.launch.restarts.policy import (
    ATTEMPTS_FILE,
    NOT_RESTARTED,
    Attempt,
    Cause,
    Decision,
    choose_nodes,
    decide,
    read_attempts,
)

__all__ = [
    "ATTEMPTS_FILE",
    "NOT_RESTARTED",
    "Attempt",
    "Cause",
    "Decision",
    "StepReport",
    "attempt_cause",
    "cause_from_note",
    "choose_nodes",
    "decide",
    "first_note",
    "notes",
    "read_attempts",
]
