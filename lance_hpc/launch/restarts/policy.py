"""What an attempt was and what ended it (:class:`Attempt`, :class:`Cause`), whether the job starts
it again (:func:`decide`) and on which nodes (:func:`choose_nodes`); the record of the attempts
(``attempts.jsonl``, :func:`read_attempts`) that ``lance-hpc status`` shows. The local launcher
(``--local``) decides with the same policy."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from lance_hpc.storage.shared_files import RefusedFile, read_own

ATTEMPTS_FILE = "attempts.jsonl"
ATTEMPTS_LIMIT = 16 * 1024 * 1024  # bytes read of it: two short lines an attempt, many thousand attempts
# Exit codes of ``python -m lance_hpc.run`` that a restart cannot change (lance_hpc.errors.ExitCode).
NOT_RESTARTED = {
    0: "finished",
    2: "a problem in the spec or data",
    3: "stopped by a signal, checkpoint saved",
    130: "interrupted",
    255: "requeued by its rank 0 (a submitit task ends so)",
}


@dataclass(frozen=True)
class Cause:
    """Why an attempt failed. ``what``: error (a rank's own exception), hang (the watchdog named a
    stuck rank), killed (a rank ended by a signal), exit (a rank's exit code alone), node (a node
    failed)."""

    what: str
    message: str
    rank: int | None = None
    host: str | None = None
    step: int | None = None
    user_error: bool = False
    repeats: bool = False  # the user's code failed on an input a restart gives it again
    exit_code: int | None = None  # the rank's own, as srun reported it ("Exited with exit code 3")

    def describe(self) -> str:
        """``rank 1 on node2 at step 5: ValueError: ...``, ``rank 1 on node2 was killed (...)``."""
        if self.what == "node":
            return f"node {self.host} failed ({self.message})"
        parts = [f"rank {self.rank}" if self.rank is not None else "", f"on {self.host}" if self.host else ""]
        where = " ".join(part for part in parts if part) or "a rank"
        at = f" at step {self.step}" if self.step is not None else ""
        if self.what in ("killed", "exit"):
            return f"{where} {self.message}{at}"
        return f"{where}{at}: {self.message}"

    def same_as(self, other: Cause) -> bool:
        """The same error (or hang) at the same step: what a restart would run into again."""
        return (
            self.what == other.what
            and self.what in ("error", "hang")
            and (self.message, self.step) == (other.message, other.step)
        )


@dataclass
class Attempt:
    """One job step of the job in this allocation (``number`` 0 is the first)."""

    number: int
    started: float
    nodes: list[str]
    ranks: int
    run: int = 0  # SLURM's restart count: how many times the job was requeued before this allocation
    ended: float | None = None
    exit_code: int | None = None
    cause: Cause | None = None
    failed_at: float | None = None  # the first sign of the failure: a rank's note or srun's message
    step: int | None = None  # the furthest step a rank reached, when known
    outcome: str = ""  # what came of it: finished, restarted, the reason the job stopped

    def line(self) -> str:
        """One JSON line of ``attempts.jsonl``."""
        return json.dumps(asdict(self))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Attempt:
        cause = values.get("cause")
        known = {name: values[name] for name in cls.__dataclass_fields__ if name in values and name != "cause"}
        return cls(**known, cause=Cause(**cause) if isinstance(cause, dict) else None)


@dataclass(frozen=True)
class Decision:
    restart: bool
    exit_code: int
    reason: str


def decide(history: Sequence[Attempt], max_restarts: int) -> Decision:
    """Whether the job starts its last attempt again, and if not, its exit code and why."""
    last = history[-1]
    code = last.exit_code if last.exit_code is not None else 1
    cause = last.cause
    if cause is not None and cause.exit_code in NOT_RESTARTED and cause.exit_code != 0:
        # srun's own code is its tasks' highest, or 143 for those --kill-on-bad-exit ended: the rank
        # that ended first says why (3: it stopped on a signal, its checkpoint saved, the others cut short)
        code = cause.exit_code
    # exit 2 is the user's to fix, unless the rank's note says it is a fault (another process took the port)
    fault = code == 2 and cause is not None and cause.what == "error" and not cause.user_error
    if code in NOT_RESTARTED and not fault:
        return Decision(False, code, NOT_RESTARTED[code])
    if cause is not None and cause.user_error:
        return Decision(False, 2, f"not restarted: {NOT_RESTARTED[2]}: {cause.describe()}")
    if cause is not None and cause.repeats:
        return Decision(False, code, f"not restarted: a restart would meet the same error: {cause.describe()}")
    for earlier in history[:-1]:
        if cause is not None and earlier.cause is not None and cause.same_as(earlier.cause):
            at = f" at step {cause.step}" if cause.step is not None else ""  # none: it failed outside the loop
            return Decision(
                False,
                code,
                f"the same error{at} in attempts {earlier.number + 1} and {last.number + 1}, so a "
                f"restart would fail again: {cause.describe()}",
            )
    if len(history) > max_restarts:
        return Decision(
            False, first_code(history), f"no restarts left (slurm.max_restarts: {max_restarts}); {first_error(history)}"
        )
    return Decision(True, code, f"restart {len(history)} of at most {max_restarts}")


def first_error(history: Sequence[Attempt]) -> str:
    """``the first error: rank 1 on node2: ...``, for the line a job that stops for good ends with."""
    first = history[0]
    return f"the first error: {first.cause.describe() if first.cause else f'exit code {first.exit_code}'}"


def first_code(history: Sequence[Attempt]) -> int:
    """The exit code a job that stops for good ends with: its first attempt's (1 if that has none)."""
    code = history[0].exit_code
    return code if code not in (None, 0) else 1


def choose_nodes(allocated: Sequence[str], left_out: dict[str, str], wanted: int, minimum: int) -> list[str] | None:
    """The next attempt's nodes: the first ``wanted`` usable ones of the allocation (the rest are
    spares), or all usable ones when fewer; None when fewer than ``minimum`` are left."""
    usable = [node for node in allocated if node not in left_out]
    return usable[:wanted] if len(usable) >= minimum else None


def read_attempts(path: str | Path) -> list[Attempt]:
    """The attempts ``attempts.jsonl`` records, in order; a later line of an attempt updates it.
    Raises RefusedFile for anything there but a regular file of the caller's (a FIFO would block the
    reader, a link point anywhere)."""
    merged: dict[tuple, dict[str, Any]] = {}
    try:
        text = read_own(path, ATTEMPTS_LIMIT).decode(errors="replace")
    except RefusedFile:
        raise
    except OSError:
        return []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by a full disk: the others still count
        if isinstance(entry, dict) and "number" in entry:
            merged.setdefault((entry.get("run", 0), entry["number"]), {}).update(entry)
    found = []
    for values in merged.values():
        try:
            found.append(Attempt.from_dict(values))
        except (TypeError, ValueError):
            continue
    return found
