"""What SLURM knows about a job, read with the commands every login node has.

``scontrol show job`` answers for queued, running and recently ended jobs (until SLURM's
``MinJobAge``, 300 s by default) and needs no accounting database; ``sacct`` answers for older
jobs where slurmdbd runs, and is skipped quietly where it does not. ``squeue --name`` finds jobs
submitted by hand from a rendered script.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from lance_hpc.errors import ExitCode, UserError

# scontrol states of a job that will not run again.
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}

# A "Key=" of scontrol's one-line output: values may hold spaces, so keys mark where fields start.
SCONTROL_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:]*)=")
SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "Start", "End", "Elapsed", "NodeList")
COMMAND_TIMEOUT_S = 30
# How long a cancel --now waits for a node to answer its pause (kill_now); it cancels either way.
PAUSE_ANSWER_S = 10
# scancel's words (slurm_strerror) for a step that ended before its signal reached it
STEP_GONE_WORDS = ("already completing or completed", "invalid job id specified", "invalid job step")
SHELL_SIGNAL_BASE = 128  # a process killed by signal N exits 128 + N as the shell reports it
# What the exit codes of ``python -m lance_hpc.run`` mean, as SLURM reports them for the job.
RUN_EXIT_MEANINGS = {str(int(code)): code.meaning for code in (ExitCode.FAILED, ExitCode.USER_ERROR, ExitCode.STOPPED)}


@dataclass(frozen=True)
class SlurmJob:
    """One job as SLURM shows it; ``source`` says which command answered."""

    job_id: str
    name: str
    state: str
    source: str
    reason: str = ""
    restarts: int | None = None
    exit_code: str = ""
    run_time: str = ""
    time_limit: str = ""
    start_time: str = ""
    end_time: str = ""
    nodes: str = ""
    stdout: str = ""
    stderr: str = ""
    command: str = ""

    @property
    def via_submitit(self) -> bool:
        """submitit names a job's logs ``<folder>/<id>_<task>_log.out``; task 0's is the batch log."""
        return Path(self.stdout).name == f"{self.job_id}_0_log.out"

    @property
    def ended(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def started(self) -> bool:
        return self.state not in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING")

    def describe_exit(self) -> str:
        """``exit 3 (stopped by a signal, checkpoint saved)``; empty while the job runs."""
        if not self.ended or not self.exit_code:
            return ""
        code, _, signal_number = self.exit_code.partition(":")
        if signal_number not in ("", "0"):
            return f"exit {code}, killed by signal {signal_number}"
        meaning = RUN_EXIT_MEANINGS.get(code)
        if meaning is None and code.isdigit() and int(code) > SHELL_SIGNAL_BASE:  # the shell's 128 + signal
            meaning = f"a task ended by {_signal_name(int(code) - SHELL_SIGNAL_BASE)}"
        return f"exit {code}" + (f" ({meaning})" if meaning else "")


def parse_scontrol(text: str) -> list[dict[str, str]]:
    """``scontrol show job -o`` output: one dict of fields per line (per job, or array task)."""
    jobs = []
    for line in text.splitlines():
        keys = list(SCONTROL_KEY.finditer(line))
        fields = {}
        for index, match in enumerate(keys):
            end = keys[index + 1].start() if index + 1 < len(keys) else len(line)
            fields[match.group(1)] = line[match.end() : end].strip()
        if "JobId" in fields:
            jobs.append(fields)
    return jobs


def job_from_scontrol(fields: dict[str, str]) -> SlurmJob:
    restarts = fields.get("Restarts", "")
    return SlurmJob(
        job_id=f"{fields['ArrayJobId']}_{fields['ArrayTaskId']}" if "ArrayTaskId" in fields else fields["JobId"],
        name=fields.get("JobName", ""),
        state=fields.get("JobState", "UNKNOWN"),
        source="scontrol",
        reason="" if fields.get("Reason") in (None, "None") else fields["Reason"],
        restarts=int(restarts) if restarts.isdigit() else None,
        exit_code=fields.get("ExitCode", ""),
        run_time=fields.get("RunTime", ""),
        time_limit=fields.get("TimeLimit", ""),
        start_time=_known(fields.get("StartTime", "")),
        end_time=_known(fields.get("EndTime", "")),
        nodes=_known(fields.get("NodeList", "")),
        stdout=fields.get("StdOut", ""),
        stderr=fields.get("StdErr", ""),
        command=fields.get("Command", ""),
    )


def parse_sacct(text: str, job_id: str) -> SlurmJob | None:
    """``sacct -D -X -n -P -o <SACCT_FIELDS>`` output: every run of the job, one per requeue;
    the last is the current one and the count of earlier ones is its restarts."""
    runs = [line.split("|") for line in text.splitlines() if line.strip()]
    runs = [run for run in runs if len(run) == len(SACCT_FIELDS) and run[0] == job_id]
    if not runs:
        return None
    fields = dict(zip(SACCT_FIELDS, runs[-1]))
    return SlurmJob(
        job_id=job_id,
        name=fields["JobName"],
        state=fields["State"].split()[0],  # "CANCELLED by 1000" -> CANCELLED
        source="sacct",
        restarts=len(runs) - 1,
        exit_code=fields["ExitCode"],
        run_time=fields["Elapsed"],
        start_time=_known(fields["Start"]),
        end_time=_known(fields["End"]),
        nodes=_known(fields["NodeList"]),
    )


def parse_squeue_ids(text: str) -> list[str]:
    """Job ids from ``squeue -h -o %i`` (array tasks as ``123_4``), oldest first."""
    return sorted({line.strip() for line in text.splitlines() if line.strip()}, key=job_order)


def job_order(job_id: str) -> tuple[int, int]:
    """Sort key of a job id: ``123`` < ``123_4`` < ``124``."""
    head, _, task = job_id.partition("_")
    return (int(head) if head.isdigit() else -1, int(task) if task.isdigit() else -1)


def show_job(job_id: str) -> SlurmJob | None:
    """The job as scontrol shows it, else as sacct does; None when neither knows it."""
    if shutil.which("scontrol"):
        shown = _run("scontrol", "show", "job", "-o", job_id)
        if shown.returncode == 0:
            matching = [job_from_scontrol(fields) for fields in parse_scontrol(shown.stdout)]
            matching = [job for job in matching if job.job_id == job_id] or matching
            if matching:
                return matching[0]
    if shutil.which("sacct"):
        accounted = _run("sacct", "-D", "-X", "-n", "-P", "-o", ",".join(SACCT_FIELDS), "-j", job_id)
        if accounted.returncode == 0:  # fails where slurmdbd does not run: nothing to add then
            return parse_sacct(accounted.stdout, job_id)
    return None


def jobs_named(name: str) -> list[str]:
    """Ids of this user's queued and running jobs called ``name`` (the spec's name is the job name)."""
    if not shutil.which("squeue"):
        return []
    listed = _run("squeue", "--me", "-h", "-o", "%i", "--name", name)
    return parse_squeue_ids(listed.stdout) if listed.returncode == 0 else []


def have_slurm() -> bool:
    return shutil.which("scontrol") is not None or shutil.which("sacct") is not None


def scancel(job_id: str, signal_name: str | None = None) -> None:
    """Plain scancel, or with ``signal_name`` that signal to the job's steps (not the batch shell)."""
    require("scancel")
    command = ["scancel", *([f"--signal={signal_name}"] if signal_name else []), job_id]
    result = _run(*command)
    if result.returncode != 0:
        message = (result.stderr or result.stdout).strip()
        raise UserError(f"{' '.join(command)} failed: {message}\n  fix: check the job id with squeue --me")


def signal_steps(job_id: str, signal_name: str) -> list[str]:
    """Send ``signal_name`` once to each running step of the job; returns the steps signalled.

    ``scancel --signal`` given a job id retries for up to a minute and a half while SLURM calls
    the job "in a transitional state", which it does for a job whose ranks requeue it on that very
    signal: a retry then lands in the requeued run, which stops and requeues again, or dies of the
    signal before it can hold it. A step id is signalled once, with no retry.

    A step that ended meanwhile fails harmlessly; when every step fails for another reason (someone
    else's job, say), UserError says so rather than leaving the caller to wait for a stop that
    never comes."""
    require("scancel")
    steps = job_steps(job_id)
    refusals = []
    for step in steps:
        result = _run("scancel", f"--signal={signal_name}", step)
        if result.returncode != 0:
            refusals.append((result.stderr or result.stdout).strip() or f"exit status {result.returncode}")
    refused = [message for message in refusals if not _step_gone(message)]
    if steps and len(refusals) == len(steps) and refused:
        raise UserError(
            f"scancel --signal={signal_name} could not signal job {job_id}: {refused[0]}\n"
            f"  fix: check the job id with squeue --me (only your own jobs can be signalled)"
        )
    return steps


def _step_gone(message: str) -> bool:
    """Whether scancel failed because the step had already ended (nothing to signal any more)."""
    lowered = message.lower()
    return any(words in lowered for words in STEP_GONE_WORDS)


def kill_now(job_id: str) -> None:
    """Cancel a running job with its tasks killed at once, so they save nothing.

    A plain scancel gives every task SIGTERM and ``KillWait`` seconds before SIGKILL, and
    lance_hpc's ranks take SIGTERM as "save and stop": a small model saves well within that. A
    cancelled job step gets SIGKILL alone, so each step is cancelled first, with the batch script
    paused meanwhile: it would otherwise end the job as FAILED as soon as its srun returns. The
    job's own scancel then continues the script into its end, and the job ends CANCELLED.

    SLURM records the pause (JobState STOPPED) only when the node answers, and an answer that
    comes after the cancel overwrites CANCELLED: the job then shows STOPPED for good, though
    nothing of it runs. So the cancel waits for that answer (:func:`wait_until_paused`)."""
    paused = _run("scancel", "--batch", "--signal=STOP", job_id)  # fails only where the script has ended: no matter
    if paused.returncode == 0:
        wait_until_paused(job_id)
    for step in job_steps(job_id):
        _run("scancel", step)  # fails only for a step that ended meanwhile
    scancel(job_id)


def wait_until_paused(job_id: str, timeout_s: float = PAUSE_ANSWER_S) -> None:
    """Wait until SLURM shows the job STOPPED (its node answered the pause), or ended, or
    ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = show_job(job_id)
        if job is None or job.state in ("STOPPED", "COMPLETING") or job.ended:
            return
        time.sleep(0.1)


def job_steps(job_id: str) -> list[str]:
    """The job's steps that srun started (``1234.0``, ``55_2.1``), not its batch or extern step."""
    listed = _run("squeue", "--steps", "--jobs", job_id, "-h", "-o", "%i")
    return [step for step in listed.stdout.split() if step.rpartition(".")[2].isdigit()]


def require(command: str) -> None:
    if shutil.which(command) is None:
        raise UserError(
            f"{command} not found on PATH, so this machine cannot reach SLURM\n"
            "  fix: run this on your cluster's login node (where sbatch, squeue and scontrol work)"
        )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _known(value: str) -> str:
    return "" if value in ("", "None", "Unknown", "(null)", "N/A") else value


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UserError(
            f"{' '.join(command)} did not answer within {COMMAND_TIMEOUT_S} s\n"
            "  fix: check that the SLURM controller is up (scontrol ping), then try again"
        ) from None
