"""``job: command``: a program of your own on every task, as torchrun would start it (``command:``,
:mod:`lance_hpc.spec.command_section`).

Each rank starts the program as its child with torchrun's variables (:func:`program_environment`)
and waits for it. SLURM's warning before the time limit (USR2) reaches the program as
``command.signal``; TERM and INT as they are. When it has exited, rank 0 requeues the job as any
job of lance_hpc's (USR2 only, up to ``slurm.max_requeues``), and the rerun's program sees
``SLURM_RESTART_COUNT`` and ``LANCE_HPC_RUN_COUNT``. A program that exits non-zero on its own fails
its rank, which the restart supervisor starts again inside the allocation (``slurm.max_restarts``);
a program that is not there fails the job at once, with its name.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

from lance_hpc.kinds import JobKind
from lance_hpc.runtime.preemption import Preemption
from lance_hpc.signals import REQUEUE_SIGNAL
from lance_hpc.spec.command_section import expand_argv
from lance_hpc.spec.kinds.builtin import CommandRules

if TYPE_CHECKING:
    from types import FrameType

    from lance_hpc.runtime.context import Summary
    from lance_hpc.runtime.environment import DistEnv
    from lance_hpc.runtime.preemption import Requeue
    from lance_hpc.spec import JobSpec

# What the program reads to know it runs again: earlier starts of this job's program on this rank,
# requeues (SLURM_RESTART_COUNT) and restarts inside the allocation together.
RUN_COUNT_VARIABLE = "LANCE_HPC_RUN_COUNT"
# command.options.NAME reaches the program as this prefix + NAME in capitals.
OPTION_PREFIX = "LANCE_HPC_OPTION_"
# What lance_hpc's own Python processes read and a program of the user's must not: PYTHONSAFEPATH
# would keep `python train.py` from importing the modules beside train.py.
NOT_PASSED_ON = ("PYTHONSAFEPATH",)


class Command(CommandRules, JobKind):
    """Your program on every task; no data plan, no progress of its own beyond its log."""

    def check(self, spec: JobSpec, nproc: int | None) -> list[str]:
        """What each rank will run."""
        return [describe(spec, nproc or spec.slurm.world_size)]

    def plan(self, spec: JobSpec, source: str) -> str:
        """The command line each rank starts, with the variables it gets besides the job's."""
        return "\n".join(
            [
                describe(spec, spec.slurm.world_size),
                "each with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, GROUP_RANK, MASTER_ADDR, MASTER_PORT, "
                f"TORCHELASTIC_RESTART_COUNT and {RUN_COUNT_VARIABLE} set (docs/command-jobs.md)",
            ]
        )

    def progress(self, spec: JobSpec) -> list[str] | None:
        """A program's progress is in its own output."""
        return [f"job: command runs {shlex.join(expand_argv(spec.to_dict()))}; its progress is in its output (lance-hpc logs)"]

    def run(self, spec: JobSpec, env: DistEnv, requeue: Requeue, signals: tuple[int, ...]) -> Summary:
        """Start the program, pass the stop signals on, wait; then requeue (rank 0) or report how it ended."""
        from lance_hpc.runtime.context import Summary

        argv = expand_argv(spec.to_dict())
        program = find_program(argv[0])
        environ = program_environment(spec, env)
        assert spec.command is not None  # job: command is implied by it
        preemption = Forwarding(signals, signal.Signals[f"SIG{spec.command.signal}"])
        with preemption:
            if preemption.received is None:  # a stop that came while the rank started: the program never runs
                code = preemption.start(program, argv, environ)
        if preemption.received is None:
            return Summary("completed", 0, 0, None) if code == 0 else failed(argv, code, env)
        return stopped(spec, env, requeue, preemption)


def describe(spec: JobSpec, ranks: int) -> str:
    assert spec.command is not None
    line = shlex.join(expand_argv(spec.to_dict()))
    return f"job: command: {line} on each of {ranks} rank(s); SLURM's time-limit warning reaches it as SIG{spec.command.signal}"


def find_program(program: str) -> str:
    """The program's path as the task's PATH (or working directory) finds it; a UserError naming it otherwise."""
    from lance_hpc.errors import UserError

    found = shutil.which(program)
    if found is None:
        where = "in the working directory " + os.getcwd() if os.sep in program else "on PATH"
        raise UserError(
            f"command: program {program!r} is not an executable file {where} (no restart can help)\n"
            "  fix: name an installed program (python, torchrun's script's interpreter) or a path to an executable file, "
            "relative to the directory you submit from; put a virtual environment on PATH in slurm.setup"
        )
    return found


def program_environment(spec: JobSpec, env: DistEnv) -> dict[str, str]:
    """The rank's environment with torchrun's variables for this rank, this run's counts and the
    command's options; the port the batch step held for rank 0 is let go, for the program to listen on."""
    from lance_hpc.runtime.ports import take_held_port
    from lance_hpc.runtime.restart_variables import ATTEMPT_VARIABLE

    if env.is_main:  # the batch step holds MASTER_PORT for rank 0: the program's store binds it itself
        held = take_held_port(env.master_port)
        if held is not None:
            os.close(held)
    attempt = int(os.environ.get(ATTEMPT_VARIABLE) or 0)
    environ = {key: value for key, value in os.environ.items() if key not in NOT_PASSED_ON}
    assert spec.command is not None
    for name, value in spec.command.options.items():
        environ[OPTION_PREFIX + re.sub(r"\W", "_", name).upper()] = str(value)
    environ.update(
        RANK=str(env.rank),
        LOCAL_RANK=str(env.local_rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_WORLD_SIZE=str(env.local_world_size),
        NODE_RANK=str(env.node_rank),
        GROUP_RANK=str(env.node_rank),
        GROUP_WORLD_SIZE=str(env.num_nodes),
        ROLE_RANK=str(env.rank),
        ROLE_WORLD_SIZE=str(env.world_size),
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
        TORCHELASTIC_RESTART_COUNT=str(attempt),
        **{RUN_COUNT_VARIABLE: str(env.restart_count + attempt)},
    )
    return environ


class Forwarding(Preemption):
    """A :class:`~lance_hpc.runtime.preemption.Preemption` that also passes each stop signal on to
    the program: SLURM's warning (USR2) as the command's signal, the others as they are."""

    def __init__(self, signals: tuple[int, ...], warning_as: signal.Signals) -> None:
        super().__init__(signals)
        self.warning_as = warning_as
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, program: str, argv: list[str], environ: dict[str, str]) -> int:
        """Run ``program`` with ``argv`` to its end and return its exit code; a stop that came while it started is passed on."""
        from lance_hpc.errors import UserError

        try:
            self.process = subprocess.Popen(argv, executable=program, env=environ, preexec_fn=self.program_signals)
        except OSError as error:  # no interpreter line, not permitted, ...: every start would fail the same way
            raise UserError(
                f"command: program {program!r} could not be started: {error.strerror or error} (no restart can help)\n"
                "  fix: a script needs its interpreter line (#!/usr/bin/env python3) and the execute bit, "
                "or name its interpreter first in command: ([python3, train.py])"
            ) from None
        if self.received is not None:
            self.forward(self.received)
        return self.process.wait()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        super()._on_signal(signum, frame)
        self.forward(signum)

    def forward(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(self.warning_as if signum == REQUEUE_SIGNAL else signum)

    def program_signals(self) -> None:
        """In the program's process, before it starts: SLURM sends its warning (USR2) and
        ``scancel --signal`` to every process of the job, and USR1 asks lance_hpc for a profile;
        the program ignores both unless one is the signal it saves on (it may still handle them)."""
        for signum in (signal.SIGUSR1, signal.SIGUSR2):
            if signum != self.warning_as:
                signal.signal(signum, signal.SIG_IGN)


def signal_name(signum: int) -> str:
    """SIGKILL, or ``signal 35`` for one without a name (a real-time signal)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def failed(argv: list[str], code: int, env: DistEnv) -> Summary:
    """A program that ended on its own with an error: said once, and noted for the restart supervisor."""
    from lance_hpc.runtime.context import Summary
    from lance_hpc.runtime.failures import note_failure

    how = f"was killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"
    message = f"command {shlex.join(argv)} {how}"
    print(f"lance_hpc.run: rank {env.rank}: {message}", file=sys.stderr, flush=True)
    note_failure(env.rank, message, False, step=None, user_error=False)
    return Summary("failed", 0, 0, None)


def stopped(spec: JobSpec, env: DistEnv, requeue: Requeue, preemption: Preemption) -> Summary:
    """After the program stopped on a signal: rank 0 requeues the job on SLURM's warning; the
    others leave that to it."""
    from lance_hpc.runtime.context import Summary
    from lance_hpc.runtime.preemption import after_preemption

    preemption.agreed_signal = preemption.received  # no collective: each rank honours its own signal
    if not env.is_main:
        return Summary("completed" if preemption.received == REQUEUE_SIGNAL else "stopped", 0, 0, None)
    requeued, message = after_preemption(env, spec, preemption, requeue)
    assert preemption.received is not None
    print(f"rank 0: the program stopped on {signal.Signals(preemption.received).name}; {message}", flush=True)
    return Summary("requeued" if requeued else "stopped", 0, 0, None)
