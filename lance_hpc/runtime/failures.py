"""How the ranks tell their launcher how they failed: each notes its own failure in the launcher's
failure directory. The launcher (the restart supervisor, :mod:`lance_hpc.launch.restarts`, or the
local one) names the rank whose error came first rather than one that only lost contact with it,
and decides from the notes whether a restart could help."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from lance_hpc.errors import UserError
from lance_hpc.storage.files import write_file

# Where a rank notes how it failed (the restart supervisor names the same variable).
FAILURE_DIR_VARIABLE = "LANCE_HPC_FAILURE_DIR"


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
        write_file(Path(folder) / f"rank-{rank}.json", json.dumps(note))
    except OSError:
        pass  # the launcher then names a rank by exit codes alone
