"""What SLURM says of the allocation's nodes (which it still gives the job, which it marks
unusable), how far the ranks got (the watchdog's files), and a rendezvous port free on this node,
for the next attempt."""

from __future__ import annotations

import json
import random
import re
import socket
import subprocess
from pathlib import Path
from typing import Sequence

from lance_hpc.runtime.ports import PORT_RANGE

# sinfo's compact node states (%t) in which a node takes no new step; a trailing * means not
# responding. Not resv or maint: a job that runs in a reservation sees its nodes so.
UNUSABLE_STATES = ("down", "drain", "drng", "fail", "boot", "pow", "npc", "inval", "unk", "futr")


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
