"""How a rank of a write-back job waits for what rank 0 writes: a pinned version, the records of a
stale run cleared or a commit made.

A rank waits for a record that stays once written, never for a state that may come and go between
two of its looks (rank 0 may clear a stale run's records and commit again in less than one poll).
And it looks at the stop signals between polls: a rank blocked in a wait ends within a poll of a
SIGTERM (scancel, the local launcher) or USR2, not at the end of the wait's limit.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, TypeVar

from lance_hpc.errors import UserError

if TYPE_CHECKING:
    from lance_hpc.runtime.context import Summary

Found = TypeVar("Found")

# How often a rank looks for what rank 0 writes, and for how long at most.
WAIT_S, WAIT_LIMIT_S = 0.5, 600.0


class Stopped(Exception):
    """A stop signal arrived while the rank waited for rank 0 (the message: what it waited for)."""


def wait_for(look: Callable[[], Found | None], stopped: Callable[[], bool], what: str) -> Found:
    """``look()``'s first answer that is not None, looked for every :data:`WAIT_S`; :class:`Stopped`
    once ``stopped()``; a UserError naming ``what`` (rank 0's part) after :data:`WAIT_LIMIT_S`."""
    limit_s = WAIT_LIMIT_S  # read here, not as a default: a test shortens it
    deadline = time.monotonic() + limit_s
    while True:
        found = look()
        if found is not None:
            return found
        if stopped():
            raise Stopped(what)
        if time.monotonic() > deadline:
            raise UserError(f"rank 0 did not {what} within {limit_s:.0f} s: see its log")
        time.sleep(WAIT_S)


def until_stopped(work: Callable[[], Summary], rank: int) -> Summary:
    """``work()``'s summary, or ``stopped`` when a stop signal ended one of its waits (said in one line)."""
    from lance_hpc.runtime.context import Summary

    try:
        return work()
    except Stopped as stop:
        print(f"rank {rank}: stopped by a signal while waiting for rank 0 to {stop}", flush=True)
        return Summary("stopped", 0, 0, None)
