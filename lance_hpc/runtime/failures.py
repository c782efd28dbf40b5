"""How the ranks tell their launcher how they failed: each notes its own failure in the launcher's
failure directory. The launcher (the restart supervisor, :mod:`lance_hpc.launch.restarts`, or the
local one) names the rank whose error came first rather than one that only lost contact with it,
and decides from the notes whether a restart could help.

An error no restart can change (an import or syntax error in the job's own code,
:func:`error_that_repeats`) ends the rank as a user error: one message, the user's own frames, and
no restart.
"""

from __future__ import annotations

import json
import os
import site
import socket
import sysconfig
import time
import traceback
from pathlib import Path

from lance_hpc.errors import UserError
from lance_hpc.runtime.restart_variables import FAILURE_DIR_VARIABLE
from lance_hpc.storage.files import PRIVATE_MODE, write_file


class PortInUse(UserError):
    """Rank 0 could not listen on MASTER_PORT: another process took it. The user's to fix by hand,
    but no fault of the job's: a restart inside the allocation, on another port, gets past it, so
    its note does not call it a user error."""


def note_failure(
    rank: int,
    message: str,
    lost_contact: bool,
    directory: str | None = None,
    *,
    step: int | None = None,
    user_error: bool = False,
    repeats: bool = False,
    what: str = "error",
    host: str | None = None,
) -> None:
    """Record that ``rank`` failed (with its own error, or by losing contact with another rank) in
    the launcher's failure directory, when it set one: at which step, whether the user must fix
    something (no restart helps then), whether the error repeats on a restart (the user's code failed on
    the same input: the job stops at once, with its own exit code), and ``what`` (error, or hang when the watchdog names a
    stuck rank)."""
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
        "repeats": repeats,
        "what": what,
    }
    try:
        write_file(Path(folder) / f"rank-{rank}.json", json.dumps(note), mode=PRIVATE_MODE)
    except OSError:
        pass  # the launcher then names a rank by exit codes alone


# Errors that a restart on the same software meets again: the job's code does not import or parse.
REPEATING_ERRORS = (ImportError, SyntaxError)


def error_that_repeats(error: BaseException) -> UserError | None:
    """A UserError for ``error`` (or the error it wraps) when a restart would only meet it again:
    an import or a syntax error raised through the job's own code. Its message is the exception
    and the traceback's frames in the job's own files, not lance_hpc's, the standard library's or
    an installed package's. None for any other error."""
    cause = error.__cause__ if isinstance(error.__cause__, REPEATING_ERRORS) else error
    if not isinstance(cause, REPEATING_ERRORS):
        return None
    frames = [frame for frame in traceback.extract_tb(cause.__traceback__) if _users_file(frame.filename)]
    if not frames:
        return None
    shown = "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(cause))
    return UserError(
        f"the job's code failed in a way no restart changes:\n{shown.rstrip()}\n"
        "  fix: correct the code or install what it imports where the job runs, then submit the job again"
    )


def _users_file(filename: str) -> bool:
    """Whether ``filename`` is the job's own code: a file outside lance_hpc and the Python installation."""
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return False
    path = Path(filename).resolve()
    return not any(path.is_relative_to(root) for root in _installed_roots())


def _installed_roots() -> list[Path]:
    """lance_hpc's own directory, the standard library's and the installed packages'."""
    paths = sysconfig.get_paths()
    roots = [paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")]
    roots += [*site.getsitepackages(), site.getusersitepackages()]
    return [Path(__file__).resolve().parents[1], *(Path(root).resolve() for root in roots)]
