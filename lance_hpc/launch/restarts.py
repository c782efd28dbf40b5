"""Restarts inside one allocation: a failed job step starts again from the latest checkpoint,
on the nodes that are left, without a place in the queue.

The batch script runs srun through this module (``python3 -I <log_dir>/<name>.restarts.py ...
-- srun ...``; submitit's script through a shell function ``srun`` that does the same). Each
attempt is one job step. When it fails (a rank died, raised, hung past the watchdog's limit, or
a node failed), the allocation stays (``#SBATCH --no-kill``), and the next attempt runs:

- on the allocation's nodes that SLURM still gives the job and does not mark down, drained or not
  responding, and that srun did not report failed; the first ``--nodes`` of them (later ones are
  spares), or as few as ``--min-nodes`` (fewer ranks: the checkpoint resumes on any world size);
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

The batch step runs this file with the node's own ``python3 -I``, outside any container, where
lance_hpc may not be installed: it imports the standard library only (a test holds it to that),
and the renderer copies it beside the job's script.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Collection, Sequence

# What the ranks of an attempt read (lance_hpc.runtime.attempt and lance_hpc.runtime.failures name the same).
FAILURE_DIR_VARIABLE = "LANCE_HPC_FAILURE_DIR"  # where each rank notes how it failed
ATTEMPT_VARIABLE = "LANCE_HPC_ATTEMPT"  # 0 for the first attempt in the allocation
RESTARTS_LEFT_VARIABLE = "LANCE_HPC_RESTARTS_LEFT"  # whether a hang may end the step (the watchdog)
FAILED_AT_VARIABLE = "LANCE_HPC_FAILED_AT"  # when the previous attempt failed (seconds since the epoch)
FAILED_STEP_VARIABLE = "LANCE_HPC_FAILED_STEP"  # the furthest step it reached, when known
STANDBY_VARIABLE = "LANCE_HPC_STANDBY"  # a standby rank's go file
ATTEMPTS_FILE = "attempts.jsonl"
# Exit codes of ``python -m lance_hpc.run`` that a restart cannot change (lance_hpc.errors.ExitCode).
NOT_RESTARTED = {
    0: "finished",
    2: "a problem in the spec or data",
    3: "stopped by a signal, checkpoint saved",
    130: "interrupted",
    255: "requeued by its rank 0 (a submitit task ends so)",
}
# Set by the batch script of a job in a container: a file there means rank 0 asked for a requeue,
# which the script carries out once this supervisor ends (lance_hpc.runtime.preemption).
REQUEUE_REQUEST_VARIABLE = "LANCE_HPC_REQUEUE_REQUEST"
# What srun prints of a step's failures (SLURM 22.05 and later).
SRUN_TASKS = re.compile(r"^srun: error: (?P<host>\S+): tasks? (?P<ranks>[\d,-]+): (?P<what>.+)$")
SRUN_NODE_FAILURE = re.compile(r"^srun: error: Node failure on (?P<host>\S+)")
# sinfo's compact node states (%t) in which a node takes no new step; a trailing * means not
# responding. Not resv or maint: a job that runs in a reservation sees its nodes so.
UNUSABLE_STATES = ("down", "drain", "drng", "fail", "boot", "pow", "npc", "inval", "unk", "futr")
PORT_RANGE = (20000, 60000)  # as lance_hpc.runtime.ports
# A standby step starts once the running attempt published a step, or this long after it started.
STANDBY_AFTER_S = 30.0
STANDBY_CANCEL_S = 10.0  # how long a standby step gets to end on SIGTERM before srun is killed
POLL_S = 0.1


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
    # exit 2 is the user's to fix, unless the rank's note says it is a fault (another process took the port)
    fault = code == 2 and cause is not None and cause.what == "error" and not cause.user_error
    if code in NOT_RESTARTED and not fault:
        return Decision(False, code, NOT_RESTARTED[code])
    if cause is not None and cause.user_error:
        return Decision(False, 2, f"not restarted: {NOT_RESTARTED[2]}: {cause.describe()}")
    for earlier in history[:-1]:
        if cause is not None and earlier.cause is not None and cause.same_as(earlier.cause):
            return Decision(
                False,
                code,
                f"the same error at step {cause.step} in attempts {earlier.number + 1} and {last.number + 1}, so a "
                f"restart would fail again: {cause.describe()}",
            )
    if len(history) > max_restarts:
        return Decision(
            False, _first_code(history), f"no restarts left (slurm.max_restarts: {max_restarts}); {first_error(history)}"
        )
    return Decision(True, code, f"restart {len(history)} of at most {max_restarts}")


def first_error(history: Sequence[Attempt]) -> str:
    """``the first error: rank 1 on node2: ...``, for the line a job that stops for good ends with."""
    first = history[0]
    return f"the first error: {first.cause.describe() if first.cause else f'exit code {first.exit_code}'}"


def _first_code(history: Sequence[Attempt]) -> int:
    code = history[0].exit_code
    return code if code not in (None, 0) else 1


def choose_nodes(allocated: Sequence[str], left_out: dict[str, str], wanted: int, minimum: int) -> list[str] | None:
    """The next attempt's nodes: the first ``wanted`` usable ones of the allocation (the rest are
    spares), or all usable ones when fewer; None when fewer than ``minimum`` are left."""
    usable = [node for node in allocated if node not in left_out]
    return usable[:wanted] if len(usable) >= minimum else None


def notes(directory: str | Path) -> list[dict[str, Any]]:
    """The failure notes the ranks wrote in ``directory`` (lance_hpc.runtime.failures.note_failure)."""
    found = []
    folder = Path(directory)
    for path in sorted(folder.glob("rank-*.json")) if folder.is_dir() else []:
        try:
            note = json.loads(path.read_text())
        except (OSError, ValueError):
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
            for rank in _ranks(task.group("ranks")):
                self.tasks.append(Cause("killed" if signalled else "exit", message, rank, task.group("host")))
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


def read_attempts(path: str | Path) -> list[Attempt]:
    """The attempts ``attempts.jsonl`` records, in order; a later line of an attempt updates it."""
    merged: dict[tuple, dict[str, Any]] = {}
    try:
        text = Path(path).read_text()
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


def _slurm(*command: str) -> str:
    """A SLURM command's output, or "" when it failed or is missing."""
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout if result.returncode == 0 else ""


def allocated_nodes(job_id: str) -> list[str]:
    """The nodes SLURM gives the job now (a failed node leaves a --no-kill allocation), in order."""
    shown = _slurm("scontrol", "show", "job", "-o", job_id)
    match = re.search(r"(?:^|\s)NodeList=(\S+)", shown)
    if not match or match.group(1) in ("(null)", "None"):
        return []
    return _slurm("scontrol", "show", "hostnames", match.group(1)).split()


def unusable_nodes(nodes: Sequence[str]) -> dict[str, str]:
    """node -> its state, for the nodes SLURM marks down, drained, failing or not responding."""
    listed = _slurm("sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %t") if nodes else ""
    found = {}
    for line in listed.splitlines():
        parts = line.split()
        if len(parts) == 2 and (parts[1].endswith("*") or parts[1].startswith(UNUSABLE_STATES)):
            found[parts[0]] = f"SLURM shows it {parts[1]}"
    return found


def furthest_step(progress_dir: str | None) -> int | None:
    """The furthest step any rank published in the watchdog's directory, if it did."""
    steps = []
    for path in Path(progress_dir).glob("rank-*.json") if progress_dir else []:
        try:
            steps.append(int(json.loads(path.read_text())["step"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return max(steps) if steps else None


def port_free(port: int) -> bool:
    """Whether rank 0 could listen on ``port`` here (the rendezvous store sets SO_REUSEADDR too)."""
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((address, port))
        except OSError as error:
            if error.errno not in (97, 99):  # EAFNOSUPPORT, EADDRNOTAVAIL: no IPv6 here
                return False
    return True


def rendezvous_port(current: str | None) -> str | None:
    """MASTER_PORT for the next attempt: the one the batch step picked while it is free, else a
    free one drawn from the same range; None when none was found (the ranks fall back)."""
    if current and current.isdigit() and port_free(int(current)):
        return current
    for _ in range(100):
        port = random.randrange(*PORT_RANGE)
        if port_free(port):
            return str(port)
    return None


class Step:
    """One srun: its stderr passed on line by line and read for failures (:class:`StepReport`).

    A standby step (``go`` set) is the next attempt started ahead: its ranks import everything,
    then wait for ``go`` (:func:`lance_hpc.kinds.standby.wait_if_standby`), which says either
    what they need to know of the failure before them, or that they are not needed."""

    def __init__(self, command: list[str], environ: dict[str, str], nodes: list[str], go: Path | None = None) -> None:
        self.nodes, self.go = nodes, go
        self.announced = False
        self.report = StepReport()
        self.process = subprocess.Popen(command, env=environ, stderr=subprocess.PIPE)
        self.reader = threading.Thread(target=self._forward, name="srun-stderr", daemon=True)
        self.reader.start()

    def _forward(self) -> None:
        assert self.process.stderr is not None
        for raw in iter(self.process.stderr.readline, b""):
            sys.stderr.buffer.write(raw)
            sys.stderr.flush()
            self.report.read(raw.decode(errors="replace").rstrip("\n"))

    def running(self) -> bool:
        return self.process.poll() is None

    def wait(self) -> int:
        code = self.process.wait()
        self.reader.join(timeout=10)
        return code if code >= 0 else 128 - code

    def ready(self, ranks: int) -> bool:
        """Whether every rank of this standby step is waiting (each marks it beside the go file)."""
        return self.go is not None and len(list(self.go.parent.glob(f"{self.go.name}.ready-*"))) >= ranks

    def release(self, environ: dict[str, str]) -> None:
        """Start the waiting ranks as the next attempt, with ``environ`` added to theirs."""
        self._say_go({"environ": environ})

    def cancel(self) -> None:
        """End a standby step that is not needed: waiting ranks read so and exit; ranks still
        starting get SIGTERM through srun (a waiting rank exits quietly on it too)."""
        self._say_go({"cancel": True})
        for end, wait_s in ((None, 1.0), (self.process.terminate, STANDBY_CANCEL_S), (self.process.kill, None)):
            if end is not None:
                end()
            try:
                self.process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self.reader.join(timeout=10)

    def _say_go(self, message: dict[str, Any]) -> None:
        assert self.go is not None
        temporary = self.go.with_name(self.go.name + ".tmp")
        temporary.write_text(json.dumps(message))
        os.replace(temporary, self.go)  # the ranks read it whole or not at all


class Supervisor:
    """The loop over a job's attempts in this allocation."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.record = Path(args.record)
        self.run = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        self.job_id = os.environ.get("SLURM_JOB_ID", "")
        self.here = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.left_out: dict[str, str] = {}
        self.history: list[Attempt] = []
        self.standby: Step | None = None
        self.stopping = False

    def stop(self, signum: int, frame: Any) -> None:
        """SIGTERM or SIGINT (scancel, the time limit): no more attempts; srun passes it on to the ranks."""
        self.stopping = True

    def main(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.stop)
        self.record.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            return self.loop()
        finally:
            if self.standby is not None:
                self.standby.cancel()

    def loop(self) -> int:
        while True:
            allocated = allocated_nodes(self.job_id) if self.job_id else []
            self.left_out.update(unusable_nodes(allocated))
            self.left_out.update(
                {node: "no longer in the job's allocation" for node in self.original() if allocated and node not in allocated}
            )
            nodes = choose_nodes(allocated, self.left_out, self.args.nodes, self.args.min_nodes) if allocated else []
            if nodes is None:
                return self.give_up(allocated)
            attempt = self.attempt(allocated, nodes)
            decision = decide(self.history, self.args.max_restarts)
            if self.stopping and decision.restart:
                decision = Decision(False, decision.exit_code, "stopped by a signal while it ran")
            request = os.environ.get(REQUEUE_REQUEST_VARIABLE)
            if request and os.path.exists(request) and decision.restart:
                decision = Decision(False, attempt.exit_code or 0, "rank 0 asked for a requeue")
            attempt.outcome = f"restarted ({decision.reason})" if decision.restart else decision.reason
            self.write(attempt)
            if not decision.restart:
                if decision.exit_code != 0 and attempt.exit_code not in NOT_RESTARTED:
                    say(f"the job failed after {len(self.history)} attempt(s) in this allocation: {decision.reason}", error=True)
                return decision.exit_code
            failed = attempt.cause.describe() if attempt.cause else f"exit code {attempt.exit_code}"
            say(
                f"attempt {attempt.number + 1} failed after {_seconds(attempt)}: {failed}; {decision.reason} in this "
                "allocation, from the latest checkpoint"
            )
            if attempt.cause is not None and attempt.cause.what == "node" and attempt.cause.host:
                self.left_out.setdefault(attempt.cause.host, attempt.cause.message)

    def original(self) -> list[str]:
        return self.history[0].nodes if self.history else []

    def attempt(self, allocated: list[str], nodes: list[str]) -> Attempt:
        """Run one attempt to its end: the standby step when it runs on these nodes, else a new srun."""
        number = len(self.history)
        ranks = (len(nodes) if nodes else self.args.nodes) * self.args.tasks_per_node
        attempt = Attempt(number, time.time(), nodes, ranks, run=self.run)
        if number:
            left = ", ".join(f"{node} ({why})" for node, why in self.left_out.items() if node in self.original())
            fewer = f", down from {self.history[0].ranks}" if ranks < self.history[0].ranks else ""
            say(
                f"attempt {number + 1} of at most {self.args.max_restarts + 1}{' on ' if nodes else ''}{', '.join(nodes)}: "
                f"{ranks} ranks{fewer}"
                + (" (its ranks were started and waiting)" if self.standby_fits(nodes) else "")
                + (f"; left out: {left}" if left else "")
            )
        self.write(attempt)
        self.history.append(attempt)
        environ = self.environment(allocated, number)
        step, self.standby = self.standby, None
        if step is not None and step.nodes == nodes and step.running():
            step.release({name: value for name, value in environ.items() if os.environ.get(name) != value})
        else:
            if step is not None:
                step.cancel()
            step = Step(self.command(nodes, ranks), environ, nodes)
        while step.running():
            if self.standby is None and number < self.args.max_restarts and self.started(attempt):
                self.standby = self.start_standby(allocated, nodes, ranks, number + 1)
            if self.standby is not None and not self.standby.announced and self.standby.ready(ranks):
                self.standby.announced = True
                say(f"attempt {number + 2}'s {ranks} ranks are started and waiting, should this one fail")
            time.sleep(POLL_S)
        attempt.exit_code, attempt.ended = step.wait(), time.time()
        if attempt.exit_code != 0:
            self.explain(attempt, step.report)
        return attempt

    def standby_fits(self, nodes: list[str]) -> bool:
        return self.standby is not None and self.standby.nodes == nodes and self.standby.running()

    def started(self, attempt: Attempt) -> bool:
        """Whether the attempt is past its start, so that a standby step no longer slows it: a rank
        published a step, or STANDBY_AFTER_S passed."""
        if not self.args.standby:
            return False
        if time.time() - attempt.started > STANDBY_AFTER_S:
            return True
        for path in Path(self.args.progress).glob("rank-*.json") if self.args.progress else []:
            try:
                status = json.loads(path.read_text())
                if status["time"] > attempt.started and status["step"] > 0:
                    return True
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return False

    def start_standby(self, allocated: list[str], nodes: list[str], ranks: int, number: int) -> Step:
        go = self.record / f"run{self.run}-attempt{number}.go"
        for stale in [go, *go.parent.glob(f"{go.name}.ready-*")]:  # left by an earlier run of the job
            if stale.exists():
                stale.unlink()
        environ = {**self.environment(allocated, number, ahead=True), STANDBY_VARIABLE: str(go)}
        command = self.command(nodes, ranks)
        # beside the running step, which holds the CPUs (and GPUs) the standby ranks share until they start
        return Step([command[0], "--overlap", *command[1:]], environ, nodes, go)

    def explain(self, attempt: Attempt, report: StepReport) -> None:
        notes_dir = self.notes_dir(attempt.number)
        attempt.cause = attempt_cause(notes_dir, report, attempt.exit_code or 1)
        own = [note["time"] for note in notes(notes_dir) if not note["lost_contact"]]
        attempt.failed_at = min([*own, *([report.first_seen] if report.first_seen else []), attempt.ended or time.time()])
        attempt.step = attempt.cause.step if attempt.cause.step is not None else furthest_step(self.args.progress)
        self.left_out.update(report.failed_nodes)

    def notes_dir(self, number: int) -> Path:
        folder = self.record / f"run{self.run}-attempt{number}"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        return folder

    def command(self, nodes: list[str], ranks: int) -> list[str]:
        """srun with this attempt's nodes and task count put in after its name."""
        command = list(self.args.command)
        if not nodes or os.path.basename(command[0]) != "srun":
            return command
        return [command[0], f"--nodes={len(nodes)}", f"--ntasks={ranks}", f"--nodelist={','.join(nodes)}", *command[1:]]

    def environment(self, allocated: list[str], number: int, ahead: bool = False) -> dict[str, str]:
        """The variables of attempt ``number``'s ranks; ``ahead``: for its standby step, which is
        told the failure's when and where once it happened."""
        environ = dict(os.environ)
        environ.update(
            {
                FAILURE_DIR_VARIABLE: str(self.notes_dir(number)),
                ATTEMPT_VARIABLE: str(number),
                RESTARTS_LEFT_VARIABLE: str(self.args.max_restarts - number),
            }
        )
        if number and not ahead:
            previous = self.history[-2]
            environ[FAILED_AT_VARIABLE] = f"{previous.failed_at or previous.ended or time.time():.3f}"
            if previous.step is not None:
                environ[FAILED_STEP_VARIABLE] = str(previous.step)
            if allocated and allocated[0] == self.here:  # rank 0 listens here: on a port free now
                port = rendezvous_port(environ.get("MASTER_PORT"))
                if port:
                    environ["MASTER_PORT"] = port
        if allocated and str(len(allocated)) != environ.get("SLURM_JOB_NUM_NODES"):
            # srun refuses a step whose SLURM_JOB_NUM_NODES disagrees with the allocation left
            for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
                environ[name] = str(len(allocated))
            for name in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
                environ[name] = ",".join(allocated)
        return environ

    def give_up(self, allocated: list[str]) -> int:
        left = ", ".join(f"{node} ({why})" for node, why in self.left_out.items())
        usable = len([node for node in allocated if node not in self.left_out])
        reason = f"{usable} usable node(s) left, fewer than {self.args.min_nodes} (slurm.min_nodes); left out: {left}"
        if self.history:
            reason += f"; {first_error(self.history)}"
            self.history[-1].outcome = f"stopped: {reason}"
            self.write(self.history[-1])
        say(f"the job failed: {reason}", error=True)
        return _first_code(self.history) if self.history else 1

    def write(self, attempt: Attempt) -> None:
        try:
            with open(self.record / ATTEMPTS_FILE, "a") as file:  # one short write in append mode
                file.write(attempt.line() + "\n")
        except OSError as error:
            say(f"cannot record attempt {attempt.number + 1} in {self.record}: {error.strerror}", error=True)


def _seconds(attempt: Attempt) -> str:
    return f"{(attempt.ended or time.time()) - attempt.started:.0f} s"


def say(text: str, error: bool = False) -> None:
    stream = sys.stderr if error else sys.stdout
    print(f"lance_hpc: {text}", file=stream, flush=True)


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(
        prog="python3 -I restarts.py",
        description="Run a job step with srun; start it again inside the allocation when it fails.",
    )
    result.add_argument("--max-restarts", type=int, required=True, help="slurm.max_restarts")
    result.add_argument("--nodes", type=int, required=True, help="slurm.nodes: the nodes a step runs on")
    result.add_argument("--min-nodes", type=int, required=True, help="slurm.min_nodes: the fewest a restart may use")
    result.add_argument("--tasks-per-node", type=int, required=True, help="ranks per node")
    result.add_argument("--record", required=True, help="directory of attempts.jsonl and the ranks' failure notes")
    result.add_argument("--progress", help="the watchdog's directory, where the ranks publish their step")
    result.add_argument(
        "--no-standby",
        dest="standby",
        action="store_false",
        help="start no ranks ahead for the next attempt (slurm.restart_standby)",
    )
    result.add_argument("command", nargs=argparse.REMAINDER, help="-- srun ...")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser().error("give the step's command after --")
    return Supervisor(args).main()


if __name__ == "__main__":
    sys.exit(main())
