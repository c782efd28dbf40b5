"""What SLURM says of the allocation's nodes (which it still gives the job, which it marks
unusable), and how far the ranks got (the watchdog's files), for the next attempt."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Sequence

from lance_hpc.storage.shared_files import read_own

# sinfo's compact node states (%t) in which a node takes no new step; a trailing * means not
# responding. Not resv or maint: a job that runs in a reservation sees its nodes so.
UNUSABLE_STATES = ("down", "drain", "drng", "fail", "boot", "pow", "npc", "inval", "unk", "futr")
PROGRESS_LIMIT = 64 * 1024  # bytes read of a rank's published step: a few numbers


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
            steps.append(int(json.loads(read_own(path, PROGRESS_LIMIT))["step"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return max(steps) if steps else None
