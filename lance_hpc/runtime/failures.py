"""How the ranks of a local run tell their launcher which of them failed first: each notes its own
failure in the launcher's failure directory, and the launcher names the rank whose error came
first rather than one that only lost contact with it."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from lance_hpc.storage.files import write_file

# Where a rank notes how it failed, for its launcher to name the rank whose error came first.
FAILURE_DIR_VARIABLE = "LANCE_HPC_FAILURE_DIR"


def note_failure(rank: int, message: str, lost_contact: bool, directory: str | None = None) -> None:
    """Record that ``rank`` failed (with its own error, or by losing contact with another rank) in
    the launcher's failure directory, when it set one."""
    folder = directory or os.environ.get(FAILURE_DIR_VARIABLE)
    if not folder:
        return
    note = {"rank": rank, "host": socket.gethostname(), "time": time.time(), "lost_contact": lost_contact, "message": message}
    try:
        write_file(Path(folder) / f"rank-{rank}.json", json.dumps(note))
    except OSError:
        pass  # the launcher then names a rank by exit codes alone


def first_error(directory: str) -> dict | None:
    """The note of the rank whose own error came first (one that only lost contact with another
    rank is never the cause while a rank with an error of its own exists), or None."""
    notes = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if name.startswith("rank-") and name.endswith(".json"):
            try:
                with open(os.path.join(directory, name)) as file:
                    notes.append(json.load(file))
            except (OSError, ValueError):
                continue
    return min(notes, key=lambda note: (note["lost_contact"], note["time"]), default=None)
