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


class RepeatingError(Exception):
    """The user's own code failed on the same input a restart would give it again (a map function
    raising on a row): the job fails at once with this message, no traceback and no restart."""


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


def listing(names: list[str], indent: str = "      ", width: int = 100, most: int = 40) -> str:
    """``names`` for a message, each whole: on lines of their own after a newline, each line
    starting with ``indent`` and broken only between names (a terminal that wraps a long line cuts
    a name in two); past ``most`` names, ``and N more``."""
    shown = [f"{name}," for name in names[:most]]
    if shown:
        shown[-1] = shown[-1].removesuffix(",")
    if len(names) > most:
        shown[-1] += ","
        shown.append(f"and {len(names) - most} more")
    lines = [indent + (shown[0] if shown else "none")]
    for name in shown[1:]:
        if len(lines[-1]) + 1 + len(name) > width:
            lines.append(indent + name)
        else:
            lines[-1] += " " + name
    return "\n" + "\n".join(lines)
