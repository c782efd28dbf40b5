"""``lance-hpc status``: where a job is, how far it got, its last loss and how long it has left.

SLURM says the state and restarts (requeues) while it knows the job; the restart supervisor's records
say the attempts inside each allocation; the checkpoint, the TensorBoard events and the log say the
rest, also for a job SLURM has forgotten. Logs and checkpoint directories may be shared: only the
end of a regular log file is read, and every line is printed with its control characters escaped.
"""

from __future__ import annotations

import sys

from lance_hpc.checkpoint import manifests
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.kinds import registered_kind
from lance_hpc.manage import logs, progress
from lance_hpc.manage.attempts import attempt_lines
from lance_hpc.output import printable
from lance_hpc.runtime.watchdog import activity_line, watch_dir
from lance_hpc.slurm import queue, records
from lance_hpc.slurm.records import JobRef
from lance_hpc.spec import JobSpec

PROG = "lance-hpc status"


def headline(ref: JobRef, job: queue.SlurmJob | None, recorded: dict) -> str:
    """``job 1234 (digits4): RUNNING for 0:03:12 on node[1-2], restarts 1``."""
    name = ref.spec.name if ref.spec else (job.name if job else "?")
    if job is None:
        if "state" in recorded:
            detail = f"gone from SLURM; it ended {recorded['state']}" + (
                f" with exit code {recorded['exit_code']}" if recorded.get("exit_code") else ""
            )
        else:
            detail = "gone from SLURM (it forgot the job: no accounting, or long ended), final state not recorded"
        return f"job {ref.job_id} ({name}): {detail}"
    state = job.state + (f" ({job.reason})" if job.reason and not job.ended else "")
    if job.state == "RUNNING" and job.run_time:
        state += f" for {job.run_time} of {job.time_limit or '?'} on {job.nodes}"
    parts = [state]
    exit_text = job.describe_exit()
    if exit_text:
        parts.append(exit_text)
    if job.restarts is not None:
        parts.append(f"restarts {job.restarts}")
    return f"job {ref.job_id} ({name}): {', '.join(parts)}  [{job.source}]"


def report(ref: JobRef, job: queue.SlurmJob | None) -> list[str]:
    """The lines ``status`` prints for one job."""
    spec = ref.spec
    recorded = records.read_records(spec).get(ref.job_id, {}) if spec else {}
    lines = [headline(ref, job, recorded)]
    if spec is None:
        fix = ": name the spec to see them" if ref.spec_note == records.SPEC_NOT_FOUND else ""
        lines.append(f"  ({ref.spec_note}, so no checkpoint or metrics{fix})")
        return lines
    if job is not None:
        records.record_state(spec, job)
    lines.append(f"  spec        {ref.spec_source}{ref.run_label}")
    found = attempt_lines(ref)  # restarts inside the allocation, beside SLURM's requeues in the headline
    if found:
        lines += [f"  attempts    {found[0]}", *(f"              {line}" for line in found[1:])]
    job_logs = logs.job_logs(ref, job)
    ended = job is None or job.ended
    if ended:
        outcome = logs.log_outcome(job_logs.files)
        lines.append(f"  ended       {outcome or 'the log does not say how'}")
    shown = kind_progress(spec)
    if shown is not None:
        label, found = shown
        lines += [f"  {label:<11} {found[0]}", *(f"              {line}" for line in found[1:])]
        lines.append(f"  log         {job_logs.files[0]}")
        return lines
    saved, logged = manifests.latest(open_store(spec.checkpoint.dir)), progress.last_logged(spec.logging.tensorboard_dir)
    lines += training_lines(spec, saved, logged)
    if not ended:
        step = max(logged.step or 0, saved.step if saved else 0)
        lines.append(f"  time left   {time_left_text(spec, step, logged.seconds_per_step)}")
        activity = activity_line(watch_dir(spec.slurm.log_dir, spec.name, ref.job_id))
        if activity:
            lines.append(f"  ranks       {activity}")
    lines.append(f"  log         {job_logs.files[0]}")
    if ended and saved:
        lines.append(f"  resume      lance-hpc submit {ref.spec_source}  (continues from step {saved.step})")
    return lines


def training_lines(spec: JobSpec, saved: manifests.Saved | None, logged: progress.Logged) -> list[str]:
    """The checkpoint and last-log lines of a training job (names, manifests and events only:
    nothing is loaded)."""
    if saved:
        epoch = f", epoch {saved.epoch}" if saved.epoch is not None else ""
        lines = [f"  checkpoint  step {saved.step}{epoch}: {saved.location}"]
    else:
        lines = [f"  checkpoint  none yet in {spec.checkpoint.dir}"]
    if logged.loss is not None or logged.samples_per_s is not None:
        values = [
            f"loss {logged.loss:.4g}" if logged.loss is not None else "",
            f"{logged.samples_per_s:,.1f} samples/s" if logged.samples_per_s is not None else "",
        ]
        lines.append(f"  last log    step {logged.step}: {', '.join(value for value in values if value)}")
    else:
        lines.append(f"  last log    nothing logged yet in {spec.logging.tensorboard_dir}")
    return lines


def local_report(never: records.NeverSubmitted) -> list[str]:
    """For a training spec without a SLURM job: what its local runs left (a checkpoint, TensorBoard
    events) and where their output went. Raises ``never`` when they left nothing either."""
    spec = never.spec
    kind = registered_kind(spec.job)
    if kind is None or not kind.trains:
        raise never
    saved, logged = manifests.latest(open_store(spec.checkpoint.dir)), progress.last_logged(spec.logging.tensorboard_dir)
    if saved is None and logged.step is None:
        raise never
    lines = [f"{never.target} ({spec.name}): no SLURM job; what its --local runs left", *training_lines(spec, saved, logged)]
    if saved:
        try:
            total: int | None = progress.total_steps(spec)
        except Exception:  # a dataset that cannot be opened here: the line without the total
            total = None
        if total is not None and saved.step >= total:
            lines.append(f"  finished    step {saved.step} of {total}")
        else:
            lines.append(
                f"  continue    lance-hpc submit {never.target} --local  (from step {saved.step}; without --local on SLURM)"
            )
    lines.append("  output      a --local run prints to the terminal (or the file) it ran in; lance-hpc logs follows SLURM jobs")
    return lines


def kind_progress(spec: JobSpec) -> tuple[str, list[str]] | None:
    """The label and progress lines of the job's kind; None: the training lines. A kind of the
    user's own (an import path) is not imported: status never runs the code a spec names, so it
    says where to look instead."""
    kind = registered_kind(spec.job)
    if kind is None:
        return "job", [f"{spec.job}: its progress is in the log (status does not import a job kind of your own)"]
    found = kind.progress(spec)
    return None if found is None else (kind.name, found)


def time_left_text(spec: JobSpec, step: int, seconds_per_step: float | None) -> str:
    try:
        total = progress.total_steps(spec)
    except Exception as error:  # a dataset the login node cannot open: report the rest anyway
        return f"unknown (cannot plan the data to count the steps: {error})"
    left = progress.seconds_left(step, total, seconds_per_step)
    if left is None:
        return f"unknown until the first steps are logged (step {step} of {total})"
    return (
        f"about {progress.format_duration(left)}: step {step} of {total}, {total - step} steps x "
        f"{seconds_per_step:.3g} s (recent mean; evaluation and checkpoints not counted)"
    )


def show_status(target: str, overrides: list[str], job_id: str | None, every: bool) -> int:
    """Print the report of each job ``target`` (a spec or a job id) names: its latest job, the one
    ``job_id`` picks, or with ``every`` all of them, oldest first; for a spec never submitted, what
    its runs on this machine left."""
    try:
        refs = records.resolve(target, overrides, job_id, every=every)
    except records.NeverSubmitted as never:
        print("\n".join(map(printable, local_report(never))), flush=True)
        return 0
    if not queue.have_slurm():
        print(
            f"{PROG}: scontrol not found on PATH, so SLURM's view is missing below; run this on the login node for it",
            file=sys.stderr,
        )
    for index, ref in enumerate(refs):
        job = queue.show_job(ref.job_id) if queue.have_slurm() else None
        print(("\n" if index else "") + "\n".join(map(printable, report(ref, job))), flush=True)
    return 0
