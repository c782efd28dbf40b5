"""Which SLURM jobs belong to a job spec, and the job spec of a SLURM job.

``lance-hpc submit`` appends one JSON line per job to ``<slurm.log_dir>/jobs.jsonl``;
``status`` and ``cancel`` append the final state they saw, so it is still known once SLURM has
forgotten the job (without accounting that is minutes after it ends). Jobs submitted by hand
from a rendered script are found by their log files (``<name>-<id>.out``) and, while queued, by
their job name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from lance_hpc.errors import UserError
from lance_hpc.slurm import queue
from lance_hpc.spec import JobSpec, SweepRun, expand, load_spec_text
from lance_hpc.spec.load import NotYourFile, owner_name, read_own_text
from lance_hpc.storage.files import read_regular

RECORDS_FILE = "jobs.jsonl"
JOB_ID = re.compile(r"^\d+(_\d+)?$")
SPEC_NOT_FOUND = "its spec was not found beside its log"


class NotYourSpec(NotYourFile):
    """A spec file someone else owns: its paths would decide what this user's commands read and write."""

    def __init__(self, path: Path, uid: int) -> None:
        owner = owner_name(uid)
        super().__init__(
            path,
            uid,
            "lance-hpc status, logs and cancel read only your own job specs, so that nobody else's spec decides "
            "which files they read and write as you",
            f"give the job id instead (lance-hpc status <job id>) to see what SLURM knows, or ask {owner}",
        )


@dataclass(frozen=True)
class JobRef:
    """A job to report on: its id, its spec when known, and where the spec came from. A sweep's
    run has its own spec; ``log_spec`` is the sweep's, which names the array's log files."""

    job_id: str
    spec: JobSpec | None
    spec_source: str = ""
    log_spec: JobSpec | None = None
    run_label: str = ""  # a sweep's run: " (run 2: train.lr=0.05)"
    spec_note: str = SPEC_NOT_FOUND  # without a spec: why

    @property
    def log_owner(self) -> JobSpec | None:
        return self.log_spec or self.spec


# Far more than the lines of a lifetime of submissions of one log directory (about 100 bytes a line).
RECORDS_BYTES = 64 * 1024 * 1024


def records_path(spec: JobSpec) -> Path:
    return Path(spec.slurm.log_dir) / RECORDS_FILE


def record_submission(spec: JobSpec, job_id: str, via: str) -> None:
    """Note that ``job_id`` runs ``spec`` (called by submit once SLURM has given the id)."""
    _append(records_path(spec), {"job_id": str(job_id), "name": spec.name, "via": via, "submitted": _now()})


def record_state(spec: JobSpec, job: queue.SlurmJob) -> None:
    """Keep an ended job's final state for when SLURM no longer shows it (once per job)."""
    if job.ended and read_records(spec).get(job.job_id, {}).get("state") != job.state:
        _append(
            records_path(spec),
            {"job_id": job.job_id, "state": job.state, "exit_code": job.exit_code, "end_time": job.end_time, "seen": _now()},
        )


def read_records(spec: JobSpec) -> dict[str, dict[str, Any]]:
    """job id -> everything recorded about it (later lines update earlier ones)."""
    path = records_path(spec)
    records: dict[str, dict[str, Any]] = {}
    # a log directory may be shared: a FIFO or a link to a device planted here must not hang status
    found = read_regular(path, RECORDS_BYTES, fix=f"remove {path}; it is lance_hpc's own record of the jobs submitted")
    if found is None:
        return records
    for line in found.decode(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a full disk: the others still count
        if isinstance(entry, dict) and "job_id" in entry:
            records.setdefault(str(entry["job_id"]), {}).update(entry)
    return records


def job_ids_of(spec: JobSpec) -> list[str]:
    """Every job of ``spec`` lance_hpc can find, oldest first: recorded, logged, or queued by name."""
    found = set(read_records(spec))
    log_dir = Path(spec.slurm.log_dir)
    pattern = re.compile(rf"^{re.escape(spec.name)}-(\d+(?:_\d+)?)\.(?:out|err)$")
    if log_dir.is_dir():
        found.update(match.group(1) for path in log_dir.iterdir() if (match := pattern.match(path.name)))
    found.update(queue.jobs_named(spec.name))
    return sorted(found, key=queue.job_order)


def resolve(target: str, overrides: Sequence[str] = (), job_id: str | None = None, every: bool = False) -> list[JobRef]:
    """The jobs ``target`` (a job spec path or a job id) names: the latest of a spec's jobs (of a
    sweep: every run of its latest array), the one ``job_id`` picks, or with ``every`` all of them,
    oldest first."""
    if JOB_ID.match(target) and not Path(target).exists():
        if overrides:
            raise UserError("--set goes with a job spec, not a job id")
        return job_refs(target)
    spec = load_own_spec(Path(target), overrides)
    if spec.sweep:
        return sweep_runs(spec, target, job_id, every)
    ids = job_ids_of(spec)
    if job_id is not None:
        if job_id not in ids:
            known = ", ".join(ids) or "none"
            raise UserError(
                f"job {job_id} is not one of {target}'s jobs (found: {known})\n"
                f"  fix: pick one of those, or give the job id alone: lance-hpc ... {job_id}"
            )
        ids = [job_id]
    if not ids:
        raise NeverSubmitted(spec, target)
    return [JobRef(one, spec, target) for one in (ids if every else ids[-1:])]


def sweep_runs(spec: JobSpec, target: str, job_id: str | None, every: bool) -> list[JobRef]:
    """A sweep's array tasks, one per run (``<array id>_<run index>``), each with its run's spec."""
    runs = expand(spec, target, imports=False)
    arrays = sorted({found.partition("_")[0] for found in job_ids_of(spec)}, key=queue.job_order)
    if not arrays:
        raise NeverSubmitted(spec, target)
    refs = [run_ref(array, run, spec, target) for array in (arrays if every or job_id else arrays[-1:]) for run in runs]
    if job_id is not None:
        refs = [ref for ref in refs if job_id in (ref.job_id, ref.job_id.partition("_")[0])]
        if not refs:
            raise UserError(
                f"job {job_id} is not one of {target}'s runs (arrays found: {', '.join(arrays)})\n"
                "  fix: give an array id, or <array id>_<run index> for one run"
            )
    return refs


def run_ref(array_id: str, run: SweepRun, sweep: JobSpec, source: str) -> JobRef:
    return JobRef(f"{array_id}_{run.index}", run.spec, source, sweep, f" (run {run.index}: {run.describe()})")


def job_refs(job_id: str) -> list[JobRef]:
    """The job a job id names, with its spec when found. A sweep's array task reports with its
    run's spec (its own checkpoints and events), an array id as every run of the array."""
    spec, source, note = spec_of_job(job_id)
    if spec is None or not spec.sweep:
        return [JobRef(job_id, spec, source, spec_note=note)]
    array_id, _, index = job_id.partition("_")
    runs = [run for run in expand(spec, source, imports=False) if index in ("", str(run.index))]
    return [run_ref(array_id, run, spec, source) for run in runs] or [JobRef(job_id, spec, source)]


class NeverSubmitted(UserError):
    """A spec with no SLURM job to report on (``spec``: it, validated; ``target``: as it was named)."""

    def __init__(self, spec: JobSpec, target: str) -> None:
        self.spec, self.target = spec, target
        super().__init__(
            f"{target} ({spec.name}) has no SLURM job that lance_hpc can find: none in {records_path(spec)}, "
            f"no {spec.name}-<id>.out log in {spec.slurm.log_dir}, none named {spec.name} in squeue\n"
            f"  {LOCAL_RUNS_NOTE.format(checkpoints=spec.checkpoint.dir, events=spec.logging.tensorboard_dir)}\n"
            f"  fix: submit it with `lance-hpc submit {target}`, or give the job id instead of the spec"
        )


# What status, logs and cancel say of runs they do not follow.
LOCAL_RUNS_NOTE = (
    "lance-hpc status, logs and cancel follow SLURM jobs; a --local run prints to the terminal (or the file) "
    "it ran in, stops with Ctrl-C, and keeps its checkpoints in {checkpoints} and its TensorBoard events in {events}"
)


def load_own_spec(path: Path, overrides: Sequence[str] = (), follow_links: bool = True) -> JobSpec:
    """The spec at ``path``, read only if the caller owns it and validated without importing
    anything it names: looking at a job must not run its code, nor let another user's spec
    choose the checkpoints, logs and records read and written as the caller. Raises NotYourSpec
    for another user's file, SpecError for a missing or invalid one."""
    try:
        text = read_own_text(path, follow_links)
    except NotYourFile as error:
        raise NotYourSpec(path, error.uid) from None
    return load_spec_text(text, str(path), overrides, imports=False).spec


def spec_of_job(job_id: str) -> tuple[JobSpec | None, str, str]:
    """The resolved spec a live job runs, found beside its log file (where submit writes it), its
    path, and without it what to tell the user. Any user's job can be named, so only a regular
    file the caller owns is read (a link there is not followed)."""
    if not queue.have_slurm():
        queue.require("scontrol")
    job = queue.show_job(job_id)
    if job is None:
        raise UserError(
            f"SLURM does not know job {job_id}: a wrong id, or it ended long enough ago that SLURM forgot it "
            "(without accounting, finished jobs leave scontrol after MinJobAge, 300 s by default)\n"
            "  fix: check the id with `squeue --me`, or name the job's spec: lance-hpc status jobs/<spec>.yaml"
        )
    for candidate in _spec_candidates(job):
        try:
            return load_own_spec(candidate, follow_links=False), str(candidate), ""
        except NotYourSpec as error:
            return None, "", f"its spec {candidate} belongs to {error.owner}, not to you, so lance-hpc did not read it"
        except UserError:
            continue  # missing, or a spec since rewritten by a newer lance_hpc: report what SLURM knows
    return None, "", SPEC_NOT_FOUND


def _spec_candidates(job: queue.SlurmJob) -> list[Path]:
    """``<log_dir>/<name>.spec.yaml``; the log is ``<log_dir>/<name>-<id>.out`` (sbatch) or
    ``<log_dir>/submitit/<id>_<task>_log.out`` (submitit)."""
    if not job.stdout or not job.name:
        return []
    log_folder = Path(job.stdout).parent
    return [log_folder / f"{job.name}.spec.yaml", log_folder.parent / f"{job.name}.spec.yaml"]


def _append(path: Path, entry: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as file:  # one short write in append mode: concurrent writers do not interleave
        file.write(json.dumps(entry) + "\n")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
