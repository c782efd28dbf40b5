"""Why an attempt failed, from what srun printed of the step (:class:`StepReport`) and the notes
the ranks wrote (:func:`notes`, :func:`lance_hpc.runtime.failures.note_failure`): a failed node, the
rank whose own error came first, or the task srun named (:func:`attempt_cause`)."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection

from lance_hpc.launch.restarts.policy import Cause
from lance_hpc.storage.shared_files import read_own

# What srun prints of a step's failures (SLURM 22.05 and later).
SRUN_TASKS = re.compile(r"^srun: error: (?P<host>\S+): tasks? (?P<ranks>[\d,-]+): (?P<what>.+)$")
SRUN_NODE_FAILURE = re.compile(r"^srun: error: Node failure on (?P<host>\S+)")
EXIT_CODE = re.compile(r"Exited with exit code (\d+)$", re.IGNORECASE)
NOTE_LIMIT = 1024 * 1024  # bytes read of a rank's note: an error message and a few fields


def notes(directory: str | Path) -> list[dict[str, Any]]:
    """The failure notes the ranks wrote in ``directory`` (lance_hpc.runtime.failures.note_failure)."""
    found = []
    folder = Path(directory)
    for path in sorted(folder.glob("rank-*.json")) if folder.is_dir() else []:
        try:
            note = json.loads(read_own(path, NOTE_LIMIT))
        except (OSError, ValueError):  # a FIFO, a link or another user's file planted there included
            continue
        if isinstance(note, dict) and {"rank", "time", "lost_contact", "message"} <= set(note):
            found.append(note)
    return found


def first_note(directory: str | Path) -> dict[str, Any] | None:
    """The note of the rank whose own error came first (one that only lost contact with another
    rank is never the cause while a rank with an error of its own exists), or None."""
    return min(notes(directory), key=lambda note: (note["lost_contact"], note["time"]), default=None)


def cause_from_note(note: dict[str, Any]) -> Cause:
    return Cause(
        what=str(note.get("what") or "error"),
        message=str(note["message"]),
        rank=int(note["rank"]),
        host=note.get("host"),
        step=note.get("step"),
        user_error=bool(note.get("user_error")),
        repeats=bool(note.get("repeats")),
    )


@dataclass
class StepReport:
    """What srun said of a step's failures, in the order it said it."""

    failed_nodes: dict[str, str] = field(default_factory=dict)
    tasks: list[Cause] = field(default_factory=list)  # each task srun named as failed, first first
    first_seen: float | None = None

    def read(self, line: str) -> None:
        node = SRUN_NODE_FAILURE.match(line)
        task = SRUN_TASKS.match(line)
        if node:
            self.failed_nodes.setdefault(node.group("host"), "srun reported a node failure")
        elif task:
            what = task.group("what").strip()
            # Killed, Segmentation fault, Aborted...: a signal ended it; "Exited with exit code N" did not
            signalled = not what.lower().startswith("exited")
            message = f"was killed (srun: {what})" if what.lower().startswith("killed") else f"{what[0].lower()}{what[1:]} (srun)"
            code = EXIT_CODE.match(what)
            for rank in _ranks(task.group("ranks")):
                self.tasks.append(
                    Cause(
                        "killed" if signalled else "exit",
                        message,
                        rank,
                        task.group("host"),
                        exit_code=int(code[1]) if code else None,
                    )
                )
        else:
            return
        if self.first_seen is None:
            self.first_seen = time.time()

    def first_task(self, lost_contact: Collection[int] = ()) -> Cause | None:
        """The task that most likely failed first: srun names tasks as it hears of them, and ranks
        that lost contact with a dead one may exit before it is reported; those, and ranks ended
        by srun's own SIGTERM (Terminated), come last."""

        def consequence(task: Cause) -> bool:
            return task.rank in lost_contact or task.message.startswith("terminated")

        ordered = sorted(enumerate(self.tasks), key=lambda item: (consequence(item[1]), item[0]))
        return ordered[0][1] if ordered else None


def _ranks(text: str) -> list[int]:
    """``0,2-3`` -> [0, 2, 3]."""
    ranks: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        ranks += range(int(first), int(last or first) + 1)
    return ranks


def attempt_cause(note_dir: Path, report: StepReport, exit_code: int) -> Cause:
    """Why a step failed: a failed node first (its ranks' errors follow from it), then the rank
    whose own error came first, then the task srun named that did not only lose contact with
    another, then the exit code alone."""
    if report.failed_nodes:
        host, why = next(iter(report.failed_nodes.items()))
        return Cause("node", why, host=host)
    found = notes(note_dir)
    note = first_note(note_dir)
    if note is not None and not note["lost_contact"]:
        return cause_from_note(note)
    task = report.first_task({int(note["rank"]) for note in found if note["lost_contact"]})
    if task is not None:
        return task
    return Cause("exit", f"srun exited with code {exit_code}")
