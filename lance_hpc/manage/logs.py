"""``lance-hpc logs``: a job's output across requeues, optionally one rank's, optionally followed.

A job's log files are appended to by every run of the same job id (``--open-mode=append``), so
the files are the whole story. sbatch jobs write one stdout and one stderr file with every line
labelled by its rank (``srun --label``: ``3: text``); submitit jobs write a pair per task.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence, TextIO

from submitit.core.utils import JobPaths as SubmititPaths

from lance_hpc.errors import UserError
from lance_hpc.launch.paths import JobPaths
from lance_hpc.manage import progress
from lance_hpc.slurm import queue, records
from lance_hpc.slurm.records import JobRef
from lance_hpc.storage.files import open_regular

PROG = "lance-hpc logs"
RANK_LABEL = re.compile(rb"^\s*(\d+): ?")
POLL_S, STATE_EVERY_S = 0.5, 2.0
# Logs are read and printed this much at a time, so a huge one never sits in memory whole; a line
# longer than this is printed in pieces.
READ_CHUNK = 1 << 20
# --rank looks for rank labels in this much of the end of the log, not the whole file.
LABEL_CHECK_BYTES = 1 << 16
# How an ended job ended is in the last lines of its log: this much of its end is read.
OUTCOME_BYTES = 1 << 20


@dataclass(frozen=True)
class JobLogs:
    """The files that hold a job's output; ``labelled``: ranks share them, each line labelled."""

    files: list[Path]
    labelled: bool


def expand_job_id(pattern: str, job_id: str) -> Path:
    """A log path with SLURM's ``%j`` (job id) or ``%A``/``%a`` (array job id and task) filled in."""
    array_id, _, task = job_id.partition("_")
    return Path(pattern.replace("%A", array_id).replace("%a", task).replace("%j", job_id))


def job_logs(ref: JobRef, job: queue.SlurmJob | None, rank: int | None = None) -> JobLogs:
    """Where ``ref``'s output is (or will be), for every rank or just ``rank``."""
    owner = ref.log_owner
    if ref.spec is not None and owner is not None:
        files = JobPaths.of(owner)
        out, err = (expand_job_id(path, ref.job_id) for path in (files.stdout, files.stderr))
        submitit_log = SubmititPaths(files.submitit_folder, ref.job_id, 0).stdout
        if out.exists() or not (submitit_log.exists() or (job is not None and job.via_submitit)):
            return JobLogs([out, err], labelled=True)
        tasks = [rank] if rank is not None else range(ref.spec.slurm.world_size)
        paths = [SubmititPaths(JobPaths.of(owner).submitit_folder, ref.job_id, task) for task in tasks]
        return JobLogs([path for task in paths for path in (task.stdout, task.stderr)], labelled=False)
    if job is None or not job.stdout:
        raise UserError(
            f"cannot tell where job {ref.job_id} writes its log\n  fix: name the job's spec: lance-hpc logs jobs/<spec>.yaml"
        )
    return JobLogs([Path(job.stdout), *([Path(job.stderr)] if job.stderr and job.stderr != job.stdout else [])], labelled=True)


def rank_filter(rank: int | None) -> Callable[[bytes], bytes | None]:
    """Keep every line, or only ``rank``'s labelled lines without their label."""

    def keep(line: bytes) -> bytes | None:
        if rank is None:
            return line
        match = RANK_LABEL.match(line)
        return line[match.end() :] if match and int(match.group(1)) == rank else None

    return keep


class Printer:
    """Prints lines from several files, with a ``==> file <==`` header whenever the file changes."""

    def __init__(self, keep: Callable[[bytes], bytes | None], headers: bool, out: TextIO = sys.stdout) -> None:
        self.keep, self.headers, self.out = keep, headers, out
        self.current: Path | None = None

    def lines(self, path: Path, lines: Sequence[bytes]) -> None:
        kept = [line for line in map(self.keep, lines) if line is not None]
        if not kept:
            return
        if self.headers and path != self.current:
            self.out.write(f"{'' if self.current is None else chr(10)}==> {path} <==\n")
        self.current = path
        self.out.write(b"\n".join(kept).decode(errors="replace") + "\n")
        self.out.flush()


def open_log(path: Path) -> int | None:
    """A descriptor of the regular file at ``path``, or None while it does not exist. A job found
    by id alone has the log path SLURM shows, which its submitter chose: a device such as
    /dev/zero or a FIFO there would never end or block forever, so only a regular file is read (a
    link to one is followed: the path is the submitter's own choice, not a file lance_hpc wrote)."""
    return open_regular(
        path,
        fix="read the job's output where it was sent, or name the job's spec: lance-hpc logs jobs/<spec>.yaml",
        follow_links=True,
    )


def read_log(path: Path, offset: int, size: int) -> bytes:
    """Up to ``size`` bytes of the log at ``path`` from ``offset``; nothing while it does not exist."""
    descriptor = open_log(path)
    if descriptor is None:
        return b""
    try:
        return os.pread(descriptor, size, offset)
    finally:
        os.close(descriptor)


def read_end(path: Path, size: int) -> tuple[bytes, bool]:
    """The last ``size`` bytes of the log at ``path`` (nothing while it does not exist), and whether
    the log holds more before them (then the first line read is cut off)."""
    descriptor = open_log(path)
    if descriptor is None:
        return b"", False
    try:
        start = max(os.fstat(descriptor).st_size - size, 0)
        return os.pread(descriptor, size, start), start > 0
    finally:
        os.close(descriptor)


def log_outcome(files: Sequence[Path]) -> str | None:
    """How the job whose log is ``files`` (stdout first, then stderr) last ended, read from the
    whole lines in the last OUTCOME_BYTES of each; None when they do not say."""
    texts = []
    for path in files:
        end, cut = read_end(path, OUTCOME_BYTES)
        text = end.decode(errors="replace")
        texts.append(text.partition("\n")[2] if cut else text)
    return progress.outcome_from_log(texts[0], "".join(texts[1:]))


class Tail:
    """New complete lines of one file since the last read (a cut-off last line waits for its end).
    Each read takes at most READ_CHUNK bytes; ``more`` says the file has more to read now."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial, self.more = path, 0, b"", False

    def read(self, final: bool = False) -> list[bytes]:
        data = read_log(self.path, self.offset, READ_CHUNK)
        self.offset += len(data)
        self.more = len(data) == READ_CHUNK
        *complete, self.partial = (self.partial + data).split(b"\n")
        if (final and not self.more and self.partial) or len(self.partial) >= READ_CHUNK:
            complete.append(self.partial)
            self.partial = b""
        return complete


def show(logs: JobLogs, rank: int | None, follow_job: str | None) -> None:
    """Print the logs; with ``follow_job``, keep printing new lines until that job has ended."""
    printer = Printer(rank_filter(rank if logs.labelled else None), headers=len(logs.files) > 1)
    tails = [Tail(path) for path in logs.files]
    ended, checked_at = follow_job is None, time.monotonic()
    while True:
        for tail in tails:
            printer.lines(tail.path, tail.read(final=ended))
            while tail.more:
                printer.lines(tail.path, tail.read(final=ended))
        if ended:
            return
        time.sleep(POLL_S)
        if time.monotonic() - checked_at >= STATE_EVERY_S:
            assert follow_job is not None  # ended from the start otherwise
            job = queue.show_job(follow_job)
            ended, checked_at = job is None or job.ended, time.monotonic()  # then read what is left once more


def check_labels(logs: JobLogs, rank: int | None) -> None:
    """--rank needs labelled lines: refuse clearly on logs written before the script labelled them."""
    if rank is None or not logs.labelled or not logs.files[0].exists():
        return
    end, cut = read_end(logs.files[0], LABEL_CHECK_BYTES)
    lines = end.splitlines()[1 if cut else 0 :]  # the line the window starts in is cut off
    if any(line.strip() for line in lines) and not any(RANK_LABEL.match(line) for line in lines):
        raise UserError(
            f"the lines in {logs.files[0]} carry no rank labels (the job's script was rendered "
            "before lance_hpc ran srun with --label)\n"
            "  fix: leave out --rank to see every line; jobs rendered from now on label them"
        )


def print_logs(
    target: str,
    overrides: list[str],
    job_id: str | None,
    rank: int | None,
    stream: Literal["stdout", "stderr"] | None,
    follow: bool,
) -> int:
    """Print the output of the job ``target`` (a spec or a job id) names: only rank ``rank``'s lines,
    only one ``stream`` ("stdout" or "stderr") when given; with ``follow``, until the job ends."""
    refs = records.resolve(target, overrides, job_id)
    ref = refs[0]
    if len(refs) > 1:
        print(
            f"{PROG}: showing {ref.job_id}, the first of {len(refs)} runs; pick another with --job "
            f"({', '.join(other.job_id for other in refs[1:])})",
            file=sys.stderr,
        )
    job = queue.show_job(ref.job_id) if queue.have_slurm() else None
    if ref.spec is not None and rank is not None and rank >= ref.spec.slurm.world_size:
        raise UserError(f"--rank {rank}: job {ref.job_id} has ranks 0 to {ref.spec.slurm.world_size - 1}")
    logs = job_logs(ref, job, rank)
    if stream is not None:
        logs = JobLogs([path for path in logs.files if path.suffix == (".out" if stream == "stdout" else ".err")], logs.labelled)
    if not any(path.exists() for path in logs.files):
        if job is not None and not job.started:
            print(
                f"job {ref.job_id} has not started ({job.state}{', ' + job.reason if job.reason else ''}); "
                f"its output will go to {logs.files[0]}",
                file=sys.stderr,
            )
            if not follow:
                return 0
        elif job is None or job.ended:
            raise UserError(
                f"job {ref.job_id} left no log: {', '.join(map(str, logs.files))} do not exist\n"
                "  fix: check slurm.log_dir, or pass the --set overrides the job was submitted with"
            )
    check_labels(logs, rank)
    if follow and queue.have_slurm():
        show(logs, rank, follow_job=ref.job_id)
    else:
        if follow:
            print(f"{PROG}: scontrol not found, so the log cannot be followed; printing it once", file=sys.stderr)
        show(logs, rank, follow_job=None)
    return 0
