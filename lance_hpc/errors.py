"""The one exception type for mistakes a user can fix (the command line prints its message,
which says what is wrong and how to fix it, and exits non-zero without a traceback), and the exit
codes every lance_hpc command and rank ends with."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """How a lance_hpc command, a rank or a job ended; SLURM reports these as the job's exit code."""

    OK = 0
    FAILED = 1  # training raised, a rank died, a job ended FAILED, a wait ran out of time
    USER_ERROR = 2  # a problem in the spec, the data or the command line; its message says the fix
    STOPPED = 3  # stopped by a signal with a checkpoint saved: run the job again to continue
    INTERRUPTED = 130  # Ctrl-C before training began, as a shell reports it

    @property
    def meaning(self) -> str:
        return _MEANINGS[self]


_MEANINGS = {
    ExitCode.OK: "finished",
    ExitCode.FAILED: "training failed",
    ExitCode.USER_ERROR: "a problem in the spec or data, see the log",
    ExitCode.STOPPED: "stopped by a signal, checkpoint saved",
    ExitCode.INTERRUPTED: "interrupted before training began",
}


class UserError(Exception):
    """A problem with the user's input or environment, with its fix in the message."""

    def __init__(self, message: str = "", *rest: object) -> None:
        super().__init__(worker_message(message, type(self).__name__) if isinstance(message, str) else message, *rest)


def worker_message(message: str, name: str) -> str:
    """The original message of an exception that a DataLoader worker raised.

    torch re-raises a worker's exception in the main process as the same type, built from one
    string: "Caught NAME in DataLoader worker process N." and the worker's whole traceback, which
    ends with "module.NAME: message". The message is what the user needs; the rest is noise."""
    if not message.startswith(f"Caught {name} ") or "Original Traceback" not in message:
        return message
    marker = f"{name}: "
    position = message.rfind(marker)
    return message[position + len(marker) :].strip() if position >= 0 else message


# Where a rank notes how it failed, for its launcher to name the rank whose error came first and to
# decide whether a restart could help (lance_hpc.launch.restarts reads the notes).
FAILURE_DIR_VARIABLE = "LANCE_HPC_FAILURE_DIR"


def note_failure(
    rank: int,
    message: str,
    lost_contact: bool,
    directory: str | None = None,
    *,
    step: int | None = None,
    user_error: bool = False,
    what: str = "error",
    host: str | None = None,
) -> None:
    """Record that ``rank`` failed (with its own error, or by losing contact with another rank) in
    the launcher's failure directory, when it set one: at which step, whether the user must fix
    something (no restart helps then), and ``what`` (error, or hang when the watchdog names a
    stuck rank)."""
    import json
    import os
    import socket
    import time
    from pathlib import Path

    from lance_hpc.storage.files import write_file

    folder = directory or os.environ.get(FAILURE_DIR_VARIABLE)
    if not folder:
        return
    note = {
        "rank": rank,
        "host": host or os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "time": time.time(),
        "lost_contact": lost_contact,
        "message": message,
        "step": step,
        "user_error": user_error,
        "what": what,
    }
    try:
        write_file(Path(folder) / f"rank-{rank}.json", json.dumps(note))
    except OSError:
        pass  # the launcher then names a rank by exit codes alone
