"""The supervisor: the loop over a job's attempts in its allocation (:class:`Supervisor`); see
:mod:`lance_hpc.launch.restarts`. Its command line, which the batch script runs, is
:mod:`lance_hpc.cli.restarts`."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lance_hpc.launch.restarts.causes import StepReport, attempt_cause, notes
from lance_hpc.launch.restarts.nodes import PROGRESS_LIMIT, allocated_nodes, furthest_step, unusable_nodes
from lance_hpc.launch.restarts.policy import (
    ATTEMPTS_FILE,
    NOT_RESTARTED,
    Attempt,
    Decision,
    choose_nodes,
    decide,
    first_code,
    first_error,
)
from lance_hpc.launch.restarts.port_holder import PortHolder
from lance_hpc.launch.restarts.step import Step
from lance_hpc.runtime.ports import HANDOFF_VARIABLE
from lance_hpc.runtime.restart_variables import (
    ATTEMPT_VARIABLE,
    FAILED_AT_VARIABLE,
    FAILED_STEP_VARIABLE,
    FAILURE_DIR_VARIABLE,
    REQUEUE_REQUEST_VARIABLE,
    RESTARTS_LEFT_VARIABLE,
    STANDBY_VARIABLE,
)
from lance_hpc.storage.shared_files import append_own, own_private_dir, read_own

# Where a restarted attempt starts, as far as the supervisor knows: it does not read the job's
# checkpoints (the job may have failed before its first save; an infer or map job keeps none).
RESUMES = "resuming from what the job saved (its latest checkpoint, if any)"
# A standby step starts once the running attempt published a step, or this long after it started.
STANDBY_AFTER_S = 30.0
POLL_S = 0.1
STOPPED_CODE = 3  # lance_hpc.errors.ExitCode.STOPPED: run the job again to continue


@dataclass(frozen=True)
class Options:
    """What the batch script tells the supervisor (:mod:`lance_hpc.cli.restarts`, from the spec)."""

    max_restarts: int  # slurm.max_restarts
    nodes: int  # slurm.nodes: the nodes a step runs on
    min_nodes: int  # slurm.min_nodes: the fewest a restart may use
    tasks_per_node: int
    record: str  # directory of attempts.jsonl and the ranks' failure notes
    progress: str | None  # the watchdog's directory, where the ranks publish their step
    standby: bool  # slurm.restart_standby
    command: list[str]  # srun and its arguments


class Supervisor:
    """The loop over a job's attempts in this allocation."""

    def __init__(self, args: Options) -> None:
        self.args = args
        self.record = Path(args.record)
        self.run = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        self.job_id = os.environ.get("SLURM_JOB_ID", "")
        self.here = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.left_out: dict[str, str] = {}
        self.history: list[Attempt] = []
        self.standby: Step | None = None
        self.holder: PortHolder | None = None  # the port held for the running attempt's rank 0
        self.stopping = False

    def stop(self, signum: int, frame: Any) -> None:
        """SIGTERM or SIGINT (scancel, the time limit): no more attempts; srun passes it on to the ranks."""
        self.stopping = True

    def main(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.stop)
        try:
            # <name>.attempts/<job id>/: the ranks' notes and the go files are read back from there
            own_private_dir(self.record, levels=2)
        except OSError as error:
            say(f"cannot keep the job's records in {self.record}: {error}; choose a slurm.log_dir of your own", error=True)
            return 2
        try:
            return self.loop()
        finally:
            if self.standby is not None:
                self.standby.cancel()
            self.release_port()

    def loop(self) -> int:
        while True:
            allocated = allocated_nodes(self.job_id) if self.job_id else []
            self.left_out.update(unusable_nodes(allocated))
            self.left_out.update(
                {node: "no longer in the job's allocation" for node in self.original() if allocated and node not in allocated}
            )
            nodes = choose_nodes(allocated, self.left_out, self.args.nodes, self.args.min_nodes) if allocated else []
            if self.stopping:  # the signal came while SLURM was asked: the next attempt never starts
                return self.stop_before_next()
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
                f"allocation, {RESUMES}"
            )
            if attempt.cause is not None and attempt.cause.what == "node" and attempt.cause.host:
                self.left_out.setdefault(attempt.cause.host, attempt.cause.message)

    def stop_before_next(self) -> int:
        """End the job on a signal that came between two attempts, with the first one's exit code."""
        if not self.history:
            say("stopped by a signal before the first attempt", error=True)
            return STOPPED_CODE
        self.history[-1].outcome = "stopped by a signal before the next attempt"
        self.write(self.history[-1])
        say(f"stopped by a signal before attempt {len(self.history) + 1}; the job ends with attempt 1's error", error=True)
        return first_code(self.history)

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
        if number and ranks > 1 and nodes and nodes[0] == self.here:  # rank 0 starts on this node
            environ.update(self.hold_port())
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
        self.release_port()
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
                status = json.loads(read_own(path, PROGRESS_LIMIT))
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
        if allocated and str(len(allocated)) != environ.get("SLURM_JOB_NUM_NODES"):
            # srun refuses a step whose SLURM_JOB_NUM_NODES disagrees with the allocation left
            for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
                environ[name] = str(len(allocated))
            for name in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
                environ[name] = ",".join(allocated)
        return environ

    def hold_port(self) -> dict[str, str]:
        """MASTER_PORT for a restart, held on this node for its rank 0 from now on (see
        :mod:`~lance_hpc.launch.restarts.port_holder`), with the name rank 0 takes it over by; when
        no port is free, the one before, which rank 0 listens on itself (waiting a little if
        something holds it)."""
        self.holder = PortHolder(self.job_id)
        held = self.holder.variables()
        if not held:
            say(f"no free port found on {self.here} for attempt {len(self.history)}'s rank 0; it listens on MASTER_PORT itself")
        return held or {HANDOFF_VARIABLE: ""}  # the batch step's holder, named in the environment, is gone

    def release_port(self) -> None:
        """Stop the holder of the port held for the attempt that ended, if rank 0 never took it over."""
        if self.holder is not None:
            self.holder.stop()
            self.holder = None

    def give_up(self, allocated: list[str]) -> int:
        left = ", ".join(f"{node} ({why})" for node, why in self.left_out.items())
        usable = len([node for node in allocated if node not in self.left_out])
        reason = f"{usable} usable node(s) left, fewer than {self.args.min_nodes} (slurm.min_nodes); left out: {left}"
        if self.history:
            reason += f"; {first_error(self.history)}"
            self.history[-1].outcome = f"stopped: {reason}"
            self.write(self.history[-1])
        say(f"the job failed: {reason}", error=True)
        return first_code(self.history) if self.history else 1

    def write(self, attempt: Attempt) -> None:
        try:
            append_own(self.record / ATTEMPTS_FILE, attempt.line() + "\n")  # one short write in append mode
        except OSError as error:
            say(f"cannot record attempt {attempt.number + 1} in {self.record}: {error.strerror}", error=True)


def _seconds(attempt: Attempt) -> str:
    return f"{(attempt.ended or time.time()) - attempt.started:.0f} s"


def say(text: str, error: bool = False) -> None:
    stream = sys.stderr if error else sys.stdout
    print(f"lance_hpc: {text}", file=stream, flush=True)
